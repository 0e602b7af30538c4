//! Q4_K rows in [`RowLayout::Q4Kx8`](crate::quant::RowLayout) unpacked into panels eight rows
//! (two panels) at a time, with the vector operations the interleaving was made for: per
//! interleaved super-block, each 32-byte chunk of codes arrives as four registers of four rows'
//! 8-byte pieces, a 4 x 4 transpose of 64-bit lanes gives each row its 32 bytes, and the
//! nibbles go to the panels; the eight rows' scales and mins unpack at once (the decode
//! kernel's `scales_mins`), and the shift constant `128 Σ_g sc_g Σ code` sums the pieces'
//! nibbles with `vpsadbw` before the transpose. The same bytes as the row-by-row unpacking of
//! `panel` (tested through the integer GEMM's bitwise checks).

use super::panel::{Kind, NR};
use crate::quant::dot_q4kx8::scales_mins;
use std::arch::x86_64::*;

/// Bytes of one interleaved super-block of eight rows.
const GROUP_BLOCK: usize = 8 * 144;

/// Unpacks the group of eight rows at `g` (`nb` interleaved super-blocks) into the two panels at
/// `out` and `out + panel_bytes` (rows 0-3, then 4-7).
///
/// # Safety
/// `K` must be Q4_K's [`Kind`]; `g` readable for `nb` interleaved super-blocks; both panels
/// writable for `nb` blocks of `K::BYTES`; the CPU must have AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn group<K: Kind>(g: *const u8, nb: usize, out: *mut u8, panel_bytes: usize) {
    debug_assert_eq!(NR, 4, "two panels per group");
    // SAFETY: every read is inside super-block `b` of the group, every write inside block `b` of
    // one of the two panels (offsets from `K`'s layout), as the caller guarantees.
    unsafe {
        // Lane `l` of an interleaved register holds row `LANES[l]`; this puts row `r` in lane `r`.
        let rows_in_order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
        let nibble = _mm256_set1_epi8(0x0F);
        let zero = _mm256_setzero_si256();
        for b in 0..nb {
            let blk = g.add(b * GROUP_BLOCK);
            let dst = [out.add(b * K::BYTES), out.add(panel_bytes + b * K::BYTES)];
            let (sc, mn) = scales_mins(blk.add(32));
            for (gi, s) in sc.iter().enumerate() {
                halves(*s, rows_in_order, dst, K::SC + 16 * gi);
            }
            for p in 0..4 {
                let pair = _mm256_or_si256(mn[2 * p], _mm256_slli_epi32::<16>(mn[2 * p + 1]));
                halves(pair, rows_in_order, dst, K::PAIRS + 16 * p);
            }
            let d = _mm256_castps_si256(_mm256_cvtph_ps(_mm_loadu_si128(blk.cast())));
            halves(d, rows_in_order, dst, K::D);
            let dmin = _mm256_castps_si256(_mm256_cvtph_ps(_mm_loadu_si128(blk.add(16).cast())));
            halves(dmin, rows_in_order, dst, K::DMIN);
            // Per half `q`: `Σ_g sc_g Σ code` of its four rows, as four 64-bit lanes.
            let mut c128 = [zero; 2];
            for c in 0..4 {
                let (sc_lo, sc_hi) = (
                    _mm256_permutevar8x32_epi32(sc[2 * c], rows_in_order),
                    _mm256_permutevar8x32_epi32(sc[2 * c + 1], rows_in_order),
                );
                for q in 0..2 {
                    let piece = |p: usize| blk.add(128 + 32 * ((4 * c + p) * 2 + q)).cast::<__m256i>();
                    let v = [
                        _mm256_loadu_si256(piece(0)),
                        _mm256_loadu_si256(piece(1)),
                        _mm256_loadu_si256(piece(2)),
                        _mm256_loadu_si256(piece(3)),
                    ];
                    let (mut lo_sum, mut hi_sum) = (zero, zero);
                    for vp in &v {
                        lo_sum = _mm256_add_epi64(lo_sum, _mm256_sad_epu8(_mm256_and_si256(*vp, nibble), zero));
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(*vp), nibble);
                        hi_sum = _mm256_add_epi64(hi_sum, _mm256_sad_epu8(hi, zero));
                    }
                    c128[q] = _mm256_add_epi64(c128[q], _mm256_mul_epu32(lo_sum, rows_u64(sc_lo, q)));
                    c128[q] = _mm256_add_epi64(c128[q], _mm256_mul_epu32(hi_sum, rows_u64(sc_hi, q)));
                    // Rows 4q + rr: pieces 0-3 of chunk c.
                    for (rr, wr) in transpose4(v).iter().enumerate() {
                        let at = dst[q].add(rr * K::BLOCK + 64 * c);
                        _mm256_storeu_si256(at.cast(), _mm256_and_si256(*wr, nibble));
                        _mm256_storeu_si256(at.add(32).cast(), _mm256_and_si256(_mm256_srli_epi16::<4>(*wr), nibble));
                    }
                }
            }
            for (q, c) in c128.iter().enumerate() {
                store_c128(*c, dst[q].add(K::C128));
            }
        }
    }
}

/// The two halves of `v` (eight rows in lane order), put in row order, into the two panels at
/// byte `at`.
///
/// # Safety
/// Both `dst[i] + at` writable for 16 bytes; AVX2.
#[inline(always)]
pub(super) unsafe fn halves(v: __m256i, rows_in_order: __m256i, dst: [*mut u8; 2], at: usize) {
    // SAFETY: as stated.
    unsafe { store_halves(_mm256_permutevar8x32_epi32(v, rows_in_order), dst, at) }
}

/// The two halves of `v` (eight rows in row order) into the two panels at byte `at`.
///
/// # Safety
/// Both `dst[i] + at` writable for 16 bytes; AVX2.
#[inline(always)]
pub(super) unsafe fn store_halves(v: __m256i, dst: [*mut u8; 2], at: usize) {
    // SAFETY: as stated.
    unsafe {
        _mm_storeu_si128(dst[0].add(at).cast(), _mm256_castsi256_si128(v));
        _mm_storeu_si128(dst[1].add(at).cast(), _mm256_extracti128_si256::<1>(v));
    }
}

/// A 4 x 4 transpose of 64-bit lanes: `v[p]` holds piece `p` of four rows (row `rr` in lane
/// `rr`); the result's register `rr` holds row `rr`'s pieces 0-3.
///
/// # Safety
/// AVX2.
#[inline(always)]
pub(super) unsafe fn transpose4(v: [__m256i; 4]) -> [__m256i; 4] {
    // SAFETY: AVX2 is the caller's.
    unsafe {
        let (t0, t1) = (_mm256_unpacklo_epi64(v[0], v[1]), _mm256_unpackhi_epi64(v[0], v[1]));
        let (t2, t3) = (_mm256_unpacklo_epi64(v[2], v[3]), _mm256_unpackhi_epi64(v[2], v[3]));
        [
            _mm256_permute2x128_si256::<0x20>(t0, t2),
            _mm256_permute2x128_si256::<0x20>(t1, t3),
            _mm256_permute2x128_si256::<0x31>(t0, t2),
            _mm256_permute2x128_si256::<0x31>(t1, t3),
        ]
    }
}

/// 128 times each of four rows' sums (64-bit lanes; the products fit in 32 bits) as four `i32`
/// at `at`.
///
/// # Safety
/// `at` writable for 16 bytes; AVX2.
#[inline(always)]
pub(super) unsafe fn store_c128(sums: __m256i, at: *mut u8) {
    // SAFETY: as stated.
    unsafe {
        let low = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
        let v = _mm256_permutevar8x32_epi32(_mm256_slli_epi64::<7>(sums), low);
        _mm_storeu_si128(at.cast(), _mm256_castsi256_si128(v));
    }
}

/// Rows `4q .. 4q + 4` of `v` (eight `u32` in row order) widened to four 64-bit lanes.
///
/// # Safety
/// AVX2.
#[inline(always)]
unsafe fn rows_u64(v: __m256i, q: usize) -> __m256i {
    // SAFETY: AVX2 is the caller's.
    unsafe { _mm256_cvtepu32_epi64(if q == 0 { _mm256_castsi256_si128(v) } else { _mm256_extracti128_si256::<1>(v) }) }
}
