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

/// This rank's part of Hub expert `i` kept as MXFP4 blocks (gpt-oss's
/// `gate_up_proj_blocks: [E, 2I, H / 32, 16]`, rows `2j` gate and `2j + 1` up, and
/// `down_proj_blocks: [E, H, I / 32, 16]`, with their scales and biases under `ld`): the
/// intermediate features whole (`whole`, expert parallelism over the tensor-parallel ranks)
/// or split in whole groups of 32 where each rank gets one, gate and up rows, down columns
/// (the blocks covering them). Nothing is dequantized: decode reads 4.25 bits a weight.
pub(crate) fn quantized_expert(
    ld: &crate::Loader<'_>,
    i: usize,
    (hidden, inter): (usize, usize),
    whole: bool,
    act: tp_core::Activation,
) -> Result<crate::ParallelMlp> {
    use crate::{Linear, MergedColumnParallel, RowParallel, Weight};
    use tp_core::{QuantWeight, TensorShard};
    let (rank, world) = (ld.rank(), ld.world_size());
    let s = if whole {
        crate::merged::whole_shard(inter, rank, world)?
    } else {
        crate::merged::aligned_shard(inter, GROUP, rank, world)?
    };
    let q = QuantType::Mxfp4;
    let entry = |name: &str, rows: usize, cols: usize| -> Result<Vec<u8>> {
        let codes = ld.u8_entry(&format!("{name}_blocks"), i)?;
        let scales = ld.u8_entry(&format!("{name}_scales"), i)?;
        ggml_blocks(&codes, &scales, rows, cols)
    };
    // Gate/up: rows `2j` and `2j + 1` of the interleaved `[2I, H]`, for this rank's features.
    let gate_up = entry("gate_up_proj", 2 * inter, hidden)?;
    let row_bytes = hidden / GROUP * q.block_bytes();
    let rows_of = |parity: usize| -> Result<Weight> {
        let mut bytes = Vec::with_capacity(s.len() * row_bytes);
        for j in s.start()..s.end() {
            let r = 2 * j + parity;
            bytes.extend_from_slice(&gate_up[r * row_bytes..(r + 1) * row_bytes]);
        }
        Ok(Weight::Quant(QuantWeight::new(q, s.len(), hidden, 0, hidden, bytes)?))
    };
    let bias = ld.rows("gate_up_proj_bias", i, 1)?.reshape(&[inter, 2])?;
    let bias_of = |parity: usize| -> Result<tp_core::Tensor> {
        Ok(bias.narrow(1, parity, 1)?.reshape(&[inter])?.narrow(0, s.start(), s.len())?)
    };
    let stacked = Weight::stack(vec![rows_of(0)?, rows_of(1)?])?;
    let bias = tp_core::Tensor::cat(&[bias_of(0)?, bias_of(1)?], 0)?;
    let gate_up = MergedColumnParallel::new(Linear::new(stacked, Some(bias))?, vec![s, s], ld.group())?;
    // Down: the blocks of `[H, I]` covering this rank's columns, on every row.
    let down = entry("down_proj", hidden, inter)?;
    let down_row = inter / GROUP * q.block_bytes();
    let (b0, b1) = (s.start() / GROUP, s.end().div_ceil(GROUP));
    let mut bytes = Vec::with_capacity(hidden * (b1 - b0) * q.block_bytes());
    for r in 0..hidden {
        bytes.extend_from_slice(&down[r * down_row + b0 * q.block_bytes()..r * down_row + b1 * q.block_bytes()]);
    }
    let k = (b1 - b0) * GROUP;
    let down_w = QuantWeight::new(q, hidden, k, s.start() - b0 * GROUP, s.len(), bytes)?;
    let down_b = ld.rows("down_proj_bias", i, 1)?.reshape(&[hidden])?;
    let cols = TensorShard::with_range(1, inter, rank, world, s.start(), s.len())?;
    let down = RowParallel::new(Weight::Quant(down_w), Some(down_b), cols, ld.group())?;
    crate::ParallelMlp::from_parts(gate_up, down, act)
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
