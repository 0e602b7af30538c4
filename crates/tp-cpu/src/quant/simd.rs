//! The x86 building blocks of the integer dot products: [`Dot`], the two ways to multiply 32
//! unsigned 8-bit weight codes by 32 signed 8-bit activations and sum them in groups of four
//! (AVX2: `vpmaddubsw` + `vpmaddwd`; AVX512-VNNI: `vpdpbusd`),
//! and the helpers the kernels share (nibble unpacking, `f16` scales, horizontal sums).
//!
//! Everything here is `#[inline(always)]` without target features of its own: it is compiled
//! into the `#[target_feature]` entry points of `dot_x86`, which guarantee the instructions. The
//! weight codes handed to [`Dot`] are at most 128 (`vpmaddubsw` adds two products of at most
//! `128 * 127` in 16 bits without saturating) and the activations at most 127 in magnitude.

use std::arch::x86_64::*;

/// An 8-bit dot-product instruction set. Lanes: 8 `i32`, lane `l` covering bytes `4l..4l+4`.
pub(crate) trait Dot {
    /// Lane `l` = `Σ_{j<4} u[4l+j] x[4l+j]` (`u` unsigned, `x` signed).
    ///
    /// # Safety
    /// The CPU must have the implementation's instructions (the caller's target features).
    unsafe fn dot(u: __m256i, x: __m256i) -> __m256i;
    /// `acc` plus [`Dot::dot`] (one instruction with VNNI).
    ///
    /// # Safety
    /// As [`Dot::dot`].
    #[inline(always)]
    unsafe fn dot_acc(acc: __m256i, u: __m256i, x: __m256i) -> __m256i {
        // SAFETY: as `dot`, plus AVX2 for the add (every implementation's caller has it).
        unsafe { _mm256_add_epi32(acc, Self::dot(u, x)) }
    }
    /// Byte `j` = `0xFF` where bit `j` of `bits` is set, else 0.
    ///
    /// # Safety
    /// As [`Dot::dot`].
    unsafe fn byte_mask(bits: u32) -> __m256i;
}

/// AVX2: `vpmaddubsw` (pairs, 16 bits) then `vpmaddwd` (pairs of pairs, 32 bits).
pub(crate) struct Avx2;

/// AVX512-VNNI with VL and BW, 256-bit forms.
pub(crate) struct Vnni;

impl Dot for Avx2 {
    #[inline(always)]
    unsafe fn dot(u: __m256i, x: __m256i) -> __m256i {
        // SAFETY: the caller's target features include AVX2.
        unsafe { _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)) }
    }

    #[inline(always)]
    unsafe fn byte_mask(bits: u32) -> __m256i {
        // SAFETY: as above.
        unsafe {
            // Byte j takes byte j / 8 of `bits`, then keeps bit j % 8.
            let v = _mm256_set1_epi32(bits as i32);
            let spread = _mm256_setr_epi64x(0, 0x0101_0101_0101_0101, 0x0202_0202_0202_0202, 0x0303_0303_0303_0303);
            let v = _mm256_shuffle_epi8(v, spread);
            let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
            _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit)
        }
    }
}

impl Dot for Vnni {
    #[inline(always)]
    unsafe fn dot(u: __m256i, x: __m256i) -> __m256i {
        // SAFETY: the caller's target features include AVX512-VNNI and AVX512-VL.
        unsafe { _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x) }
    }

    #[inline(always)]
    unsafe fn dot_acc(acc: __m256i, u: __m256i, x: __m256i) -> __m256i {
        // SAFETY: as above.
        unsafe { _mm256_dpbusd_epi32(acc, u, x) }
    }

    #[inline(always)]
    unsafe fn byte_mask(bits: u32) -> __m256i {
        // SAFETY: the caller's target features include AVX512-BW and AVX512-VL.
        unsafe { _mm256_movm_epi8(bits) }
    }
}

/// `acc` plus, in lane `l`, `Σ_{j<2} sc[2l+j] (u[4l+2j] x[4l+2j] + u[4l+2j+1] x[4l+2j+1])`:
/// the pairs of products (`vpmaddubsw`, 16 bits) scaled by the 16-bit `sc` and summed in pairs
/// (`vpmaddwd`), the K-quants' group scales applied on the way. (Not `vpdpwssd` where the CPU has
/// it: `vpaddd`'s one-cycle latency keeps a row's chain short; measured faster on Zen 4.)
///
/// # Safety
/// The CPU must have AVX2.
#[inline(always)]
pub(crate) unsafe fn dot_scaled(acc: __m256i, u: __m256i, x: __m256i, sc: __m256i) -> __m256i {
    // SAFETY: as stated.
    unsafe { _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), sc)) }
}

/// 32 bytes at `p`.
///
/// # Safety
/// `p..p + 32` must be readable.
#[inline(always)]
pub(crate) unsafe fn load(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees the 32 bytes; the load is unaligned.
    unsafe { _mm256_loadu_si256(p.cast()) }
}

/// The 32 activations at `p`.
///
/// # Safety
/// `p..p + 32` must be readable.
#[inline(always)]
pub(crate) unsafe fn load_x(p: *const i8) -> __m256i {
    // SAFETY: as [`load`].
    unsafe { load(p.cast()) }
}

/// The 16 bytes at `p` split into 32 nibbles: bytes 0..16 the low nibbles, 16..32 the high ones
/// (the legacy types' element order).
///
/// # Safety
/// `p..p + 16` must be readable; the CPU must have AVX2.
#[inline(always)]
pub(crate) unsafe fn nibbles16(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees the 16 bytes and AVX2.
    unsafe {
        let v = _mm_loadu_si128(p.cast());
        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(v), v), _mm256_set1_epi8(0x0F))
    }
}

/// The `n <= 8` little-endian `f16` values at `p`, `p + stride`, ... widened to `f32` (lanes
/// `n..8` zero).
///
/// # Safety
/// The two bytes at each `p + i * stride`, `i < n`, must be readable; the CPU must have AVX2 and
/// F16C.
#[inline(always)]
pub(crate) unsafe fn f16x8(p: *const u8, stride: usize, n: usize) -> __m256 {
    // SAFETY: the reads stay at the `n` places the caller guarantees.
    unsafe {
        let at = |i: usize| p.add(i * stride).cast::<u16>().read_unaligned() as i16;
        let h = if n == 8 {
            // Four values per 64-bit word, assembled in general registers (spare on every x86
            // core) rather than with eight dependent `vpinsrw`.
            let four = |i: usize| (0..4).fold(0u64, |w, j| w | u64::from(at(i + j) as u16) << (16 * j)) as i64;
            _mm_set_epi64x(four(4), four(0))
        } else {
            let mut h = [0i16; 8];
            for (i, h) in h.iter_mut().enumerate().take(n) {
                *h = at(i);
            }
            _mm_loadu_si128(h.as_ptr().cast())
        };
        _mm256_cvtph_ps(h)
    }
}

/// The `f16` at `p`, widened.
///
/// # Safety
/// `p..p + 2` must be readable; the CPU must have F16C.
#[inline(always)]
pub(crate) unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: as stated.
    unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(p.cast::<u16>().read_unaligned())))) }
}

/// The `n <= 8` `f32` at `p` (lanes `n..8` zero).
///
/// # Safety
/// `p..p + n` must be readable; the CPU must have AVX2.
#[inline(always)]
pub(crate) unsafe fn load_f32(p: *const f32, n: usize) -> __m256 {
    // SAFETY: a full load when all 8 are there, else a masked load of the first `n`.
    unsafe {
        if n == 8 {
            _mm256_loadu_ps(p)
        } else {
            let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), lane))
        }
    }
}

/// The sum of the 8 lanes.
///
/// # Safety
/// The CPU must have AVX2.
#[inline(always)]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    // SAFETY: as stated.
    unsafe {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }
}

/// A byte-shuffle index that puts 16-bit word `lo` of each 128-bit lane in every word of the low
/// lane and word `hi` in every word of the high lane.
///
/// # Safety
/// The CPU must have AVX2.
#[inline(always)]
pub(crate) unsafe fn word_pick(lo: usize, hi: usize) -> __m256i {
    let w = |j: usize| (2 * j as i16) | ((2 * j as i16 + 1) << 8);
    // SAFETY: as stated.
    unsafe { _mm256_set_m128i(_mm_set1_epi16(w(hi)), _mm_set1_epi16(w(lo))) }
}
