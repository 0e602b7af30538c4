//! [`dequantize`]: whole blocks of any [`QuantType`] to `f32`, bit-exact with ggml's reference
//! dequantization (and the gguf Python package's `gguf.quants.dequantize`).

use super::blocks::Decoded;
use super::types::QuantType;
use crate::dispatch::CpuKernel;
#[cfg(target_arch = "x86_64")]
use crate::dispatch::Isa;
use crate::error::{Error, Result};

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
    dequantize_unchecked(t, src, dst);
    Ok(())
}

/// [`dequantize`] without the checks: `src` holds whole blocks and `dst` their elements. Compiled
/// twice, for the baseline and for AVX2 + F16C (the same operations, vectorised; the values are
/// the same bits either way), as the calling thread's [`CpuKernel`] allows.
pub(crate) fn dequantize_unchecked(t: QuantType, src: &[u8], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if CpuKernel::current().f32_isa() != Isa::Portable {
        // SAFETY: the AVX2 and AVX-512 families require AVX2, FMA and F16C (dispatch).
        return unsafe { dequantize_avx2(t, src, dst) };
    }
    dequantize_body(t, src, dst, |src, dst| {
        for (o, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
            *o = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
        }
    })
}

/// [`dequantize_body`] compiled for AVX2 and F16C.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequantize_avx2(t: QuantType, src: &[u8], dst: &mut [f32]) {
    dequantize_body(t, src, dst, |src, dst| {
        use std::arch::x86_64::{_mm_loadu_si128, _mm256_cvtph_ps, _mm256_storeu_ps};
        let main = dst.len() / 8 * 8;
        let (dst_main, dst_tail) = dst.split_at_mut(main);
        let (src_main, src_tail) = src.split_at(2 * main);
        for (s, d) in src_main.chunks_exact(16).zip(dst_main.chunks_exact_mut(8)) {
            // SAFETY: `s` holds 16 bytes (8 `f16`) and `d` 8 `f32`; F16C is enabled here.
            unsafe { _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(_mm_loadu_si128(s.as_ptr().cast()))) };
        }
        for (o, b) in dst_tail.iter_mut().zip(src_tail.chunks_exact(2)) {
            *o = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
        }
    })
}

/// The conversion itself; `f16s` widens a run of `f16` elements (the one step that needs
/// instruction-set specific code to be fast).
#[inline(always)]
fn dequantize_body(t: QuantType, src: &[u8], dst: &mut [f32], f16s: impl Fn(&[u8], &mut [f32])) {
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
        _ => {
            let mut d = Decoded::new();
            for (block, out) in src.chunks_exact(t.block_bytes()).zip(dst.chunks_exact_mut(t.block_elems())) {
                d.decode(t, block);
                d.dequantize(out);
            }
        }
    }
}
