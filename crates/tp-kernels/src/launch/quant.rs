//! Launchers of the block-quantized weight kernels: `kernels/quant_dequant.cu` (a ggml-format
//! weight dequantized into f32 or bf16) and `kernels/quant_gemv.cu` (decode-shaped products
//! `y = x W^T` straight from the quantized weight). The format is named by its ggml type id
//! ([`QuantFormat`]).

use super::gemm_args::GemmShape;
use super::{BLOCKS_PER_SM, ElemType, i64_of, invalid, span};
use crate::consts;
use crate::error::{Result, driver};
use crate::gpu::Gpu;
use crate::limits::QUANT_GEMV_MAX_M;
use crate::quant::QuantFormat;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

/// The quant kernels' activation/output types: f32, or bf16 (tp's model dtype on GPU).
fn require_f32_or_bf16(kernel: &'static str, ty: ElemType) -> Result<()> {
    match ty {
        ElemType::F32 | ElemType::BF16 => Ok(()),
        _ => Err(invalid(kernel, format!("takes f32 or bf16, not {}", ty.name()))),
    }
}

/// The bytes of `rows` rows of `k` weights in `format`, after checking that `k` is a whole
/// number of blocks.
fn weight_bytes(kernel: &'static str, format: QuantFormat, rows: usize, k: usize) -> Result<usize> {
    let row = format.row_bytes(k).ok_or_else(|| {
        invalid(
            kernel,
            format!("k = {k} is not a multiple of {}'s {}-weight blocks", format.name(), format.block_elems()),
        )
    })?;
    span(kernel, rows, row, 0)
}

impl Gpu {
    /// Dequantizes `w`, `rows` rows of `k` weights in the ggml format `ggml_type` stored row
    /// after row (`rows * k / block_elems` whole blocks, as in a GGUF file), into `out`, a
    /// `rows x k` row-major matrix of `ty` (f32 or bf16) (`kernels/quant_dequant.cu`). In f32
    /// the values are bit-exact with ggml's CPU dequantization; bf16 rounds them to nearest
    /// even. `k` must be a multiple of the format's block size (32, or 256 for the K-quants).
    pub fn dequantize(
        &self,
        ggml_type: u32,
        w: &CudaSlice<u8>,
        (rows, k): (usize, usize),
        out: &mut CudaSlice<u8>,
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "dequantize";
        let format = QuantFormat::from_ggml_id(ggml_type)?;
        require_f32_or_bf16(K, ty)?;
        let w_bytes = weight_bytes(K, format, rows, k)?;
        let out_bytes = span(K, rows, k, 0).and_then(|n| span(K, n, ty.size(), 0))?;
        if w.len() < w_bytes {
            return Err(invalid(
                K,
                format!("the weight holds {} bytes, {rows} x {k} {} needs {w_bytes}", w.len(), format.name()),
            ));
        }
        if out.len() < out_bytes {
            return Err(invalid(K, format!("the output holds {} bytes, needs {out_bytes}", out.len())));
        }
        let blocks = w_bytes / format.block_bytes();
        if blocks == 0 {
            return Ok(());
        }
        let units = span(K, blocks, format.units(), 0)?;
        let f = self.function(&crate::kernels::dequant(format, ty), 0)?;
        let blocks_i = i64_of(K, blocks)?;
        i64_of(K, units)?; // the kernel's unit index is an int64
        let mut l = self.stream().launch_builder(f);
        l.arg(out).arg(w).arg(&blocks_i);
        // SAFETY: matches tp_dequant_FMT_T(T* out, const uint8_t* w, int64 blocks). `w` holds
        // `blocks` whole blocks of the format (w_bytes = blocks * block_bytes, checked) and `out`
        // blocks * block_elems elements of T (rows * k, checked); the kernel's grid-stride loop
        // stays below blocks * units (which fits in i64, checked), and each unit reads inside its
        // block and writes inside its block's block_elems outputs. Both buffers are whole
        // allocations (256-byte aligned): the 16-bit weight loads are aligned (block sizes and
        // field offsets are even) and so are the 16-byte (f32) / 8-byte (bf16) stores of 4
        // elements at multiples of 4. `out` is borrowed mutably: it aliases nothing.
        unsafe { l.launch(self.grid_stride(units as u64)) }.map(drop).map_err(driver("cuLaunchKernel(tp_dequant)"))
    }

    /// `y = x W^T` for `1 <= m <= 8` rows of activations (`kernels/quant_gemv.cu`): `x` is
    /// `m x k` and `y` `m x n` (row-major, both of `ty`: f32 or bf16), `W` is `n` rows of `k`
    /// weights in the ggml format `ggml_type`, stored row after row (`shape.n = rows`). Each
    /// weight is dequantized in registers to ggml's exact f32 value; f32 products and
    /// accumulation, one rounding per output. One warp streams a weight row once for all `m`
    /// rows of `x`. `k` must be a multiple of the format's block size; `k = 0` writes zeros.
    pub fn quant_gemv(
        &self,
        ggml_type: u32,
        w: &CudaSlice<u8>,
        shape: GemmShape,
        x: &CudaSlice<u8>,
        y: &mut CudaSlice<u8>,
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "quant_gemv";
        let GemmShape { m, n: rows, k } = shape;
        let format = QuantFormat::from_ggml_id(ggml_type)?;
        require_f32_or_bf16(K, ty)?;
        if !(1..=QUANT_GEMV_MAX_M).contains(&m) {
            return Err(invalid(K, format!("m = {m}; this kernel takes 1..={QUANT_GEMV_MAX_M}")));
        }
        let w_bytes = weight_bytes(K, format, rows, k)?;
        let elems = |a: usize, b: usize| span(K, a, b, 0).and_then(|n| span(K, n, ty.size(), 0));
        let buffers = [("W", w.len(), w_bytes), ("x", x.len(), elems(m, k)?), ("y", y.len(), elems(m, rows)?)];
        for (what, have, want) in buffers {
            if have < want {
                return Err(invalid(K, format!("{what} holds {have} bytes, needs {want}")));
            }
        }
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(&crate::kernels::quant_gemv(format, ty), 0)?;
        let (m_i, rows_i, k_i) = (m as i32, i64_of(K, rows)?, i64_of(K, k)?);
        let warps = consts::QUANT_GEMV_WARPS; // one weight row per warp at a time
        let blocks = (rows as u64).div_ceil(u64::from(warps)).clamp(1, u64::from(self.sm_count()) * BLOCKS_PER_SM);
        let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (warps * 32, 1, 1), shared_mem_bytes: 0 };
        let mut l = self.stream().launch_builder(f);
        l.arg(y).arg(w).arg(x).arg(&m_i).arg(&rows_i).arg(&k_i);
        // SAFETY: matches tp_quant_gemv_FMT_T(T* y, const uint8_t* w, const T* x, int M,
        // int64 rows, int64 k). Checked above: 1 <= M <= QUANT_GEMV_MAX_M (the kernel's register
        // arrays), k a multiple of the block size, W holding rows * k / block_elems whole
        // blocks, x M * k and y M * rows elements of T. The kernel reads blocks ib < k /
        // block_elems of rows r < rows, x[m][< k] for m < M, and writes y[m][r] for m < M,
        // r < rows. All buffers are whole allocations (256-byte aligned); with k a multiple of
        // 32 every 4-element x load (16 bytes in f32, 8 in bf16) is aligned, and the weight is
        // read with 16-bit loads at even offsets. The grid is at most 32 blocks per SM (warps
        // stride over rows). `y` is borrowed mutably: it aliases neither input.
        unsafe { l.launch(cfg) }.map(drop).map_err(driver("cuLaunchKernel(tp_quant_gemv)"))
    }
}
