//! [`dequantize`]: whole blocks of any [`QuantType`] to `f32`, bit-exact with ggml's reference
//! dequantization (and the gguf Python package's `gguf.quants.dequantize`).

use super::blocks::Decoded;
use super::types::QuantType;
use crate::dispatch::CpuKernel;
#[cfg(target_arch = "x86_64")]
use crate::dispatch::Isa;
use crate::error::{Error, Result};
use half::bf16;

/// Dequantizes `src` (whole blocks of type `t`) into `dst` (`dst.len() == blocks * block_elems`),
/// bit-exact with ggml's / the gguf Python package's dequantization: each element is computed
/// with the same `f32` operations in the same order (`f16` scales widened exactly, then e.g.
/// `(d * scale) * q - (dmin * min)` for Q4_K). `F32` and `BF16` elements are copied bit for bit;
/// `F16` elements are widened exactly (a NaN stays a NaN, its payload may differ).
///
/// Errors: [`Error::NotWholeBlocks`] if `src` is not a whole number of blocks;
/// [`Error::QuantLength`] if `dst` does not hold as many elements as those blocks.
pub fn dequantize(t: QuantType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let (bb, be) = (t.block_bytes(), t.block_elems());
    if !src.len().is_multiple_of(bb) {
        return Err(Error::NotWholeBlocks { ty: t.name(), operand: "src", len: src.len(), block: bb, unit: "bytes" });
    }
    let expected = src.len() / bb * be;
    if dst.len() != expected {
        return Err(Error::QuantLength { ty: t.name(), operand: "dst", unit: "elements", expected, got: dst.len() });
    }
    dequantize_unchecked(CpuKernel::current(), t, src, dst);
    Ok(())
}

/// [`dequantize`] of a [`QuantPart`](super::QuantPart)'s rows of `k` elements, stored in any
/// [`RowLayout`](super::RowLayout) (put back in ggml's order first): `rows * k` values.
///
/// Errors: as [`dequantize`], and a part whose bytes are not `rows` rows of `k` elements.
pub fn dequantize_part(part: &super::QuantPart<'_>, k: usize) -> Result<Vec<f32>> {
    let t = part.t;
    let row_bytes = t.row_bytes(k).ok_or(Error::NotWholeBlocks {
        ty: t.name(),
        operand: "k",
        len: k,
        block: t.block_elems(),
        unit: "elements",
    })?;
    if part.w.len() != part.rows * row_bytes {
        return Err(Error::QuantLength {
            ty: t.name(),
            operand: "w",
            unit: "bytes",
            expected: part.rows * row_bytes,
            got: part.w.len(),
        });
    }
    let mut ggml = vec![0u8; part.w.len()];
    super::interleave::to_ggml(t, part.layout, part.w, row_bytes, &mut ggml);
    let mut out = vec![0f32; part.rows * k];
    dequantize(t, &ggml, &mut out)?;
    Ok(out)
}

/// [`dequantize`] without the checks: `src` holds whole blocks and `dst` their elements. Compiled
/// twice, for the baseline and for AVX2 + F16C (the same operations, vectorised; the values are
/// the same bits either way), as `kernel` allows (the caller's [`CpuKernel`], which pool tasks
/// carry over).
pub(crate) fn dequantize_unchecked(kernel: CpuKernel, t: QuantType, src: &[u8], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if kernel.f32_isa() != Isa::Portable {
        // SAFETY: the AVX2 and AVX-512 families require AVX2, FMA and F16C (dispatch).
        return unsafe { dequantize_avx2(t, src, dst) };
    }
    dequantize_body(t, src, dst, &f16s_portable)
}

/// [`dequantize_body`] compiled for AVX2 and F16C.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequantize_avx2(t: QuantType, src: &[u8], dst: &mut [f32]) {
    // SAFETY: this function's target features include F16C.
    dequantize_body(t, src, dst, &|src, dst| unsafe { f16s_f16c(src, dst) })
}

/// `f16` elements widened one at a time.
fn f16s_portable(src: &[u8], dst: &mut [f32]) {
    for (o, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *o = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
    }
}

/// `f16` elements widened 8 at a time with `vcvtph2ps`.
///
/// # Safety
/// The CPU must have F16C and AVX.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn f16s_f16c(src: &[u8], dst: &mut [f32]) {
    use std::arch::x86_64::{_mm_loadu_si128, _mm256_cvtph_ps, _mm256_storeu_ps};
    let main = dst.len() / 8 * 8;
    let (dst_main, dst_tail) = dst.split_at_mut(main);
    let (src_main, src_tail) = src.split_at(2 * main);
    for (s, d) in src_main.chunks_exact(16).zip(dst_main.chunks_exact_mut(8)) {
        // SAFETY: `s` holds 16 bytes (8 `f16`) and `d` 8 `f32`; the caller guarantees F16C.
        unsafe { _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(_mm_loadu_si128(s.as_ptr().cast()))) };
    }
    f16s_portable(src_tail, dst_tail);
}

/// The conversion itself; `f16s` widens a run of `f16` elements (the one step that needs
/// instruction-set specific code to be fast).
#[inline(always)]
fn dequantize_body(t: QuantType, src: &[u8], dst: &mut [f32], f16s: &impl Fn(&[u8], &mut [f32])) {
    match t {
        QuantType::F32 => {
            for (o, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        QuantType::F16 => f16s(src, dst),
        QuantType::BF16 => {
            for (o, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
            }
        }
        // One loop per type (the decoder inlined with its type a constant).
        QuantType::Q4_0 => blocks(QuantType::Q4_0, src, dst),
        QuantType::Q4_1 => blocks(QuantType::Q4_1, src, dst),
        QuantType::Q5_0 => blocks(QuantType::Q5_0, src, dst),
        QuantType::Q5_1 => blocks(QuantType::Q5_1, src, dst),
        QuantType::Q8_0 => blocks(QuantType::Q8_0, src, dst),
        QuantType::Q2K => blocks(QuantType::Q2K, src, dst),
        QuantType::Q3K => blocks(QuantType::Q3K, src, dst),
        QuantType::Q4K => blocks(QuantType::Q4K, src, dst),
        QuantType::Q5K => blocks(QuantType::Q5K, src, dst),
        QuantType::Q6K => blocks(QuantType::Q6K, src, dst),
        QuantType::Mxfp4 => blocks(QuantType::Mxfp4, src, dst),
    }
}

/// The blocks of the quantized type `t`, one after the other.
#[inline(always)]
fn blocks(t: QuantType, src: &[u8], dst: &mut [f32]) {
    let mut d = Decoded::new();
    for (block, out) in src.chunks_exact(t.block_bytes()).zip(dst.chunks_exact_mut(t.block_elems())) {
        d.decode(t, block);
        d.dequantize(out);
    }
}

/// Dequantizes whole blocks of `t` (any type) into `bf16`, rounding each `f32` value of
/// [`dequantize`] to nearest even (`BF16` elements are copied exactly). For the GEMM tiles of
/// `quant_matmul`; compiled for AVX2 too, like [`dequantize_unchecked`].
pub(crate) fn dequantize_bf16_unchecked(kernel: CpuKernel, t: QuantType, src: &[u8], dst: &mut [bf16]) {
    #[cfg(target_arch = "x86_64")]
    if kernel.f32_isa() != Isa::Portable {
        // SAFETY: the AVX2 and AVX-512 families require AVX2, FMA and F16C (dispatch).
        return unsafe { dequantize_bf16_avx2(t, src, dst) };
    }
    dequantize_bf16_body(t, src, dst, &f16s_portable)
}

/// [`dequantize_bf16_body`] compiled for AVX2 and F16C.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequantize_bf16_avx2(t: QuantType, src: &[u8], dst: &mut [bf16]) {
    // SAFETY: this function's target features include F16C.
    dequantize_bf16_body(t, src, dst, &|src, dst| unsafe { f16s_f16c(src, dst) })
}

/// 256 elements at a time through an `f32` buffer.
#[inline(always)]
fn dequantize_bf16_body(t: QuantType, src: &[u8], dst: &mut [bf16], f16s: &impl Fn(&[u8], &mut [f32])) {
    if t == QuantType::BF16 {
        for (o, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
            *o = bf16::from_bits(u16::from_le_bytes([b[0], b[1]]));
        }
        return;
    }
    let elems = 256;
    let bytes = elems / t.block_elems() * t.block_bytes();
    let mut wide = [0f32; 256];
    for (src, dst) in src.chunks(bytes).zip(dst.chunks_mut(elems)) {
        let wide = &mut wide[..dst.len()];
        dequantize_body(t, src, wide, f16s);
        for (o, &v) in dst.iter_mut().zip(wide.iter()) {
            *o = to_bf16(v);
        }
    }
}

/// `v` rounded to the nearest `bf16`, ties to even (NaNs stay NaNs), without branches so that it
/// vectorises: the same values as `half::bf16::from_f32`.
#[inline(always)]
fn to_bf16(v: f32) -> bf16 {
    let b = v.to_bits();
    let rounded = (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
    let nan = ((b >> 16) as u16) | 0x0040;
    bf16::from_bits(if v.is_nan() { nan } else { rounded })
}
