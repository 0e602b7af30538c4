//! [`dequantize`]: whole blocks of any [`QuantType`] to `f32`, bit-exact with ggml's reference
//! dequantization (and the gguf Python package's `gguf.quants.dequantize`).

use super::blocks::Decoded;
use super::types::QuantType;
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

/// [`dequantize`] without the checks: `src` holds whole blocks and `dst` their elements.
pub(crate) fn dequantize_unchecked(t: QuantType, src: &[u8], dst: &mut [f32]) {
    match t {
        QuantType::F32 => {
            for (o, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        QuantType::F16 => {
            for (o, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
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
