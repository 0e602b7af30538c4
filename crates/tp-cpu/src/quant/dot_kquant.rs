//! x86 dot products of the K-quants (Q2_K .. Q6_K; super-blocks of 256) with Q8_K activations.
//!
//! Each 32-element slice of a super-block is unpacked to unsigned codes `u` and multiplied by
//! its activation codes with [`dot_scaled`], which also applies the 16-bit group scales (one
//! per 32 elements for Q4_K / Q5_K, two per 32 for the others), so a whole super-block sums in
//! `i32` lanes. The codes' offsets (32 for Q6_K, 4 for Q3_K) are taken out in integers with the
//! activations' sums per 16 (`bsums`), `Σ_g sc_g offset Σ_{e in g} q_x`; the mins of Q2_K, Q4_K
//! and Q5_K likewise give `Σ_g mn_g Σ_{e in g} q_x`, scaled in `f32` by `dmin dx`:
//!
//! `Σ w x = d dx (Σ_g sc_g Σ u q_x - offset Σ_g sc_g Σ q_x) - dmin dx Σ_g mn_g Σ q_x`.
//!
//! The super-block is unpacked once and dotted with every activation row. Two integer
//! accumulators per row alternate. The kernels use AVX2 instructions only (`vpdpwssd` measured
//! slower, see [`dot_scaled`]); the AVX512-VNNI entry points compile them with the wider
//! register file.

use super::act::XRow;
use super::blocks::{
    K4_SCALES, Q2K_D, Q2K_DMIN, Q2K_QS, Q3K_D, Q3K_QS, Q3K_SCALES, Q4K_QS, Q5K_QH, Q5K_QS, Q6K_D, Q6K_QH, Q6K_SCALES,
};
use super::simd::{dot_scaled, f16_at, hsum, load, load_x, word_pick};
use std::arch::x86_64::*;

/// What one super-block gives each activation row: the `i32` lanes of `Σ_g sc_g Σ w_int q_x`
/// (offsets removed), the lanes of `Σ_g mn_g Σ q_x` (types with mins), `d` and `dmin`.
pub(crate) struct Sums<const M: usize> {
    int: [__m256i; M],
    min: [__m256i; M],
    d: f32,
    dmin: f32,
}

/// One K-quant type.
pub(crate) trait KQuant {
    /// Bytes per super-block.
    const BYTES: usize;
    /// Whether the type has mins (Q2_K, Q4_K, Q5_K).
    const HAS_MIN: bool;
    /// Super-blocks ahead to prefetch (0: none, the hardware prefetchers keep up).
    const PREFETCH: usize = 0;

    /// The sums of the super-block at `p` with the activation codes at `xq[i]` (256) and their
    /// 16 sums at `bs[i]`.
    ///
    /// # Safety
    /// `p` must point at a whole super-block, `xq[i]` at 256 codes, `bs[i]` at 16 sums; the CPU
    /// must have AVX2, FMA and F16C.
    unsafe fn sums<const M: usize>(p: *const u8, xq: [*const i8; M], bs: [*const i16; M]) -> Sums<M>;
}

/// Integer accumulators of a super-block: two per activation row, taken in turn.
struct Acc<const M: usize>([[__m256i; 2]; M]);

impl<const M: usize> Acc<M> {
    #[inline(always)]
    fn new() -> Self {
        // SAFETY: `_mm256_setzero_si256` needs only AVX, which every caller has.
        Acc([[unsafe { _mm256_setzero_si256() }; 2]; M])
    }

    /// Step `step` of row `i`: [`dot_scaled`] into chain `step % 2`.
    ///
    /// # Safety
    /// As [`dot_scaled`].
    #[inline(always)]
    unsafe fn dot(&mut self, i: usize, step: usize, u: __m256i, x: __m256i, scale: __m256i) {
        let a = &mut self.0[i][step % 2];
        // SAFETY: forwarded.
        *a = unsafe { dot_scaled(*a, u, x, scale) };
    }

    /// Row `i`'s sum over its chains.
    ///
    /// # Safety
    /// AVX2.
    #[inline(always)]
    unsafe fn total(&self, i: usize) -> __m256i {
        // SAFETY: as stated.
        unsafe { _mm256_add_epi32(self.0[i][0], self.0[i][1]) }
    }
}

/// The 16 activation sums of a super-block.
///
/// # Safety
/// `p..p + 16` readable; AVX2.
#[inline(always)]
unsafe fn bsums(p: *const i16) -> __m256i {
    // SAFETY: as stated.
    unsafe { _mm256_loadu_si256(p.cast()) }
}

/// The 16 scales of a 16-group type (in 16-bit lanes: lane half 0 holds scales 0..8, half 1
/// holds 8..16) arranged for half `j` of the super-block (elements `128 j ..`): both 128-bit
/// halves hold the scales of that half.
///
/// # Safety
/// AVX2.
#[inline(always)]
unsafe fn half_scales(sc16: __m256i, j: usize) -> __m256i {
    // SAFETY: as stated.
    unsafe {
        if j == 0 {
            _mm256_permute2x128_si256::<0x00>(sc16, sc16)
        } else {
            _mm256_permute2x128_si256::<0x11>(sc16, sc16)
        }
    }
}

/// The 2-bit fields `2s..2s+2` of 32 bytes.
///
/// # Safety
/// AVX2.
#[inline(always)]
unsafe fn two_bits(q: __m256i, s: usize) -> __m256i {
    // SAFETY: as stated.
    unsafe { _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * s as i32)), _mm256_set1_epi8(3)) }
}

pub(crate) struct Q2;
pub(crate) struct Q3;
pub(crate) struct Q4;
pub(crate) struct Q5;
pub(crate) struct Q6;

impl KQuant for Q2 {
    const BYTES: usize = 84;
    const HAS_MIN: bool = true;
    #[inline(always)]
    unsafe fn sums<const M: usize>(p: *const u8, xq: [*const i8; M], bs: [*const i16; M]) -> Sums<M> {
        // SAFETY: the reads stay in the super-block and the activations the caller guarantees.
        unsafe {
            let raw = _mm_loadu_si128(p.cast());
            let sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, _mm_set1_epi8(0x0F)));
            let mn16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(raw), _mm_set1_epi8(0x0F)));
            let mut acc = Acc::<M>::new();
            for j in 0..2 {
                let sc = half_scales(sc16, j);
                let q = load(p.add(Q2K_QS + 32 * j));
                for s in 0..4 {
                    let (u, scale) = (two_bits(q, s), _mm256_shuffle_epi8(sc, word_pick(2 * s, 2 * s + 1)));
                    for (i, xq) in xq.iter().enumerate() {
                        let x = load_x(xq.add(128 * j + 32 * s));
                        acc.dot(i, 4 * j + s, u, x, scale);
                    }
                }
            }
            let int = std::array::from_fn(|i| acc.total(i));
            let min = std::array::from_fn(|i| _mm256_madd_epi16(bsums(bs[i]), mn16));
            Sums { int, min, d: f16_at(p.add(Q2K_D)), dmin: f16_at(p.add(Q2K_DMIN)) }
        }
    }
}

impl KQuant for Q3 {
    const BYTES: usize = 110;
    const HAS_MIN: bool = false;
    #[inline(always)]
    unsafe fn sums<const M: usize>(p: *const u8, xq: [*const i8; M], bs: [*const i16; M]) -> Sums<M> {
        // SAFETY: as for Q2.
        unsafe {
            let sc16 = q3k_scales(p.add(Q3K_SCALES));
            let mut hmask = load(p);
            let mut acc = Acc::<M>::new();
            for j in 0..2 {
                let sc = half_scales(sc16, j);
                let q = load(p.add(Q3K_QS + 32 * j));
                for s in 0..4 {
                    // Bit 4 j + s of the mask, moved to bit 2 (`hmask` shifts right once per step).
                    let high = _mm256_and_si256(_mm256_slli_epi16::<2>(hmask), _mm256_set1_epi8(4));
                    hmask = _mm256_srli_epi16::<1>(hmask);
                    let u = _mm256_or_si256(two_bits(q, s), high);
                    let scale = _mm256_shuffle_epi8(sc, word_pick(2 * s, 2 * s + 1));
                    for (i, xq) in xq.iter().enumerate() {
                        let x = load_x(xq.add(128 * j + 32 * s));
                        acc.dot(i, 4 * j + s, u, x, scale);
                    }
                }
            }
            // Codes are `u - 4`.
            let int = std::array::from_fn(|i| {
                let offset = _mm256_slli_epi32::<2>(_mm256_madd_epi16(bsums(bs[i]), sc16));
                _mm256_sub_epi32(acc.total(i), offset)
            });
            Sums { int, min: [_mm256_setzero_si256(); M], d: f16_at(p.add(Q3K_D)), dmin: 0.0 }
        }
    }
}

/// Q3_K's 12 scale bytes at `p` (`blocks::q3k_scales`, eight bytes at a time): the 16 scales
/// minus 32, in 16-bit lanes.
///
/// # Safety
/// `p..p + 12` readable; AVX2.
#[inline(always)]
unsafe fn q3k_scales(p: *const u8) -> __m256i {
    // SAFETY: as stated.
    unsafe {
        let low = p.cast::<u64>().read_unaligned();
        let high = u64::from(p.add(8).cast::<u32>().read_unaligned());
        // Scale i: the low (i < 8) or high nibble of byte i % 8, and bits 2 (i / 4) of byte
        // 8 + i % 4 on top.
        let two = |shift: u32| (high >> shift) & 0x0303_0303;
        let s0 = (low & 0x0F0F_0F0F_0F0F_0F0F) | ((two(0) | (two(2) << 32)) << 4);
        let s1 = ((low >> 4) & 0x0F0F_0F0F_0F0F_0F0F) | ((two(4) | (two(6) << 32)) << 4);
        let codes = _mm256_cvtepu8_epi16(_mm_set_epi64x(s1 as i64, s0 as i64));
        _mm256_sub_epi16(codes, _mm256_set1_epi16(32))
    }
}

/// Q4_K / Q5_K's 12 scale bytes at `p` (`blocks::k4_scales_mins`, four bytes at a time): the
/// 8 scales in both 128-bit halves (16-bit lanes), and the 8 mins each twice in a row (one per
/// 16 activation sums).
///
/// # Safety
/// `p..p + 12` readable; AVX2.
#[inline(always)]
unsafe fn k4_scales(p: *const u8) -> (__m256i, __m256i) {
    // SAFETY: as stated.
    unsafe {
        let word = |i: usize| p.add(4 * i).cast::<u32>().read_unaligned();
        let (b0, b1, b2) = (word(0), word(1), word(2));
        // Groups 0..4: the low 6 bits; 4..8: a nibble of bytes 8..12 and the top 2 bits of
        // bytes 0..4 (scales) or 4..8 (mins), moved to bits 4..6 of the same byte.
        let sc_lo = b0 & 0x3F3F_3F3F;
        let sc_hi = (b2 & 0x0F0F_0F0F) | ((b0 >> 2) & 0x3030_3030);
        let mn_lo = b1 & 0x3F3F_3F3F;
        let mn_hi = ((b2 >> 4) & 0x0F0F_0F0F) | ((b1 >> 2) & 0x3030_3030);
        let bytes = _mm_setr_epi32(sc_lo as i32, sc_hi as i32, mn_lo as i32, mn_hi as i32);
        let sc8 = _mm_cvtepu8_epi16(bytes);
        let mn8 = _mm_cvtepu8_epi16(_mm_srli_si128::<8>(bytes));
        (_mm256_set_m128i(sc8, sc8), _mm256_set_m128i(_mm_unpackhi_epi16(mn8, mn8), _mm_unpacklo_epi16(mn8, mn8)))
    }
}

/// Q4_K (`FIVE = false`) and Q5_K.
///
/// # Safety
/// As [`KQuant::sums`].
#[inline(always)]
unsafe fn sums_45<const M: usize, const FIVE: bool>(p: *const u8, xq: [*const i8; M], bs: [*const i16; M]) -> Sums<M> {
    // SAFETY: as for Q2.
    unsafe {
        let (sc16, mn16) = k4_scales(p.add(K4_SCALES));
        let qs = if FIVE { Q5K_QS } else { Q4K_QS };
        let (low4, bit4) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x10));
        let mut qh = if FIVE { load(p.add(Q5K_QH)) } else { _mm256_setzero_si256() };
        let mut acc = Acc::<M>::new();
        for c in 0..4 {
            let v = load(p.add(qs + 32 * c));
            let mut u = [_mm256_and_si256(v, low4), _mm256_and_si256(_mm256_srli_epi16::<4>(v), low4)];
            if FIVE {
                // Bits 2c and 2c + 1 of `qh` to bit 4 (`qh` shifts right once per group).
                for u in &mut u {
                    *u = _mm256_or_si256(*u, _mm256_and_si256(_mm256_slli_epi16::<4>(qh), bit4));
                    qh = _mm256_srli_epi16::<1>(qh);
                }
            }
            for (h, &u) in u.iter().enumerate() {
                let scale = _mm256_shuffle_epi8(sc16, word_pick(2 * c + h, 2 * c + h));
                for (i, xq) in xq.iter().enumerate() {
                    let x = load_x(xq.add(64 * c + 32 * h));
                    acc.dot(i, 2 * c + h, u, x, scale);
                }
            }
        }
        let int = std::array::from_fn(|i| acc.total(i));
        let min = std::array::from_fn(|i| _mm256_madd_epi16(bsums(bs[i]), mn16));
        Sums { int, min, d: f16_at(p), dmin: f16_at(p.add(2)) }
    }
}

impl KQuant for Q4 {
    const BYTES: usize = 144;
    const HAS_MIN: bool = true;
    #[inline(always)]
    unsafe fn sums<const M: usize>(p: *const u8, xq: [*const i8; M], bs: [*const i16; M]) -> Sums<M> {
        // SAFETY: forwarded.
        unsafe { sums_45::<M, false>(p, xq, bs) }
    }
}

impl KQuant for Q5 {
    const BYTES: usize = 176;
    const HAS_MIN: bool = true;
    #[inline(always)]
    unsafe fn sums<const M: usize>(p: *const u8, xq: [*const i8; M], bs: [*const i16; M]) -> Sums<M> {
        // SAFETY: forwarded.
        unsafe { sums_45::<M, true>(p, xq, bs) }
    }
}

impl KQuant for Q6 {
    const BYTES: usize = 210;
    const HAS_MIN: bool = false;
    // Measured on Zen 4 (one and two threads, weights streamed from memory): Q6_K rows ran at
    // about 5 GB/s on the hardware prefetchers alone, 11 with 8 super-blocks prefetched; the
    // other types ran slower with it.
    const PREFETCH: usize = 8;
    #[inline(always)]
    unsafe fn sums<const M: usize>(p: *const u8, xq: [*const i8; M], bs: [*const i16; M]) -> Sums<M> {
        // SAFETY: as for Q2.
        unsafe {
            let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(Q6K_SCALES).cast()));
            let mut acc = Acc::<M>::new();
            for j in 0..2 {
                let sc = half_scales(sc16, j);
                let (l0, l1) = (load(p.add(64 * j)), load(p.add(64 * j + 32)));
                let u = q6_codes(l0, l1, load(p.add(Q6K_QH + 32 * j)));
                for (s, &u) in u.iter().enumerate() {
                    let scale = _mm256_shuffle_epi8(sc, word_pick(2 * s, 2 * s + 1));
                    for (i, xq) in xq.iter().enumerate() {
                        let x = load_x(xq.add(128 * j + 32 * s));
                        acc.dot(i, 4 * j + s, u, x, scale);
                    }
                }
            }
            // Codes are `u - 32`.
            let int = std::array::from_fn(|i| {
                let offset = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bsums(bs[i]), sc16));
                _mm256_sub_epi32(acc.total(i), offset)
            });
            Sums { int, min: [_mm256_setzero_si256(); M], d: f16_at(p.add(Q6K_D)), dmin: 0.0 }
        }
    }
}

/// ggml's 6-bit Q6_K codes `u` (`0..64`) of 32 bytes' worth of elements from two registers of
/// low-nibble bytes `a`, `b` and one of high-bit bytes `h` (ggml's `ql` and `qh` runs):
/// `[a low | h bits 0-1, b low | h bits 2-3, a high | h bits 4-5, b high | h bits 6-7]`, each
/// high pair placed at bits 4-5. Within one row (`dot_kquant`) these are the elements `l`,
/// `l + 32`, `l + 64`, `l + 96` of a half super-block; in `RowLayout::Q6Kx8` (`dot_q6kx8`)
/// four rows' pieces `P`, `P + 4`, `P + 8`, `P + 12`.
///
/// # Safety
/// AVX2.
#[inline(always)]
pub(crate) unsafe fn q6_codes(a: __m256i, b: __m256i, h: __m256i) -> [__m256i; 4] {
    // SAFETY: as stated.
    unsafe {
        let (low4, top2) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
        [
            _mm256_or_si256(_mm256_and_si256(a, low4), _mm256_and_si256(_mm256_slli_epi16::<4>(h), top2)),
            _mm256_or_si256(_mm256_and_si256(b, low4), _mm256_and_si256(_mm256_slli_epi16::<2>(h), top2)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(a), low4), _mm256_and_si256(h, top2)),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(b), low4),
                _mm256_and_si256(_mm256_srli_epi16::<2>(h), top2),
            ),
        ]
    }
}

/// `Σ_e w[e] x_i[e]` for the weight row at `w` (`nb` super-blocks of `K`) and `M` activation
/// rows: per super-block, `d dx` times the integer sums and `-dmin dx` times the min sums,
/// accumulated in 8 `f32` lanes.
///
/// # Safety
/// `w` must hold `nb * K::BYTES` readable bytes; every `xs[i]` must have `256 nb` codes, `nb`
/// scales and `16 nb` sums; the CPU must have AVX2, FMA and F16C.
#[inline(always)]
pub(crate) unsafe fn row<K: KQuant, const M: usize>(w: *const u8, nb: usize, xs: &[XRow<'_>; M]) -> [f32; M] {
    // SAFETY: super-block `s < nb` is inside `w`, and its activations inside every `xs[i]`.
    unsafe {
        // Even and odd super-blocks, and the min terms, in separate accumulators (the FMA
        // latency would otherwise chain the super-blocks).
        let (mut even, mut odd, mut mins) =
            ([_mm256_setzero_ps(); M], [_mm256_setzero_ps(); M], [_mm256_setzero_ps(); M]);
        let mut s = 0;
        while s + 2 <= nb {
            superblock::<K, M>(w, s, xs, &mut even, &mut mins);
            superblock::<K, M>(w, s + 1, xs, &mut odd, &mut mins);
            s += 2;
        }
        if s < nb {
            superblock::<K, M>(w, s, xs, &mut even, &mut mins);
        }
        let acc: [__m256; M] = std::array::from_fn(|i| _mm256_add_ps(_mm256_add_ps(even[i], odd[i]), mins[i]));
        std::array::from_fn(|i| hsum(acc[i]))
    }
}

/// Super-block `s` of the row at `w` against every activation row: `d dx` times its integer sums
/// into `acc`, `-dmin dx` times its min sums into `mins`.
///
/// # Safety
/// As [`row`], with `s < nb`.
#[inline(always)]
unsafe fn superblock<K: KQuant, const M: usize>(
    w: *const u8,
    s: usize,
    xs: &[XRow<'_>; M],
    acc: &mut [__m256; M],
    mins: &mut [__m256; M],
) {
    // SAFETY: super-block `s` is inside `w` and every activation row, as the caller guarantees.
    unsafe {
        let xq = std::array::from_fn(|i| xs[i].qs.as_ptr().add(256 * s));
        let bs = std::array::from_fn(|i| xs[i].bsums.as_ptr().add(16 * s));
        if K::PREFETCH > 0 {
            // Every cache line of the super-block `PREFETCH` ahead (the address may lie past
            // the row: a prefetch does not fault).
            let ahead = w.wrapping_add((s + K::PREFETCH) * K::BYTES);
            for l in (0..K::BYTES).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(l).cast());
            }
        }
        let sums = K::sums::<M>(w.add(s * K::BYTES), xq, bs);
        for i in 0..M {
            let dx = xs[i].d[s];
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums.int[i]), _mm256_set1_ps(sums.d * dx), acc[i]);
            if K::HAS_MIN {
                let m = _mm256_set1_ps(-(sums.dmin * dx));
                mins[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums.min[i]), m, mins[i]);
            }
        }
    }
}
