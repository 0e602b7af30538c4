//! The x86 decode kernel of Q6_K rows in [`RowLayout::Q6Kx8`](super::interleave::RowLayout):
//! eight weight rows against `M` Q8_K activation rows, one interleaved super-block at a time.
//!
//! Per super-block, and per half of the group (rows 0-3, then 4-7): ggml's code bytes come in
//! 32-byte registers of four rows' 8-byte runs, so ggml's own bit operations give the 6-bit
//! codes `u` of four 8-element pieces of four rows at once (two low-nibble runs and one high-bit
//! run make four pieces). Each piece is dotted with the activation's matching 8 bytes broadcast
//! to every row (two `i32` lanes per row); the two pieces of a 16-element group go into one
//! register, which takes the group's scale (each row's, in both its lanes) in one multiply and
//! adds into the half's integer sums. After the super-block one horizontal add leaves the eight
//! rows' sums in the lane order [`LANES`](super::interleave::LANES), the offset of the codes
//! (`u - 32`) comes out as `32 Σ_g sc_g X_g` (`X_g` the activation's sum over group `g`, one
//! multiply-add of 16-bit pairs per two groups), and one conversion and one multiply-add by
//! `d dx` finish it for all eight rows: ggml's
//!
//! `Σ w x = d dx (Σ_g sc_g Σ u q_x − 32 Σ_g sc_g X_g)`,
//!
//! the same integers (exact: at most `16 · 128 · 16 · 63 · 127` before the offset) and the same
//! two roundings per super-block as the one-row kernel in `dot_kquant`, so `quant_matmul`'s
//! bound holds unchanged.

use super::act::XRow;
use super::dot_kquant::q6_codes;
use super::dot_q4x8::{Group, by_row};
use super::interleave::{K6_QH, K6_QL, K6_SCALES};
use super::simd::Dot;
use std::arch::x86_64::*;

/// Bytes of one interleaved super-block of eight rows.
const GROUP_BLOCK: usize = 8 * 210;

/// Interleaved super-blocks ahead to prefetch, a line at a time as each super-block starts
/// (into L2; measured on Zen 4, two threads, `[5632, 2048]` from memory: with it one activation
/// row takes about as long as ggml's layout on the one-row kernel, 0.32-0.39 ms, and without it
/// or with the whole next group asked for at once, 0.44-0.6).
const PREFETCH: usize = 8;

/// Q6_K in `RowLayout::Q6Kx8`.
pub(crate) struct Q6Kx8;

impl Group for Q6Kx8 {
    const BLOCK_BYTES: usize = 210;
    const WIDEST: usize = 4;

    // `q` and `j` also place the loads and the activation bytes, not only index.
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn group<D: Dot, const M: usize>(g: *const u8, nb: usize, xs: &[XRow<'_>; M]) -> [[f32; 8]; M] {
        // SAFETY: every read stays in the `nb` interleaved super-blocks at `g` and the first `nb`
        // super-blocks of each activation row (256 codes, one scale and 16 sums each), as the
        // caller guarantees; the instructions are the caller's.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); M];
            for s in 0..nb {
                let blk = g.add(s * GROUP_BLOCK);
                // The super-block `PREFETCH` ahead, a line at a time (past the group's end it is
                // the next group's, which follows; a prefetch never faults).
                let ahead = blk.wrapping_add(PREFETCH * GROUP_BLOCK);
                for l in (0..GROUP_BLOCK).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(l).cast());
                }
                // Integer sums of rows 0-3 and 4-7, two lanes per row.
                let mut int = [[_mm256_setzero_si256(); 2]; M];
                for n in 0..2 {
                    for kk in 0..2 {
                        for q in 0..2 {
                            // Pieces 16n + 4j + k (k = 2kk, 2kk + 1) of rows 4q..4q + 4.
                            let mut u = [[_mm256_setzero_si256(); 4]; 2];
                            for (dk, u) in u.iter_mut().enumerate() {
                                let k = 2 * kk + dk;
                                let a = _mm256_loadu_si256(blk.add(K6_QL + 32 * (2 * (8 * n + k) + q)).cast());
                                let b = _mm256_loadu_si256(blk.add(K6_QL + 32 * (2 * (8 * n + 4 + k) + q)).cast());
                                let h = _mm256_loadu_si256(blk.add(K6_QH + 32 * (2 * (4 * n + k) + q)).cast());
                                *u = q6_codes(a, b, h);
                            }
                            for j in 0..4 {
                                // Group 8n + 2j + kk: pieces 16n + 4j + 2kk and the next.
                                let sc = half_scale(blk, 8 * n + 2 * j + kk, q);
                                for i in 0..M {
                                    let xq = xs[i].qs.as_ptr().add(256 * s + 8 * (16 * n + 4 * j + 2 * kk));
                                    let x0 = _mm256_set1_epi64x(xq.cast::<i64>().read_unaligned());
                                    let x1 = _mm256_set1_epi64x(xq.add(8).cast::<i64>().read_unaligned());
                                    let d = D::dot_acc(D::dot(u[0][j], x0), u[1][j], x1);
                                    int[i][q] = _mm256_add_epi32(int[i][q], _mm256_mullo_epi32(d, sc));
                                }
                            }
                        }
                    }
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.cast()));
                for i in 0..M {
                    let bs = xs[i].bsums.as_ptr().add(16 * s);
                    let mut off = _mm256_setzero_si256();
                    for t in 0..8 {
                        // Lane l: row LANES[l]'s scales of groups 2t and 2t + 1, against the
                        // activation's sums over them.
                        let pairs = _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(K6_SCALES + 16 * t).cast()));
                        let x = _mm256_set1_epi32(bs.add(2 * t).cast::<i32>().read_unaligned());
                        off = _mm256_add_epi32(off, _mm256_madd_epi16(pairs, x));
                    }
                    let sums = _mm256_hadd_epi32(int[i][0], int[i][1]);
                    let total = _mm256_sub_epi32(sums, _mm256_slli_epi32::<5>(off));
                    let dx = _mm256_set1_ps(*xs[i].d.get_unchecked(s));
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, dx), acc[i]);
                }
            }
            std::array::from_fn(|i| by_row(acc[i]))
        }
    }
}

/// The scale of group `g` for rows `4q .. 4q + 4`, each row's in both its `i32` lanes (the order
/// of a half's dot products: row `4q + rr` in lanes `2rr`, `2rr + 1`), from the interleaved
/// super-block at `blk` (scale `2t + j` of lane `l` at `K6_SCALES + 16 t + 2 l + j`).
///
/// # Safety
/// `blk` must hold an interleaved super-block; AVX2.
#[inline(always)]
unsafe fn half_scale(blk: *const u8, g: usize, q: usize) -> __m256i {
    // SAFETY: as stated.
    unsafe {
        let pairs = _mm_loadu_si128(blk.add(K6_SCALES + 16 * (g / 2)).cast());
        // Rows 0-3 sit in lanes 0, 1, 4, 5; rows 4-7 in lanes 2, 3, 6, 7.
        let lanes: [i8; 4] = if q == 0 { [0, 1, 4, 5] } else { [2, 3, 6, 7] };
        let j = (g % 2) as i8;
        let at: [i8; 4] = [2 * lanes[0] + j, 2 * lanes[1] + j, 2 * lanes[2] + j, 2 * lanes[3] + j];
        let mask =
            _mm_setr_epi8(at[0], at[0], at[1], at[1], at[2], at[2], at[3], at[3], -1, -1, -1, -1, -1, -1, -1, -1);
        _mm256_cvtepi8_epi32(_mm_shuffle_epi8(pairs, mask))
    }
}
