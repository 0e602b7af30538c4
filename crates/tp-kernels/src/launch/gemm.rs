//! Launchers of the SIMT (`kernels/gemm_simt.cu`), mma.sync (`gemm_mma.cu`) and decode-shaped
//! (`gemm_small_m.cu`) GEMMs, in the layouts training needs besides the forward's `A B^T`:
//! `A B` (the data gradient) and `A^T B` into f32, accumulated or not (the weight gradient).

use super::gemm_args::{GemmArgs, GemmShape, GemmTnArgs};
use super::{BLOCKS_PER_SM, ElemType, i64_of, invalid, push_bias, require_float};
use crate::consts;
use crate::error::{Result, driver};
use crate::gpu::Gpu;
use crate::kernels::MmaLayout;
use crate::limits::SMALL_M_MAX;
use cudarc::driver::{LaunchConfig, PushKernelArg};

impl Gpu {
    /// fp32 SIMT GEMM with fused bias (`kernels/gemm_simt.cu`): `C = A op(B) + bias` where `A` is
    /// `m×k`, `B` is `n×k` when `nk` (so `C = A B^T`) or `k×n` otherwise, `bias` has `n` entries.
    /// `g.ty` must be f32. Any `k`, 0 included (then `C` is the bias, or zeros).
    pub fn gemm_simt_f32(&self, g: GemmArgs<'_>, nk: bool) -> Result<()> {
        const K: &str = "gemm_simt_f32";
        if g.ty != ElemType::F32 {
            return Err(invalid(K, format!("the SIMT kernel takes f32, not {}", g.ty.name())));
        }
        g.check_buffers(K)?;
        let GemmArgs { c, a, b, bias, shape: GemmShape { m, n, k }, .. } = g;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let grid = gemm_grid(K, m, n)?;
        let vec_a = k % 4 == 0;
        let vec_b = if nk { k % 4 == 0 } else { n % 4 == 0 };
        let vec = i32::from(vec_a) | (i32::from(vec_b) << 1);
        let f = self.function(&crate::kernels::simt(nk), 0)?;
        let [m_i, n_i, k_i] = [i64_of(K, m)?, i64_of(K, n)?, i64_of(K, k)?];
        let mut l = self.stream().launch_builder(f);
        l.arg(c).arg(a).arg(b);
        push_bias(&mut l, bias);
        l.arg(&m_i).arg(&n_i).arg(&k_i).arg(&vec);
        let cfg = LaunchConfig { grid_dim: grid, block_dim: (consts::SIMT_THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: matches tp_gemm_simt_f32_xx(float* C, const float* A, const float* B,
        // const float* bias_or_null, int64 M, N, K, int vec). check_buffers verified that A holds
        // m*k, B n*k, C m*n and bias n floats; the kernel bounds-checks every tile edge against
        // M, N, K. Vector (16-byte) loads are enabled only when every row start is a multiple of
        // 4 floats from a 256-byte aligned base. C is the only buffer written and is borrowed
        // mutably, so it aliases no input.
        unsafe { l.launch(cfg) }.map(drop).map_err(driver("cuLaunchKernel(tp_gemm_simt)"))
    }

    /// bf16/f16 tensor-core GEMM with fused bias (`kernels/gemm_mma.cu`): `C = A B^T + bias`,
    /// `A` `m×k`, `B` `n×k` (nn.Linear layout), `C` `m×n`, all of element type `g.ty`.
    /// Needs compute capability 8.0 or later. Any `k`, 0 included (no tile is loaded; `C` is the
    /// bias, or zeros).
    pub fn gemm_mma(&self, g: GemmArgs<'_>) -> Result<()> {
        self.gemm_mma_layout("gemm_mma", g, MmaLayout::Nk)
    }

    /// bf16/f16 tensor-core GEMM with fused bias in the `[K, N]` layout (`kernels/gemm_mma.cu`,
    /// `tp_gemm_mma_T_kn`): `C = A B + bias`, `A` `m×k`, `B` `k×n`, `C` `m×n`, all of element
    /// type `g.ty`: the data gradient `dX = dY W` of a layer whose `[out, in]` weight is read as
    /// `[K, N]`. f32 accumulation, one rounding. Needs compute capability 8.0 or later; any `k`.
    pub fn gemm_mma_kn(&self, g: GemmArgs<'_>) -> Result<()> {
        self.gemm_mma_layout("gemm_mma_kn", g, MmaLayout::Kn)
    }

    /// The checks and launch shared by the `nk` and `kn` layouts of `tp_gemm_mma_T_*`.
    fn gemm_mma_layout(&self, name: &'static str, g: GemmArgs<'_>, layout: MmaLayout) -> Result<()> {
        let ty = g.ty;
        self.mma_usable(name, ty)?;
        g.check_buffers(name)?;
        let GemmArgs { c, a, b, bias, shape: GemmShape { m, n, k }, .. } = g;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let grid = gemm_grid(name, m, n)?;
        // Rows of A (k elements) and of B (k for [N, K], n for [K, N]) start on 16-byte
        // boundaries, so every 16-byte chunk of the cp.async path is aligned.
        let aligned = k % 8 == 0 && (layout == MmaLayout::Nk || n % 8 == 0);
        let f = self.function(&crate::kernels::mma_layout(ty, layout, aligned), consts::MMA_SMEM_BYTES)?;
        let [m_i, n_i, k_i] = [i64_of(name, m)?, i64_of(name, n)?, i64_of(name, k)?];
        let mut l = self.stream().launch_builder(f);
        l.arg(c).arg(a).arg(b);
        push_bias(&mut l, bias);
        l.arg(&m_i).arg(&n_i).arg(&k_i);
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (consts::MMA_THREADS, 1, 1),
            shared_mem_bytes: consts::MMA_SMEM_BYTES,
        };
        // SAFETY: matches tp_gemm_mma_T_{nk,kn}[_unaligned](T* C, const T* A, const T* B,
        // const T* bias_or_null, int64 M, N, K). check_buffers verified the buffer sizes (B
        // holds n*k elements in either layout); the kernel zero-fills loads past M, N, K and
        // skips stores past M, N. The 16-byte cp.async path is chosen only when every row of A
        // and B is a multiple of 8 elements (K, and N for the [K, N] layout), so every chunk
        // starts 16-byte aligned from a 256-byte aligned allocation and lies wholly in or out of
        // bounds. The dynamic shared memory requested is the kernel's SMEM_BYTES for every
        // layout (static_assert there) and within the device's opt-in limit (mma_usable), which
        // the function attribute was raised to above. C is borrowed mutably: no aliasing.
        unsafe { l.launch(cfg) }.map(drop).map_err(driver("cuLaunchKernel(tp_gemm_mma)"))
    }

    /// bf16/f16 tensor-core weight-gradient GEMM (`kernels/gemm_mma.cu`, `tp_gemm_mma_T_tn`):
    /// `C (+)= A^T B` with `A` stored `k×m` and `B` `k×n` of element type `g.ty` and `C` `m×n`
    /// in f32 (added to when `g.accumulate`). f32 accumulation; needs compute capability 8.0 or
    /// later; any `k` (0: `C` is zeroed, or left as it is when accumulating).
    pub fn gemm_mma_tn(&self, g: GemmTnArgs<'_>) -> Result<()> {
        const K: &str = "gemm_mma_tn";
        let ty = g.ty;
        self.mma_usable(K, ty)?;
        g.check_buffers(K)?;
        let GemmTnArgs { c, a, b, shape: GemmShape { m, n, k }, accumulate, .. } = g;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let grid = gemm_grid(K, m, n)?;
        let aligned = m % 8 == 0 && n % 8 == 0; // rows of A (m) and B (n) 16-byte aligned
        let f = self.function(&crate::kernels::mma_layout(ty, MmaLayout::Tn, aligned), consts::MMA_SMEM_BYTES)?;
        let [m_i, n_i, k_i] = [i64_of(K, m)?, i64_of(K, n)?, i64_of(K, k)?];
        let beta = i32::from(accumulate);
        let mut l = self.stream().launch_builder(f);
        l.arg(c).arg(a).arg(b).arg(&m_i).arg(&n_i).arg(&k_i).arg(&beta);
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (consts::MMA_THREADS, 1, 1),
            shared_mem_bytes: consts::MMA_SMEM_BYTES,
        };
        // SAFETY: matches tp_gemm_mma_T_tn[_unaligned](float* C, const T* A, const T* B, int64 M,
        // N, K, int beta). check_buffers verified that A holds k*m and B k*n elements of T and C
        // m*n floats; the kernel zero-fills loads past M, N, K and reads and writes C only below
        // M, N (float2 pairs only when N is even, so they are 8-byte aligned). The cp.async path
        // is chosen only when M and N are multiples of 8 (every chunk of a row of A or B
        // aligned, wholly in or out). Dynamic shared memory as for gemm_mma_layout. C is
        // borrowed mutably: no aliasing with A or B.
        unsafe { l.launch(cfg) }.map(drop).map_err(driver("cuLaunchKernel(tp_gemm_mma_tn)"))
    }

    /// Refuses what `kernels/gemm_mma.cu` cannot run: a type other than f16/bf16, a device
    /// before sm_80 or without its shared memory.
    pub(super) fn mma_usable(&self, name: &'static str, ty: ElemType) -> Result<()> {
        if !matches!(ty, ElemType::F16 | ElemType::BF16) {
            return Err(invalid(name, "the mma.sync kernel takes f16 or bf16; use the SIMT kernel for f32"));
        }
        let (major, minor) = self.compute_capability();
        if major < 8 {
            return Err(invalid(name, format!("needs sm_80 or later, device is sm_{major}{minor}")));
        }
        if self.smem_optin() < consts::MMA_SMEM_BYTES {
            return Err(invalid(
                name,
                format!(
                    "needs {} B of shared memory per block, device allows {}",
                    consts::MMA_SMEM_BYTES,
                    self.smem_optin()
                ),
            ));
        }
        Ok(())
    }

    /// fp32 SIMT weight-gradient GEMM (`kernels/gemm_simt.cu`, `tp_gemm_simt_f32_tn`):
    /// `C (+)= A^T B` with `A` stored `k×m`, `B` `k×n` and `C` `m×n`, all f32 (`g.ty` must be
    /// f32), added to `C` when `g.accumulate`. Any `k`, 0 included.
    pub fn gemm_simt_f32_tn(&self, g: GemmTnArgs<'_>) -> Result<()> {
        const K: &str = "gemm_simt_f32_tn";
        if g.ty != ElemType::F32 {
            return Err(invalid(K, format!("the SIMT kernel takes f32, not {}", g.ty.name())));
        }
        g.check_buffers(K)?;
        let GemmTnArgs { c, a, b, shape: GemmShape { m, n, k }, accumulate, .. } = g;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let grid = gemm_grid(K, m, n)?;
        let vec = i32::from(m % 4 == 0) | (i32::from(n % 4 == 0) << 1);
        let f = self.function(crate::kernels::SIMT_TN, 0)?;
        let [m_i, n_i, k_i] = [i64_of(K, m)?, i64_of(K, n)?, i64_of(K, k)?];
        let beta = i32::from(accumulate);
        let mut l = self.stream().launch_builder(f);
        l.arg(c).arg(a).arg(b).arg(&m_i).arg(&n_i).arg(&k_i).arg(&vec).arg(&beta);
        let cfg = LaunchConfig { grid_dim: grid, block_dim: (consts::SIMT_THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: matches tp_gemm_simt_f32_tn(float* C, const float* A, const float* B, int64 M,
        // N, K, int vec, int beta). check_buffers verified that A holds k*m, B k*n and C m*n
        // floats; the kernel bounds-checks every tile edge against M, N, K. Vector (16-byte)
        // loads only where the rows (m floats of A, n of B) are multiples of 4 floats from a
        // 256-byte aligned base. C is the only buffer written and is borrowed mutably.
        unsafe { l.launch(cfg) }.map(drop).map_err(driver("cuLaunchKernel(tp_gemm_simt_tn)"))
    }

    /// Decode-shaped `C = A B^T + bias` for `1 <= m <= 8` (`kernels/gemm_small_m.cu`): one
    /// warp per weight row, 16-byte loads, so the weight streams from memory once. Any `k`, 0
    /// included (then `C` is the bias, or zeros).
    pub fn gemm_small_m(&self, g: GemmArgs<'_>) -> Result<()> {
        const K: &str = "gemm_small_m";
        let ty = g.ty;
        require_float(K, ty)?;
        let m = g.shape.m;
        if !(1..=SMALL_M_MAX).contains(&m) {
            return Err(invalid(K, format!("M = {m}; this kernel takes 1..={SMALL_M_MAX}")));
        }
        g.check_buffers(K)?;
        let GemmArgs { c, a, b, bias, shape: GemmShape { n, k, .. }, .. } = g;
        if n == 0 {
            return Ok(());
        }
        let vec = k % (16 / ty.size()) == 0; // every row starts 16-byte aligned
        let f = self.function(&crate::kernels::small_m(ty, vec), 0)?;
        let (m_i, n_i, k_i) = (m as i32, i64_of(K, n)?, i64_of(K, k)?);
        let warps = consts::SMALL_M_WARPS; // one weight row per warp
        let blocks = (n as u64).div_ceil(u64::from(warps)).clamp(1, u64::from(self.sm_count()) * BLOCKS_PER_SM);
        let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (warps * 32, 1, 1), shared_mem_bytes: 0 };
        let mut l = self.stream().launch_builder(f);
        l.arg(c).arg(a).arg(b);
        push_bias(&mut l, bias);
        l.arg(&m_i).arg(&n_i).arg(&k_i);
        // SAFETY: matches tp_gemm_small_m_T[_unaligned](T* C, const T* A, const T* B,
        // const T* bias_or_null, int M, int64 N, int64 K). check_buffers verified that A holds m*k,
        // B n*k, C m*n and bias n elements; the kernel reads rows of A and B only below K and
        // writes C[m][n] only for m < M (<= 8) and n < N. The 16-byte vector variant is chosen only
        // when K is a multiple of the vector width, so every vector is in bounds and aligned
        // (allocations are 256-byte aligned). C is borrowed mutably: no aliasing.
        unsafe { l.launch(cfg) }.map(drop).map_err(driver("cuLaunchKernel(tp_gemm_small_m)"))
    }
}

/// `(ceil(n / BN), ceil(m / BM), 1)` for the SIMT and mma.sync tiles (both 128 x 128), within
/// CUDA's grid limits.
pub(super) fn gemm_grid(kernel: &'static str, m: usize, n: usize) -> Result<(u32, u32, u32)> {
    let (gx, gy) = (n.div_ceil(consts::SIMT_BN as usize), m.div_ceil(consts::SIMT_BM as usize));
    if gx > i32::MAX as usize || gy > 65535 {
        return Err(invalid(kernel, format!("grid {gx} x {gy} exceeds CUDA's limits (2^31-1 x 65535)")));
    }
    Ok((gx as u32, gy as u32, 1))
}

#[cfg(test)]
mod tests {
    #[test]
    fn grids_respect_limits() {
        assert_eq!(super::gemm_grid("t", 129, 1).unwrap(), (1, 2, 1));
        assert!(super::gemm_grid("t", 65536 * 128, 1).is_err());
    }
}
