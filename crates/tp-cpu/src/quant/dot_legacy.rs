//! x86 dot products of the legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and MXFP4; blocks of 32)
//! with Q8_0 activations.
//!
//! A block's codes are unpacked to 32 unsigned bytes `u` (nibbles, plus the 5th bit for Q5) and
//! multiplied by the block's 32 activation codes with [`Dot::dot`]. The signed value of a code is
//! `u - offset` (8 for Q4_0, 16 for Q5_0), so
//!
//! `Σ w x = d dx Σ u q_x + c dx Σ q_x`, with `c = -offset d` (Q4_0, Q5_0) or `c = m` (Q4_1, Q5_1),
//!
//! as llama.cpp's x86 kernels do it: the integer part per block, its float product with the
//! block's `d dx` accumulated in 8 lanes, and the second term `c (dx Σ q_x)` 8 blocks at a time
//! (the activations keep `dx Σ q_x` per block). Q8_0's signed codes go through the sign trick
//! instead: `|w|` times `x` with `w`'s sign. MXFP4's codes are looked up from its nibbles in a
//! 16-entry byte table (`pshufb`) already offset by 12 (`kvalues + 12`, unsigned, 0..24), so they
//! take the unsigned path with offset 12 (no sign trick), its E8M0 scale byte widened to
//! `2^(e-128)`.
//!
//! Scales are read 8 blocks at a time (8 `f16` at the block stride, one `vcvtph2ps`) and
//! multiplied by the 8 activation scales, for all `M` activation rows, ahead of the dots (see
//! [`row`]); each block is unpacked once and dotted with every activation row.

use super::act::XRow;
use super::blocks::{MXFP4_QS, MXFP4_VALUES, Q4_0_QS, Q4_1_QS, Q5_0_QH, Q5_0_QS, Q5_1_QH, Q5_1_QS, Q8_0_QS, e8m0_half};
use super::simd::{Dot, f16x8, hsum, load, load_f32, load_x, nibbles16};
use std::arch::x86_64::*;

/// One legacy type: its block size, where its codes are, how its offset enters.
pub(crate) trait Legacy {
    /// Bytes per block.
    const BYTES: usize;
    /// Whether the block has an `f16` `m` at byte 2 (Q4_1, Q5_1).
    const HAS_MIN: bool;
    /// The code offset (8 for Q4_0, 16 for Q5_0), else 0.
    const OFFSET: f32;

    /// The 32 codes of the block at `p`, as unsigned bytes (Q8_0: its signed bytes).
    ///
    /// # Safety
    /// `p` must point at a whole block; the CPU must have `D`'s instructions and AVX2.
    unsafe fn codes<D: Dot>(p: *const u8) -> __m256i;

    /// The 8 lanes of `Σ codes * x`.
    ///
    /// # Safety
    /// As [`Dot::dot`].
    #[inline(always)]
    unsafe fn dot<D: Dot>(codes: __m256i, x: __m256i) -> __m256i {
        // SAFETY: the caller guarantees `D`'s instructions.
        unsafe { D::dot(codes, x) }
    }

    /// The scales `d` of the `n <= 8` blocks at `p`, `p + BYTES`, ... (lanes `n..8` zero): the
    /// `f16` at each block's start.
    ///
    /// # Safety
    /// The blocks must be readable; the CPU must have AVX2 and F16C.
    #[inline(always)]
    unsafe fn scales(p: *const u8, n: usize) -> __m256 {
        // SAFETY: the caller guarantees the bytes and the instructions.
        unsafe { f16x8(p, Self::BYTES, n) }
    }
}

pub(crate) struct Q40;
pub(crate) struct Q41;
pub(crate) struct Q50;
pub(crate) struct Q51;
pub(crate) struct Q80;
pub(crate) struct Mxfp4;

impl Legacy for Q40 {
    const BYTES: usize = 18;
    const HAS_MIN: bool = false;
    const OFFSET: f32 = 8.0;
    #[inline(always)]
    unsafe fn codes<D: Dot>(p: *const u8) -> __m256i {
        // SAFETY: the 16 nibble bytes are inside the block.
        unsafe { nibbles16(p.add(Q4_0_QS)) }
    }
}

impl Legacy for Q41 {
    const BYTES: usize = 20;
    const HAS_MIN: bool = true;
    const OFFSET: f32 = 0.0;
    #[inline(always)]
    unsafe fn codes<D: Dot>(p: *const u8) -> __m256i {
        // SAFETY: as above.
        unsafe { nibbles16(p.add(Q4_1_QS)) }
    }
}

/// Nibbles at `qs` with the 5th bits of the `u32` at `qh`.
///
/// # Safety
/// Both fields inside the block at `p`; `D`'s instructions and AVX2.
#[inline(always)]
unsafe fn five_bits<D: Dot>(p: *const u8, qh: usize, qs: usize) -> __m256i {
    // SAFETY: the caller guarantees the fields and the instructions.
    unsafe {
        let high = D::byte_mask(p.add(qh).cast::<u32>().read_unaligned());
        _mm256_or_si256(nibbles16(p.add(qs)), _mm256_and_si256(high, _mm256_set1_epi8(0x10)))
    }
}

impl Legacy for Q50 {
    const BYTES: usize = 22;
    const HAS_MIN: bool = false;
    const OFFSET: f32 = 16.0;
    #[inline(always)]
    unsafe fn codes<D: Dot>(p: *const u8) -> __m256i {
        // SAFETY: as [`five_bits`].
        unsafe { five_bits::<D>(p, Q5_0_QH, Q5_0_QS) }
    }
}

impl Legacy for Q51 {
    const BYTES: usize = 24;
    const HAS_MIN: bool = true;
    const OFFSET: f32 = 0.0;
    #[inline(always)]
    unsafe fn codes<D: Dot>(p: *const u8) -> __m256i {
        // SAFETY: as [`five_bits`].
        unsafe { five_bits::<D>(p, Q5_1_QH, Q5_1_QS) }
    }
}

impl Legacy for Q80 {
    const BYTES: usize = 34;
    const HAS_MIN: bool = false;
    const OFFSET: f32 = 0.0;
    #[inline(always)]
    unsafe fn codes<D: Dot>(p: *const u8) -> __m256i {
        // SAFETY: the 32 code bytes are inside the block.
        unsafe { load(p.add(Q8_0_QS)) }
    }
    #[inline(always)]
    unsafe fn dot<D: Dot>(codes: __m256i, x: __m256i) -> __m256i {
        // SAFETY: the caller guarantees `D`'s instructions (AVX2 included).
        unsafe { D::dot(_mm256_abs_epi8(codes), _mm256_sign_epi8(x, codes)) }
    }
}

/// MXFP4's code values plus [`Mxfp4::OFFSET`]: unsigned bytes (0..24) for the unsigned dot.
pub(crate) const MXFP4_UNSIGNED: [u8; 16] = {
    let mut t = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = (MXFP4_VALUES[i] + 12) as u8;
        i += 1;
    }
    t
};

impl Legacy for Mxfp4 {
    const BYTES: usize = 17;
    const HAS_MIN: bool = false;
    const OFFSET: f32 = 12.0;
    #[inline(always)]
    unsafe fn codes<D: Dot>(p: *const u8) -> __m256i {
        // SAFETY: the 16 nibble bytes are inside the block; AVX2 as the caller guarantees.
        unsafe {
            let table = _mm_loadu_si128(MXFP4_UNSIGNED.as_ptr().cast());
            _mm256_shuffle_epi8(_mm256_set_m128i(table, table), nibbles16(p.add(MXFP4_QS)))
        }
    }
    #[inline(always)]
    unsafe fn scales(p: *const u8, n: usize) -> __m256 {
        let mut d = [0f32; 8];
        for (i, d) in d.iter_mut().enumerate().take(n) {
            // SAFETY: block `i < n` is readable, as the caller guarantees.
            *d = e8m0_half(unsafe { p.add(i * Self::BYTES).read() });
        }
        // SAFETY: AVX as the caller guarantees; `d` holds 8 floats.
        unsafe { _mm256_loadu_ps(d.as_ptr()) }
    }
}

/// Blocks per pass (a multiple of 8): the scales of a pass stay on the stack, and its blocks in
/// L1 between the two passes (16 measured faster than 8 or 64 on this Zen 4, streaming from
/// memory, Q8_0 most: one thread 16 -> 20 GB/s against 64).
const PASS: usize = 16;

/// `Σ_e w[e] x_i[e]` for the weight row at `w` (`nb` blocks of `L`) and `M` activation rows.
///
/// The row goes in passes of [`PASS`] blocks: first the blocks' `d dx` for every activation row,
/// 8 blocks at a time, into a stack buffer (and the offset terms into their accumulators), then
/// the integer dots, each block's `f32` sum scaled by its `d dx` broadcast from that buffer.
/// Consecutive blocks go to different accumulators.
///
/// # Safety
/// `w` must hold `nb * L::BYTES` readable bytes; every `xs[i]` must have `32 nb` codes and `nb`
/// scales and sums; the CPU must have `D`'s instructions, AVX2, FMA and F16C.
#[inline(always)]
pub(crate) unsafe fn row<D: Dot, L: Legacy, const M: usize>(w: *const u8, nb: usize, xs: &[XRow<'_>; M]) -> [f32; M] {
    let has_c = L::HAS_MIN || L::OFFSET != 0.0;
    // SAFETY: every read below stays in the blocks `0..nb` of `w` and the first `nb` blocks of
    // each activation row, as the caller guarantees; the stores stay in `scale` (a pass has at
    // most `PASS` blocks, a multiple of 8); the instructions are the caller's.
    unsafe {
        // Independent accumulators per activation row: four for one row (the FMA latency would
        // otherwise bound a block to half its throughput), two for more.
        let chains = if M == 1 { 4 } else { 2 };
        let mut acc = [[_mm256_setzero_ps(); M]; 4];
        let mut corr = [_mm256_setzero_ps(); M];
        let mut scale = [[0f32; PASS]; M];
        for p0 in (0..nb).step_by(PASS) {
            let len = PASS.min(nb - p0);
            for g in (0..len).step_by(8) {
                let n = (len - g).min(8);
                let base = w.add((p0 + g) * L::BYTES);
                let dw = L::scales(base, n);
                let c = if L::HAS_MIN {
                    f16x8(base.add(2), L::BYTES, n)
                } else {
                    _mm256_mul_ps(dw, _mm256_set1_ps(-L::OFFSET))
                };
                for i in 0..M {
                    let dx = load_f32(xs[i].d.as_ptr().add(p0 + g), n);
                    _mm256_storeu_ps(scale[i].as_mut_ptr().add(g), _mm256_mul_ps(dw, dx));
                    if has_c {
                        corr[i] = _mm256_fmadd_ps(c, load_f32(xs[i].sx.as_ptr().add(p0 + g), n), corr[i]);
                    }
                }
            }
            for b in (0..len).step_by(chains) {
                for (c, acc) in acc.iter_mut().enumerate().take(chains) {
                    if b + c < len {
                        block::<D, L, M>(w, p0 + b + c, xs, &scale, b + c, acc);
                    }
                }
            }
        }
        let mut out = [0f32; M];
        for i in 0..M {
            let sum = _mm256_add_ps(_mm256_add_ps(acc[0][i], acc[1][i]), _mm256_add_ps(acc[2][i], acc[3][i]));
            out[i] = hsum(_mm256_add_ps(sum, corr[i]));
        }
        out
    }
}

/// Block `b` of the row at `w` into `acc`: its integer dots with each activation row, times
/// `scale[i][at]`.
///
/// # Safety
/// As [`row`], with `b < nb` and `at < PASS`.
#[inline(always)]
unsafe fn block<D: Dot, L: Legacy, const M: usize>(
    w: *const u8,
    b: usize,
    xs: &[XRow<'_>; M],
    scale: &[[f32; PASS]; M],
    at: usize,
    acc: &mut [__m256; M],
) {
    // SAFETY: block `b` is inside `w` and the activation rows, as the caller guarantees.
    unsafe {
        let u = L::codes::<D>(w.add(b * L::BYTES));
        for i in 0..M {
            let r = L::dot::<D>(u, load_x(xs[i].qs.as_ptr().add(b * 32)));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(r), _mm256_broadcast_ss(&scale[i][at]), acc[i]);
        }
    }
}
