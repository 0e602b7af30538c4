//! Q6_K rows in [`RowLayout::Q6Kx8`](crate::quant::RowLayout) unpacked into panels eight rows
//! (two panels) at a time, as `q4kx8` does for Q4_K: per interleaved super-block and half of
//! the group, each 32-element quarter's codes are put together from registers of low-nibble
//! pieces and high-bit pieces (`q6_codes`, the decode kernels' bit operations, four rows at
//! once), summed per 16-element group with `vpsadbw` for the shift constant, then transposed so
//! that each row's 32 codes (minus 32) go to its panel; the scales come sign-extended from their
//! interleaved pairs. The same bytes as the row-by-row unpacking of `panel` (tested through the integer
//! GEMM's bitwise checks).

use super::panel::{Kind, NR};
use super::q4kx8::{store_c128, store_halves, transpose4};
use crate::quant::dot_kquant::q6_codes;
use crate::quant::interleave::{K6_QH, K6_QL, K6_SCALES};
use std::arch::x86_64::*;

/// Bytes of one interleaved super-block of eight rows.
const GROUP_BLOCK: usize = 8 * 210;

/// Unpacks the group of eight rows at `g` (`nb` interleaved super-blocks) into the two panels at
/// `out` and `out + panel_bytes` (rows 0-3, then 4-7).
///
/// # Safety
/// `K` must be Q6_K's [`Kind`]; `g` readable for `nb` interleaved super-blocks; both panels
/// writable for `nb` blocks of `K::BYTES`; the CPU must have AVX2 and F16C.
// `s` picks the same quarter out of each piece's four.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn group<K: Kind>(g: *const u8, nb: usize, out: *mut u8, panel_bytes: usize) {
    debug_assert_eq!(NR, 4, "two panels per group");
    // SAFETY: every read is inside super-block `b` of the group, every write inside block `b` of
    // one of the two panels (offsets from `K`'s layout), as the caller guarantees.
    unsafe {
        let rows_in_order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
        let offset = _mm256_set1_epi8(32);
        let zero = _mm256_setzero_si256();
        let half_group = _mm256_set1_epi64x(16 * 32);
        for b in 0..nb {
            let blk = g.add(b * GROUP_BLOCK);
            let dst = [out.add(b * K::BYTES), out.add(panel_bytes + b * K::BYTES)];
            // Scales, each group's eight (lane order) sign-extended and put in row order.
            let mut sc = [zero; 16];
            for (gi, s) in sc.iter_mut().enumerate() {
                let pairs = _mm_loadu_si128(blk.add(K6_SCALES + 16 * (gi / 2)).cast());
                let j = (gi % 2) as i8;
                let pick = _mm_setr_epi8(
                    j,
                    2 + j,
                    4 + j,
                    6 + j,
                    8 + j,
                    10 + j,
                    12 + j,
                    14 + j,
                    -1,
                    -1,
                    -1,
                    -1,
                    -1,
                    -1,
                    -1,
                    -1,
                );
                *s = _mm256_permutevar8x32_epi32(_mm256_cvtepi8_epi32(_mm_shuffle_epi8(pairs, pick)), rows_in_order);
                store_halves(*s, dst, K::SC + 16 * gi);
            }
            let d = _mm256_castps_si256(_mm256_cvtph_ps(_mm_loadu_si128(blk.cast())));
            store_halves(_mm256_permutevar8x32_epi32(d, rows_in_order), dst, K::D);
            for (q, dq) in dst.iter().enumerate() {
                let mut c128 = zero;
                for jh in 0..2 {
                    let run = |base: usize, r: usize| blk.add(base + 32 * (2 * r + q)).cast::<__m256i>();
                    let h = [
                        _mm256_loadu_si256(run(K6_QH, 4 * jh)),
                        _mm256_loadu_si256(run(K6_QH, 4 * jh + 1)),
                        _mm256_loadu_si256(run(K6_QH, 4 * jh + 2)),
                        _mm256_loadu_si256(run(K6_QH, 4 * jh + 3)),
                    ];
                    let ql = |r: usize| run(K6_QL, 8 * jh + r);
                    // Piece p of the four quarters of half jh, four rows at once: ggml's codes u
                    // from two low-nibble runs and one high-bit run, as the decode kernel takes
                    // them.
                    let mut pieces = [[zero; 4]; 4];
                    for (p, piece) in pieces.iter_mut().enumerate() {
                        *piece = q6_codes(_mm256_loadu_si256(ql(p)), _mm256_loadu_si256(ql(p + 4)), h[p]);
                    }
                    for s in 0..4 {
                        let u = [pieces[0][s], pieces[1][s], pieces[2][s], pieces[3][s]];
                        // Groups 8 jh + 2 s (pieces 0, 1) and the next (2, 3): Σ u - 512, times the
                        // row's scale.
                        let gi = 8 * jh + 2 * s;
                        for (k, pp) in [(0, 0), (1, 2)] {
                            let sum = _mm256_add_epi64(_mm256_sad_epu8(u[pp], zero), _mm256_sad_epu8(u[pp + 1], zero));
                            let scale = _mm256_cvtepi32_epi64(half(sc[gi + k], q));
                            c128 = _mm256_add_epi64(c128, _mm256_mul_epi32(_mm256_sub_epi64(sum, half_group), scale));
                        }
                        // Rows 4q + rr, minus 32.
                        for (rr, wr) in transpose4(u).iter().enumerate() {
                            let at = dq.add(rr * K::BLOCK + 128 * jh + 32 * s);
                            _mm256_storeu_si256(at.cast(), _mm256_sub_epi8(*wr, offset));
                        }
                    }
                }
                store_c128(c128, dq.add(K::C128));
            }
        }
    }
}

/// Rows `4q .. 4q + 4` of `v` (eight 32-bit lanes in row order).
///
/// # Safety
/// AVX2.
#[inline(always)]
unsafe fn half(v: __m256i, q: usize) -> __m128i {
    // SAFETY: AVX2 is the caller's.
    unsafe { if q == 0 { _mm256_castsi256_si128(v) } else { _mm256_extracti128_si256::<1>(v) } }
}
