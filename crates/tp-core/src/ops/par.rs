//! Host row-wise and element-wise work split over tp-cpu's persistent pool: each task writes
//! its own rows of the output, so results are the same bits as one thread's.

/// Multiply-adds (or element visits) below which the work stays on the calling thread.
const MIN_WORK: usize = 1 << 15;

/// Runs `f(first_row, rows)` over `out` cut into groups of whole rows of `row_len` elements,
/// on the pool when `rows × work_per_row` is large enough.
pub(crate) fn rows<E: Send>(out: &mut [E], row_len: usize, work_per_row: usize, f: impl Fn(usize, &mut [E]) + Sync) {
    let rows = out.len().div_ceil(row_len.max(1));
    let groups = if rows.saturating_mul(work_per_row) < MIN_WORK { 1 } else { 4 * tp_cpu::num_threads() };
    tp_cpu::par_row_groups(out, row_len, groups, f);
}

/// `out[c] = Σ_r f(r, c)` for `c < cols` over `rows` rows, summed in f64 in row order
/// (deterministic): tasks take blocks of columns.
pub(crate) fn col_sums(rows: usize, cols: usize, f: impl Fn(usize, usize) -> f64 + Sync) -> Vec<f32> {
    const BLOCK: usize = 16;
    let mut out = vec![0f32; cols];
    let groups = if rows.saturating_mul(cols) < MIN_WORK { 1 } else { 4 * tp_cpu::num_threads() };
    tp_cpu::par_row_groups(&mut out, BLOCK, groups, |first, chunk| {
        let c0 = first * BLOCK;
        let mut acc = vec![0f64; chunk.len()];
        for r in 0..rows {
            for (j, a) in acc.iter_mut().enumerate() {
                *a += f(r, c0 + j);
            }
        }
        chunk.iter_mut().zip(acc).for_each(|(o, a)| *o = a as f32);
    });
    out
}
