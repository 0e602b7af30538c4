//! The activation rows of the integer GEMM: `x` quantized exactly as the decode kernels' `QuantX`
//! does (same blocks, same scales, same codes), then laid out for 512-bit registers whose 16
//! `i32` lanes are 16 rows of `x`.
//!
//! Rows are taken 16 at a time (a *tile*; rows past `m` are zero: codes 0, scales 0). For tile
//! `g` and element `e` (a multiple of 4), the 64 bytes at `16 (g k + e)` hold, for lanes
//! `l = 0..16` in turn, the four codes `e .. e + 4` of row `16 g + l`, each shifted to unsigned
//! (`u = q + 128`: `vpdpbusd` takes its register operand unsigned), so that one load and one
//! dot-product instruction with four codes of a weight row (broadcast) give 16 rows' partial
//! sums. The per-block values are likewise 16 lanes wide:
//!
//! * `d[(g · nb + b) · 16 + l]`: block `b`'s scale of row `16 g + l`;
//! * `sx` (blocks of 32): `d · Σ q` of the block, as `QuantX` keeps it (Q4_0's offset uses it);
//! * `pairs` (blocks of 256, for types with mins): `pairs[((g · nb + b) · 4 + p) · 16 + l]`
//!   holds the sums of the codes over the 32-element groups `2p` and `2p + 1` as two `i16`
//!   (low half `2p`; each at most `32 · 127` in magnitude), for a `vpdpwssd` with two rows' mins.

use crate::pool::{self, TaskPtr};
use crate::quant::act::quantize_block;

/// Rows per tile (the `i32` lanes of a 512-bit register).
pub(crate) const LANES: usize = 16;

/// Quantized activation rows in tiles of [`LANES`] (see the module docs).
pub(crate) struct XTiles {
    pub codes: Vec<u8>,
    pub d: Vec<f32>,
    pub sx: Vec<f32>,
    pub pairs: Vec<i32>,
    /// Tiles, and blocks per row.
    pub tiles: usize,
    pub nb: usize,
    /// Elements per row.
    pub k: usize,
}

/// Which per-block values the weight type needs besides the codes and scales.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Extra {
    /// Nothing.
    None,
    /// `d · Σ q` per block of 32.
    Sx,
    /// Pair sums of 32-element groups per block of 256.
    Pairs,
}

impl XTiles {
    /// No rows.
    pub(crate) const fn empty() -> XTiles {
        XTiles { codes: Vec::new(), d: Vec::new(), sx: Vec::new(), pairs: Vec::new(), tiles: 0, nb: 0, k: 0 }
    }

    /// Quantizes `m` rows of `k` elements of `x` (`x.len() == m * k`) in blocks of `block` (32 or
    /// 256, dividing `k`) into `self` (its buffers reused), tiles spread over the pool.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, BW and VL, AVX2 and FMA.
    pub(crate) unsafe fn fill(&mut self, x: &[f32], m: usize, k: usize, block: usize, extra: Extra) {
        assert!(x.len() == m * k && k.is_multiple_of(block) && (block == 32 || block == 256), "XTiles: shape");
        assert!(match extra {
            Extra::None => true,
            Extra::Sx => block == 32,
            Extra::Pairs => block == 256,
        });
        let (tiles, nb) = (m.div_ceil(LANES), k / block);
        (self.tiles, self.nb, self.k) = (tiles, nb, k);
        self.codes.resize(tiles * LANES * k, 0);
        self.d.resize(tiles * nb * LANES, 0.0);
        self.sx.resize(if extra == Extra::Sx { tiles * nb * LANES } else { 0 }, 0.0);
        self.pairs.resize(if extra == Extra::Pairs { tiles * nb * 4 * LANES } else { 0 }, 0);
        let (codes, d, sx, pairs) = (
            TaskPtr(self.codes.as_mut_ptr()),
            TaskPtr(self.d.as_mut_ptr()),
            TaskPtr(self.sx.as_mut_ptr()),
            TaskPtr(self.pairs.as_mut_ptr()),
        );
        let tile = |g: usize| {
            // SAFETY: tile `g` owns these ranges of the four buffers (each sized for `tiles`
            // tiles above; `sx` and `pairs` only when `extra` asks for them), which outlive
            // `run`; no other task touches them. The CPU is the caller's.
            unsafe {
                let parts = (
                    std::slice::from_raw_parts_mut(codes.get().add(g * LANES * k), LANES * k),
                    std::slice::from_raw_parts_mut(d.get().add(g * nb * LANES), nb * LANES),
                    if extra == Extra::Sx {
                        std::slice::from_raw_parts_mut(sx.get().add(g * nb * LANES), nb * LANES)
                    } else {
                        &mut []
                    },
                    if extra == Extra::Pairs {
                        std::slice::from_raw_parts_mut(pairs.get().add(g * nb * 4 * LANES), nb * 4 * LANES)
                    } else {
                        &mut []
                    },
                );
                let rows = &x[g * LANES * k..((g + 1) * LANES).min(m) * k];
                fill_tile(rows, k, block, extra, parts);
            }
        };
        if tiles * k >= 1 << 16 {
            pool::run(tiles, &tile);
        } else {
            (0..tiles).for_each(tile);
        }
    }
}

/// One tile: `rows` (at most 16 rows of `k`) quantized into its parts (codes, scales, `sx`,
/// pairs); lanes past the rows get zero codes and scales.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VL, AVX2 and FMA (the quantization vectorises with them;
/// the operations, and so the results, are those of `QuantX`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn fill_tile(
    rows: &[f32],
    k: usize,
    block: usize,
    extra: Extra,
    (codes, d, sx, pairs): (&mut [u8], &mut [f32], &mut [f32], &mut [i32]),
) {
    let mut q = [0i8; 256];
    let q = &mut q[..block];
    let valid = rows.len() / k;
    for l in 0..LANES {
        for b in 0..k / block {
            let db = if l < valid {
                quantize_block(&rows[l * k + b * block..][..block], q)
            } else {
                q.fill(0);
                0.0
            };
            d[b * LANES + l] = db;
            for (s, four) in q.chunks_exact(4).enumerate() {
                let at = ((b * block) / 4 + s) * 4 * LANES + 4 * l;
                let word = u32::from_le_bytes([four[0] as u8, four[1] as u8, four[2] as u8, four[3] as u8]);
                codes[at..at + 4].copy_from_slice(&(word ^ 0x8080_8080).to_le_bytes());
            }
            match extra {
                Extra::None => {}
                Extra::Sx => {
                    let sum: i32 = q.iter().map(|&v| i32::from(v)).sum();
                    sx[b * LANES + l] = db * sum as f32;
                }
                Extra::Pairs => {
                    let s = |j: usize| q[32 * j..][..32].iter().map(|&v| i32::from(v)).sum::<i32>();
                    for p in 0..4 {
                        let (lo, hi) = (s(2 * p), s(2 * p + 1));
                        pairs[(b * 4 + p) * LANES + l] = (lo & 0xFFFF) | (hi << 16);
                    }
                }
            }
        }
    }
}
