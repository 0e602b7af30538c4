//! [`RowLayout::Q4_0x8`]: Q4_0 rows stored eight at a time, interleaved block by block, so
//! that the decode kernel (`dot_q4x8`) takes one block of eight rows with a few wide loads and
//! finishes it with one conversion and one multiply-add for all eight (instead of one per row);
//! llama.cpp's CPU backend repacks Q4_0 the same way (`q4_0_8x8`), in its own order.
//!
//! Rows `8g .. 8g + 8` (a *group*) occupy the bytes they occupy in ggml's layout, `8 · 18 · nb`,
//! as `nb` interleaved blocks of 144 bytes. Interleaved block `b`:
//!
//! * bytes `0..16`: the eight rows' `f16` scales `d`, in the lane order [`LANES`] (rows 0, 1, 4,
//!   5, 2, 3, 6, 7: the order the kernel's horizontal add leaves its eight sums in);
//! * bytes `16..144`: four chunks of 32 bytes, chunk `2h + q` holding, for rows `4q .. 4q + 4`
//!   in turn, bytes `8h .. 8h + 8` of that row's 16 code bytes (byte `j` of a Q4_0 block holds
//!   element `j` in its low nibble and `j + 16` in its high one).
//!
//! Rows past the last whole group (`rows % 8` of them) keep ggml's layout, after the groups.
//! Everything but the host decode kernels reads ggml's layout: [`to_ggml`] puts rows back.

use super::types::QuantType;

/// How the rows of a quantized weight are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RowLayout {
    /// ggml's: row after row, block after block.
    #[default]
    Ggml,
    /// Q4_0 only: groups of eight rows interleaved block by block (see the module docs).
    Q4_0x8,
}

impl RowLayout {
    /// The layout the host decode kernels read fastest for `t`.
    pub fn preferred(t: QuantType) -> RowLayout {
        if t == QuantType::Q4_0 { RowLayout::Q4_0x8 } else { RowLayout::Ggml }
    }

    /// Whether rows of `t` in this layout differ from ggml's.
    pub(crate) fn applies(self, t: QuantType) -> bool {
        self == RowLayout::Q4_0x8 && t == QuantType::Q4_0
    }
}

/// The row held by lane `l` of an interleaved block's scales (and of the kernel's sums).
pub(crate) const LANES: [usize; 8] = [0, 1, 4, 5, 2, 3, 6, 7];

/// Bytes of a Q4_0 block, and of an interleaved block of eight.
const BLOCK: usize = 18;
const GROUP_BLOCK: usize = 8 * BLOCK;

/// One group: eight ggml rows of `nb` blocks (`src`, row after row) into `dst` interleaved.
fn interleave(src: &[u8], nb: usize, dst: &mut [u8]) {
    let row_bytes = nb * BLOCK;
    for b in 0..nb {
        let out = &mut dst[b * GROUP_BLOCK..(b + 1) * GROUP_BLOCK];
        let block = |r: usize| &src[r * row_bytes + b * BLOCK..][..BLOCK];
        for (l, &r) in LANES.iter().enumerate() {
            out[2 * l..2 * l + 2].copy_from_slice(&block(r)[..2]);
        }
        for h in 0..2 {
            for q in 0..2 {
                for rr in 0..4 {
                    let at = 16 + 32 * (2 * h + q) + 8 * rr;
                    out[at..at + 8].copy_from_slice(&block(4 * q + rr)[2 + 8 * h..][..8]);
                }
            }
        }
    }
}

/// One interleaved group back into eight ggml rows.
fn deinterleave(src: &[u8], nb: usize, dst: &mut [u8]) {
    let row_bytes = nb * BLOCK;
    for b in 0..nb {
        let inp = &src[b * GROUP_BLOCK..(b + 1) * GROUP_BLOCK];
        for (l, &r) in LANES.iter().enumerate() {
            dst[r * row_bytes + b * BLOCK..][..2].copy_from_slice(&inp[2 * l..2 * l + 2]);
        }
        for h in 0..2 {
            for q in 0..2 {
                for rr in 0..4 {
                    let at = 16 + 32 * (2 * h + q) + 8 * rr;
                    let r = 4 * q + rr;
                    dst[r * row_bytes + b * BLOCK + 2 + 8 * h..][..8].copy_from_slice(&inp[at..at + 8]);
                }
            }
        }
    }
}

/// Whole rows of `t` (`row_bytes` each, whole blocks; the first row a multiple of 8 from the
/// weight's first) from ggml's layout into `layout`, in place. Nothing changes where the layout
/// does not apply to `t`.
pub fn to_layout(t: QuantType, layout: RowLayout, data: &mut [u8], row_bytes: usize) {
    if !layout.applies(t) || row_bytes == 0 {
        return;
    }
    let nb = row_bytes / BLOCK;
    let mut tmp = vec![0u8; 8 * row_bytes];
    for group in data.chunks_exact_mut(8 * row_bytes) {
        interleave(group, nb, &mut tmp);
        group.copy_from_slice(&tmp);
    }
}

/// Rows of `t` stored in `layout` (as [`to_layout`] left them) written into `dst` in ggml's
/// layout (`dst.len() == src.len()`).
pub(crate) fn to_ggml(t: QuantType, layout: RowLayout, src: &[u8], row_bytes: usize, dst: &mut [u8]) {
    assert_eq!(src.len(), dst.len(), "to_ggml: lengths");
    if !layout.applies(t) || row_bytes == 0 {
        dst.copy_from_slice(src);
        return;
    }
    let nb = row_bytes / BLOCK;
    let whole = src.len() / (8 * row_bytes) * 8 * row_bytes;
    for (s, d) in src[..whole].chunks_exact(8 * row_bytes).zip(dst[..whole].chunks_exact_mut(8 * row_bytes)) {
        deinterleave(s, nb, d);
    }
    dst[whole..].copy_from_slice(&src[whole..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_go_there_and_back_and_land_where_documented() {
        let t = QuantType::Q4_0;
        let (nb, rows) = (3, 19);
        let row_bytes = nb * BLOCK;
        let ggml: Vec<u8> = (0..rows * row_bytes).map(|i| (i * 37 % 251) as u8).collect();
        let mut x8 = ggml.clone();
        to_layout(t, RowLayout::Q4_0x8, &mut x8, row_bytes);
        // Group 1, block 2: lane 2's scale is row 4's; chunk (h 1, q 1), row 6's bytes 8..16.
        let (g, b) = (8 * row_bytes, 2 * GROUP_BLOCK);
        assert_eq!(x8[g + b + 4..g + b + 6], ggml[(8 + 4) * row_bytes + 2 * BLOCK..][..2]);
        let at = 16 + 32 * 3 + 8 * 2;
        assert_eq!(x8[g + b + at..g + b + at + 8], ggml[(8 + 6) * row_bytes + 2 * BLOCK + 2 + 8..][..8]);
        // The 3 rows past the last group are untouched.
        assert_eq!(x8[16 * row_bytes..], ggml[16 * row_bytes..]);
        let mut back = vec![0u8; ggml.len()];
        to_ggml(t, RowLayout::Q4_0x8, &x8, row_bytes, &mut back);
        assert_eq!(back, ggml);
        // Other types are left alone.
        let mut q8 = ggml.clone();
        to_layout(QuantType::Q8_0, RowLayout::Q4_0x8, &mut q8, row_bytes);
        assert_eq!(q8, ggml);
    }
}
