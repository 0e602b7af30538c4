//! Q4_0 rows in [`RowLayout::Q4_0x8`](crate::quant::RowLayout) unpacked into panels eight rows
//! (two panels) at a time, as `q4kx8` does for Q4_K: per interleaved block and half of the
//! group, the two registers of four rows' 8-byte pieces split into low and high nibbles (codes
//! `0..16` and `16..32` of each row), `vpsadbw` sums them for the shift constant, and a 4 x 4
//! transpose of 64-bit lanes gives each row its 32 codes; the scales widen from `f16` at once.
//! The same bytes as the row-by-row unpacking of `panel` (tested through the integer GEMM's
//! bitwise checks).

use super::panel::{Kind, NR};
use super::q4kx8::{halves, store_c128, transpose4};
use std::arch::x86_64::*;

/// Bytes of one interleaved block of eight rows.
const GROUP_BLOCK: usize = 8 * 18;

/// Unpacks the group of eight rows at `g` (`nb` interleaved blocks) into the two panels at `out`
/// and `out + panel_bytes` (rows 0-3, then 4-7).
///
/// # Safety
/// `K` must be Q4_0's [`Kind`]; `g` readable for `nb` interleaved blocks; both panels writable
/// for `nb` blocks of `K::BYTES`; the CPU must have AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn group<K: Kind>(g: *const u8, nb: usize, out: *mut u8, panel_bytes: usize) {
    debug_assert_eq!(NR, 4, "two panels per group");
    // SAFETY: every read is inside block `b` of the group, every write inside block `b` of one of
    // the two panels (offsets from `K`'s layout), as the caller guarantees.
    unsafe {
        let rows_in_order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
        let (nibble, zero) = (_mm256_set1_epi8(0x0F), _mm256_setzero_si256());
        for b in 0..nb {
            let blk = g.add(b * GROUP_BLOCK);
            let dst = [out.add(b * K::BYTES), out.add(panel_bytes + b * K::BYTES)];
            halves(_mm256_castps_si256(_mm256_cvtph_ps(_mm_loadu_si128(blk.cast()))), rows_in_order, dst, K::D);
            for (q, dq) in dst.iter().enumerate() {
                // Bytes 0-7 and 8-15 of rows 4q .. 4q + 4 (chunks 2h + q).
                let v0 = _mm256_loadu_si256(blk.add(16 + 32 * q).cast());
                let v1 = _mm256_loadu_si256(blk.add(16 + 32 * (2 + q)).cast());
                let v = [
                    _mm256_and_si256(v0, nibble),
                    _mm256_and_si256(v1, nibble),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(v0), nibble),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(v1), nibble),
                ];
                let mut sums = zero;
                for vp in &v {
                    sums = _mm256_add_epi64(sums, _mm256_sad_epu8(*vp, zero));
                }
                store_c128(sums, dq.add(K::C128));
                for (rr, wr) in transpose4(v).iter().enumerate() {
                    _mm256_storeu_si256(dq.add(rr * K::BLOCK).cast(), *wr);
                }
            }
        }
    }
}
