//! The kernels' block dequantization (`kernels/quant_blocks.cuh`), compiled as host C++ by
//! build.rs (`host/quant_blocks.cpp`, with FMA contraction off) and exposed here so CPU tests can
//! check the very unit functions the quant kernels run against independent references, without
//! a GPU. Every f32 operation rounds on its own, as the kernels' `__fmul_rn` and friends do.

use crate::error::{KernelError, Result};
use crate::quant::QuantFormat;

unsafe extern "C" {
    fn tp_host_dequantize(ggml_type: u32, src: *const u8, blocks: i64, dst: *mut f32) -> i32;
    fn tp_host_block_info(ggml_type: u32, what: i32) -> i64;
}

fn invalid(why: String) -> KernelError {
    KernelError::InvalidLaunch { kernel: "host dequantize", why }
}

/// Dequantizes `src`, whole blocks of `format`, into `dst` (`blocks * block_elems` values), unit
/// by unit as `tp_dequant_*` does on the GPU.
pub fn dequantize(format: QuantFormat, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let (bytes, elems) = (format.block_bytes(), format.block_elems());
    if src.len() % bytes != 0 {
        return Err(invalid(format!("{} bytes are not whole {}-byte {} blocks", src.len(), bytes, format.name())));
    }
    let blocks = src.len() / bytes;
    if dst.len() != blocks * elems {
        return Err(invalid(format!(
            "{blocks} {} blocks give {} values, not {}",
            format.name(),
            blocks * elems,
            dst.len()
        )));
    }
    let n = i64::try_from(blocks).map_err(|_| invalid(format!("{blocks} blocks do not fit in an i64")))?;
    // SAFETY: `src` holds exactly `blocks` blocks of the format and `dst` blocks * block_elems
    // floats (checked above); the C++ reads each block's bytes through unaligned-safe byte
    // loads and writes each block's block_elems outputs, nothing else; the two slices are
    // distinct (& vs &mut).
    let rc = unsafe { tp_host_dequantize(format.ggml_id(), src.as_ptr(), n, dst.as_mut_ptr()) };
    if rc != 0 {
        return Err(KernelError::UnsupportedQuantType { id: format.ggml_id() });
    }
    Ok(())
}

/// `(bytes, elements, units)` of the C++ block struct of a ggml type id, `None` when
/// quant_blocks.cuh has none (for checks of [`QuantFormat`]'s table against the structs).
pub fn block_layout(ggml_type: u32) -> Option<(usize, usize, usize)> {
    // SAFETY: integers in and out, no memory touched.
    let info = |what| unsafe { tp_host_block_info(ggml_type, what) };
    let [b, e, u] = [info(0), info(1), info(2)].map(|v| usize::try_from(v).ok());
    Some((b?, e?, u?))
}
