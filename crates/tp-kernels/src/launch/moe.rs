//! Launchers of `kernels/moe.cu`: a mixture of experts' router (softmax, the top `k` with
//! their weights) and the weighted combine of the experts' outputs, on the device.

use super::{ElemType, i64_of, invalid, require_float, span};
use crate::error::{Result, driver};
use crate::gpu::Gpu;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

/// Rows a block of the router takes (one warp each).
const ROUTE_ROWS_PER_BLOCK: u64 = 8;
/// Most experts the router takes (8 per lane, in registers).
pub const MAX_ROUTED_EXPERTS: usize = 256;

impl Gpu {
    /// The routing of `logits: [rows, e]` of `ty` (`tp_moe_route_T`): for each row the `k`
    /// experts of largest softmax probability, in descending order (NaN last, ties to the lower
    /// expert), into `experts` (`rows * k` int32) and their weights (`rows * k` f32: the
    /// probabilities, or with `renormalize` those divided by their sum).
    ///
    /// Errors: `k` outside `1..=e`, `e` above [`MAX_ROUTED_EXPERTS`], buffers too small.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_route(
        &self,
        experts: &mut CudaSlice<u8>,
        weights: &mut CudaSlice<u8>,
        logits: &CudaSlice<u8>,
        (rows, e, k): (usize, usize, usize),
        renormalize: bool,
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "moe_route";
        require_float(K, ty)?;
        if k == 0 || k > e || e > MAX_ROUTED_EXPERTS {
            return Err(invalid(K, format!("top {k} of {e} experts (1 <= k <= e <= {MAX_ROUTED_EXPERTS})")));
        }
        let slots = span(K, rows, k, 0)?;
        if span(K, span(K, rows, e, 0)?, ty.size(), 0)? > logits.len()
            || span(K, slots, 4, 0)? > experts.len()
            || span(K, slots, 4, 0)? > weights.len()
        {
            return Err(invalid(K, format!("{rows} rows of {e} logits, top {k}, do not fit the buffers")));
        }
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(&format!("tp_moe_route_{}", ty.name()), 0)?;
        let (r, e_i, k_i, renorm) = (i64_of(K, rows)?, e as i32, k as i32, i32::from(renormalize));
        let blocks = (rows as u64).div_ceil(ROUTE_ROWS_PER_BLOCK).clamp(1, u64::from(self.sm_count()) * 32);
        let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut l = self.stream().launch_builder(f);
        l.arg(experts).arg(weights).arg(logits).arg(&r).arg(&e_i).arg(&k_i).arg(&renorm);
        // SAFETY: matches tp_moe_route_T(int32* experts, float* weights, const T* logits, int64 rows,
        // int e, int k, int renorm); logits holds rows*e elements of T, experts and weights rows*k
        // 4-byte entries (checked above); 1 <= k <= e <= 256 as the kernel's 8 registers a lane
        // need; experts and weights, borrowed mutably, are the only buffers written; 256 threads
        // (8 warps, one row each).
        unsafe { l.launch(cfg) }.map(drop).map_err(driver("cuLaunchKernel(tp_moe_route)"))
    }

    /// The experts' combine (`tp_moe_combine_T`): `out[r, c] = Σ_j weights[r·k + j] ·
    /// y[pos[r·k + j], c]` over `j` in order (f32, each product and sum rounded in that order),
    /// slots with a negative `pos` skipped. `out`: `rows * h` f32; `y`: `y_rows * h` of `ty`;
    /// `pos`: `rows * k` int64, each below `y_rows`; `weights`: `rows * k` f32.
    ///
    /// Errors: a `pos` at or past `y_rows` (checked on the host copy `pos_host`), buffers too
    /// small.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_combine(
        &self,
        out: &mut CudaSlice<u8>,
        y: &CudaSlice<u8>,
        (pos, pos_host): (&CudaSlice<u8>, &[i64]),
        weights: &CudaSlice<u8>,
        (rows, k, h, y_rows): (usize, usize, usize, usize),
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "moe_combine";
        require_float(K, ty)?;
        let slots = span(K, rows, k, 0)?;
        if pos_host.len() != slots || pos_host.iter().any(|&p| p >= y_rows as i64) {
            return Err(invalid(K, format!("{} positions for {slots} slots, each below {y_rows}", pos_host.len())));
        }
        if span(K, span(K, y_rows, h, 0)?, ty.size(), 0)? > y.len()
            || span(K, span(K, rows, h, 0)?, 4, 0)? > out.len()
            || span(K, slots, 8, 0)? > pos.len()
            || span(K, slots, 4, 0)? > weights.len()
        {
            return Err(invalid(K, format!("{rows} x {h} from {y_rows} rows, {k} slots each, do not fit the buffers")));
        }
        if rows == 0 || h == 0 {
            return Ok(());
        }
        let f = self.function(&format!("tp_moe_combine_{}", ty.name()), 0)?;
        let (r, k_i, h_i) = (i64_of(K, rows)?, k as i32, i64_of(K, h)?);
        let mut l = self.stream().launch_builder(f);
        l.arg(out).arg(y).arg(pos).arg(weights).arg(&r).arg(&k_i).arg(&h_i);
        // SAFETY: matches tp_moe_combine_T(float* out, const T* y, const int64* pos, const float*
        // weights, int64 rows, int k, int64 h); out holds rows*h floats, y y_rows*h elements of
        // T, pos rows*k int64 each below y_rows (checked on the copy the caller uploaded) and
        // weights rows*k floats; out, borrowed mutably, is the only buffer written.
        unsafe { l.launch(self.grid_rows(rows as u64)) }.map(drop).map_err(driver("cuLaunchKernel(tp_moe_combine)"))
    }
}
