//! The x86 decode kernel of Q4_K rows in [`RowLayout::Q4Kx8`](super::interleave::RowLayout):
//! eight weight rows against `M` Q8_K activation rows, one interleaved super-block at a time.
//!
//! Per super-block: the eight rows' `d` and `dmin` in one load each, their packed 6-bit scales
//! and mins as three registers of eight `u32` lanes, unpacked for all eight rows at once (the
//! bit operations of ggml's `get_scale_min_k4`, lane-wise); the 1024 code bytes in 32-byte
//! pieces of four rows, split into low nibbles (sub-block `2c`) and high nibbles (`2c + 1`) and
//! dotted with the activation's matching 8 bytes broadcast to every row, two `i32` lanes per
//! row; one horizontal add per sub-block leaves its eight rows' sums `S_j` in the lane order
//! [`LANES`](super::interleave::LANES), and the integer sum `Σ_j sc_j S_j` (exact: at most
//! `8 · 63 · 32 · 15 · 127`) and the min term `Σ_j mn_j X_j` (`X_j` the activation's sum over
//! sub-block `j`, from its 16-element sums) take one conversion and one multiply-add each by
//! `d dx` and `dmin dx` for all eight rows: ggml's
//!
//! `Σ w x = d dx Σ_j sc_j S_j − dmin dx Σ_j mn_j X_j`,
//!
//! the same integers and the same two roundings per super-block as the one-row kernel in
//! `dot_kquant`, so `quant_matmul`'s bound holds unchanged.

use super::act::XRow;
use super::dot_q4x8::{Group, by_row};
use super::simd::Dot;
use std::arch::x86_64::*;

/// Bytes of one interleaved super-block of eight rows.
const GROUP_BLOCK: usize = 8 * 144;

/// Interleaved super-blocks ahead to prefetch, a line at a time as each super-block starts
/// (into L2). Measured on Zen 4 (two threads, `[5632, 2048]` streamed from memory): one
/// activation row 0.32 -> 0.19-0.22 ms, against asking for the whole next group at once as
/// each group starts; 16 rows 1.26 -> 1.03 ms. (Q4_0 and Q6_K gain alike, see their kernels.)
const PREFETCH: usize = 8;

/// Q4_K in `RowLayout::Q4Kx8`.
pub(crate) struct Q4Kx8;

impl Group for Q4Kx8 {
    const BLOCK_BYTES: usize = 144;
    const WIDEST: usize = 8;

    #[inline(always)]
    unsafe fn group<D: Dot, const M: usize>(g: *const u8, nb: usize, xs: &[XRow<'_>; M]) -> [[f32; 8]; M] {
        // SAFETY: every read stays in the `nb` interleaved super-blocks at `g` and the first `nb`
        // super-blocks of each activation row (256 codes, one scale and 16 sums each), as the
        // caller guarantees; the instructions are the caller's.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); M];
            let nibble = _mm256_set1_epi8(0x0F);
            for s in 0..nb {
                let blk = g.add(s * GROUP_BLOCK);
                // The super-block `PREFETCH` ahead, a line at a time (past the group's end it is
                // the next group's, which follows; a prefetch never faults).
                let ahead = blk.wrapping_add(PREFETCH * GROUP_BLOCK);
                for l in (0..GROUP_BLOCK).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(l).cast());
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.cast()));
                let dmin = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16).cast()));
                let (sc, mn) = scales_mins(blk.add(32));
                let mut int = [_mm256_setzero_si256(); M];
                for c in 0..4 {
                    // [rows 0-3 low, rows 4-7 low, rows 0-3 high, rows 4-7 high] per activation row.
                    let mut part = [[_mm256_setzero_si256(); 4]; M];
                    for p in 0..4 {
                        let at = blk.add(128 + 32 * ((4 * c + p) * 2));
                        let (v03, v47) = (_mm256_loadu_si256(at.cast()), _mm256_loadu_si256(at.add(32).cast()));
                        let lo03 = _mm256_and_si256(v03, nibble);
                        let lo47 = _mm256_and_si256(v47, nibble);
                        let hi03 = _mm256_and_si256(_mm256_srli_epi16::<4>(v03), nibble);
                        let hi47 = _mm256_and_si256(_mm256_srli_epi16::<4>(v47), nibble);
                        for i in 0..M {
                            let xq = xs[i].qs.as_ptr().add(256 * s + 64 * c + 8 * p);
                            let xl = _mm256_set1_epi64x(xq.cast::<i64>().read_unaligned());
                            let xh = _mm256_set1_epi64x(xq.add(32).cast::<i64>().read_unaligned());
                            let a = &mut part[i];
                            a[0] = D::dot_acc(a[0], lo03, xl);
                            a[1] = D::dot_acc(a[1], lo47, xl);
                            a[2] = D::dot_acc(a[2], hi03, xh);
                            a[3] = D::dot_acc(a[3], hi47, xh);
                        }
                    }
                    for i in 0..M {
                        let a = &part[i];
                        let (s_lo, s_hi) = (_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
                        int[i] = _mm256_add_epi32(int[i], _mm256_mullo_epi32(s_lo, sc[2 * c]));
                        int[i] = _mm256_add_epi32(int[i], _mm256_mullo_epi32(s_hi, sc[2 * c + 1]));
                    }
                }
                for i in 0..M {
                    let bs = xs[i].bsums.as_ptr().add(16 * s);
                    let mut mins = _mm256_setzero_si256();
                    for (j, mn) in mn.iter().enumerate() {
                        let xj = i32::from(*bs.add(2 * j)) + i32::from(*bs.add(2 * j + 1));
                        mins = _mm256_add_epi32(mins, _mm256_mullo_epi32(*mn, _mm256_set1_epi32(xj)));
                    }
                    let dx = _mm256_set1_ps(*xs[i].d.get_unchecked(s));
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(int[i]), _mm256_mul_ps(d, dx), acc[i]);
                    acc[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dmin, dx), acc[i]);
                }
            }
            std::array::from_fn(|i| by_row(acc[i]))
        }
    }
}

/// The 8 scales and 8 mins of eight rows (`i32` lanes in lane order) from their packed words at
/// `p` (three registers of eight `u32`: word `w` of lane `l` at `p + 4 (8 w + l)`): scales and
/// mins `0..4` are the low 6 bits of bytes `0..4` and `4..8`; `4..8` a nibble of bytes `8..12`
/// with the top 2 bits of bytes `0..4` (scales) or `4..8` (mins) above it.
///
/// # Safety
/// `p..p + 96` readable; AVX2.
#[inline(always)]
pub(crate) unsafe fn scales_mins(p: *const u8) -> ([__m256i; 8], [__m256i; 8]) {
    // SAFETY: as stated.
    unsafe {
        let (b0, b1, b2) =
            (_mm256_loadu_si256(p.cast()), _mm256_loadu_si256(p.add(32).cast()), _mm256_loadu_si256(p.add(64).cast()));
        let (low6, low4, top2) =
            (_mm256_set1_epi32(0x3F3F_3F3F), _mm256_set1_epi32(0x0F0F_0F0F), _mm256_set1_epi32(0x3030_3030));
        let sc_lo = _mm256_and_si256(b0, low6);
        let sc_hi = _mm256_or_si256(_mm256_and_si256(b2, low4), _mm256_and_si256(_mm256_srli_epi32::<2>(b0), top2));
        let mn_lo = _mm256_and_si256(b1, low6);
        let mn_hi = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi32::<4>(b2), low4),
            _mm256_and_si256(_mm256_srli_epi32::<2>(b1), top2),
        );
        let bytes = |v: __m256i| {
            let ff = _mm256_set1_epi32(0xFF);
            [
                _mm256_and_si256(v, ff),
                _mm256_and_si256(_mm256_srli_epi32::<8>(v), ff),
                _mm256_and_si256(_mm256_srli_epi32::<16>(v), ff),
                _mm256_srli_epi32::<24>(v),
            ]
        };
        let (s0, s1, m0, m1) = (bytes(sc_lo), bytes(sc_hi), bytes(mn_lo), bytes(mn_hi));
        (
            [s0[0], s0[1], s0[2], s0[3], s1[0], s1[1], s1[2], s1[3]],
            [m0[0], m0[1], m0[2], m0[3], m1[0], m1[1], m1[2], m1[3]],
        )
    }
}
