//! Typed launchers, one file per kernel family. Each checks its arguments against the kernel's
//! contract (sizes, alignment, grid limits) and returns [`KernelError::InvalidLaunch`] instead of
//! launching a kernel that would read or write out of bounds. Every `unsafe` launch carries a
//! SAFETY note listing the conditions it relies on.
//!
//! * `copy.rs`: strided row copies, the all-gather interleave, dtype casts.
//! * `elementwise.rs`: gated activations (SwiGLU, GeGLU), row bias, in-place add, scale,
//!   soft-capping.
//! * `decoder.rs`: RMSNorm, RoPE, attention, embedding lookup, argmax.
//! * `paged.rs`: attention over a paged KV cache (block tables), writes into cache slots.
//! * `sampling.rs`: penalised logits, per-row top-k candidates, per-row (max, sum of exps).
//! * `quant.rs`: ggml block-quantized weights: dequantization into f32/bf16 and the
//!   decode-shaped product straight from the quantized weight.
//! * `gemm_args.rs`: [`GemmArgs`] and [`GemmShape`], what every GEMM launcher takes, and
//!   [`GemmTnArgs`] for the weight-gradient form `C (+)= A^T B`, and their buffer checks;
//!   `gemm.rs`: the SIMT, mma.sync and decode-shaped GEMMs (`A B^T`, `A B`, `A^T B`);
//!   `wgmma.rs` + `tma.rs`: the Hopper GEMM and its TMA descriptors; `dispatch.rs`: which GEMM
//!   runs for a shape.
//! * `grad.rs`: training's backward kernels (RMSNorm, RoPE, GLU, soft-capping, the embedding's
//!   scatter-add), column sums and the transpose.
//! * `loss.rs`: a vocab-parallel cross-entropy's row maxima, parts and gradient.
//! * `optim.rs`: the multi-tensor AdamW step.

mod copy;
mod decoder;
mod dispatch;
mod elementwise;
mod gemm;
mod gemm_args;
mod grad;
mod grouped;
mod lora;
mod loss;
mod moe;
mod optim;
mod paged;
mod quant;
mod sampling;
mod tma;
mod wgmma;

pub use decoder::AttentionShape;
pub use dispatch::GemmKernel;
pub use gemm_args::{GemmArgs, GemmShape, GemmTnArgs};
pub use grad::NormSplit;
pub use grouped::GroupedExpert;
pub use lora::{LoraFactor, LoraShape, MAX_LORA_RANK};
pub use moe::MAX_ROUTED_EXPERTS;
pub use optim::{AdamwFactors, AdamwTensor};
pub use paged::{PagedSequence, PagedShape};
pub use sampling::{RowPenalties, TOP_K_MAX};

use crate::consts;
// Launchers name it `super::ElemType`.
pub(crate) use crate::elem::ElemType;
use crate::error::{KernelError, Result};
use crate::gpu::Gpu;
use cudarc::driver::{CudaSlice, LaunchArgs, LaunchConfig, PushKernelArg};

/// Refuses an integer type for a float-only kernel.
pub(crate) fn require_float(kernel: &'static str, ty: ElemType) -> Result<()> {
    if ty.is_float() { Ok(()) } else { Err(invalid(kernel, format!("takes f32, f16 or bf16, not {}", ty.name()))) }
}

/// A strided copy of `rows` rows of `row_bytes` bytes: row `j` is read at
/// `src_off + j * src_pitch` and written at `dst_off + j * dst_pitch` (all in bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowCopy {
    /// Number of rows.
    pub rows: usize,
    /// Bytes copied per row.
    pub row_bytes: usize,
    /// Bytes between the starts of consecutive source rows.
    pub src_pitch: usize,
    /// Byte offset of the first source row.
    pub src_off: usize,
    /// Bytes between the starts of consecutive destination rows.
    pub dst_pitch: usize,
    /// Byte offset of the first destination row.
    pub dst_off: usize,
}

/// Grid-stride grids get at most this many blocks per SM.
const BLOCKS_PER_SM: u64 = 32;

pub(crate) fn invalid(kernel: &'static str, why: impl Into<String>) -> KernelError {
    KernelError::InvalidLaunch { kernel, why: why.into() }
}

/// `a * b + c` with overflow as an error.
pub(crate) fn span(kernel: &'static str, a: usize, b: usize, c: usize) -> Result<usize> {
    a.checked_mul(b).and_then(|x| x.checked_add(c)).ok_or_else(|| invalid(kernel, "size overflows usize"))
}

pub(crate) fn i64_of(kernel: &'static str, v: usize) -> Result<i64> {
    i64::try_from(v).map_err(|_| invalid(kernel, format!("{v} does not fit in a 64-bit signed index")))
}

/// The widest unit (16, 8, 4, 2 or 1 bytes) dividing every value.
fn unit_for(values: &[usize]) -> usize {
    [16, 8, 4, 2, 1].into_iter().find(|u| values.iter().all(|v| v % u == 0)).unwrap_or(1)
}

impl Gpu {
    /// A 1-D grid-stride launch over `items`, `ELEMENTWISE_THREADS` per block.
    pub(crate) fn grid_stride(&self, items: u64) -> LaunchConfig {
        let block = consts::ELEMENTWISE_THREADS;
        let blocks = items.div_ceil(u64::from(block)).clamp(1, u64::from(self.sm_count()) * BLOCKS_PER_SM);
        LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 }
    }

    /// A grid of one block per row, capped at `BLOCKS_PER_SM` per SM (blocks stride over rows).
    pub(crate) fn grid_rows(&self, rows: u64) -> LaunchConfig {
        let blocks = rows.clamp(1, u64::from(self.sm_count()) * BLOCKS_PER_SM);
        LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (consts::ELEMENTWISE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// A null device pointer, passed where a kernel's optional bias is absent.
pub(crate) static NULL_PTR: u64 = 0;

/// Pushes the GEMM kernels' `const T* bias` argument: the bias buffer, or a null pointer.
fn push_bias<'a>(l: &mut LaunchArgs<'a>, bias: Option<&'a CudaSlice<u8>>) {
    match bias {
        Some(bias) => l.arg(bias),
        None => l.arg(&NULL_PTR),
    };
}

#[cfg(test)]
mod tests {
    #[test]
    fn unit_is_the_widest_common_divisor_power() {
        assert_eq!(super::unit_for(&[32, 64, 16]), 16);
        assert_eq!(super::unit_for(&[24, 8]), 8);
        assert_eq!(super::unit_for(&[6, 4]), 2);
        assert_eq!(super::unit_for(&[3]), 1);
    }
}
