//! The integer GEMM of `quant_matmul` on AVX512-VNNI, for Q4_0, Q4_K and Q6_K weights in any
//! [`RowLayout`]: prefill-sized products on 8-bit integers, where the decode kernels
//! (`dot_q4x8`, `dot_q4kx8`, `dot_q6kx8`) stream the weight once per few activation rows and
//! unpack its codes each time.
//!
//! `x` is quantized once per call, exactly as the decode kernels quantize it (`xtiles`: blocks
//! of 32 or 256, `f32` scales, codes rounded to nearest), into tiles of 16 rows. The weight is
//! cut into chunks of [`CHUNK_ROWS`] rows, one pool task each: the task unpacks its rows once
//! into panels of 4 (`panel`: 8-bit codes in element order, integer group scales, `f32`
//! scales), then runs the micro-kernel (`kernel`) over every three activation tiles (48 rows of `x`) and every
//! panel. The micro-kernel computes, for activation row `i` and weight row `r`, per block `b`:
//!
//! `y_ir += d_rb dx_ib Σ_g sc_rg Σ_{e in g} code_re q_ie  (- dmin_rb dx_ib Σ_g mn_rg Σ_{e in g} q_ie)`
//!
//! with the same integers and the same `f32` operations in the same order as the decode kernels
//! of the interleaved layouts, so the result is bitwise theirs (and `quant_matmul`'s error bound
//! of the integer path holds). Only the instruction count differs: one `vpdpbusd` per 64
//! products, each weight code unpacked once per call rather than once per few activation rows.

mod kernel;
mod panel;
mod xtiles;

use super::interleave::RowLayout;
use super::types::QuantType;
use crate::pool;
use panel::{Kind, Q4K, Q6K, Q40};
use std::cell::RefCell;
use xtiles::XTiles;

/// Weight rows per task: 12 panels of 4 (a multiple of 8, so a task starts on a group of
/// interleaved rows). Their unpacked panels (about 120 KiB for rows of 2048 Q4_K) stay in L2 while
/// every activation tile passes.
const CHUNK_ROWS: usize = 48;

/// Whether [`igemm`] takes weights of type `t`.
pub(crate) fn takes(t: QuantType) -> bool {
    matches!(t, QuantType::Q4_0 | QuantType::Q4K | QuantType::Q6K)
}

/// `y = x W^T` for `rows` weight rows of `k` elements of `t` ([`takes`]) stored in `layout`,
/// `x` `[m, k]`, `y` `[m, rows]` (every element written); `k` a positive multiple of `t`'s
/// block, `w.len() == rows * t.row_bytes(k)`.
///
/// # Safety
/// The CPU must have AVX-512 F, BW, VL and VNNI, AVX2 and FMA.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn igemm(
    t: QuantType,
    layout: RowLayout,
    w: &[u8],
    rows: usize,
    k: usize,
    x: &[f32],
    m: usize,
    y: &mut [f32],
) {
    // SAFETY: forwarded.
    unsafe {
        match t {
            QuantType::Q4_0 => run::<Q40>(layout, w, rows, k, x, m, y),
            QuantType::Q4K => run::<Q4K>(layout, w, rows, k, x, m, y),
            QuantType::Q6K => run::<Q6K>(layout, w, rows, k, x, m, y),
            _ => unreachable!("igemm: {t} is not taken"),
        }
    }
}

/// `y` as a raw pointer for the tasks, which write disjoint columns of it.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: used only inside `pool::run`, which returns after every task, while the `&mut [f32]`
// it came from is borrowed; each task writes its own columns.
unsafe impl Sync for Out {}

impl Out {
    /// The pointer (a method, so closures capture the whole `Out`).
    fn get(self) -> *mut f32 {
        self.0
    }
}

thread_local! {
    /// A task's unpacked panels, kept between calls.
    static PANELS: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    /// The quantized activation tiles of the calling thread, kept between calls.
    static XT: RefCell<XTiles> = const { RefCell::new(XTiles::empty()) };
}

/// [`igemm`] for one type.
///
/// # Safety
/// As [`igemm`].
unsafe fn run<K: Kind>(layout: RowLayout, w: &[u8], rows: usize, k: usize, x: &[f32], m: usize, y: &mut [f32]) {
    let row_bytes = w.len() / rows;
    let nb = k / K::BLOCK;
    let mut xt = XT.with(|b| std::mem::replace(&mut *b.borrow_mut(), XTiles::empty()));
    // SAFETY: the CPU is the caller's.
    unsafe { xt.fill(x, m, k, K::BLOCK, K::EXTRA) };
    let out = Out(y.as_mut_ptr());
    let task = |c: usize| {
        let (r0, r1) = (c * CHUNK_ROWS, ((c + 1) * CHUNK_ROWS).min(rows));
        PANELS.with(|p| {
            let mut p = p.borrow_mut();
            // SAFETY: the CPU is the caller's.
            unsafe { panel::build::<K>(&w[r0 * row_bytes..r1 * row_bytes], layout, r1 - r0, row_bytes, nb, &mut p) };
            // SAFETY: `p` holds the panels of rows `r0..r1` (`nb` blocks each, as `xt`); `y` is
            // `[m, rows]` and this task alone writes columns `r0..r1`; the CPU is the caller's.
            unsafe { kernel::panels::<K>(&xt, p.as_ptr(), r1 - r0, out.get(), (m, rows, r0)) };
        })
    };
    pool::run(rows.div_ceil(CHUNK_ROWS), &task);
    XT.with(|b| *b.borrow_mut() = xt);
}
