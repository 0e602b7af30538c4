//! Which GEMM kernel runs for a shape, dtype and device.

use super::gemm_args::{GemmArgs, GemmTnArgs};
use super::{ElemType, require_float};
use crate::error::Result;
use crate::gpu::Gpu;
use crate::limits::SMALL_M_MAX;

/// The tensor-core GEMM kernels, for [`Gpu::gemm_tensor_core`]'s choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmKernel {
    /// Ampere-style mma.sync + ldmatrix + cp.async (sm_80 and later).
    MmaSync,
    /// Hopper wgmma + TMA, warp-specialised and persistent (sm_90a).
    Wgmma,
}

/// The kernel `TP_GEMM_KERNEL` asks for (`mma` or `wgmma`), read once per process.
fn requested() -> Option<GemmKernel> {
    static KERNEL: std::sync::OnceLock<Option<GemmKernel>> = std::sync::OnceLock::new();
    *KERNEL.get_or_init(|| match std::env::var("TP_GEMM_KERNEL").as_deref() {
        Ok("wgmma") => Some(GemmKernel::Wgmma),
        Ok("mma") => Some(GemmKernel::MmaSync),
        _ => None,
    })
}

/// The tensor-core kernel for `k` on a device of compute capability `cc`, given the kernel
/// `TP_GEMM_KERNEL` requested: wgmma only when asked for, on sm_90, with `k` a non-zero multiple
/// of 8 (its TMA maps need 16-byte row strides and non-zero dimensions); mma.sync otherwise.
fn choose(requested: Option<GemmKernel>, cc: (i32, i32), k: usize) -> GemmKernel {
    let wgmma_ok = cc == (9, 0) && k > 0 && k % 8 == 0;
    match requested {
        Some(GemmKernel::Wgmma) if wgmma_ok => GemmKernel::Wgmma,
        _ => GemmKernel::MmaSync,
    }
}

impl Gpu {
    /// The kernel that `gemm_tensor_core` uses for this shape on this device: `TP_GEMM_KERNEL`
    /// (`mma` or `wgmma`) when set; otherwise mma.sync. The Hopper kernel becomes the sm_90
    /// default once it has passed the GPU suite on an H200 (it compiles and its SASS is checked
    /// in CI, but it has not run yet); it needs K % 8 == 0 and K > 0 either way.
    pub fn gemm_kernel_for(&self, k: usize) -> GemmKernel {
        choose(requested(), self.compute_capability(), k)
    }

    /// bf16/f16 `C = A B^T + bias` on the kernel [`gemm_kernel_for`](Self::gemm_kernel_for)
    /// picks.
    pub fn gemm_tensor_core(&self, g: GemmArgs<'_>) -> Result<()> {
        match self.gemm_kernel_for(g.shape.k) {
            GemmKernel::Wgmma => self.gemm_wgmma(g),
            GemmKernel::MmaSync => self.gemm_mma(g),
        }
    }

    /// `C = A B^T + bias` for the `[N, K]` weight layout, on the kernel that suits the shape:
    /// the decode kernel for `m <= 8` (any dtype), the SIMT kernel for f32, and the tensor-core
    /// kernel [`gemm_kernel_for`](Self::gemm_kernel_for) picks for f16/bf16.
    pub fn gemm_nt(&self, g: GemmArgs<'_>) -> Result<()> {
        if (1..=SMALL_M_MAX).contains(&g.shape.m) {
            return self.gemm_small_m(g);
        }
        match g.ty {
            ElemType::F32 => self.gemm_simt_f32(g, true),
            ElemType::F16 | ElemType::BF16 => self.gemm_tensor_core(g),
            ElemType::I32 | ElemType::I64 => require_float("gemm_nt", g.ty),
        }
    }

    /// `C = A B + bias` for the `[K, N]` weight layout (the data gradient `dX = dY W` of an
    /// `[out, in]` weight): the SIMT kernel for f32, mma.sync for f16/bf16 (any `m`).
    pub fn gemm_nn(&self, g: GemmArgs<'_>) -> Result<()> {
        match g.ty {
            ElemType::F32 => self.gemm_simt_f32(g, false),
            ElemType::F16 | ElemType::BF16 => self.gemm_mma_kn(g),
            ElemType::I32 | ElemType::I64 => require_float("gemm_nn", g.ty),
        }
    }

    /// `C (+)= A^T B` into f32 (the weight gradient `dW = dY^T X`): the SIMT kernel for f32
    /// operands, mma.sync for f16/bf16 ones.
    pub fn gemm_tn(&self, g: GemmTnArgs<'_>) -> Result<()> {
        match g.ty {
            ElemType::F32 => self.gemm_simt_f32_tn(g),
            ElemType::F16 | ElemType::BF16 => self.gemm_mma_tn(g),
            ElemType::I32 | ElemType::I64 => require_float("gemm_tn", g.ty),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{GemmKernel, choose};

    #[test]
    fn wgmma_only_when_asked_on_sm90_with_a_nonzero_multiple_of_8() {
        let wgmma = Some(GemmKernel::Wgmma);
        assert_eq!(choose(wgmma, (9, 0), 64), GemmKernel::Wgmma);
        // K = 0 (bias only): a TMA map cannot have a zero dimension.
        assert_eq!(choose(wgmma, (9, 0), 0), GemmKernel::MmaSync);
        assert_eq!(choose(wgmma, (9, 0), 12), GemmKernel::MmaSync);
        assert_eq!(choose(wgmma, (8, 0), 64), GemmKernel::MmaSync);
        assert_eq!(choose(None, (9, 0), 64), GemmKernel::MmaSync);
        assert_eq!(choose(Some(GemmKernel::MmaSync), (9, 0), 64), GemmKernel::MmaSync);
    }
}
