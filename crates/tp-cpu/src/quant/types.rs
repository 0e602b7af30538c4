//! [`QuantType`]: the weight formats of [`crate::quant`], with ggml's type numbers, names and
//! block sizes.

/// The block formats tp runs: llama.cpp's ggml layouts, little-endian, byte-exact with ggml (the
/// byte layout of each block is in `blocks`). `F32`, `F16` and `BF16` are plain elements ("blocks"
/// of one element).
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    BF16,
    /// 32 elements: f16 scale `d`, 4-bit codes `q`; `d * (q - 8)`.
    Q4_0,
    /// 32 elements: f16 `d` and `m`, 4-bit codes; `d * q + m`.
    Q4_1,
    /// 32 elements: f16 `d`, 5-bit codes (low 4 bits packed, 5th bits in a 32-bit mask);
    /// `d * (q - 16)`.
    Q5_0,
    /// 32 elements: f16 `d` and `m`, 5-bit codes; `d * q + m`.
    Q5_1,
    /// 32 elements: f16 `d`, signed 8-bit codes; `d * q`.
    Q8_0,
    /// 256 elements: 16 groups of 16 with 4-bit scales and mins, 2-bit codes.
    Q2K,
    /// 256 elements: 16 groups of 16 with 6-bit signed scales, 3-bit codes.
    Q3K,
    /// 256 elements: 8 groups of 32 with 6-bit scales and mins, 4-bit codes.
    Q4K,
    /// 256 elements: 8 groups of 32 with 6-bit scales and mins, 5-bit codes.
    Q5K,
    /// 256 elements: 16 groups of 16 with signed 8-bit scales, 6-bit codes.
    Q6K,
    /// 32 elements: an E8M0 scale byte `e` (a power of two), 4-bit FP4 (E2M1) codes; ggml's
    /// `2^(e-128) · kvalues[q]` with `kvalues = ±{0, 1, 2, 3, 4, 6, 8, 12}` (OCP MX FP4, as
    /// gpt-oss ships its experts).
    Mxfp4,
}

impl QuantType {
    /// Every type, in declaration order.
    pub const ALL: [QuantType; 14] = [
        QuantType::F32,
        QuantType::F16,
        QuantType::BF16,
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q5_0,
        QuantType::Q5_1,
        QuantType::Q8_0,
        QuantType::Q2K,
        QuantType::Q3K,
        QuantType::Q4K,
        QuantType::Q5K,
        QuantType::Q6K,
        QuantType::Mxfp4,
    ];

    /// ggml's type number (`GGML_TYPE_*`), as GGUF files store it.
    pub const fn ggml_id(self) -> u32 {
        match self {
            QuantType::F32 => 0,
            QuantType::F16 => 1,
            QuantType::Q4_0 => 2,
            QuantType::Q4_1 => 3,
            QuantType::Q5_0 => 6,
            QuantType::Q5_1 => 7,
            QuantType::Q8_0 => 8,
            QuantType::Q2K => 10,
            QuantType::Q3K => 11,
            QuantType::Q4K => 12,
            QuantType::Q5K => 13,
            QuantType::Q6K => 14,
            QuantType::BF16 => 30,
            QuantType::Mxfp4 => 39,
        }
    }

    /// The type with ggml's type number `id`, if tp runs it.
    pub fn from_ggml_id(id: u32) -> Option<QuantType> {
        QuantType::ALL.into_iter().find(|t| t.ggml_id() == id)
    }

    /// ggml's name of the type (`"Q4_0"`, `"Q6_K"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            QuantType::F32 => "F32",
            QuantType::F16 => "F16",
            QuantType::BF16 => "BF16",
            QuantType::Q4_0 => "Q4_0",
            QuantType::Q4_1 => "Q4_1",
            QuantType::Q5_0 => "Q5_0",
            QuantType::Q5_1 => "Q5_1",
            QuantType::Q8_0 => "Q8_0",
            QuantType::Q2K => "Q2_K",
            QuantType::Q3K => "Q3_K",
            QuantType::Q4K => "Q4_K",
            QuantType::Q5K => "Q5_K",
            QuantType::Q6K => "Q6_K",
            QuantType::Mxfp4 => "MXFP4",
        }
    }

    /// Elements per block: 1 for the float types, 32 for the legacy quants, 256 for the K-quants.
    pub const fn block_elems(self) -> usize {
        match self {
            QuantType::F32 | QuantType::F16 | QuantType::BF16 => 1,
            QuantType::Q4_0
            | QuantType::Q4_1
            | QuantType::Q5_0
            | QuantType::Q5_1
            | QuantType::Q8_0
            | QuantType::Mxfp4 => 32,
            QuantType::Q2K | QuantType::Q3K | QuantType::Q4K | QuantType::Q5K | QuantType::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            QuantType::F32 => 4,
            QuantType::F16 | QuantType::BF16 => 2,
            QuantType::Q4_0 => 18,
            QuantType::Q4_1 => 20,
            QuantType::Q5_0 => 22,
            QuantType::Q5_1 => 24,
            QuantType::Q8_0 => 34,
            QuantType::Q2K => 84,
            QuantType::Q3K => 110,
            QuantType::Q4K => 144,
            QuantType::Q5K => 176,
            QuantType::Q6K => 210,
            QuantType::Mxfp4 => 17,
        }
    }

    /// Bytes of a row of `elems` elements: `None` unless `elems` is a whole number of blocks (or
    /// if the size overflows `usize`).
    pub fn row_bytes(self, elems: usize) -> Option<usize> {
        if !elems.is_multiple_of(self.block_elems()) {
            return None;
        }
        (elems / self.block_elems()).checked_mul(self.block_bytes())
    }

    /// Whether the type is one of the K-quants (256-element super-blocks, Q8_K activations).
    pub(crate) const fn is_k_quant(self) -> bool {
        matches!(self, QuantType::Q2K | QuantType::Q3K | QuantType::Q4K | QuantType::Q5K | QuantType::Q6K)
    }

    /// Whether the type is a plain float format.
    pub(crate) const fn is_float(self) -> bool {
        matches!(self, QuantType::F32 | QuantType::F16 | QuantType::BF16)
    }
}

impl std::fmt::Display for QuantType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
