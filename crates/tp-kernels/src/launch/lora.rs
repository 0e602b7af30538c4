//! Launchers of `kernels/lora.cu`: LoRA's batched multi-adapter products (Punica's BGMV
//! shape), every token through the adapter of its slot in one launch.

use super::{ElemType, i64_of, invalid, require_float, span};
use crate::error::{Result, driver};
use crate::gpu::Gpu;
use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};

/// Largest adapter rank the expand kernel takes (its shared row of `u`).
pub const MAX_LORA_RANK: usize = 128;
/// Columns a block of the expand kernel takes.
const EXPAND_COLS: usize = 256;

/// One slot's factor for a batched product: an f32 matrix read as `w(i, j) = W[i·ld_i + j·ld_j]`
/// (`ld_i`, `ld_j` shared by every slot of a launch), or none where the slot is empty.
pub type LoraFactor<'a> = Option<&'a CudaSlice<u8>>;

/// The shape of a batched LoRA product: tokens, the input width, the rank, and how the factors
/// are read (`(ld_i, ld_j)`: `(in, 1)` for `A: [r, in]`, `(1, r)` for `Bᵀ`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoraShape {
    /// Tokens (rows of `x` and `u`).
    pub rows: usize,
    /// The shrink's input width, or the expand's output width.
    pub width: usize,
    /// The adapters' rank (columns of `u`).
    pub rank: usize,
    /// Strides of the factor's first and second index.
    pub ld: (usize, usize),
}

impl Gpu {
    /// `u[t, i] = scale · Σ_j x[t, j] · w_{slot[t]}(i, j)` (`tp_lora_shrink_T`) for every token
    /// whose slot (`slot`: `rows` int32, `< 0` none) holds a factor; `x`: `rows × width` of
    /// `ty`, `u`: `rows × rank` f32 (rows of the other tokens untouched).
    ///
    /// Errors: a rank of 0, buffers too small, a slot table larger than `i32`.
    #[allow(clippy::too_many_arguments)]
    pub fn lora_shrink(
        &self,
        u: &mut CudaSlice<u8>,
        x: &CudaSlice<u8>,
        factors: &[LoraFactor<'_>],
        slot: &CudaSlice<u8>,
        shape: LoraShape,
        scale: f32,
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "lora_shrink";
        let LoraShape { rows, width, rank, ld } = shape;
        require_float(K, ty)?;
        self.check_lora(K, factors, shape)?;
        if span(K, span(K, rows, width, 0)?, ty.size(), 0)? > x.len()
            || span(K, span(K, rows, rank, 0)?, 4, 0)? > u.len()
            || span(K, rows, 4, 0)? > slot.len()
        {
            return Err(invalid(K, format!("{rows} tokens of {width} -> rank {rank} do not fit the buffers")));
        }
        if rows == 0 {
            return Ok(());
        }
        let (table, guards) = self.factor_table(factors)?;
        let f = self.function(&format!("tp_lora_shrink_{}", ty.name()), 0)?;
        let (r, w, rk, li, lj) = (i64_of(K, rows)?, i64_of(K, width)?, rank as i32, i64_of(K, ld.0)?, i64_of(K, ld.1)?);
        let blocks = (rows as u64).clamp(1, u64::from(self.sm_count()) * 16);
        let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut l = self.stream().launch_builder(f);
        let nslots = factors.len() as i32;
        l.arg(u).arg(x).arg(&table).arg(slot).arg(&nslots).arg(&r).arg(&w).arg(&rk).arg(&li).arg(&lj).arg(&scale);
        // SAFETY: matches tp_lora_shrink_T(float* u, const T* x, const float* const* ws, const
        // int32* slot, int nslots, int64 rows, int64 width, int r, int64 ld_i, int64 ld_j, float
        // scale). x holds rows*width elements of T, u rows*rank f32, slot rows int32 (checked
        // above); the table holds nslots pointers (0: none) and the kernel skips a slot id
        // outside 0..nslots; each factor holds every element its (rank, width) reads at strides
        // ld (check_lora). u, borrowed mutably, is the only buffer written; the guards record the
        // factors' use on the stream when dropped after the launch.
        unsafe { l.launch(cfg) }.map(drop).map_err(driver("cuLaunchKernel(tp_lora_shrink)"))?;
        drop(guards);
        Ok(())
    }

    /// `y[t, c] = round(y[t, c] + scales[s] · Σ_i u[t, i] · w_s(c, i))`, `s = slot[t]`
    /// (`tp_lora_expand_T`), for every token whose slot holds a factor: `y`: `rows × width` of
    /// `ty` (updated in place), `u`: `rows × rank` f32, `scales`: one f32 per slot.
    ///
    /// Errors: a rank of 0 or above [`MAX_LORA_RANK`], buffers too small.
    #[allow(clippy::too_many_arguments)]
    pub fn lora_expand(
        &self,
        y: &mut CudaSlice<u8>,
        u: &CudaSlice<u8>,
        factors: &[LoraFactor<'_>],
        slot: &CudaSlice<u8>,
        scales: &CudaSlice<u8>,
        shape: LoraShape,
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "lora_expand";
        let LoraShape { rows, width, rank, ld } = shape;
        require_float(K, ty)?;
        if rank > MAX_LORA_RANK {
            return Err(invalid(K, format!("rank {rank} is over {MAX_LORA_RANK}")));
        }
        self.check_lora(K, factors, shape)?;
        if span(K, span(K, rows, width, 0)?, ty.size(), 0)? > y.len()
            || span(K, span(K, rows, rank, 0)?, 4, 0)? > u.len()
            || span(K, rows, 4, 0)? > slot.len()
            || span(K, factors.len(), 4, 0)? > scales.len()
        {
            return Err(invalid(K, format!("{rows} tokens of rank {rank} -> {width} do not fit the buffers")));
        }
        if rows == 0 || width == 0 {
            return Ok(());
        }
        let (table, guards) = self.factor_table(factors)?;
        let f = self.function(&format!("tp_lora_expand_{}", ty.name()), 0)?;
        let (r, w, rk, li, lj) = (i64_of(K, rows)?, i64_of(K, width)?, rank as i32, i64_of(K, ld.0)?, i64_of(K, ld.1)?);
        let tiles = span(K, rows, width.div_ceil(EXPAND_COLS), 0)? as u64;
        let blocks = tiles.clamp(1, u64::from(self.sm_count()) * 32);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (EXPAND_COLS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = self.stream().launch_builder(f);
        let nslots = factors.len() as i32;
        l.arg(y).arg(u).arg(&table).arg(slot).arg(scales).arg(&nslots).arg(&r).arg(&w).arg(&rk).arg(&li).arg(&lj);
        // SAFETY: matches tp_lora_expand_T(T* y, const float* u, const float* const* ws, const
        // int32* slot, const float* scales, int nslots, int64 rows, int64 out, int r, int64 ld_i,
        // int64 ld_j). y holds rows*width elements of T, u rows*rank f32, slot rows int32, scales
        // nslots f32 (checked above); rank <= 128, the kernel's shared row; the table holds
        // nslots pointers (0: none) and the kernel skips a slot id outside 0..nslots; each factor
        // holds what (width, rank) reads at strides ld (check_lora). y, borrowed mutably, is the
        // only buffer written; 256 threads, as __launch_bounds__.
        unsafe { l.launch(cfg) }.map(drop).map_err(driver("cuLaunchKernel(tp_lora_expand)"))?;
        drop(guards);
        Ok(())
    }

    /// Checks that every factor holds what `shape` reads: `w(i, j)` for `i < first`, `j <
    /// second` at strides `ld`, where a shrink reads `(rank, width)` and an expand `(width,
    /// rank)`; both are covered by the larger of the two reads.
    fn check_lora(&self, k: &'static str, factors: &[LoraFactor<'_>], shape: LoraShape) -> Result<()> {
        let LoraShape { width, rank, ld, .. } = shape;
        if rank == 0 {
            return Err(invalid(k, "rank 0"));
        }
        if factors.is_empty() || i32::try_from(factors.len()).is_err() {
            return Err(invalid(k, format!("{} slots", factors.len())));
        }
        // The last element either read reaches, plus one.
        let reach = |a: usize, b: usize| -> Result<usize> {
            let last = span(k, a.saturating_sub(1), ld.0, 0)?.checked_add(span(k, b.saturating_sub(1), ld.1, 0)?);
            last.and_then(|x| x.checked_add(1)).ok_or_else(|| invalid(k, "factor extent overflows"))
        };
        let need = span(k, reach(rank, width)?.max(reach(width, rank)?), 4, 0)?;
        for (s, f) in factors.iter().enumerate() {
            if f.is_some_and(|f| f.len() < need) {
                return Err(invalid(k, format!("slot {s}'s factor holds fewer than the {need} bytes read")));
            }
        }
        Ok(())
    }

    /// The device table of the factors' pointers (0 for an empty slot) and the guards that
    /// record their use on the stream.
    fn factor_table<'s>(
        &'s self,
        factors: &[LoraFactor<'s>],
    ) -> Result<(CudaSlice<u8>, Vec<cudarc::driver::SyncOnDrop<'s>>)> {
        let stream = self.stream();
        let mut guards = Vec::new();
        let mut ptrs: Vec<u8> = Vec::with_capacity(8 * factors.len());
        for f in factors {
            let p = match f {
                Some(f) => {
                    let (p, g) = f.device_ptr(stream);
                    guards.push(g);
                    p
                }
                None => 0,
            };
            ptrs.extend(p.to_le_bytes());
        }
        Ok((self.htod(&ptrs)?, guards))
    }
}
