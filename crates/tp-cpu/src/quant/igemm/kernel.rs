//! The AVX512-VNNI micro-kernel of the integer GEMM: `MV` tiles of 16 activation rows (one
//! register each per four elements) against one panel of [`NR`] weight rows, all of `k`.
//!
//! Per four elements: `MV` loads of activation codes, and per weight row one `vpdpbusd` per
//! tile with the row's four codes broadcast from the panel, into `MV · NR` `i32` accumulators
//! of 16 lanes. After each group the accumulators take the
//! group's scale (one `vpmulld` each, K-quants) into the block's integer sums; after each block
//! the shift of the activation codes comes out (`c128`), the mins' integer sum is one
//! `vpdpwssd` per two groups (Q4_K), and one conversion and one multiply-add by `d dx` (and one
//! by `dmin dx`) put the block into the `f32` outputs. Those are the integers and the `f32`
//! operations, in the same order, of the decode kernels of the interleaved layouts
//! (`dot_q4x8`, `dot_q4kx8`, `dot_q6kx8`), so each output is bitwise the same as theirs.

use super::CHUNK_ROWS;
use super::panel::{Kind, NR};
use super::xtiles::{LANES, XTiles};
use std::arch::x86_64::*;

/// Activation tiles per micro-kernel call, at most: `3 · NR = 12` accumulators of 16 lanes, as
/// many for the block's sums, and 3 registers of activation codes (measured on Zen 4 the same
/// speed as 2 tiles by 6 weight rows; both keep `vpdpbusd` busy on data in L1).
const MV: usize = 3;

/// `out[v][j]` lane `l`: activation row `16 (g + v) + l` against panel row `j`, for the `MV`
/// tiles from `g` of `x` and the panel at `panel` (`x.nb` blocks).
///
/// # Safety
/// `g + MV <= x.tiles`; `panel` must hold `x.nb` blocks of `K::BYTES` bytes; the CPU must have
/// AVX-512 F, BW, VL and VNNI (the caller's target features).
// `v` and `j` index several arrays at once (the accumulators, the activation registers, the
// panel's rows).
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn tile<K: Kind, const MV: usize>(x: &XTiles, g: usize, panel: *const u8) -> [[__m512; NR]; MV] {
    // SAFETY: every read is inside tiles `g .. g + MV` of `x` (codes, scales, extras: `x.nb`
    // blocks each) or the panel's `x.nb` blocks, as the caller guarantees.
    unsafe {
        let nb = x.nb;
        let codes: [*const u8; MV] = std::array::from_fn(|v| x.codes.as_ptr().add((g + v) * LANES * x.k));
        let xd: [*const f32; MV] = std::array::from_fn(|v| x.d.as_ptr().add((g + v) * nb * LANES));
        let mut out = [[_mm512_setzero_ps(); NR]; MV];
        let mut corr = [[_mm512_setzero_ps(); NR]; MV];
        let word = |p: *const u8, at: usize| p.add(at).cast::<i32>().read_unaligned();
        for b in 0..nb {
            let blk = panel.add(b * K::BYTES);
            let mut int = [[_mm512_setzero_si512(); NR]; MV];
            for grp in 0..K::BLOCK / K::GROUP {
                let mut acc = [[_mm512_setzero_si512(); NR]; MV];
                for t in 0..K::GROUP / 4 {
                    let e = grp * K::GROUP + 4 * t;
                    let xv: [__m512i; MV] =
                        std::array::from_fn(|v| _mm512_loadu_si512(codes[v].add((b * K::BLOCK + e) * LANES).cast()));
                    for j in 0..NR {
                        let w = _mm512_set1_epi32(word(blk, j * K::BLOCK + e));
                        for v in 0..MV {
                            acc[v][j] = _mm512_dpbusd_epi32(acc[v][j], xv[v], w);
                        }
                    }
                }
                if K::SCALED {
                    for j in 0..NR {
                        let sc = _mm512_set1_epi32(word(blk, K::SC + 4 * (grp * NR + j)));
                        for v in 0..MV {
                            int[v][j] = _mm512_add_epi32(int[v][j], _mm512_mullo_epi32(acc[v][j], sc));
                        }
                    }
                } else {
                    int = acc;
                }
            }
            let dx: [__m512; MV] = std::array::from_fn(|v| _mm512_loadu_ps(xd[v].add(b * LANES)));
            for j in 0..NR {
                let c128 = _mm512_set1_epi32(word(blk, K::C128 + 4 * j));
                let d = _mm512_set1_ps(f32::from_bits(word(blk, K::D + 4 * j) as u32));
                for v in 0..MV {
                    let sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(int[v][j], c128));
                    out[v][j] = _mm512_fmadd_ps(sums, _mm512_mul_ps(d, dx[v]), out[v][j]);
                }
                if K::MINS {
                    let dmin = _mm512_set1_ps(f32::from_bits(word(blk, K::DMIN + 4 * j) as u32));
                    for v in 0..MV {
                        let xp = x.pairs.as_ptr().add(((g + v) * nb + b) * K::NP * LANES);
                        let mut mins = _mm512_setzero_si512();
                        for p in 0..K::NP {
                            let mn = _mm512_set1_epi32(word(blk, K::PAIRS + 4 * (p * NR + j)));
                            mins = _mm512_dpwssd_epi32(mins, _mm512_loadu_si512(xp.add(p * LANES).cast()), mn);
                        }
                        out[v][j] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(dmin, dx[v]), out[v][j]);
                    }
                }
                if K::OFFSET8 {
                    for v in 0..MV {
                        let sx = _mm512_loadu_ps(x.sx.as_ptr().add(((g + v) * nb + b) * LANES));
                        corr[v][j] = _mm512_fmadd_ps(d, sx, corr[v][j]);
                    }
                }
            }
        }
        if K::OFFSET8 {
            for v in 0..MV {
                for j in 0..NR {
                    out[v][j] = _mm512_fnmadd_ps(_mm512_set1_ps(8.0), corr[v][j], out[v][j]);
                }
            }
        }
        out
    }
}

/// Outputs of one group of activation tiles: lane `l` of tile `v` against panel row `j` at
/// `[16 v + l][4 p + j]`, panel `p` after panel.
type GroupBuf = [[f32; CHUNK_ROWS]; MV * LANES];

/// The `mv <= MV` tiles from `g` of `x` against every panel in `panels_at` (`rows` weight rows
/// in all) into `buf`, each group of tiles against every panel in turn (its codes stay in cache
/// across the panels).
///
/// # Safety
/// `g + mv <= x.tiles`; `panels_at` must hold `rows.div_ceil(NR)` panels of `x.nb` blocks; the
/// CPU must have AVX-512 F, BW, VL and VNNI, AVX2, FMA (the callers' target features).
#[inline(always)]
unsafe fn group<K: Kind>(x: &XTiles, panels_at: *const u8, rows: usize, g: usize, mv: usize, buf: &mut GroupBuf) {
    let panel_bytes = x.nb * K::BYTES;
    for p in 0..rows.div_ceil(NR) {
        let at = panels_at.wrapping_add(p * panel_bytes);
        let (out3, out2, out1);
        // SAFETY: `g + mv <= x.tiles`, panel `p` is inside `panels_at`, the CPU is the caller's.
        let out: &[[__m512; NR]] = unsafe {
            match mv {
                3 => {
                    out3 = tile::<K, 3>(x, g, at);
                    &out3
                }
                2 => {
                    out2 = tile::<K, 2>(x, g, at);
                    &out2
                }
                _ => {
                    out1 = tile::<K, 1>(x, g, at);
                    &out1
                }
            }
        };
        for (v, out) in out.iter().enumerate() {
            for (j, o) in out.iter().enumerate() {
                let mut lanes = [0f32; LANES];
                // SAFETY: `lanes` holds 16 floats.
                unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), *o) };
                for (l, &val) in lanes.iter().enumerate() {
                    if let Some(slot) = buf[LANES * v + l].get_mut(p * NR + j) {
                        *slot = val;
                    }
                }
            }
        }
    }
}

/// Every activation tile of `x` against the panels in `panels_at` (`rows <= CHUNK_ROWS` weight
/// rows in all), written into `y` (`[m, n]` row-major) at columns `col .. col + rows`: tiles
/// [`MV`] at a time (then fewer), their outputs gathered in a buffer ([`group`]) and written a
/// row of `rows` columns at a time.
///
/// # Safety
/// `panels_at` must hold `rows.div_ceil(NR)` panels of `x.nb` blocks; `y` must be valid for
/// writes of `m · n` `f32`, with `m <= 16 x.tiles` and `col + rows <= n`, and no one else may
/// touch those columns meanwhile; the CPU must have AVX-512 F, BW, VL and VNNI, AVX2, FMA.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub(crate) unsafe fn panels<K: Kind>(
    x: &XTiles,
    panels_at: *const u8,
    rows: usize,
    y: *mut f32,
    (m, n, col): (usize, usize, usize),
) {
    assert!(rows <= CHUNK_ROWS, "panels: rows");
    let mut buf = [[0f32; CHUNK_ROWS]; MV * LANES];
    let mut g = 0;
    while g < x.tiles {
        let mv = (x.tiles - g).min(MV);
        // SAFETY: `g + mv <= x.tiles`; the panels and the CPU are the caller's.
        unsafe { group::<K>(x, panels_at, rows, g, mv, &mut buf) };
        for (i, row) in buf.iter().enumerate().take(m.saturating_sub(LANES * g).min(LANES * mv)) {
            // SAFETY: row `16 g + i < m`, columns `col .. col + rows <= n`, which the caller gave
            // this call alone.
            unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), y.add((LANES * g + i) * n + col), rows) };
        }
        g += mv;
    }
}

/// [`panels`] for two weights of `rows` rows each (a gate's and an up projection's same rows):
/// per group of tiles both products into buffers of [`CHUNK_ROWS`] columns per activation row,
/// then one call `f(gate, up, out)` on the group's rows of those buffers (element-wise, so the
/// columns past `rows` it also sees are discarded), and the first `rows` columns of each row of
/// `out` written into columns `col .. col + rows` of `y` (`[m, n]`).
///
/// # Safety
/// As [`panels`], for both `gate_at` and `up_at`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub(crate) unsafe fn paired_panels<K: Kind>(
    x: &XTiles,
    (gate_at, up_at): (*const u8, *const u8),
    rows: usize,
    y: *mut f32,
    (m, n, col): (usize, usize, usize),
    f: &super::super::matmul::PairEpilogue<'_>,
) {
    assert!(rows <= CHUNK_ROWS, "paired_panels: rows");
    let mut gate = [[0f32; CHUNK_ROWS]; MV * LANES];
    let mut up = [[0f32; CHUNK_ROWS]; MV * LANES];
    let mut out = [[0f32; CHUNK_ROWS]; MV * LANES];
    let mut g = 0;
    while g < x.tiles {
        let mv = (x.tiles - g).min(MV);
        // SAFETY: `g + mv <= x.tiles`; the panels and the CPU are the caller's.
        unsafe {
            group::<K>(x, gate_at, rows, g, mv, &mut gate);
            group::<K>(x, up_at, rows, g, mv, &mut up);
        }
        let valid = m.saturating_sub(LANES * g).min(LANES * mv);
        let len = valid * CHUNK_ROWS;
        f(&gate.as_flattened()[..len], &up.as_flattened()[..len], &mut out.as_flattened_mut()[..len]);
        for (i, row) in out.iter().enumerate().take(valid) {
            // SAFETY: row `16 g + i < m`, columns `col .. col + rows <= n`, which the caller gave
            // this call alone.
            unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), y.add((LANES * g + i) * n + col), rows) };
        }
        g += mv;
    }
}
