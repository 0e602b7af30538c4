//! The x86 decode kernel of Q4_0 rows in [`RowLayout::Q4_0x8`](super::interleave::RowLayout):
//! eight weight rows against `M` Q8_0 activation rows, one interleaved block at a time (and, the
//! same way, MXFP4's [`Mxfp4x8`] and Q8_0's [`Q80x8`], at the end).
//!
//! Per block: the eight rows' scales in one load and one `vcvtph2ps`; the 128 code bytes in four
//! 32-byte loads, each split into its low and high nibbles (elements `8h..8h + 8` and
//! `16 + 8h..` of four rows); then, per activation row, eight dot-product instructions against
//! the activation's matching 8 bytes broadcast to every row (two `i32` lanes per row, in one
//! register for rows 0-3 and one for rows 4-7), one horizontal add that leaves the eight rows'
//! integer sums in the lane order [`LANES`], and one conversion and one multiply-add by the
//! scales for all eight rows. The Q4_0 offset enters as ggml's does: `Σ w x = d dx Σ u q_x −
//! 8 d (dx Σ q_x)`, the second term accumulated apart and subtracted at the end.
//!
//! The integer sums are exact, and each block adds one rounded term per row, so the error bound
//! of `quant_matmul` holds as for ggml's layout (the rounding order differs, not the count).
//!
//! [`Mxfp4x8`] runs MXFP4 rows in [`RowLayout::Mxfp4x8`](super::interleave::RowLayout) the same
//! way: its codes sit where Q4_0x8's do (after eight scale bytes instead of sixteen), each nibble
//! looked up in a 16-entry table of its value plus 12 (unsigned, one `pshufb`), the offset 12
//! taken back as Q4_0's 8 is; the eight E8M0 scale bytes become `2^(e - 128)` in one register
//! (integer shifts into the exponent, subnormal below `e = 2`, exactly as the scalar decoder).

use super::act::XRow;
use super::interleave::LANES;
use super::simd::Dot;
use std::arch::x86_64::*;

/// Bytes of one interleaved block of eight rows.
const GROUP_BLOCK: usize = 144;

/// A type whose rows are interleaved eight at a time: its kernel for one group.
pub(crate) trait Group {
    /// Bytes of one (super-)block of one row.
    const BLOCK_BYTES: usize;
    /// The most activation rows one call takes (4, 6 or 8): more rows share each unpacking of
    /// the codes, but past the register file the sums spill. Measured on Zen 4 (two threads,
    /// `[5632, 2048]`, 16 activation rows): 8 rows take Q4_0 from 0.83-0.87 to 0.77 ms and Q4_K
    /// from 0.89-1.06 to 0.87-0.91 against 4, and Q6_K from 1.20-1.33 to 1.42-1.54.
    const WIDEST: usize;

    /// `out[i][r] = Σ_e w_r[e] x_i[e]` for the eight rows of the interleaved group at `g` (`nb`
    /// interleaved blocks) and the `M` activation rows `xs`.
    ///
    /// # Safety
    /// `g` must hold `8 nb BLOCK_BYTES` readable bytes; every `xs[i]` must cover `nb` blocks
    /// (codes, scales, sums); the CPU must have `D`'s instructions, AVX2, FMA and F16C.
    unsafe fn group<D: Dot, const M: usize>(g: *const u8, nb: usize, xs: &[XRow<'_>; M]) -> [[f32; 8]; M];
}

/// Interleaved blocks ahead to prefetch (about 9 KiB, as the K-quant kernels), a line at a time
/// as each block starts (into L2). Measured on Zen 4 (two threads, `[5632, 2048]` streamed from
/// memory): one activation row 0.33 -> 0.16 ms against asking for the whole next group at once
/// as each group starts, 4 rows 0.47 -> 0.33, 16 rows 1.07 -> 0.93.
const PREFETCH: usize = 64;

/// Q4_0 in `RowLayout::Q4_0x8`.
pub(crate) struct Q40x8;

/// MXFP4 in `RowLayout::Mxfp4x8`.
pub(crate) struct Mxfp4x8;

/// Q8_0 in `RowLayout::Q8_0x8`.
pub(crate) struct Q80x8;

/// Bytes of one interleaved Q8_0 block of eight rows.
const Q8_GROUP_BLOCK: usize = 272;

/// Bytes of one interleaved MXFP4 block of eight rows.
const MX_GROUP_BLOCK: usize = 136;

/// The eight sums of `v`, in lane order [`LANES`], by row.
///
/// # Safety
/// AVX.
#[inline(always)]
pub(crate) unsafe fn by_row(v: __m256) -> [f32; 8] {
    let mut lanes = [0f32; 8];
    // SAFETY: `lanes` holds 8 floats; AVX is the caller's.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
    let mut rows = [0f32; 8];
    for (l, &r) in LANES.iter().enumerate() {
        rows[r] = lanes[l];
    }
    rows
}

/// A 4-bit type interleaved as Q4_0x8 is (eight rows' scales at the start of an interleaved
/// block, then four 32-byte chunks of codes): how its scales and codes decode, and the offset
/// its unsigned codes carry. [`Q40x8`] and [`Mxfp4x8`] share [`group4`] through it.
trait FourBit {
    /// Bytes of one interleaved block of eight rows, and where its codes start.
    const GROUP_BLOCK: usize;
    const CODES: usize;
    /// The offset the unsigned codes carry (8 for Q4_0, 12 for MXFP4's looked-up values).
    const OFFSET: f32;
    /// The eight rows' scales `d`, in lane order, from the block at `blk`.
    ///
    /// # Safety
    /// The block is readable; AVX2 and F16C.
    unsafe fn scales(blk: *const u8) -> __m256;
    /// The unsigned codes of 32 nibbles (`0..16` each).
    ///
    /// # Safety
    /// AVX2.
    unsafe fn codes(nibbles: __m256i) -> __m256i;
}

impl FourBit for Q40x8 {
    const GROUP_BLOCK: usize = GROUP_BLOCK;
    const CODES: usize = 16;
    const OFFSET: f32 = 8.0;
    #[inline(always)]
    unsafe fn scales(blk: *const u8) -> __m256 {
        // SAFETY: the eight f16 scales start the block; F16C as the caller guarantees.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(blk.cast())) }
    }
    #[inline(always)]
    unsafe fn codes(nibbles: __m256i) -> __m256i {
        nibbles
    }
}

impl FourBit for Mxfp4x8 {
    const GROUP_BLOCK: usize = MX_GROUP_BLOCK;
    const CODES: usize = 8;
    const OFFSET: f32 = 12.0;
    #[inline(always)]
    unsafe fn scales(blk: *const u8) -> __m256 {
        // SAFETY: the eight scale bytes start the block; AVX2 as the caller guarantees.
        unsafe {
            // 2^(e - 128): (e - 1) << 23 for e >= 2, 0x00200000 << e below (ggml's
            // `GGML_E8M0_TO_FP32_HALF`).
            let one = _mm256_set1_epi32(1);
            let e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(blk.cast()));
            let normal = _mm256_slli_epi32::<23>(_mm256_sub_epi32(e, one));
            let small = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
            _mm256_castsi256_ps(_mm256_blendv_epi8(small, normal, _mm256_cmpgt_epi32(e, one)))
        }
    }
    #[inline(always)]
    unsafe fn codes(nibbles: __m256i) -> __m256i {
        // SAFETY: register operations; AVX2 as the caller guarantees.
        unsafe {
            let t = _mm_loadu_si128(super::dot_legacy::MXFP4_UNSIGNED.as_ptr().cast());
            _mm256_shuffle_epi8(_mm256_set_m128i(t, t), nibbles)
        }
    }
}

/// [`Group::group`] of a [`FourBit`] type (see the module docs).
///
/// # Safety
/// As [`Group::group`].
#[inline(always)]
unsafe fn group4<F: FourBit, D: Dot, const M: usize>(g: *const u8, nb: usize, xs: &[XRow<'_>; M]) -> [[f32; 8]; M] {
    // SAFETY: every read stays in the `nb` interleaved blocks at `g` and the first `nb` blocks of
    // each activation row (codes, scales, sums), as the caller guarantees; the instructions are
    // the caller's.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); M];
        let mut corr = [_mm256_setzero_ps(); M];
        let nibble = _mm256_set1_epi8(0x0F);
        for b in 0..nb {
            let blk = g.add(b * F::GROUP_BLOCK);
            // The block `PREFETCH` ahead (past the group's end it is the next group's, which
            // follows; a prefetch never faults).
            let ahead = blk.wrapping_add(PREFETCH * F::GROUP_BLOCK);
            for l in (0..F::GROUP_BLOCK).step_by(64) {
                _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(l).cast());
            }
            let d = F::scales(blk);
            let mut lo = [_mm256_setzero_si256(); 4];
            let mut hi = [_mm256_setzero_si256(); 4];
            for c in 0..4 {
                let v = _mm256_loadu_si256(blk.add(F::CODES + 32 * c).cast());
                lo[c] = F::codes(_mm256_and_si256(v, nibble));
                hi[c] = F::codes(_mm256_and_si256(_mm256_srli_epi16::<4>(v), nibble));
            }
            for i in 0..M {
                let xq = xs[i].qs.as_ptr().add(b * 32);
                let bytes = |at: usize| _mm256_set1_epi64x(xq.add(at).cast::<i64>().read_unaligned());
                let (mut rows03, mut rows47) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                for h in 0..2 {
                    let (xl, xh) = (bytes(8 * h), bytes(16 + 8 * h));
                    rows03 = D::dot_acc(rows03, lo[2 * h], xl);
                    rows03 = D::dot_acc(rows03, hi[2 * h], xh);
                    rows47 = D::dot_acc(rows47, lo[2 * h + 1], xl);
                    rows47 = D::dot_acc(rows47, hi[2 * h + 1], xh);
                }
                let sums = _mm256_cvtepi32_ps(_mm256_hadd_epi32(rows03, rows47));
                let dx = _mm256_set1_ps(*xs[i].d.get_unchecked(b));
                acc[i] = _mm256_fmadd_ps(sums, _mm256_mul_ps(d, dx), acc[i]);
                corr[i] = _mm256_fmadd_ps(d, _mm256_set1_ps(*xs[i].sx.get_unchecked(b)), corr[i]);
            }
        }
        std::array::from_fn(|i| by_row(_mm256_fnmadd_ps(_mm256_set1_ps(F::OFFSET), corr[i], acc[i])))
    }
}

impl Group for Q40x8 {
    const BLOCK_BYTES: usize = 18;
    const WIDEST: usize = 8;

    #[inline(always)]
    unsafe fn group<D: Dot, const M: usize>(g: *const u8, nb: usize, xs: &[XRow<'_>; M]) -> [[f32; 8]; M] {
        // SAFETY: the caller's guarantees, passed on.
        unsafe { group4::<Self, D, M>(g, nb, xs) }
    }
}

impl Group for Mxfp4x8 {
    const BLOCK_BYTES: usize = 17;
    const WIDEST: usize = 8;

    #[inline(always)]
    unsafe fn group<D: Dot, const M: usize>(g: *const u8, nb: usize, xs: &[XRow<'_>; M]) -> [[f32; 8]; M] {
        // SAFETY: the caller's guarantees, passed on.
        unsafe { group4::<Self, D, M>(g, nb, xs) }
    }
}

/// Q8_0's rows eight at a time: each block's eight `f16` scales in one conversion, its eight
/// 32-byte chunks of signed codes through the sign trick (`|w|` against `x` with `w`'s sign, as
/// ggml's and the row kernel's: the pairwise sums of AVX2's unsigned-by-signed multiply stay
/// below `2 · 128 · 127` and never saturate), so the integer sums are exact.
impl Group for Q80x8 {
    const BLOCK_BYTES: usize = 34;
    const WIDEST: usize = 8;

    #[inline(always)]
    unsafe fn group<D: Dot, const M: usize>(g: *const u8, nb: usize, xs: &[XRow<'_>; M]) -> [[f32; 8]; M] {
        // SAFETY: every read stays in the `nb` interleaved blocks at `g` and the first `nb`
        // blocks of each activation row, as the caller guarantees; the instructions are the
        // caller's.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); M];
            for b in 0..nb {
                let blk = g.add(b * Q8_GROUP_BLOCK);
                let ahead = blk.wrapping_add(PREFETCH * Q8_GROUP_BLOCK);
                for l in (0..Q8_GROUP_BLOCK).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(l).cast());
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.cast()));
                let mut w = [_mm256_setzero_si256(); 8];
                let mut a = [_mm256_setzero_si256(); 8];
                for c in 0..8 {
                    w[c] = _mm256_loadu_si256(blk.add(16 + 32 * c).cast());
                    a[c] = _mm256_abs_epi8(w[c]);
                }
                for i in 0..M {
                    let xq = xs[i].qs.as_ptr().add(b * 32);
                    let (mut rows03, mut rows47) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                    for p in 0..4 {
                        let x = _mm256_set1_epi64x(xq.add(8 * p).cast::<i64>().read_unaligned());
                        rows03 = D::dot_acc(rows03, a[2 * p], _mm256_sign_epi8(x, w[2 * p]));
                        rows47 = D::dot_acc(rows47, a[2 * p + 1], _mm256_sign_epi8(x, w[2 * p + 1]));
                    }
                    let sums = _mm256_cvtepi32_ps(_mm256_hadd_epi32(rows03, rows47));
                    let dx = _mm256_set1_ps(*xs[i].d.get_unchecked(b));
                    acc[i] = _mm256_fmadd_ps(sums, _mm256_mul_ps(d, dx), acc[i]);
                }
            }
            std::array::from_fn(|i| by_row(acc[i]))
        }
    }
}
