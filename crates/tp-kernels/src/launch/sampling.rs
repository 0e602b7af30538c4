//! Launchers of `kernels/sampling.cu`: penalised logits, each row's top-k candidates and each
//! row's (max, sum of exponentials) of a rank's logits shard `[rows, n]`, so a sampler moves
//! only a few numbers per row to the host. Penalty lists and scales arrive as host slices and
//! are checked (columns in range and distinct, factors finite) before one upload and a launch.

use super::{ElemType, i64_of, invalid, require_float, span};
use crate::consts;
use crate::error::{Result, driver};
use crate::gpu::Gpu;
use cudarc::driver::{CudaSlice, PushKernelArg};

/// The penalties of one row of logits (see `kernels/sampling.cu`): for each local column
/// `cols[e]` (an id of the prompt or the output in this shard) with output count `counts[e]`,
/// `l = l > 0 ? l / repetition : l * repetition`, then `l = (l - count * frequency) - (count > 0
/// ? presence : 0)`, each operation rounded in f32.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowPenalties<'a> {
    /// Repetition penalty (`> 0`; 1 is none).
    pub repetition: f32,
    /// Frequency penalty per occurrence in the output.
    pub frequency: f32,
    /// Presence penalty, once for an id of the output.
    pub presence: f32,
    /// Columns of this shard to penalise (distinct, `< n`).
    pub cols: &'a [usize],
    /// Each column's count in the output (0 for an id seen only in the prompt).
    pub counts: &'a [u32],
}

/// Largest `k` of [`Gpu::top_k`].
pub const TOP_K_MAX: usize = consts::SAMPLING_TOP_K_MAX as usize;

/// The kernel's `meta` buffer: `off[rows + 1]`, `col[E]` (int64), `cnt[E]`, `par[3 rows]` (f32).
fn penalty_meta(k: &'static str, n: usize, rows: &[RowPenalties<'_>]) -> Result<Vec<u8>> {
    let mut off = vec![0i64];
    let (mut cols, mut cnts, mut par) = (Vec::new(), Vec::new(), Vec::new());
    for (r, p) in rows.iter().enumerate() {
        if !(p.repetition > 0.0 && p.repetition.is_finite() && p.frequency.is_finite() && p.presence.is_finite()) {
            return Err(invalid(k, format!("row {r}: penalties must be finite and repetition > 0")));
        }
        if p.cols.len() != p.counts.len() {
            return Err(invalid(k, format!("row {r}: {} columns but {} counts", p.cols.len(), p.counts.len())));
        }
        let mut sorted = p.cols.to_vec();
        sorted.sort_unstable();
        if let Some(&c) = sorted.last().filter(|&&c| c >= n) {
            return Err(invalid(k, format!("row {r}: column {c} is past the shard's {n}")));
        }
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(invalid(k, format!("row {r}: column {} is listed twice", w[0])));
        }
        for (&c, &count) in p.cols.iter().zip(p.counts) {
            cols.push(i64_of(k, c)?);
            cnts.push(count as f32);
        }
        off.push(i64_of(k, cols.len())?);
        par.extend([p.repetition, p.frequency, p.presence]);
    }
    let mut meta = Vec::with_capacity(8 * (off.len() + cols.len()) + 4 * (cnts.len() + par.len()));
    for v in off.iter().chain(&cols) {
        meta.extend_from_slice(&v.to_ne_bytes());
    }
    for v in cnts.iter().chain(&par) {
        meta.extend_from_slice(&v.to_ne_bytes());
    }
    Ok(meta)
}

/// Checks that `x` holds `rows x n` elements of `ty` and each output `rows * per_row` bytes.
fn check_rows(
    k: &'static str,
    x: &CudaSlice<u8>,
    (rows, n): (usize, usize),
    ty: ElemType,
    outs: &[(usize, usize)],
) -> Result<()> {
    require_float(k, ty)?;
    let x_bytes = span(k, rows, n, 0).and_then(|e| span(k, e, ty.size(), 0))?;
    if x_bytes > x.len() {
        return Err(invalid(k, format!("{rows} x {n} does not fit the logits buffer")));
    }
    for &(need_per_row, len) in outs {
        if span(k, rows, need_per_row, 0)? > len {
            return Err(invalid(k, format!("{rows} rows do not fit an output buffer of {len} bytes")));
        }
    }
    Ok(())
}

impl Gpu {
    /// `out[r, j]` = `x[r, j]` as f32 with row `r`'s penalties applied (`tp_penalize_T`); `out`
    /// holds `rows x n` f32, `penalties` one entry per row.
    pub fn penalize(
        &self,
        out: &mut CudaSlice<u8>,
        x: &CudaSlice<u8>,
        (rows, n): (usize, usize),
        penalties: &[RowPenalties<'_>],
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "penalize";
        check_rows(K, x, (rows, n), ty, &[(span(K, n, 4, 0)?, out.len())])?;
        if penalties.len() != rows {
            return Err(invalid(K, format!("{} penalty rows for {rows} rows of logits", penalties.len())));
        }
        let meta = penalty_meta(K, n, penalties)?;
        if rows == 0 || n == 0 {
            return Ok(());
        }
        let meta = self.htod(&meta)?;
        let f = self.function(&format!("tp_penalize_{}", ty.name()), 0)?;
        let (r, ni) = (i64_of(K, rows)?, i64_of(K, n)?);
        let mut b = self.stream().launch_builder(f);
        b.arg(out).arg(x).arg(&r).arg(&ni).arg(&meta);
        // SAFETY: matches tp_penalize_T(float* out, const T* x, int64 rows, n, const int64*
        // meta). x holds rows*n elements and out rows*n floats (checked above); meta is
        // penalty_meta's buffer for these rows: offsets within its columns, every column < n and
        // distinct within its row, so each thread writes its own element of out. 256 threads, a
        // multiple of 32. Only out is written, borrowed mutably.
        unsafe { b.launch(self.grid_rows(rows as u64)) }.map(drop).map_err(driver("cuLaunchKernel(tp_penalize)"))
    }

    /// The `k` best (value, column) pairs of each row of `x: [rows, n]`, best first
    /// (`tp_top_k_T`: NaN first, then larger, then lower column): `vals` receives `rows x k`
    /// f32, `ids` `rows x k` int64 holding column + `id_offset`; slots past `n` hold (-inf, -1).
    #[allow(clippy::too_many_arguments)]
    pub fn top_k(
        &self,
        vals: &mut CudaSlice<u8>,
        ids: &mut CudaSlice<u8>,
        x: &CudaSlice<u8>,
        (rows, n): (usize, usize),
        k: usize,
        id_offset: usize,
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "top_k";
        if k == 0 || k > TOP_K_MAX {
            return Err(invalid(K, format!("k = {k} is outside 1..={TOP_K_MAX}")));
        }
        check_rows(K, x, (rows, n), ty, &[(4 * k, vals.len()), (8 * k, ids.len())])?;
        if id_offset.checked_add(n).is_none_or(|end| end > i64::MAX as usize) {
            return Err(invalid(K, format!("ids {id_offset} + {n} do not fit in int64")));
        }
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(&format!("tp_top_k_{}", ty.name()), 0)?;
        let [r, ni, ki, off] = [rows, n, k, id_offset].map(|v| i64_of(K, v));
        let (r, ni, ki, off) = (r?, ni?, ki?, off?);
        let mut b = self.stream().launch_builder(f);
        b.arg(vals).arg(ids).arg(x).arg(&r).arg(&ni).arg(&ki).arg(&off);
        // SAFETY: matches tp_top_k_T(float* vals, int64* ids, const T* x, int64 rows, n, k,
        // id_offset). x holds rows*n elements, vals rows*k floats and ids rows*k int64 (checked
        // above); vals and ids are distinct mutable borrows; 256 threads, a multiple of 32, as
        // its block reduction needs (it uses 32 shared slots, one per warp).
        unsafe { b.launch(self.grid_rows(rows as u64)) }.map(drop).map_err(driver("cuLaunchKernel(tp_top_k)"))
    }

    /// Per row of `x: [rows, n]`: `maxs[r]` = its maximum (NaN skipped) and `sums[r]` =
    /// `Σ_j exp((x[r, j] - max) * scales[r])`, both f32 (`tp_row_max_sum_exp_T`); `scales[r] > 0`
    /// (1 / temperature).
    pub fn row_max_sum_exp(
        &self,
        maxs: &mut CudaSlice<u8>,
        sums: &mut CudaSlice<u8>,
        x: &CudaSlice<u8>,
        (rows, n): (usize, usize),
        scales: &[f32],
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "row_max_sum_exp";
        check_rows(K, x, (rows, n), ty, &[(4, maxs.len()), (4, sums.len())])?;
        if scales.len() != rows {
            return Err(invalid(K, format!("{} scales for {rows} rows", scales.len())));
        }
        if let Some(s) = scales.iter().find(|s| !(s.is_finite() && **s > 0.0)) {
            return Err(invalid(K, format!("scale {s} must be finite and > 0")));
        }
        if rows == 0 {
            return Ok(());
        }
        let bytes: Vec<u8> = scales.iter().flat_map(|s| s.to_ne_bytes()).collect();
        let scales_dev = self.htod(&bytes)?;
        let f = self.function(&format!("tp_row_max_sum_exp_{}", ty.name()), 0)?;
        let (r, ni) = (i64_of(K, rows)?, i64_of(K, n)?);
        let mut b = self.stream().launch_builder(f);
        b.arg(maxs).arg(sums).arg(x).arg(&scales_dev).arg(&r).arg(&ni);
        // SAFETY: matches tp_row_max_sum_exp_T(float* maxs, float* sums, const T* x, const
        // float* scales, int64 rows, n). x holds rows*n elements, maxs, sums and scales rows
        // floats each (checked above); maxs and sums are distinct mutable borrows; 256 threads,
        // a multiple of 32, as its block reductions need.
        unsafe { b.launch(self.grid_rows(rows as u64)) }.map(drop).map_err(driver("cuLaunchKernel(tp_row_max_sum_exp)"))
    }
}

#[cfg(test)]
mod tests {
    use super::{RowPenalties, penalty_meta};

    fn row<'a>(cols: &'a [usize], counts: &'a [u32]) -> RowPenalties<'a> {
        RowPenalties { repetition: 1.5, frequency: 0.5, presence: 0.25, cols, counts }
    }

    #[test]
    fn meta_lays_out_offsets_columns_counts_and_factors() {
        let meta = penalty_meta("t", 10, &[row(&[3, 9], &[0, 2]), row(&[], &[]), row(&[1], &[1])]).unwrap();
        let longs: Vec<i64> =
            meta[..7 * 8].chunks_exact(8).map(|c| i64::from_ne_bytes(c.try_into().unwrap())).collect();
        assert_eq!(longs, [0, 2, 2, 3, 3, 9, 1]);
        let floats: Vec<f32> =
            meta[7 * 8..].chunks_exact(4).map(|c| f32::from_ne_bytes(c.try_into().unwrap())).collect();
        assert_eq!(floats, [0.0, 2.0, 1.0, 1.5, 0.5, 0.25, 1.5, 0.5, 0.25, 1.5, 0.5, 0.25]);
    }

    #[test]
    fn meta_refuses_columns_out_of_range_repeated_or_uncounted_and_bad_factors() {
        let err = |rows: &[RowPenalties<'_>]| penalty_meta("t", 4, rows).unwrap_err().to_string();
        assert!(err(&[row(&[4], &[1])]).contains("column 4 is past the shard's 4"));
        assert!(err(&[row(&[2, 2], &[1, 1])]).contains("column 2 is listed twice"));
        assert!(err(&[row(&[1], &[])]).contains("1 columns but 0 counts"));
        let zero = RowPenalties { repetition: 0.0, ..row(&[], &[]) };
        assert!(err(&[zero]).contains("repetition > 0"));
        let nan = RowPenalties { presence: f32::NAN, ..row(&[], &[]) };
        assert!(err(&[nan]).contains("finite"));
    }
}
