//! Weight panels of the integer GEMM: [`NR`] weight rows unpacked, block by block, into 8-bit
//! codes that a dot-product instruction takes four at a time (broadcast to 16 activation rows),
//! with each row's integer group scales, min pairs and `f32` scales beside them.
//!
//! A panel holds `nb` blocks (one per [`Kind::BLOCK`] elements of a row). Block `b` starts at
//! `b · K::BYTES` and holds, for the panel's rows `j = 0..NR`:
//!
//! * `codes` at `j · BLOCK`: the row's `BLOCK` codes as signed bytes, in element order (Q4_0 and
//!   Q4_K their unsigned codes `0..16`, Q6_K its codes minus 32);
//! * `sc` at [`Kind::SC`] `+ 4 (g NR + j)`: the `i32` scale of group `g` (K-quants);
//! * `pairs` at [`Kind::PAIRS`] `+ 4 (p NR + j)`: the mins of groups `2p` and `2p + 1` as two
//!   `i16` (low half first; Q4_K);
//! * `c128` at [`Kind::C128`] `+ 4 j`: `128 Σ_g sc_g Σ_{e in g} code_e`, what the activation
//!   codes' shift by 128 adds to the integer sum, taken out again;
//! * `d` at [`Kind::D`] `+ 4 j` and `dmin` at [`Kind::DMIN`] `+ 4 j` (`f32`).
//!
//! Rows past the weight's last are zero (their outputs are zero and never stored).

use crate::quant::blocks::{K4_SCALES, Q4_0_QS, Q4K_QS, Q6K_D, Q6K_QH, Q6K_SCALES, f16_at, k4_scales_mins};
use crate::quant::dot_kquant::q6_codes;
use crate::quant::igemm::xtiles::Extra;
use crate::quant::interleave::RowLayout;
use crate::quant::simd::nibbles16;
use crate::quant::types::QuantType;
use std::arch::x86_64::*;

/// Weight rows per panel: the kernel's accumulators hold `NR` weight rows by 16 or 32
/// activation rows.
pub(crate) const NR: usize = 4;

/// A weight type the integer GEMM takes, and how its blocks unpack.
pub(crate) trait Kind {
    const T: QuantType;
    /// Elements per block (one `f32` scale per row and block).
    const BLOCK: usize;
    /// Elements per integer-scaled group (`BLOCK` for types without group scales).
    const GROUP: usize;
    /// Whether groups carry integer scales (K-quants).
    const SCALED: bool;
    /// Whether groups carry mins (`dmin mn_g` taken off each element).
    const MINS: bool;
    /// Q4_0: the codes' offset of 8, taken out in `f32` at the end (as its decode kernel does).
    const OFFSET8: bool;
    /// What the activation tiles keep per block.
    const EXTRA: Extra;

    /// Groups per block carrying a scale (0 without), and min pairs.
    const NG: usize = if Self::SCALED { Self::BLOCK / Self::GROUP } else { 0 };
    const NP: usize = if Self::MINS { Self::BLOCK / Self::GROUP / 2 } else { 0 };
    /// Byte offsets in a panel block (see the module docs), and its size.
    const SC: usize = NR * Self::BLOCK;
    const PAIRS: usize = Self::SC + 4 * NR * Self::NG;
    const C128: usize = Self::PAIRS + 4 * NR * Self::NP;
    const D: usize = Self::C128 + 4 * NR;
    const DMIN: usize = Self::D + 4 * NR;
    const BYTES: usize = Self::DMIN + if Self::MINS { 4 * NR } else { 0 };

    /// One ggml block `b` of one row: writes its `BLOCK` codes at `codes`, its `NG` group scales
    /// and `NP` min pairs, and returns `(c128, d, dmin)`.
    ///
    /// # Safety
    /// `b` must be one whole block of `T`, `codes` valid for `BLOCK` byte writes; AVX2.
    unsafe fn unpack(b: &[u8], codes: *mut u8, sc: &mut [i32; 16], pairs: &mut [i32; 8]) -> (i32, f32, f32);
}

/// Q4_0: `w = d (u - 8)`, `u` the nibble.
pub(crate) struct Q40;
/// Q4_K: `w = d sc_g u - dmin mn_g`.
pub(crate) struct Q4K;
/// Q6_K: `w = d sc_g (u - 32)`.
pub(crate) struct Q6K;

impl Kind for Q40 {
    const T: QuantType = QuantType::Q4_0;
    const BLOCK: usize = 32;
    const GROUP: usize = 32;
    const SCALED: bool = false;
    const MINS: bool = false;
    const OFFSET8: bool = true;
    const EXTRA: Extra = Extra::Sx;

    #[inline(always)]
    unsafe fn unpack(b: &[u8], codes: *mut u8, _sc: &mut [i32; 16], _pairs: &mut [i32; 8]) -> (i32, f32, f32) {
        // SAFETY: `b` holds a Q4_0 block (18 bytes), `codes` 32 writable bytes; AVX2.
        unsafe {
            let u = nibbles16(b.as_ptr().add(Q4_0_QS));
            _mm256_storeu_si256(codes.cast(), u);
            (128 * sum32(u), f16_at(b, 0), 0.0)
        }
    }
}

impl Kind for Q4K {
    const T: QuantType = QuantType::Q4K;
    const BLOCK: usize = 256;
    const GROUP: usize = 32;
    const SCALED: bool = true;
    const MINS: bool = true;
    const OFFSET8: bool = false;
    const EXTRA: Extra = Extra::Pairs;

    #[inline(always)]
    unsafe fn unpack(b: &[u8], codes: *mut u8, sc: &mut [i32; 16], pairs: &mut [i32; 8]) -> (i32, f32, f32) {
        let (scales, mins) = k4_scales_mins(&b[K4_SCALES..K4_SCALES + 12]);
        let mut c128 = 0i32;
        // SAFETY: `b` holds a Q4_K super-block (144 bytes), `codes` 256 writable bytes; AVX2.
        unsafe {
            for c in 0..4 {
                let v = _mm256_loadu_si256(b.as_ptr().add(Q4K_QS + 32 * c).cast());
                let lo = _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), _mm256_set1_epi8(0x0F));
                _mm256_storeu_si256(codes.add(64 * c).cast(), lo);
                _mm256_storeu_si256(codes.add(64 * c + 32).cast(), hi);
                c128 += i32::from(scales[2 * c]) * sum32(lo) + i32::from(scales[2 * c + 1]) * sum32(hi);
            }
        }
        for g in 0..8 {
            sc[g] = i32::from(scales[g]);
        }
        for p in 0..4 {
            pairs[p] = i32::from(mins[2 * p]) | (i32::from(mins[2 * p + 1]) << 16);
        }
        (128 * c128, f16_at(b, 0), f16_at(b, 2))
    }
}

impl Kind for Q6K {
    const T: QuantType = QuantType::Q6K;
    const BLOCK: usize = 256;
    const GROUP: usize = 16;
    const SCALED: bool = true;
    const MINS: bool = false;
    const OFFSET8: bool = false;
    const EXTRA: Extra = Extra::None;

    #[inline(always)]
    unsafe fn unpack(b: &[u8], codes: *mut u8, sc: &mut [i32; 16], _pairs: &mut [i32; 8]) -> (i32, f32, f32) {
        for g in 0..16 {
            sc[g] = i32::from(b[Q6K_SCALES + g] as i8);
        }
        let mut c128 = 0i32;
        // SAFETY: `b` holds a Q6_K super-block (210 bytes), `codes` 256 writable bytes; AVX2.
        unsafe {
            let p = b.as_ptr();
            for j in 0..2 {
                // Quarters `s` of half `j` (elements 128 j + 32 s ..), as the decode kernel takes
                // them from `ql[64 j ..]`, `ql[64 j + 32 ..]` and `qh[32 j ..]`.
                let quarters = q6_codes(
                    _mm256_loadu_si256(p.add(64 * j).cast()),
                    _mm256_loadu_si256(p.add(64 * j + 32).cast()),
                    _mm256_loadu_si256(p.add(Q6K_QH + 32 * j).cast()),
                );
                for (s, u) in quarters.iter().enumerate() {
                    _mm256_storeu_si256(codes.add(128 * j + 32 * s).cast(), _mm256_sub_epi8(*u, _mm256_set1_epi8(32)));
                    // Groups 8 j + 2 s and the next: the sums of `u` over each 16, minus 32 each.
                    let sad = _mm256_sad_epu8(*u, _mm256_setzero_si256());
                    let lanes: [i64; 4] = std::mem::transmute(sad);
                    let g = 8 * j + 2 * s;
                    c128 += sc[g] * (lanes[0] + lanes[1] - 512) as i32 + sc[g + 1] * (lanes[2] + lanes[3] - 512) as i32;
                }
            }
        }
        (128 * c128, f16_at(b, Q6K_D), 0.0)
    }
}

/// The sum of 32 unsigned bytes.
///
/// # Safety
/// AVX2.
#[inline(always)]
unsafe fn sum32(v: __m256i) -> i32 {
    // SAFETY: AVX2 is the caller's.
    unsafe {
        let sad = _mm256_sad_epu8(v, _mm256_setzero_si256());
        let s = _mm_add_epi64(_mm256_castsi256_si128(sad), _mm256_extracti128_si256::<1>(sad));
        (_mm_cvtsi128_si64(s) + _mm_extract_epi64::<1>(s)) as i32
    }
}

/// Unpacks `rows` weight rows (`w`, `row_bytes` each, `nb` blocks of `K` per row, stored in
/// `layout`) into `rows.div_ceil(NR)` panels, one after another in `out` (resized; rows past
/// `rows` zero). Rows in whole groups of an interleaved layout unpack eight at a time (`q4x8`,
/// `q4kx8`, `q6kx8`); the others (ggml's layout) one block at a time.
///
/// # Safety
/// The CPU must have AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn build<K: Kind>(
    w: &[u8],
    layout: RowLayout,
    rows: usize,
    row_bytes: usize,
    nb: usize,
    out: &mut Vec<u8>,
) {
    let panels = rows.div_ceil(NR);
    let panel_bytes = nb * K::BYTES;
    out.resize(panels * panel_bytes, 0);
    if !rows.is_multiple_of(NR) {
        out[(panels - 1) * panel_bytes..].fill(0);
    }
    let block_bytes = K::T.block_bytes();
    let (mut sc, mut pairs) = ([0i32; 16], [0i32; 8]);
    let o = out.as_mut_ptr();
    // Whole groups of an interleaved layout eight rows at a time (two panels each).
    let group: Option<unsafe fn(*const u8, usize, *mut u8, usize)> = match layout {
        _ if !layout.applies(K::T) => None,
        RowLayout::Q4Kx8 => Some(super::q4kx8::group::<K>),
        RowLayout::Q6Kx8 => Some(super::q6kx8::group::<K>),
        RowLayout::Q4_0x8 => Some(super::q4x8::group::<K>),
        // (No integer GEMM takes MXFP4: `applies` is false for every `K` above.)
        RowLayout::Mxfp4x8 | RowLayout::Q8_0x8 | RowLayout::Ggml => None,
    };
    let grouped = if let Some(group) = group {
        for gi in 0..rows / 8 {
            // SAFETY: group `gi` is inside `w` (`8 row_bytes` bytes, `nb` super-blocks), panels
            // `2 gi` and `2 gi + 1` inside `out`; `K` is the group function's type (the layout
            // applies to it); AVX2 and F16C are the caller's.
            unsafe { group(w.as_ptr().add(gi * 8 * row_bytes), nb, o.add(2 * gi * panel_bytes), panel_bytes) };
        }
        rows / 8 * 8
    } else {
        0
    };
    // The rest (ggml's layout, and the rows past an interleaved layout's last group) one block at
    // a time.
    for r in grouped..rows {
        let (p, j) = (r / NR, r % NR);
        for b in 0..nb {
            let blk = &w[r * row_bytes + b * block_bytes..][..block_bytes];
            let base = p * panel_bytes + b * K::BYTES;
            // SAFETY: panel `p`, block `b` is inside `out` (`panels` panels of `nb` blocks), and
            // every offset below is inside its `K::BYTES` (see the layout in the module docs);
            // `blk` is one whole block; AVX2 is the caller's.
            unsafe {
                let (c128, d, dmin) = K::unpack(blk, o.add(base + j * K::BLOCK), &mut sc, &mut pairs);
                let put = |at: usize, v: u32| o.add(base + at).cast::<u32>().write_unaligned(v);
                for (g, &s) in sc.iter().enumerate().take(K::NG) {
                    put(K::SC + 4 * (g * NR + j), s as u32);
                }
                for (q, &v) in pairs.iter().enumerate().take(K::NP) {
                    put(K::PAIRS + 4 * (q * NR + j), v as u32);
                }
                put(K::C128 + 4 * j, c128 as u32);
                put(K::D + 4 * j, d.to_bits());
                if K::MINS {
                    put(K::DMIN + 4 * j, dmin.to_bits());
                }
            }
        }
    }
}
