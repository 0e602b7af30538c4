//! Launchers of `kernels/loss.cu`: a vocab-parallel cross-entropy's pieces on one rank's logit
//! columns (row maxima, the parts the ranks sum, the gradient). Results are f32; each kernel is
//! one block per row and reads each logit once.

use super::{ElemType, i64_of, invalid, require_float, span};
use crate::error::{Result, driver};
use crate::gpu::Gpu;
use cudarc::driver::{CudaSlice, PushKernelArg};

/// `rows * cols` elements of `size` bytes, checked.
fn bytes(kernel: &'static str, rows: usize, cols: usize, size: usize) -> Result<usize> {
    span(kernel, rows, cols, 0).and_then(|n| span(kernel, n, size, 0))
}

impl Gpu {
    /// `out[r] = max_j x[r, j]` over `x: [rows, n]` of `ty` (`tp_row_max_T`; NaN ignored unless
    /// a row is all NaN, `-inf` for `n = 0`). `out`: `rows` f32.
    pub fn row_max(
        &self,
        out: &mut CudaSlice<u8>,
        x: &CudaSlice<u8>,
        (rows, n): (usize, usize),
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "row_max";
        require_float(K, ty)?;
        if bytes(K, rows, n, ty.size())? > x.len() || bytes(K, rows, 1, 4)? > out.len() {
            return Err(invalid(K, format!("{rows} x {n} does not fit the buffers")));
        }
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(&format!("tp_row_max_{}", ty.name()), 0)?;
        let (r, n_i) = (i64_of(K, rows)?, i64_of(K, n)?);
        let mut l = self.stream().launch_builder(f);
        l.arg(out).arg(x).arg(&r).arg(&n_i);
        // SAFETY: matches tp_row_max_T(float* out, const T* x, int64 rows, int64 n); x holds rows*n
        // elements of T and out rows floats (checked above); out is the only buffer written,
        // borrowed mutably; 256 threads, a multiple of 32, as the block reduction needs.
        unsafe { l.launch(self.grid_rows(rows as u64)) }.map(drop).map_err(driver("cuLaunchKernel(tp_row_max)"))
    }

    /// This rank's cross-entropy parts (`tp_cross_entropy_parts_T`): `out` (`2 x rows` f32)
    /// gets `Σ_j e^(x[r, j] − max[r])` in row `r` and the target's logit `x[r, targets[r]]`
    /// (0 where `targets[r]` is negative: not a local column) in row `rows + r`. `max`: `rows`
    /// f32; `targets`: `rows` int64, each `< n`.
    pub fn cross_entropy_parts(
        &self,
        out: &mut CudaSlice<u8>,
        x: &CudaSlice<u8>,
        max: &CudaSlice<u8>,
        targets: &CudaSlice<u8>,
        (rows, n): (usize, usize),
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "cross_entropy_parts";
        require_float(K, ty)?;
        if bytes(K, rows, n, ty.size())? > x.len()
            || bytes(K, rows, 2, 4)? > out.len()
            || bytes(K, rows, 1, 4)? > max.len()
            || bytes(K, rows, 1, 8)? > targets.len()
        {
            return Err(invalid(K, format!("{rows} x {n} does not fit the buffers")));
        }
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(&format!("tp_cross_entropy_parts_{}", ty.name()), 0)?;
        let (r, n_i) = (i64_of(K, rows)?, i64_of(K, n)?);
        let mut l = self.stream().launch_builder(f);
        l.arg(out).arg(x).arg(max).arg(targets).arg(&r).arg(&n_i);
        // SAFETY: matches tp_cross_entropy_parts_T(float* out, const T* x, const float* max,
        // const int64* targets, int64 rows, int64 n); x holds rows*n elements of T, out 2*rows
        // floats, max rows floats and targets rows int64 (checked above); the kernel reads
        // x[r, t] only for 0 <= t < n, whatever the targets hold. out is the only buffer
        // written, borrowed mutably; 256 threads, as the block reduction needs.
        unsafe { l.launch(self.grid_rows(rows as u64)) }
            .map(drop)
            .map_err(driver("cuLaunchKernel(tp_cross_entropy_parts)"))
    }

    /// The cross-entropy's gradient on this rank's logit columns
    /// (`tp_cross_entropy_backward_T`): `out[r, j] = e^(x[r, j] − max[r])·(w_r / sum_exp[r]) −
    /// [j = targets[r]]·w_r` (`rows x n` f32; rows of weight 0 are zeros). `max`, `sum_exp`,
    /// `weights`: `rows` f32; `targets`: `rows` int64 (negative: not on this rank).
    #[allow(clippy::too_many_arguments)]
    pub fn cross_entropy_backward(
        &self,
        out: &mut CudaSlice<u8>,
        x: &CudaSlice<u8>,
        max: &CudaSlice<u8>,
        sum_exp: &CudaSlice<u8>,
        targets: &CudaSlice<u8>,
        weights: &CudaSlice<u8>,
        (rows, n): (usize, usize),
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "cross_entropy_backward";
        require_float(K, ty)?;
        let row_floats = bytes(K, rows, 1, 4)?;
        if bytes(K, rows, n, ty.size())? > x.len()
            || bytes(K, rows, n, 4)? > out.len()
            || row_floats > max.len()
            || row_floats > sum_exp.len()
            || row_floats > weights.len()
            || bytes(K, rows, 1, 8)? > targets.len()
        {
            return Err(invalid(K, format!("{rows} x {n} does not fit the buffers")));
        }
        if rows == 0 || n == 0 {
            return Ok(());
        }
        let f = self.function(&format!("tp_cross_entropy_backward_{}", ty.name()), 0)?;
        let (r, n_i) = (i64_of(K, rows)?, i64_of(K, n)?);
        let mut l = self.stream().launch_builder(f);
        l.arg(out).arg(x).arg(max).arg(sum_exp).arg(targets).arg(weights).arg(&r).arg(&n_i);
        // SAFETY: matches tp_cross_entropy_backward_T(float* out, const T* x, const float* max,
        // const float* sum_exp, const int64* targets, const float* weights, int64 rows, int64 n);
        // x holds rows*n elements of T, out rows*n floats, max, sum_exp and weights rows floats,
        // targets rows int64 (checked above); the kernel writes out[r, j] for j < n only. out is
        // the only buffer written, borrowed mutably.
        unsafe { l.launch(self.grid_rows(rows as u64)) }
            .map(drop)
            .map_err(driver("cuLaunchKernel(tp_cross_entropy_backward)"))
    }
}
