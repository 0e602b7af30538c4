//! TMA descriptors (`CUtensorMap`) for the Hopper GEMM's operands.

use super::{ElemType, invalid};
use crate::error::{Result, driver};
use crate::gpu::Gpu;
use cudarc::driver::{CudaSlice, SyncOnDrop};

/// A TMA descriptor as a kernel parameter (`const __grid_constant__ CUtensorMap`).
#[repr(C, align(128))]
#[derive(Clone, Copy)]
pub(super) struct TensorMap(cudarc::driver::sys::CUtensorMap);

// SAFETY: CUtensorMap is 128 bytes of plain data that the kernel receives by value; the
// wrapper keeps its 128-byte alignment, and it holds no host pointers the device would follow
// (the global address inside is a device address).
unsafe impl cudarc::driver::DeviceRepr for TensorMap {}

impl Gpu {
    /// A 2-D TMA descriptor over a row-major `rows x k` matrix of 2-byte elements at `buf`, box
    /// `box_k x box_rows`, 128-byte swizzle, zero fill past the edges.
    ///
    /// The kernel reads `buf` only through the descriptor, so cudarc never sees it as a launch
    /// argument: the returned guard stands for that read. Keep it alive until the kernel has been
    /// launched; dropping it then records the read on the stream (cudarc's stream ordering), so
    /// later writers on other streams wait for the kernel.
    pub(super) fn tensor_map<'a>(
        &'a self,
        buf: &'a CudaSlice<u8>,
        ty: ElemType,
        rows: usize,
        k: usize,
        (box_k, box_rows): (u32, u32),
    ) -> Result<(TensorMap, SyncOnDrop<'a>)> {
        use cudarc::driver::DevicePtr;
        use cudarc::driver::sys::{
            CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave, CUtensorMapL2promotion,
            CUtensorMapSwizzle,
        };
        let dt = match ty {
            ElemType::BF16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            ElemType::F16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            _ => return Err(invalid("gemm_wgmma", "TMA maps here are for 2-byte types")),
        };
        let (dims, strides) = geometry(ty, rows, k)?;
        let (ptr, guard) = buf.device_ptr(self.stream());
        let boxes = [box_k, box_rows];
        let elem_strides = [1u32, 1];
        // SAFETY: all-zero bytes are a valid (if meaningless) CUtensorMap, fully overwritten by
        // a successful cuTensorMapEncodeTiled below.
        let mut map: cudarc::driver::sys::CUtensorMap = unsafe { std::mem::zeroed() };
        // SAFETY: the arrays hold `rank` = 2 entries each (1 stride) and outlive the call; `ptr`
        // is the device address of `buf`, which holds rows*k elements (checked by the caller's
        // check_buffers), is 256-byte aligned, and has non-zero dimensions and a row stride that
        // is a multiple of 16 bytes (`geometry`), as TMA requires.
        let r = unsafe {
            cudarc::driver::sys::cuTensorMapEncodeTiled(
                &mut map,
                dt,
                2,
                ptr as usize as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                elem_strides.as_ptr(),
                CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        r.result().map_err(driver("cuTensorMapEncodeTiled"))?;
        Ok((TensorMap(map), guard))
    }
}

/// `(dims, strides)` of a row-major `rows x k` matrix of `ty` for `cuTensorMapEncodeTiled`:
/// dimension 0 is `k` (contiguous), dimension 1 `rows`; the one stride is the row pitch in
/// bytes. TMA requires every dimension in `1..=2^32` and a row pitch that is a multiple of 16
/// bytes below 2^40; anything else is refused here, before the driver sees it.
fn geometry(ty: ElemType, rows: usize, k: usize) -> Result<([u64; 2], [u64; 1])> {
    const K: &str = "gemm_wgmma";
    let in_range = |v: usize| (1..=1u64 << 32).contains(&(v as u64));
    if !in_range(rows) || !in_range(k) {
        return Err(invalid(K, format!("a TMA map needs dimensions in 1..=2^32, got {rows} rows x {k}")));
    }
    let pitch = k as u64 * ty.size() as u64;
    if pitch % 16 != 0 || pitch >= 1 << 40 {
        return Err(invalid(K, format!("a TMA row pitch must be a multiple of 16 bytes below 2^40, got {pitch}")));
    }
    Ok(([k as u64, rows as u64], [pitch]))
}

#[cfg(test)]
mod tests {
    use super::{ElemType, geometry};

    #[test]
    fn tma_geometry_refuses_empty_and_misaligned_matrices() {
        assert_eq!(geometry(ElemType::BF16, 3, 64).unwrap(), ([64, 3], [128]));
        assert!(geometry(ElemType::BF16, 3, 0).is_err(), "K = 0: a zero dimension");
        assert!(geometry(ElemType::F16, 0, 64).is_err(), "no rows");
        assert!(geometry(ElemType::F16, 3, 12).is_err(), "24-byte rows");
        assert!(geometry(ElemType::F16, 3, (1 << 32) + 8).is_err(), "K past 2^32");
    }
}
