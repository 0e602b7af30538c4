//! Which GEMM kernel runs for a shape, dtype and device.

use super::{ElemType, require_float};
use crate::error::Result;
use crate::gpu::Gpu;
use cudarc::driver::CudaSlice;

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

impl Gpu {
    /// The kernel that `gemm_tensor_core` uses for this shape on this device: `TP_GEMM_KERNEL`
    /// (`mma` or `wgmma`) when set; otherwise mma.sync. The Hopper kernel becomes the sm_90
    /// default once it has passed the GPU suite on an H200 (it compiles and its SASS is checked
    /// in CI, but it has not run yet); it needs K % 8 == 0 either way.
    pub fn gemm_kernel_for(&self, k: usize) -> GemmKernel {
        let wgmma_ok = self.compute_capability() == (9, 0) && k % 8 == 0;
        match requested() {
            Some(GemmKernel::Wgmma) if wgmma_ok => GemmKernel::Wgmma,
            _ => GemmKernel::MmaSync,
        }
    }

    /// bf16/f16 `C = A B^T + bias` on the kernel [`gemm_kernel_for`](Self::gemm_kernel_for)
    /// picks.
    pub fn gemm_tensor_core(
        &self,
        c: &mut CudaSlice<u8>,
        a: &CudaSlice<u8>,
        b: &CudaSlice<u8>,
        bias: Option<&CudaSlice<u8>>,
        (m, n, k): (usize, usize, usize),
        ty: ElemType,
    ) -> Result<()> {
        match self.gemm_kernel_for(k) {
            GemmKernel::Wgmma => self.gemm_wgmma(c, a, b, bias, (m, n, k), ty),
            GemmKernel::MmaSync => self.gemm_mma(c, a, b, bias, (m, n, k), ty),
        }
    }

    /// `C = A B^T + bias` for the `[N, K]` weight layout, on the kernel that suits the shape:
    /// the decode kernel for `m <= 8` (any dtype), the SIMT kernel for f32, and the tensor-core
    /// kernel [`gemm_kernel_for`](Self::gemm_kernel_for) picks for f16/bf16.
    pub fn gemm_nt(
        &self,
        c: &mut CudaSlice<u8>,
        a: &CudaSlice<u8>,
        b: &CudaSlice<u8>,
        bias: Option<&CudaSlice<u8>>,
        (m, n, k): (usize, usize, usize),
        ty: ElemType,
    ) -> Result<()> {
        if (1..=crate::SMALL_M_MAX).contains(&m) {
            return self.gemm_small_m(c, a, b, bias, (m, n, k), ty);
        }
        match ty {
            ElemType::F32 => self.gemm_simt_f32(c, a, b, bias, (m, n, k), true),
            ElemType::F16 | ElemType::BF16 => self.gemm_tensor_core(c, a, b, bias, (m, n, k), ty),
            ElemType::I32 | ElemType::I64 => require_float("gemm_nt", ty),
        }
    }
}
