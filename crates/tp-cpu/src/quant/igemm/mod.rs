//! The integer GEMM of `quant_matmul` on AVX512-VNNI, for Q4_0, Q4_K and Q6_K weights in any
//! [`RowLayout`]: products of 32 or more activation rows (prefill, batched decode) on 8-bit
//! integers, where the decode kernels (`dot_q4x8`, `dot_q4kx8`, `dot_q6kx8`) stream the weight
//! once per few activation rows and unpack its codes each time.
//!
//! `x` is quantized once per call (per block size the weight's parts need), exactly as the
//! decode kernels quantize it (`xtiles`: blocks of 32 or 256, `f32` scales, codes rounded to
//! nearest), into tiles of 16 rows. The weight (all its parts, for a fused projection) is cut
//! into chunks of [`CHUNK_ROWS`] rows, one pool task each, all in one job: the task unpacks its
//! rows once into panels of 4 (`panel`: 8-bit codes in element order, integer group scales,
//! `f32` scales; Q4_K and Q6_K groups in their interleaved layouts eight rows at a time,
//! `q4kx8`, `q6kx8`), then runs the micro-kernel (`kernel`) over every three activation tiles
//! (48 rows of `x`) and every panel. The micro-kernel computes, for activation row `i` and
//! weight row `r`, per block `b`:
//!
//! `y_ir += d_rb dx_ib Σ_g sc_rg Σ_{e in g} code_re q_ie  (- dmin_rb dx_ib Σ_g mn_rg Σ_{e in g} q_ie)`
//!
//! with the same integers and the same `f32` operations in the same order as the decode kernels
//! of the interleaved layouts, so the result is bitwise theirs (and `quant_matmul`'s error bound
//! of the integer path holds). Only the instruction count differs: one `vpdpbusd` per 64
//! products, each weight code unpacked once per call rather than once per few activation rows.

mod kernel;
mod panel;
mod q4kx8;
mod q4x8;
mod q6kx8;
mod xtiles;

use super::interleave::RowLayout;
use super::matmul::QuantPart;
use super::types::QuantType;
use crate::pool::{self, TaskPtr};
use panel::{Kind, Q4K, Q6K, Q40};
use std::cell::RefCell;
use xtiles::XTiles;

/// Weight rows per task: 12 panels of 4 (a multiple of 8, so a task starts on a group of
/// interleaved rows). Their unpacked panels (about 120 KiB for rows of 2048 Q4_K) stay in L2
/// while every activation tile passes.
const CHUNK_ROWS: usize = 48;

/// Whether [`igemm`] takes weights of type `t`.
pub(crate) fn takes(t: QuantType) -> bool {
    matches!(t, QuantType::Q4_0 | QuantType::Q4K | QuantType::Q6K)
}

/// `y = x W^T` for a weight made of `parts` stacked along the rows (each of a type [`takes`]
/// takes, `rows` rows of `k` elements stored in its `layout`: a fused q/k/v or gate/up projection
/// of a Q4_K_M file, or one weight), `x` `[m, k]`, `y` `[m, Σ rows]` (every element written; part
/// `p`'s outputs in the columns after those of the parts before it). `x` is quantized once per
/// block size the parts need, and every part's chunks of rows go to the pool as one job.
/// `k` is a positive multiple of every part's block, each `w.len() == rows * t.row_bytes(k)`,
/// `m > 0`.
///
/// # Safety
/// The CPU must have AVX-512 F, BW, VL and VNNI, AVX2 and FMA.
pub(crate) unsafe fn igemm(parts: &[QuantPart<'_>], k: usize, x: &[f32], m: usize, y: &mut [f32]) {
    let n: usize = parts.iter().map(|p| p.rows).sum();
    assert!(y.len() == m * n && x.len() == m * k && parts.iter().all(|p| takes(p.t)), "igemm: operands");
    // (part, its first column in `y`, first row, end row) of every task.
    let mut tasks = Vec::new();
    let mut col = 0;
    for (i, p) in parts.iter().enumerate() {
        tasks.extend((0..p.rows).step_by(CHUNK_ROWS).map(|r0| (i, col, r0, (r0 + CHUNK_ROWS).min(p.rows))));
        col += p.rows;
    }
    // SAFETY: the CPU is the caller's.
    let (x256, x32) = unsafe { tiles_for(parts, x, m, k) };
    let out = TaskPtr(y.as_mut_ptr());
    let task = |i: usize| {
        let (p, col, r0, r1) = tasks[i];
        let part = &parts[p];
        let row_bytes = part.w.len() / part.rows;
        let w = &part.w[r0 * row_bytes..r1 * row_bytes];
        let at = (m, n, col + r0);
        // SAFETY: `y` is `[m, n]`, and this task alone writes its columns `col + r0 .. col +
        // r1`; the tiles were filled for the part's block size; the CPU is the caller's.
        unsafe {
            match part.t {
                QuantType::Q4_0 => chunk::<Q40>(&x32, w, part.layout, r1 - r0, row_bytes, out.get(), at),
                QuantType::Q4K => chunk::<Q4K>(&x256, w, part.layout, r1 - r0, row_bytes, out.get(), at),
                QuantType::Q6K => chunk::<Q6K>(&x256, w, part.layout, r1 - r0, row_bytes, out.get(), at),
                t => unreachable!("igemm: {t} is not taken"),
            }
        }
    };
    pool::run(tasks.len(), &task);
    keep_tiles(x256, x32);
}

/// `x` (`[m, k]`) quantized into the tiles the parts' types need, in the calling thread's kept
/// buffers: blocks of 256 for Q4_K and Q6_K (with Q4_K's min pairs where a part is Q4_K: Q6_K
/// needs none, Q4_K's are a superset), of 32 for Q4_0. Hand them back with [`keep_tiles`].
///
/// # Safety
/// As [`igemm`]; `k` a multiple of the parts' blocks.
unsafe fn tiles_for(parts: &[QuantPart<'_>], x: &[f32], m: usize, k: usize) -> (XTiles, XTiles) {
    let mut x256 = X256.with(|b| std::mem::replace(&mut *b.borrow_mut(), XTiles::empty()));
    let mut x32 = X32.with(|b| std::mem::replace(&mut *b.borrow_mut(), XTiles::empty()));
    let has = |t: QuantType| parts.iter().any(|p| p.t == t);
    // SAFETY: the CPU is the caller's.
    unsafe {
        if has(QuantType::Q4K) || has(QuantType::Q6K) {
            x256.fill(x, m, k, 256, if has(QuantType::Q4K) { Q4K::EXTRA } else { Q6K::EXTRA });
        }
        if has(QuantType::Q4_0) {
            x32.fill(x, m, k, 32, Q40::EXTRA);
        }
    }
    (x256, x32)
}

/// Gives the tiles of [`tiles_for`] back to the calling thread for its next call.
fn keep_tiles(x256: XTiles, x32: XTiles) {
    X256.with(|b| *b.borrow_mut() = x256);
    X32.with(|b| *b.borrow_mut() = x32);
}

/// `y[i, c] = f(gate_ic, up_ic)`: the products of `x` with `gate` and `up` (parts of one type
/// and one row count `I`), each task's rows of both unpacked and multiplied together and
/// combined by the element-wise `f` per block of activation rows (`kernel::paired_panels`),
/// instead of written side by side; `y` is `[m, I]`. The products are bitwise those of
/// [`igemm`], so `y` is bitwise `f` applied to its `[m, 2I]` output. The rest as [`igemm`].
///
/// # Safety
/// As [`igemm`].
pub(crate) unsafe fn igemm_paired(
    gate: &QuantPart<'_>,
    up: &QuantPart<'_>,
    k: usize,
    x: &[f32],
    m: usize,
    y: &mut [f32],
    f: &super::matmul::PairEpilogue<'_>,
) {
    let n = gate.rows;
    assert!(
        up.rows == n && up.t == gate.t && takes(gate.t) && y.len() == m * n && x.len() == m * k,
        "igemm_paired: operands"
    );
    // SAFETY: the CPU is the caller's.
    let (x256, x32) = unsafe { tiles_for(&[*gate, *up], x, m, k) };
    let xt = if gate.t == QuantType::Q4_0 { &x32 } else { &x256 };
    let out = TaskPtr(y.as_mut_ptr());
    let task = |i: usize| {
        let (r0, r1) = (i * CHUNK_ROWS, ((i + 1) * CHUNK_ROWS).min(n));
        let row_bytes = gate.w.len() / n;
        let (wg, wu) = (&gate.w[r0 * row_bytes..r1 * row_bytes], &up.w[r0 * row_bytes..r1 * row_bytes]);
        // SAFETY: `y` is `[m, n]` and this task alone writes its columns `r0 .. r1`; the tiles
        // were filled for the parts' block size; the CPU is the caller's.
        unsafe {
            match gate.t {
                QuantType::Q4_0 => {
                    pair::<Q40>(xt, (wg, wu), (gate.layout, up.layout), r1 - r0, row_bytes, out.get(), (m, n, r0), f)
                }
                QuantType::Q4K => {
                    pair::<Q4K>(xt, (wg, wu), (gate.layout, up.layout), r1 - r0, row_bytes, out.get(), (m, n, r0), f)
                }
                QuantType::Q6K => {
                    pair::<Q6K>(xt, (wg, wu), (gate.layout, up.layout), r1 - r0, row_bytes, out.get(), (m, n, r0), f)
                }
                t => unreachable!("igemm_paired: {t} is not taken"),
            }
        }
    };
    pool::run(n.div_ceil(CHUNK_ROWS), &task);
    keep_tiles(x256, x32);
}

thread_local! {
    /// A task's unpacked panels, kept between calls.
    static PANELS: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    /// The up projection's panels of a paired task.
    static UP_PANELS: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    /// The calling thread's quantized activation tiles (blocks of 256 and of 32), kept between
    /// calls.
    static X256: RefCell<XTiles> = const { RefCell::new(XTiles::empty()) };
    static X32: RefCell<XTiles> = const { RefCell::new(XTiles::empty()) };
}

/// One task: `rows` (at most [`CHUNK_ROWS`]) weight rows `w` of `K` (`row_bytes` each, stored in
/// `layout`, starting on a group of eight) unpacked into panels and multiplied by every tile of
/// `xt`, into columns `col .. col + rows` of `y` (`[m, n]`).
///
/// # Safety
/// `y` valid for `m · n` writes, those columns this call's alone, `col + rows <= n`; `xt` filled
/// for `K`'s block size with the rows of `x`; the CPU must have AVX-512 F, BW, VL and VNNI, AVX2
/// and FMA.
unsafe fn chunk<K: Kind>(
    xt: &XTiles,
    w: &[u8],
    layout: RowLayout,
    rows: usize,
    row_bytes: usize,
    y: *mut f32,
    at: (usize, usize, usize),
) {
    PANELS.with(|p| {
        let mut p = p.borrow_mut();
        // SAFETY: the CPU is the caller's.
        unsafe { panel::build::<K>(w, layout, rows, row_bytes, xt.nb, &mut p) };
        // SAFETY: `p` holds the panels of the `rows` rows (`xt.nb` blocks each); the rest is the
        // caller's.
        unsafe { kernel::panels::<K>(xt, p.as_ptr(), rows, y, at) };
    })
}

/// One task of [`igemm_paired`]: the same `rows` rows of the gate and up weights unpacked into
/// panels, then [`kernel::paired_panels`].
///
/// # Safety
/// As [`chunk`], for both weights.
#[allow(clippy::too_many_arguments)]
unsafe fn pair<K: Kind>(
    xt: &XTiles,
    (wg, wu): (&[u8], &[u8]),
    (lg, lu): (RowLayout, RowLayout),
    rows: usize,
    row_bytes: usize,
    y: *mut f32,
    at: (usize, usize, usize),
    f: &super::matmul::PairEpilogue<'_>,
) {
    PANELS.with(|pg| {
        UP_PANELS.with(|pu| {
            let (mut pg, mut pu) = (pg.borrow_mut(), pu.borrow_mut());
            // SAFETY: the CPU is the caller's.
            unsafe {
                panel::build::<K>(wg, lg, rows, row_bytes, xt.nb, &mut pg);
                panel::build::<K>(wu, lu, rows, row_bytes, xt.nb, &mut pu);
            }
            // SAFETY: `pg` and `pu` hold the panels of the `rows` rows (`xt.nb` blocks each); the
            // rest is the caller's.
            unsafe { kernel::paired_panels::<K>(xt, (pg.as_ptr(), pu.as_ptr()), rows, y, at, f) };
        })
    })
}
