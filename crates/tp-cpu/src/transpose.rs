//! The one transposed copy of the AMX weight gradient: `dW = dY^T X` needs `dY^T`'s rows
//! (`k` = tokens contiguous) for the tile loads, and `dY: [k, m]` has its columns there.
//!
//! `a: [rows, cols]` row-major becomes `[cols, rows]` row-major. For 16-bit elements with an
//! even number of rows on AVX-512, two input rows at a time are zero-extended and merged into
//! 32-bit lanes (the pair `(a[2p][c], a[2p+1][c])` as one lane, low half first, exactly the
//! bytes of the output's row `c` at `2p`), and each 16-lane vector is scattered down 16
//! output rows; the output rows of a block of columns fill line by line. Otherwise (or without
//! AVX-512) a cache-blocked scalar copy. Both give the same bytes; output row groups are spread
//! over the pool.

use crate::element::Float;

thread_local! {
    /// The calling thread's transposed copy, kept between calls (a step's weight gradients
    /// reuse it instead of faulting in fresh pages).
    static T_SCRATCH: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `f(t)` with `t`, `a: [rows, cols]` transposed into `[cols, rows]`, in this thread's
/// scratch.
pub(crate) fn with_transposed<T: Float, R>(a: &[T], rows: usize, cols: usize, f: impl FnOnce(&[T]) -> R) -> R {
    assert_eq!(a.len(), rows * cols, "transposed: operand");
    let bytes = rows * cols * size_of::<T>();
    crate::gemm::with_scratch(&T_SCRATCH, bytes.div_ceil(4), |buf| {
        // A float is 2 or 4 bytes: a run of 4-byte lanes holds whole, aligned elements.
        let t: &mut [T] = bytemuck::cast_slice_mut(&mut bytemuck::cast_slice_mut::<u32, u8>(buf)[..bytes]);
        fill(a, rows, cols, t);
        f(t)
    })
}

/// `t = a^T`.
fn fill<T: Float>(a: &[T], rows: usize, cols: usize, t: &mut [T]) {
    crate::pool::par_rows(t, rows, |first, part| {
        let out_cols = part.len() / rows.max(1);
        #[cfg(target_arch = "x86_64")]
        if size_of::<T>() == 2 && rows.is_multiple_of(2) && std::arch::is_x86_feature_detected!("avx512f") {
            let (a16, part16): (&[u16], &mut [u16]) = (bytemuck::cast_slice(a), bytemuck::cast_slice_mut(part));
            // SAFETY: AVX-512F was detected just above.
            unsafe { avx512::pairs(a16, rows, cols, first, out_cols, part16) };
            return;
        }
        blocked(a, rows, cols, first, out_cols, part);
    });
}

/// Output rows `first..first + out_cols` (input columns) into `part`, in `B x B` blocks.
fn blocked<T: Copy>(a: &[T], rows: usize, cols: usize, first: usize, out_cols: usize, part: &mut [T]) {
    const B: usize = 64;
    for c0 in (0..out_cols).step_by(B) {
        let c1 = (c0 + B).min(out_cols);
        for r in 0..rows {
            let src = &a[r * cols + first + c0..][..c1 - c0];
            for (c, &v) in src.iter().enumerate() {
                part[(c0 + c) * rows + r] = v;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// [`super::blocked`] for 16-bit elements and even `rows`, 16 output rows per scatter.
    ///
    /// # Safety
    /// The CPU must have AVX-512F; `a` holds `rows x cols`, `part` `out_cols x rows`, and
    /// `first + out_cols <= cols`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn pairs(a: &[u16], rows: usize, cols: usize, first: usize, out_cols: usize, part: &mut [u16]) {
        assert!(a.len() >= rows * cols && part.len() >= out_cols * rows && first + out_cols <= cols);
        let pairs = rows / 2; // 32-bit lanes per output row
        let out = part.as_mut_ptr().cast::<i32>();
        // Lane `i` of a scatter goes to output row `c + i`: `i * pairs` lanes further.
        let step = i32::try_from(pairs).ok();
        let full = out_cols / 16 * 16;
        if let Some(step) = step.filter(|s| s.checked_mul(16).is_some()) {
            let index = _mm512_mullo_epi32(
                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                _mm512_set1_epi32(step),
            );
            for c in (0..full).step_by(16) {
                for p in 0..pairs {
                    // SAFETY: rows 2p and 2p + 1 hold columns `first + c .. + 16` (c + 16 <=
                    // out_cols); the scatter writes lane `p` of output rows `c .. c + 16`, inside
                    // `part` (16 rows of `pairs` lanes each from row `c`), and `step * 15` fits
                    // in i32 (checked).
                    unsafe {
                        let lo = _mm256_loadu_si256(a.as_ptr().add(2 * p * cols + first + c).cast());
                        let hi = _mm256_loadu_si256(a.as_ptr().add((2 * p + 1) * cols + first + c).cast());
                        let v = _mm512_or_si512(
                            _mm512_cvtepu16_epi32(lo),
                            _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(hi)),
                        );
                        _mm512_i32scatter_epi32::<4>(out.add(c * pairs + p).cast(), index, v);
                    }
                }
            }
        } else {
            return super::blocked(a, rows, cols, first, out_cols, part);
        }
        // The last columns (fewer than 16), element by element.
        for c in full..out_cols {
            for r in 0..rows {
                part[c * rows + r] = a[r * cols + first + c];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// Against the plain index swap: even and odd row counts, column counts off 16, sizes
    /// that split over the pool, 16- and 32-bit elements.
    #[test]
    fn transposes_match_the_index_swap() {
        for (rows, cols) in [(2, 1), (6, 37), (64, 16), (33, 17), (1056, 70), (512, 300)] {
            // Every bit pattern (NaNs included), compared as bits.
            let a: Vec<bf16> = (0..rows * cols).map(|i| bf16::from_bits((i * 7919 % 65521) as u16)).collect();
            let want: Vec<u16> = (0..cols * rows).map(|i| a[(i % rows) * cols + i / rows].to_bits()).collect();
            with_transposed(&a, rows, cols, |t| {
                assert_eq!(t.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want, "bf16 {rows}x{cols}")
            });
            let a: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
            let want: Vec<f32> = (0..cols * rows).map(|i| a[(i % rows) * cols + i / rows]).collect();
            with_transposed(&a, rows, cols, |t| assert_eq!(t, &want[..], "f32 {rows}x{cols}"));
        }
    }
}
