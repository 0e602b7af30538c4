//! gpt-oss's MXFP4 expert tensors as the Hub ships them: `*_blocks: [E, out, in / 32, 16]` (two
//! FP4 codes a byte, element `2j` in the low nibble of byte `j` and `2j + 1` in the high one)
//! and `*_scales: [E, out, in / 32]` (one E8M0 byte a group of 32: `2^(s - 127)`), each element
//! `fp4(q) · 2^(s - 127)` with `fp4 = ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}` (transformers'
//! `convert_moe_packed_tensors`).
//!
//! A group is repacked into ggml's MXFP4 block (the scale byte, then element `j` in the low and
//! `j + 16` in the high nibble of byte `j`; ggml's doubled codes times `2^(e - 128)` are the same
//! numbers), so that one decoder ([`tp_core::quant::dequantize`], checked bit for bit against
//! the gguf package) serves both formats.

use crate::error::{LayerError, Result};
use tp_core::quant::QuantType;

/// Elements per MXFP4 group, and the packed bytes of a group's codes.
const GROUP: usize = 32;
const PACKED: usize = 16;

/// The ggml MXFP4 blocks of one expert's `[rows, cols]` weight from its Hub `blocks` and
/// `scales` (rows, then groups, in order).
pub(crate) fn ggml_blocks(blocks: &[u8], scales: &[u8], rows: usize, cols: usize) -> Result<Vec<u8>> {
    let groups = cols / GROUP;
    if cols % GROUP != 0 || blocks.len() != rows * groups * PACKED || scales.len() != rows * groups {
        return Err(LayerError::Config(format!(
            "MXFP4 weight [{rows}, {cols}]: {} code bytes and {} scales (need in % 32 == 0, {} and {})",
            blocks.len(),
            scales.len(),
            rows * groups * PACKED,
            rows * groups
        )));
    }
    let mut out = Vec::with_capacity(scales.len() * QuantType::Mxfp4.block_bytes());
    for (packed, &scale) in blocks.chunks_exact(PACKED).zip(scales) {
        let mut codes = [0u8; GROUP];
        for (j, &b) in packed.iter().enumerate() {
            codes[2 * j] = b & 0x0F;
            codes[2 * j + 1] = b >> 4;
        }
        out.push(scale);
        out.extend((0..PACKED).map(|j| codes[j] | (codes[j + PACKED] << 4)));
    }
    Ok(out)
}

/// One expert's `[rows, cols]` weight in f32 from its Hub `blocks` and `scales`.
pub(crate) fn dequantize(blocks: &[u8], scales: &[u8], rows: usize, cols: usize) -> Result<Vec<f32>> {
    let ggml = ggml_blocks(blocks, scales, rows, cols)?;
    let mut out = vec![0f32; rows * cols];
    tp_core::quant::dequantize(QuantType::Mxfp4, &ggml, &mut out)
        .map_err(|e| LayerError::Config(format!("MXFP4 weight [{rows}, {cols}]: {e}")))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    /// transformers' `FP4_VALUES`, indexed by code.
    const FP4: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

    /// Every code in every position, scales across the E8M0 range, against transformers'
    /// element formula written out.
    #[test]
    fn hub_codes_decode_as_transformers_does() {
        let (rows, cols) = (3, 64);
        let blocks: Vec<u8> = (0..rows * cols / 2).map(|i| (i * 37 % 256) as u8).collect();
        let scales: Vec<u8> = (0..rows * cols / 32).map(|i| [127u8, 120, 130, 1, 200, 64][i % 6]).collect();
        let got = super::dequantize(&blocks, &scales, rows, cols).unwrap();
        for r in 0..rows {
            for c in 0..cols {
                let (g, j) = (c / 32, (c % 32) / 2);
                let b = blocks[(r * cols / 32 + g) * 16 + j];
                let code = if c % 2 == 0 { b & 15 } else { b >> 4 };
                let s = i32::from(scales[r * cols / 32 + g]) - 127;
                let want = FP4[usize::from(code)] * 2f32.powi(s);
                assert_eq!(got[r * cols + c], want, "row {r} col {c}");
            }
        }
        assert!(super::dequantize(&blocks, &scales, rows, 48).is_err());
        assert!(super::dequantize(&blocks[1..], &scales, rows, cols).is_err());
    }
}
