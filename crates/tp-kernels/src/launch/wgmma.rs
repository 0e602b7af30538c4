//! Launcher of the Hopper GEMM (`kernels/gemm_wgmma.cu`).

use super::gemm_args::{GemmArgs, GemmShape};
use super::{ElemType, invalid, push_bias};
use crate::consts;
use crate::error::{Result, driver};
use crate::gpu::Gpu;
use cudarc::driver::{LaunchConfig, PushKernelArg};

impl Gpu {
    /// Hopper bf16/f16 GEMM with fused bias (`kernels/gemm_wgmma.cu`): `C = A B^T + bias`,
    /// `A: m x k`, `B: n x k`. Needs sm_90 and `k % 8 == 0`. With `k = 0` (a bias-only product)
    /// there is nothing for TMA to read, and a tensor map cannot have a zero dimension: the
    /// mma.sync kernel writes `C` (the bias, or zeros) instead.
    pub fn gemm_wgmma(&self, g: GemmArgs<'_>) -> Result<()> {
        const K: &str = "gemm_wgmma";
        let GemmShape { m, n, k } = g.shape;
        let ty = g.ty;
        if !matches!(ty, ElemType::F16 | ElemType::BF16) {
            return Err(invalid(K, "the wgmma kernel takes f16 or bf16"));
        }
        if self.compute_capability() != (9, 0) {
            let (ma, mi) = self.compute_capability();
            return Err(invalid(K, format!("needs sm_90 (Hopper), device is sm_{ma}{mi}")));
        }
        if k == 0 {
            return self.gemm_mma(g);
        }
        if k % 8 != 0 {
            return Err(invalid(K, format!("K = {k} is not a multiple of 8 (TMA needs 16-byte row strides)")));
        }
        if self.smem_optin() < consts::WGMMA_SMEM_BYTES {
            return Err(invalid(
                K,
                format!(
                    "needs {} B of shared memory per block, device allows {}",
                    consts::WGMMA_SMEM_BYTES,
                    self.smem_optin()
                ),
            ));
        }
        g.check_buffers(K)?;
        let GemmArgs { c, a, b, bias, .. } = g;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let too_big = |v: usize| i32::try_from(v).is_err();
        if too_big(m) || too_big(n) || too_big(k) {
            return Err(invalid(K, "M, N and K must fit in 32-bit ints"));
        }
        let (bm, bn, bk) = (consts::WGMMA_BM, consts::WGMMA_BN, consts::WGMMA_BK);
        let tiles = m.div_ceil(bm as usize) * n.div_ceil(bn as usize);
        let grid = (tiles.min(self.sm_count() as usize)) as u32;
        // The TMA boxes are the kernel's A and B stage tiles: K step x rows of the C tile.
        let (map_a, read_a) = self.tensor_map(a, ty, m, k, (bk, bm))?;
        let (map_b, read_b) = self.tensor_map(b, ty, n, k, (bk, bn))?;
        let name = format!("tp_gemm_wgmma_{}", ty.name());
        let f = self.function(&name, consts::WGMMA_SMEM_BYTES)?;
        let [m_i, n_i, k_i] = [m as i32, n as i32, k as i32];
        let mut l = self.stream().launch_builder(f);
        l.arg(c);
        push_bias(&mut l, bias);
        l.arg(&map_a).arg(&map_b).arg(&m_i).arg(&n_i).arg(&k_i);
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (consts::WGMMA_THREADS, 1, 1),
            shared_mem_bytes: consts::WGMMA_SMEM_BYTES,
        };
        // SAFETY: matches tp_gemm_wgmma_T(T* C, const T* bias_or_null, CUtensorMap tma_a,
        // CUtensorMap tma_b, int M, N, K). The maps describe exactly A (m x k) and B (n x k),
        // whose sizes check_buffers verified; TMA never reads outside them (it zero-fills past the
        // edges). C holds m*n elements and the kernel skips stores past M and N. The dynamic
        // shared memory equals the kernel's SMEM_BYTES (static_assert there), within the device
        // limit the attribute was raised to; WGMMA_THREADS is the kernel's __launch_bounds__.
        // The read guards of A and B are alive until after the launch (below).
        // C is borrowed mutably, so it aliases neither A nor B.
        let launched = unsafe { l.launch(cfg) }.map(drop).map_err(driver("cuLaunchKernel(tp_gemm_wgmma)"));
        drop((read_a, read_b)); // A and B were read by the kernel just enqueued: record it
        launched
    }
}
