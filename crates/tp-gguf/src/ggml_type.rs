//! The ggml tensor types a GGUF file may name, by their number in the file: each type's name and
//! block (how many elements one block holds, how many bytes it takes), as `ggml.h` and the `gguf`
//! Python package (0.19.0: `GGMLQuantizationType`, `GGML_QUANT_SIZES`) define them. Numbers whose
//! types were removed from GGUF files (4, 5: Q4_2, Q4_3; 31..=33: Q4_0_4_4, Q4_0_4_8, Q4_0_8_8;
//! 36..=38: IQ4_NL_4_4, IQ4_NL_4_8, IQ4_NL_8_8) and numbers past the table are unknown.

/// A ggml tensor type, by its number in the file (`ggml_type` in `ggml.h`).
///
/// Any number can be held; [`GgmlType::name`] says whether this reader knows it. Every tensor of an
/// opened [`crate::GgufFile`] has a known type.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct GgmlType(pub u32);

/// One known type: its name, elements per block, bytes per block.
struct Entry(&'static str, usize, usize);

/// `QK_K`: the elements of one K-quant (and most IQ) block.
const QK_K: usize = 256;

/// The table, indexed by type number; `None` where a number has no type.
const TABLE: [Option<Entry>; 42] = [
    Some(Entry("F32", 1, 4)),
    Some(Entry("F16", 1, 2)),
    Some(Entry("Q4_0", 32, 2 + 16)),
    Some(Entry("Q4_1", 32, 2 + 2 + 16)),
    None, // Q4_2, removed
    None, // Q4_3, removed
    Some(Entry("Q5_0", 32, 2 + 4 + 16)),
    Some(Entry("Q5_1", 32, 2 + 2 + 4 + 16)),
    Some(Entry("Q8_0", 32, 2 + 32)),
    Some(Entry("Q8_1", 32, 4 + 4 + 32)),
    Some(Entry("Q2_K", QK_K, 2 + 2 + QK_K / 16 + QK_K / 4)),
    Some(Entry("Q3_K", QK_K, 2 + QK_K / 4 + QK_K / 8 + 12)),
    Some(Entry("Q4_K", QK_K, 2 + 2 + QK_K / 2 + 12)),
    Some(Entry("Q5_K", QK_K, 2 + 2 + QK_K / 2 + QK_K / 8 + 12)),
    Some(Entry("Q6_K", QK_K, 2 + QK_K / 2 + QK_K / 4 + QK_K / 16)),
    Some(Entry("Q8_K", QK_K, 4 + QK_K + QK_K / 8)),
    Some(Entry("IQ2_XXS", QK_K, 2 + QK_K / 4)),
    Some(Entry("IQ2_XS", QK_K, 2 + QK_K / 4 + QK_K / 32)),
    Some(Entry("IQ3_XXS", QK_K, 2 + QK_K / 4 + QK_K / 8)),
    Some(Entry("IQ1_S", QK_K, 2 + QK_K / 8 + QK_K / 16)),
    Some(Entry("IQ4_NL", 32, 2 + 16)),
    Some(Entry("IQ3_S", QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4)),
    Some(Entry("IQ2_S", QK_K, 2 + QK_K / 4 + QK_K / 16)),
    Some(Entry("IQ4_XS", QK_K, 2 + 2 + QK_K / 2 + QK_K / 64)),
    Some(Entry("I8", 1, 1)),
    Some(Entry("I16", 1, 2)),
    Some(Entry("I32", 1, 4)),
    Some(Entry("I64", 1, 8)),
    Some(Entry("F64", 1, 8)),
    Some(Entry("IQ1_M", QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32)),
    Some(Entry("BF16", 1, 2)),
    None, // Q4_0_4_4, removed from GGUF files
    None, // Q4_0_4_8, removed
    None, // Q4_0_8_8, removed
    Some(Entry("TQ1_0", QK_K, 2 + 4 * 13)),
    Some(Entry("TQ2_0", QK_K, 2 + 64)),
    None, // IQ4_NL_4_4, removed
    None, // IQ4_NL_4_8, removed
    None, // IQ4_NL_8_8, removed
    Some(Entry("MXFP4", 32, 1 + 16)),
    Some(Entry("NVFP4", 64, 4 + 32)),
    Some(Entry("Q1_0", 128, 2 + 16)),
];

impl GgmlType {
    /// 32-bit floats.
    pub const F32: GgmlType = GgmlType(0);
    /// 16-bit IEEE floats.
    pub const F16: GgmlType = GgmlType(1);
    /// Blocks of 32 4-bit values with one f16 scale.
    pub const Q4_0: GgmlType = GgmlType(2);
    /// Blocks of 32 8-bit values with one f16 scale.
    pub const Q8_0: GgmlType = GgmlType(8);
    /// Super-blocks of 256 4-bit values in 8 sub-blocks with 6-bit scales and minimums.
    pub const Q4_K: GgmlType = GgmlType(12);
    /// Super-blocks of 256 6-bit values in 16 sub-blocks with 8-bit scales.
    pub const Q6_K: GgmlType = GgmlType(14);
    /// bfloat16.
    pub const BF16: GgmlType = GgmlType(30);

    fn entry(self) -> Option<&'static Entry> {
        TABLE.get(usize::try_from(self.0).ok()?)?.as_ref()
    }

    /// The type's name as ggml spells it (`"Q4_K"`), or `None` for a number with no type.
    pub fn name(self) -> Option<&'static str> {
        self.entry().map(|e| e.0)
    }

    /// How many elements one block holds (1 for the plain types), or `None` for an unknown type.
    pub fn block_elems(self) -> Option<usize> {
        self.entry().map(|e| e.1)
    }

    /// How many bytes one block takes, or `None` for an unknown type.
    pub fn block_bytes(self) -> Option<usize> {
        self.entry().map(|e| e.2)
    }

    /// Every known type, in number order.
    pub fn all() -> impl Iterator<Item = GgmlType> {
        (0..TABLE.len() as u32).map(GgmlType).filter(|t| t.name().is_some())
    }
}

impl std::fmt::Display for GgmlType {
    /// The name, or `type N` for a number with no type.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.name() {
            Some(name) => f.write_str(name),
            None => write!(f, "type {}", self.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_and_removed_numbers() {
        assert_eq!(GgmlType(14).name(), Some("Q6_K"));
        assert_eq!((GgmlType(14).block_elems(), GgmlType(14).block_bytes()), (Some(256), Some(210)));
        for removed in [4, 5, 31, 32, 33, 36, 37, 38, 42, u32::MAX] {
            let t = GgmlType(removed);
            assert_eq!((t.name(), t.block_elems(), t.block_bytes()), (None, None, None), "{removed}");
        }
        assert_eq!(GgmlType::all().count(), 42 - 8);
        assert_eq!(GgmlType(31).to_string(), "type 31");
        assert_eq!(GgmlType::Q8_0.to_string(), "Q8_0");
    }
}
