//! [`QuantFormat`]: the ggml block-quantized weight formats the CUDA quant kernels take
//! (`kernels/quant_blocks.cuh`), named by their `GGML_TYPE_*` ids. A leaf module: the
//! kernel-name table ([`crate::kernels`]) and the launchers both use it.

use crate::error::{KernelError, Result};

/// One ggml block format: `block_elems` weights stored in `block_bytes` bytes (llama.cpp's
/// layout, byte for byte). A row of `k` weights is `k / block_elems` whole blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QuantFormat {
    id: u32,
    name: &'static str,
    kernel: &'static str,
    block_elems: usize,
    block_bytes: usize,
}

const fn format(id: u32, name: &'static str, kernel: &'static str, elems: usize, bytes: usize) -> QuantFormat {
    QuantFormat { id, name, kernel, block_elems: elems, block_bytes: bytes }
}

/// Every format with CUDA kernels, in ggml id order.
pub const QUANT_FORMATS: [QuantFormat; 10] = [
    format(2, "Q4_0", "q4_0", 32, 18),
    format(3, "Q4_1", "q4_1", 32, 20),
    format(6, "Q5_0", "q5_0", 32, 22),
    format(7, "Q5_1", "q5_1", 32, 24),
    format(8, "Q8_0", "q8_0", 32, 34),
    format(10, "Q2_K", "q2_k", 256, 84),
    format(11, "Q3_K", "q3_k", 256, 110),
    format(12, "Q4_K", "q4_k", 256, 144),
    format(13, "Q5_K", "q5_k", 256, 176),
    format(14, "Q6_K", "q6_k", 256, 210),
];

impl QuantFormat {
    /// The format with this `GGML_TYPE_*` id, or [`KernelError::UnsupportedQuantType`] for an id
    /// with no CUDA kernels (F32, F16, BF16 and the IQ/TQ formats among them).
    pub fn from_ggml_id(id: u32) -> Result<QuantFormat> {
        QUANT_FORMATS.iter().copied().find(|f| f.id == id).ok_or(KernelError::UnsupportedQuantType { id })
    }
    /// The `GGML_TYPE_*` id.
    pub fn ggml_id(self) -> u32 {
        self.id
    }
    /// ggml's name ("Q4_0", ..., "Q6_K").
    pub fn name(self) -> &'static str {
        self.name
    }
    /// Weights per block: 32 (Q4_0..Q8_0) or 256 (the K-quants).
    pub fn block_elems(self) -> usize {
        self.block_elems
    }
    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        self.block_bytes
    }
    /// Bytes of a row of `k` weights, `None` unless `k` is a multiple of the block size (or on
    /// overflow).
    pub fn row_bytes(self, k: usize) -> Option<usize> {
        (k % self.block_elems == 0).then(|| (k / self.block_elems).checked_mul(self.block_bytes)).flatten()
    }
    /// The suffix the format's kernel functions carry (`q4_0`, `q2_k`...).
    pub(crate) fn kernel_name(self) -> &'static str {
        self.kernel
    }
    /// Units (8 weights each, one thread's work at a time) per block, as the kernels split it.
    pub(crate) fn units(self) -> usize {
        self.block_elems / 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_matches_ggml() {
        // (id, name, elems, bytes) from the field lists of ggml-common.h's block structs.
        const K: usize = 256;
        let want = [
            (2, "Q4_0", 32, 2 + 32 / 2),
            (3, "Q4_1", 32, 2 * 2 + 32 / 2),
            (6, "Q5_0", 32, 2 + 4 + 32 / 2),
            (7, "Q5_1", 32, 2 * 2 + 4 + 32 / 2),
            (8, "Q8_0", 32, 2 + 32),
            (10, "Q2_K", K, 2 * 2 + K / 16 + K / 4),
            (11, "Q3_K", K, 2 + K / 4 + K / 8 + 12),
            (12, "Q4_K", K, 2 * 2 + 12 + K / 2),
            (13, "Q5_K", K, 2 * 2 + 12 + K / 2 + K / 8),
            (14, "Q6_K", K, 2 + K / 16 + 3 * K / 4),
        ];
        assert_eq!(want.len(), QUANT_FORMATS.len());
        for (id, name, elems, bytes) in want {
            let f = QuantFormat::from_ggml_id(id).unwrap();
            assert_eq!((f.ggml_id(), f.name(), f.block_elems(), f.block_bytes()), (id, name, elems, bytes));
            assert_eq!(f.kernel_name(), name.to_lowercase());
        }
        assert_eq!(QuantFormat::from_ggml_id(12).unwrap().row_bytes(4096), Some(16 * 144));
        assert_eq!(QuantFormat::from_ggml_id(2).unwrap().row_bytes(48), None);
        for id in [0, 1, 4, 5, 9, 15, 16, 30, u32::MAX] {
            assert_eq!(QuantFormat::from_ggml_id(id), Err(KernelError::UnsupportedQuantType { id }));
        }
    }
}
