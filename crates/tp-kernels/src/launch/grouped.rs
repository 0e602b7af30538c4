//! Launcher of the grouped NT GEMM of a mixture's experts (`kernels/gemm_mma.cu`,
//! `tp_gemm_mma_T_grouped`): every expert's rows times its own weight in one launch.

use super::{ElemType, i64_of, invalid, span};
use crate::consts;
use crate::error::{Result, driver};
use crate::gpu::Gpu;
use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};

/// One expert of a grouped product: its `[n, k]` weight and, if it has one, its `[n]` bias.
pub struct GroupedExpert<'a> {
    /// `n × k`, nn.Linear's layout.
    pub weight: &'a CudaSlice<u8>,
    /// `n` entries, or none.
    pub bias: Option<&'a CudaSlice<u8>>,
}

impl Gpu {
    /// `C[r] = A[r] W_e^T + b_e` for the rows `r` of `offsets[e] .. offsets[e + 1]` of every
    /// expert `e` (`A`: `offsets[E] × k`, the tokens' rows sorted by expert; `C`: `offsets[E] ×
    /// n`), all of `ty` (f16 or bf16), in one launch: a block per (expert, 128-row tile,
    /// 128-column tile), each expert's tiles those of its own NT product, so the same bits as a
    /// launch per expert ([`gemm_mma`](Self::gemm_mma)).
    ///
    /// Errors: `offsets` not `E + 1` non-decreasing entries from 0, buffers too small, more
    /// row tiles than a grid's 65535, as [`gemm_mma`](Self::gemm_mma) for the device.
    pub fn gemm_mma_grouped(
        &self,
        c: &mut CudaSlice<u8>,
        a: &CudaSlice<u8>,
        experts: &[GroupedExpert<'_>],
        offsets: &[usize],
        (n, k): (usize, usize),
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "gemm_mma_grouped";
        self.mma_usable(K, ty)?;
        if offsets.len() != experts.len() + 1 || offsets.first() != Some(&0) || offsets.windows(2).any(|w| w[1] < w[0])
        {
            return Err(invalid(
                K,
                format!("{} offsets for {} experts (need E + 1, from 0, non-decreasing)", offsets.len(), experts.len()),
            ));
        }
        let rows = offsets[experts.len()];
        let size = ty.size();
        if span(K, span(K, rows, k, 0)?, size, 0)? > a.len() || span(K, span(K, rows, n, 0)?, size, 0)? > c.len() {
            return Err(invalid(K, format!("{rows} rows of {k} -> {n} do not fit A or C")));
        }
        let w_bytes = span(K, span(K, n, k, 0)?, size, 0)?;
        for (e, x) in experts.iter().enumerate() {
            if x.weight.len() < w_bytes || x.bias.is_some_and(|b| b.len() < n * size) {
                return Err(invalid(K, format!("expert {e}'s weight or bias is smaller than [{n}, {k}] / [{n}]")));
            }
        }
        // One (expert, row tile) pair per block row of the grid.
        let bm = consts::MMA_BM as usize;
        let mut tiles: Vec<i32> = Vec::new();
        for (e, w) in offsets.windows(2).enumerate() {
            for t in 0..(w[1] - w[0]).div_ceil(bm) {
                tiles.extend([e as i32, t as i32]);
            }
        }
        let tile_rows = tiles.len() / 2;
        let gx = n.div_ceil(consts::MMA_BN as usize);
        if tile_rows == 0 || gx == 0 {
            return Ok(());
        }
        if tile_rows > 65535 || gx > i32::MAX as usize {
            return Err(invalid(K, format!("grid {gx} x {tile_rows} exceeds CUDA's limits")));
        }
        let stream = self.stream();
        let mut guards = Vec::with_capacity(2 * experts.len());
        let (mut weights, mut biases) = (Vec::with_capacity(experts.len()), Vec::with_capacity(experts.len()));
        for x in experts {
            let (w, g) = x.weight.device_ptr(stream);
            weights.push(w);
            guards.push(g);
            match x.bias {
                Some(b) => {
                    let (p, g) = b.device_ptr(stream);
                    biases.push(p);
                    guards.push(g);
                }
                None => biases.push(0),
            }
        }
        let u64_bytes = |v: &[u64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let w_table = self.htod(&u64_bytes(&weights))?;
        let b_table = self.htod(&u64_bytes(&biases))?;
        let off: Vec<u8> = offsets.iter().flat_map(|&o| (o as i64).to_le_bytes()).collect();
        let off = self.htod(&off)?;
        let tiles = self.htod(&tiles.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>())?;
        // Rows of A start r0 * k elements in, of every weight on its own allocation: 16-byte
        // chunks stay aligned when k is a multiple of 8.
        let aligned = k % 8 == 0;
        let f = self.function(&crate::kernels::mma_grouped(ty, aligned), consts::MMA_SMEM_BYTES)?;
        let (n_i, k_i) = (i64_of(K, n)?, i64_of(K, k)?);
        let mut l = stream.launch_builder(f);
        l.arg(c).arg(a).arg(&w_table).arg(&b_table).arg(&off).arg(&tiles).arg(&n_i).arg(&k_i);
        let cfg = LaunchConfig {
            grid_dim: (gx as u32, tile_rows as u32, 1),
            block_dim: (consts::MMA_THREADS, 1, 1),
            shared_mem_bytes: consts::MMA_SMEM_BYTES,
        };
        // SAFETY: matches tp_gemm_mma_T_grouped[_unaligned](T* C, const T* A, const T* const* B,
        // const T* const* bias, const int64* offsets, const int32* tiles, int64 N, int64 K). The
        // tables hold one weight and one bias pointer (0: none) per expert, each weight n*k and
        // each bias n elements (checked above), E + 1 offsets up to `rows` (A holds rows*k and C
        // rows*n elements), and one (expert, row tile) pair per grid row with every tile's rows
        // within its expert's; the kernel bounds-checks every tile edge against the expert's
        // rows, N and K. The cp.async path only with k a multiple of 8. Dynamic shared memory as
        // for gemm_mma (mma_usable checked the opt-in limit). C is borrowed mutably; the guards
        // record the weights' and biases' use on the stream when dropped after the launch.
        unsafe { l.launch(cfg) }.map(drop).map_err(driver("cuLaunchKernel(tp_gemm_mma_grouped)"))?;
        drop(guards);
        Ok(())
    }
}
