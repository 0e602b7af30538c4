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
//! [`RowLayout::Q4Kx8`] does the same for Q4_K super-blocks (see [`k_place`]): eight rows'
//! `d`, `dmin` and packed scales side by side, so that the kernel (`dot_q4kx8`) unpacks the
//! scales of eight rows at once, and their codes in the same 8-byte pieces as Q4_0x8.
//!
//! [`RowLayout::Q6Kx8`] does the same for Q6_K super-blocks (see [`k6_place`]): the eight rows'
//! `d` side by side, their 16 scales in pairs of groups (so that one sign extension gives the
//! eight rows' scale pairs for a multiply-add with the activation's sums), and their low and high
//! code bytes in 8-byte runs of four rows, as ggml stores them within a row, so that the kernel
//! (`dot_q6kx8`) unpacks four rows' codes with ggml's own bit operations.
//!
//! [`RowLayout::Mxfp4x8`] does the same for MXFP4 blocks (see [`Pieces`]): the eight rows'
//! E8M0 scale bytes side by side in lane order, then their codes as Q4_0x8 places them, so that
//! the kernel (`dot_q4x8`'s `Mxfp4x8`) decodes eight rows' scales at once.
//!
//! [`RowLayout::Q8_0x8`] does the same for Q8_0 blocks (see [`Pieces`]): the eight rows' `f16`
//! scales in lane order, then their 32 code bytes in 8-byte pieces, piece `p` of rows
//! `4q .. 4q + 4` in chunk `2p + q`, so that the kernel dots a chunk with the
//! activation's matching 8 bytes for four rows at once (`dot_q4x8`'s `Q80x8`).
//!
//! Rows past the last whole group (`rows % 8` of them) keep ggml's layout, after the groups.
//! Everything but the host decode kernels reads ggml's layout: [`to_ggml`] puts rows back.

use super::types::QuantType;
use crate::error::{Error, Result};

/// How the rows of a quantized weight are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RowLayout {
    /// ggml's: row after row, block after block.
    #[default]
    Ggml,
    /// Q4_0 only: groups of eight rows interleaved block by block (see the module docs).
    Q4_0x8,
    /// Q4_K only: groups of eight rows interleaved super-block by super-block (see `k_place`).
    Q4Kx8,
    /// Q6_K only: groups of eight rows interleaved super-block by super-block (see `k6_place`).
    Q6Kx8,
    /// MXFP4 only: groups of eight rows interleaved block by block (see `Pieces`).
    Mxfp4x8,
    /// Q8_0 only: groups of eight rows interleaved block by block (see `Pieces`).
    Q8_0x8,
}

impl RowLayout {
    /// The layout the host decode kernels read fastest for `t`.
    pub fn preferred(t: QuantType) -> RowLayout {
        match t {
            QuantType::Q4_0 => RowLayout::Q4_0x8,
            QuantType::Q4K => RowLayout::Q4Kx8,
            QuantType::Q6K => RowLayout::Q6Kx8,
            QuantType::Mxfp4 => RowLayout::Mxfp4x8,
            QuantType::Q8_0 => RowLayout::Q8_0x8,
            _ => RowLayout::Ggml,
        }
    }

    /// Whether rows of `t` in this layout differ from ggml's.
    pub(crate) fn applies(self, t: QuantType) -> bool {
        matches!(
            (self, t),
            (RowLayout::Q4_0x8, QuantType::Q4_0)
                | (RowLayout::Q4Kx8, QuantType::Q4K)
                | (RowLayout::Q6Kx8, QuantType::Q6K)
                | (RowLayout::Mxfp4x8, QuantType::Mxfp4)
                | (RowLayout::Q8_0x8, QuantType::Q8_0)
        )
    }
}

/// The row held by lane `l` of an interleaved block's scales (and of the kernel's sums).
pub(crate) const LANES: [usize; 8] = [0, 1, 4, 5, 2, 3, 6, 7];

/// Bytes of a Q4_0 block, and of an interleaved block of eight.
const BLOCK: usize = 18;
#[cfg(test)]
const GROUP_BLOCK: usize = 8 * BLOCK;

/// A block type interleaved in 8-byte pieces (Q4_0x8, Mxfp4x8, Q8_0x8): `block` bytes a row,
/// the first `scale` of them its scale; in an interleaved block the eight rows' scales side by
/// side in lane order (bytes `0 .. 8 scale`), then the code bytes in 8-byte pieces, piece `p`
/// (the row's code bytes `8p .. 8p + 8`) of rows `4q .. 4q + 4` in the 32-byte chunk `2p + q`.
#[derive(Debug, Clone, Copy)]
struct Pieces {
    block: usize,
    scale: usize,
}

impl Pieces {
    const Q4_0: Pieces = Pieces { block: BLOCK, scale: 2 };
    const MXFP4: Pieces = Pieces { block: 17, scale: 1 };
    const Q8_0: Pieces = Pieces { block: 34, scale: 2 };

    /// Where the codes of an interleaved block start.
    const fn codes(self) -> usize {
        8 * self.scale
    }

    /// The runs of one group of eight rows of `nb` blocks: `(byte in ggml's layout (row after
    /// row), byte in the interleaved one, length)` for each row's scale and each of its 8-byte
    /// pieces of codes.
    fn runs(self, nb: usize) -> impl Iterator<Item = (usize, usize, usize)> {
        let (row_bytes, group, pieces) = (nb * self.block, 8 * self.block, (self.block - self.scale) / 8);
        (0..nb).flat_map(move |b| {
            (0..8).flat_map(move |r| {
                let (l, q, rr) = (LANE_OF[r], r / 4, r % 4);
                let row = r * row_bytes + b * self.block;
                let codes = b * group + self.codes() + 8 * rr;
                std::iter::once((row, b * group + self.scale * l, self.scale))
                    .chain((0..pieces).map(move |p| (row + self.scale + 8 * p, codes + 32 * (2 * p + q), 8)))
            })
        })
    }

    /// One group of eight ggml rows of `nb` blocks (`src`) into `dst` interleaved.
    fn interleave(self, src: &[u8], nb: usize, dst: &mut [u8]) {
        for (g, x, len) in self.runs(nb) {
            dst[x..x + len].copy_from_slice(&src[g..g + len]);
        }
    }

    /// One interleaved group (`src`) back into eight ggml rows.
    fn deinterleave(self, src: &[u8], nb: usize, dst: &mut [u8]) {
        for (g, x, len) in self.runs(nb) {
            dst[g..g + len].copy_from_slice(&src[x..x + len]);
        }
    }
}

/// The lane of row `r` in an interleaved block (the inverse of [`LANES`]).
const LANE_OF: [usize; 8] = [0, 1, 4, 5, 2, 3, 6, 7];

/// Bytes of a Q4_K super-block (d, dmin, 12 bytes of packed scales, 128 code bytes), and of
/// an interleaved super-block of eight rows.
const K_BLOCK: usize = 144;
const K_GROUP_BLOCK: usize = 8 * K_BLOCK;

/// Where byte `i` of super-block field data goes in an interleaved Q4_K super-block of eight
/// rows (`RowLayout::Q4Kx8`), for row `r` whose lane is `l` (`LANES[l] == r`):
///
/// * `d` at `2 l`, `dmin` at `16 + 2 l` (bytes `0..32`);
/// * the packed scales as three `u32` words, word `w` at `32 + 4 (8 w + l)` (bytes `32..128`),
///   so that each word of the eight rows is one register of eight lanes;
/// * the 128 code bytes at `128 + 32 ((4 c + p) 2 + q) + 8 rr` for bytes `32 c + 8 p ..+ 8`
///   of row `4 q + rr` (`c`: the 32-byte chunk whose low and high nibbles are sub-blocks `2c`
///   and `2c + 1`; `p`: its 8-byte piece; `q`: rows 0-3 or 4-7).
fn k_place(r: usize, i: usize) -> usize {
    let l = LANES.iter().position(|&x| x == r).unwrap_or(0);
    match i {
        0..2 => 2 * l + i,
        2..4 => 16 + 2 * l + (i - 2),
        4..16 => {
            let (w, b) = ((i - 4) / 4, (i - 4) % 4);
            32 + 4 * (8 * w + l) + b
        }
        _ => {
            let j = i - 16;
            let (c, p, b) = (j / 32, j % 32 / 8, j % 8);
            let (q, rr) = (r / 4, r % 4);
            128 + 32 * ((4 * c + p) * 2 + q) + 8 * rr + b
        }
    }
}

/// One group of a super-block type of `block` bytes: eight ggml rows of `nb` super-blocks into
/// `dst` interleaved, byte `i` of row `r`'s super-block `s` at `place(r, i)` within the group's
/// super-block `s` (`8 block` bytes). For Q4_K ([`k_place`]) and Q6_K ([`k6_place`]).
fn interleave_blocks(src: &[u8], nb: usize, block: usize, place: fn(usize, usize) -> usize, dst: &mut [u8]) {
    let row_bytes = nb * block;
    for s in 0..nb {
        let out = &mut dst[s * 8 * block..(s + 1) * 8 * block];
        for r in 0..8 {
            for (i, &v) in src[r * row_bytes + s * block..][..block].iter().enumerate() {
                out[place(r, i)] = v;
            }
        }
    }
}

/// One interleaved Q4_K group back into eight ggml rows, super-block by super-block.
fn deinterleave_k(src: &[u8], nb: usize, dst: &mut [u8]) {
    let row_bytes = nb * K_BLOCK;
    for s in 0..nb {
        let inp = &src[s * K_GROUP_BLOCK..(s + 1) * K_GROUP_BLOCK];
        for r in 0..8 {
            block_q4k(inp, r, &mut dst[r * row_bytes + s * K_BLOCK..][..K_BLOCK]);
        }
    }
}

/// Row `r`'s ggml super-block out of one interleaved Q4_K super-block of eight rows (`inp`):
/// [`k_place`]'s runs copied whole (the two `f16` scales, three 4-byte words of packed scales,
/// sixteen 8-byte pieces of codes), so that the dequantizing GEMM's copy costs little beside its
/// dequantization.
#[inline(always)]
fn block_q4k(inp: &[u8], r: usize, out: &mut [u8]) {
    let l = LANE_OF[r];
    out[0..2].copy_from_slice(&inp[2 * l..2 * l + 2]);
    out[2..4].copy_from_slice(&inp[16 + 2 * l..16 + 2 * l + 2]);
    for w in 0..3 {
        let at = 32 + 4 * (8 * w + l);
        out[4 + 4 * w..8 + 4 * w].copy_from_slice(&inp[at..at + 4]);
    }
    let (q, rr) = (r / 4, r % 4);
    for piece in 0..16 {
        // Codes `8 piece .. 8 piece + 8`: chunk `piece / 4`, piece `piece % 4` of it.
        let at = 128 + 32 * (piece * 2 + q) + 8 * rr;
        out[16 + 8 * piece..24 + 8 * piece].copy_from_slice(&inp[at..at + 8]);
    }
}

/// Where an interleaved MXFP4 and Q8_0 block's codes start (after the eight scales).
#[cfg(test)]
const MX_CODES: usize = Pieces::MXFP4.codes();
#[cfg(test)]
const Q8_CODES: usize = Pieces::Q8_0.codes();

/// Bytes of a Q6_K super-block (128 bytes of low code nibbles, 64 of high code bits, 16 signed
/// scales, `d`), and of an interleaved super-block of eight rows.
const K6_BLOCK: usize = 210;
const K6_GROUP_BLOCK: usize = 8 * K6_BLOCK;
/// Where an interleaved Q6_K super-block's scales, low nibbles and high bits start.
pub(crate) const K6_SCALES: usize = 16;
pub(crate) const K6_QL: usize = 144;
pub(crate) const K6_QH: usize = 1168;

/// Where byte `i` of a Q6_K super-block goes in an interleaved super-block of eight rows
/// (`RowLayout::Q6Kx8`), for row `r` whose lane is `l` (`LANES[l] == r`):
///
/// * `d` (bytes `208..210`) at `2 l` (bytes `0..16`);
/// * scale `g = 2 t + j` (byte `192 + g`) at `16 + 16 t + 2 l + j` (bytes `16..144`): for each
///   pair of groups, the eight rows' two scales side by side in lane order;
/// * low-nibble byte `8 R + b` (`R < 16`) at `144 + 32 (2 R + q) + 8 rr + b`, high-bit byte
///   `128 + 8 R + b` (`R < 8`) at `1168 + 32 (2 R + q) + 8 rr + b`, for row `4 q + rr`: each
///   8-byte run of ggml's bytes with the same run of the three other rows of its half.
fn k6_place(r: usize, i: usize) -> usize {
    let l = LANES.iter().position(|&x| x == r).unwrap_or(0);
    let (q, rr) = (r / 4, r % 4);
    match i {
        0..128 => K6_QL + 32 * (2 * (i / 8) + q) + 8 * rr + i % 8,
        128..192 => K6_QH + 32 * (2 * ((i - 128) / 8) + q) + 8 * rr + i % 8,
        192..208 => {
            let g = i - 192;
            K6_SCALES + 16 * (g / 2) + 2 * l + g % 2
        }
        _ => 2 * l + (i - 208),
    }
}

/// One interleaved Q6_K group back into eight ggml rows, super-block by super-block.
fn deinterleave_k6(src: &[u8], nb: usize, dst: &mut [u8]) {
    let row_bytes = nb * K6_BLOCK;
    for s in 0..nb {
        let inp = &src[s * K6_GROUP_BLOCK..(s + 1) * K6_GROUP_BLOCK];
        for r in 0..8 {
            block_q6k(inp, r, &mut dst[r * row_bytes + s * K6_BLOCK..][..K6_BLOCK]);
        }
    }
}

/// Row `r`'s ggml super-block out of one interleaved Q6_K super-block of eight rows (`inp`):
/// [`k6_place`]'s 8-byte runs of codes copied whole, the scales and `d` byte by byte.
#[inline(always)]
fn block_q6k(inp: &[u8], r: usize, out: &mut [u8]) {
    let l = LANE_OF[r];
    let (q, rr) = (r / 4, r % 4);
    for run in 0..24 {
        // Runs 0..16 are the low nibbles, 16..24 the high bits (ggml bytes 8 run ..).
        let at = if run < 16 { K6_QL + 32 * (2 * run + q) } else { K6_QH + 32 * (2 * (run - 16) + q) };
        out[8 * run..8 * run + 8].copy_from_slice(&inp[at + 8 * rr..at + 8 * rr + 8]);
    }
    for g in 0..16 {
        out[192 + g] = inp[K6_SCALES + 16 * (g / 2) + 2 * l + g % 2];
    }
    out[208..210].copy_from_slice(&inp[2 * l..2 * l + 2]);
}

/// Whole rows of `t` (`row_bytes` each, whole blocks; the first row a multiple of 8 from the
/// weight's first) from ggml's layout into `layout`, in place. Nothing changes where the layout
/// does not apply to `t`.
///
/// Errors (nothing changed): [`Error::NotWholeBlocks`] if `row_bytes` is not whole blocks of `t`
/// or `data` not whole rows.
pub fn to_layout(t: QuantType, layout: RowLayout, data: &mut [u8], row_bytes: usize) -> Result<()> {
    let whole = |operand, len: usize, block: usize| {
        if if block == 0 { len == 0 } else { len.is_multiple_of(block) } {
            Ok(())
        } else {
            Err(Error::NotWholeBlocks { ty: t.name(), operand, len, block, unit: "bytes" })
        }
    };
    whole("row_bytes", row_bytes, t.block_bytes())?;
    whole("data (rows of row_bytes)", data.len(), row_bytes)?;
    if !layout.applies(t) || row_bytes == 0 {
        return Ok(());
    }
    let mut tmp = vec![0u8; 8 * row_bytes];
    for group in data.chunks_exact_mut(8 * row_bytes) {
        match layout {
            RowLayout::Q4Kx8 => interleave_blocks(group, row_bytes / K_BLOCK, K_BLOCK, k_place, &mut tmp),
            RowLayout::Q6Kx8 => interleave_blocks(group, row_bytes / K6_BLOCK, K6_BLOCK, k6_place, &mut tmp),
            RowLayout::Mxfp4x8 => Pieces::MXFP4.interleave(group, row_bytes / Pieces::MXFP4.block, &mut tmp),
            RowLayout::Q8_0x8 => Pieces::Q8_0.interleave(group, row_bytes / Pieces::Q8_0.block, &mut tmp),
            _ => Pieces::Q4_0.interleave(group, row_bytes / BLOCK, &mut tmp),
        }
        group.copy_from_slice(&tmp);
    }
    Ok(())
}

/// `f` of the rows `w` of `t` (stored in `layout`, starting on a group of eight) in ggml's
/// layout: `w` itself when the layout does not apply to `t`, else a copy put back in a
/// thread-local buffer kept between calls. For the paths that read only ggml's layout (the
/// portable kernels, the dequantizing GEMM).
pub(crate) fn with_ggml_rows<R>(
    t: QuantType,
    layout: RowLayout,
    w: &[u8],
    row_bytes: usize,
    f: impl FnOnce(&[u8]) -> R,
) -> R {
    thread_local! {
        static GGML: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    if !layout.applies(t) {
        return f(w);
    }
    GGML.with(|g| {
        let mut g = g.borrow_mut();
        g.resize(w.len(), 0);
        to_ggml(t, layout, w, row_bytes, &mut g);
        f(&g)
    })
}

/// Rows of `t` stored in `layout` (as [`to_layout`] left them) written into `dst` in ggml's
/// layout (`dst.len() == src.len()`).
pub(crate) fn to_ggml(t: QuantType, layout: RowLayout, src: &[u8], row_bytes: usize, dst: &mut [u8]) {
    assert_eq!(src.len(), dst.len(), "to_ggml: lengths");
    if !layout.applies(t) || row_bytes == 0 {
        dst.copy_from_slice(src);
        return;
    }
    let whole = src.len() / (8 * row_bytes) * 8 * row_bytes;
    for (s, d) in src[..whole].chunks_exact(8 * row_bytes).zip(dst[..whole].chunks_exact_mut(8 * row_bytes)) {
        match layout {
            RowLayout::Q4Kx8 => deinterleave_k(s, row_bytes / K_BLOCK, d),
            RowLayout::Q6Kx8 => deinterleave_k6(s, row_bytes / K6_BLOCK, d),
            RowLayout::Mxfp4x8 => Pieces::MXFP4.deinterleave(s, row_bytes / Pieces::MXFP4.block, d),
            RowLayout::Q8_0x8 => Pieces::Q8_0.deinterleave(s, row_bytes / Pieces::Q8_0.block, d),
            _ => Pieces::Q4_0.deinterleave(s, row_bytes / BLOCK, d),
        }
    }
    dst[whole..].copy_from_slice(&src[whole..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Q8_0 groups go there and back, pieces where documented.
    #[test]
    fn q8_0_rows_go_there_and_back() {
        let t = QuantType::Q8_0;
        let (nb, rows) = (2, 17);
        let row_bytes = nb * Pieces::Q8_0.block;
        let ggml: Vec<u8> = (0..rows * row_bytes).map(|i| (i * 53 % 251) as u8).collect();
        let mut x8 = ggml.clone();
        to_layout(t, RowLayout::Q8_0x8, &mut x8, row_bytes).unwrap();
        assert_eq!(x8[16 * row_bytes..], ggml[16 * row_bytes..], "rows past the last group stay");
        // Row 6 (q 1, rr 2), piece 3 (codes 24..32) of block 0; its scale in lane 6.
        let at = Q8_CODES + 32 * 7 + 16;
        assert_eq!(x8[at..at + 8], ggml[6 * row_bytes + 26..6 * row_bytes + 34]);
        assert_eq!(x8[12..14], ggml[6 * row_bytes..6 * row_bytes + 2]);
        let mut back = vec![0u8; ggml.len()];
        to_ggml(t, RowLayout::Q8_0x8, &x8, row_bytes, &mut back);
        assert_eq!(back, ggml);
    }

    /// MXFP4 groups go there and back, scale bytes in lane order, codes where Q4_0x8 puts them.
    #[test]
    fn mxfp4_rows_go_there_and_back() {
        let t = QuantType::Mxfp4;
        let (nb, rows) = (3, 19);
        let row_bytes = nb * Pieces::MXFP4.block;
        let ggml: Vec<u8> = (0..rows * row_bytes).map(|i| (i * 37 % 251) as u8).collect();
        let mut x8 = ggml.clone();
        to_layout(t, RowLayout::Mxfp4x8, &mut x8, row_bytes).unwrap();
        assert_ne!(x8[..8 * row_bytes], ggml[..8 * row_bytes]);
        assert_eq!(x8[16 * row_bytes..], ggml[16 * row_bytes..], "rows past the last group stay");
        for (l, &r) in LANES.iter().enumerate() {
            assert_eq!(x8[l], ggml[r * row_bytes], "block 0 scale of row {r} in lane {l}");
        }
        // Row 5 (q 1, rr 1), code bytes 8..16 (h 1) of block 0.
        assert_eq!(x8[MX_CODES + 32 * 3 + 8..MX_CODES + 32 * 3 + 16], ggml[5 * row_bytes + 9..5 * row_bytes + 17]);
        let mut back = vec![0u8; ggml.len()];
        to_ggml(t, RowLayout::Mxfp4x8, &x8, row_bytes, &mut back);
        assert_eq!(back, ggml);
    }

    #[test]
    fn rows_go_there_and_back_and_land_where_documented() {
        let t = QuantType::Q4_0;
        let (nb, rows) = (3, 19);
        let row_bytes = nb * BLOCK;
        let ggml: Vec<u8> = (0..rows * row_bytes).map(|i| (i * 37 % 251) as u8).collect();
        let mut x8 = ggml.clone();
        to_layout(t, RowLayout::Q4_0x8, &mut x8, row_bytes).unwrap();
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
        // Q4_K: there and back, and a code byte where k_place says.
        let kt = QuantType::Q4K;
        let krow = 2 * K_BLOCK;
        let kg: Vec<u8> = (0..11 * krow).map(|i| (i * 53 % 241) as u8).collect();
        let mut kx = kg.clone();
        to_layout(kt, RowLayout::Q4Kx8, &mut kx, krow).unwrap();
        assert_ne!(kx, kg);
        // Row 5, super-block 1, code byte 32 * 2 + 8 * 3 + 1 (chunk 2, piece 3).
        let want = kg[5 * krow + K_BLOCK + 16 + 64 + 24 + 1];
        assert_eq!(kx[K_GROUP_BLOCK + 128 + 32 * ((4 * 2 + 3) * 2 + 1) + 8 + 1], want);
        let mut kb = vec![0u8; kg.len()];
        to_ggml(kt, RowLayout::Q4Kx8, &kx, krow, &mut kb);
        assert_eq!(kb, kg);
        let mut seen = vec![false; K_BLOCK * 8];
        for r in 0..8 {
            for i in 0..K_BLOCK {
                assert!(!std::mem::replace(&mut seen[k_place(r, i)], true), "k_place({r}, {i}) reused");
            }
        }
        // Q6_K: there and back, a code run where k6_place says, every byte placed once.
        let t6 = QuantType::Q6K;
        let row6 = 2 * K6_BLOCK;
        let g6: Vec<u8> = (0..13 * row6).map(|i| (i * 59 % 239) as u8).collect();
        let mut x6 = g6.clone();
        to_layout(t6, RowLayout::Q6Kx8, &mut x6, row6).unwrap();
        assert_ne!(x6, g6);
        // Row 6 (lane 6), super-block 1: high-bit byte 128 + 8 * 5 + 3 (run 5), and scale 9.
        let want = g6[6 * row6 + K6_BLOCK + 128 + 43];
        assert_eq!(x6[K6_GROUP_BLOCK + K6_QH + 32 * (2 * 5 + 1) + 8 * 2 + 3], want);
        assert_eq!(x6[K6_GROUP_BLOCK + K6_SCALES + 16 * 4 + 2 * 6 + 1], g6[6 * row6 + K6_BLOCK + 192 + 9]);
        let mut b6 = vec![0u8; g6.len()];
        to_ggml(t6, RowLayout::Q6Kx8, &x6, row6, &mut b6);
        assert_eq!(b6, g6);
        let mut seen = vec![false; K6_GROUP_BLOCK];
        for r in 0..8 {
            for i in 0..K6_BLOCK {
                assert!(!std::mem::replace(&mut seen[k6_place(r, i)], true), "k6_place({r}, {i}) reused");
            }
        }
        for r in 0..8 {
            assert_eq!(LANES[LANE_OF[r]], r);
        }
        // Other types are left alone.
        let q8_row = 2 * 34;
        let mut q8: Vec<u8> = (0..9 * q8_row).map(|i| i as u8).collect();
        let q8_before = q8.clone();
        to_layout(QuantType::Q8_0, RowLayout::Q4_0x8, &mut q8, q8_row).unwrap();
        assert_eq!(q8, q8_before);
    }

    /// Rows that are not whole blocks, and data that is not whole rows, are typed errors that
    /// change nothing.
    #[test]
    fn bad_rows_are_typed_errors() {
        let t = QuantType::Q4_0;
        let mut data: Vec<u8> = (0..8 * 36).map(|i| i as u8).collect();
        let before = data.clone();
        let err = to_layout(t, RowLayout::Q4_0x8, &mut data, 35).unwrap_err();
        assert!(matches!(err, Error::NotWholeBlocks { operand: "row_bytes", len: 35, block: 18, .. }), "{err}");
        let err = to_layout(t, RowLayout::Q4_0x8, &mut data[..8 * 36 - 18], 36).unwrap_err();
        assert!(matches!(err, Error::NotWholeBlocks { len: 270, block: 36, .. }), "{err}");
        let err = to_layout(t, RowLayout::Q4_0x8, &mut data, 0).unwrap_err();
        assert!(matches!(err, Error::NotWholeBlocks { len: 288, block: 0, .. }), "{err}");
        assert!(to_layout(t, RowLayout::Q4_0x8, &mut [], 0).is_ok());
        assert_eq!(data, before);
    }
}
