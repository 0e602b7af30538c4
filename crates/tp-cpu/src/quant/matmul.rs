//! [`quant_matmul`]: `y = x W^T` with a quantized weight, on four paths:
//!
//! * few rows of `x` (decode and batched decode, `m < GEMM_MIN_M`; for rows in an interleaved
//!   layout on AVX2 up to `INTERLEAVED_GEMM_MIN_M`), quantized weight types: `x` quantized once
//!   per call (`act`), then each weight row streamed once per pass of at most 92 rows and dotted
//!   in integers with them (`dot_x86` / `dot_portable`), weight rows split over the pool's
//!   threads;
//! * on AVX512-VNNI, Q4_0, Q4_K and Q6_K weights from 32 rows of `x` (prefill and batched
//!   decode): the integer GEMM (`igemm`), the same integers and roundings as the decode kernels
//!   of the interleaved layouts, each weight row unpacked once per call;
//! * few rows, `F32` / `F16` / `BF16` weights: each weight row widened to `f32` in a buffer and
//!   dotted with the `f32` rows of `x`;
//! * many rows (prefill) of the other types, or a batch-invariant thread
//!   ([`crate::set_batch_invariant`]): tiles of weight rows dequantized for the packed GEMM
//!   (`prefill`).

use super::act::{QuantX, XRow};
use super::dequant::dequantize_unchecked;
use super::dot_portable;
use super::interleave::{RowLayout, with_ggml_rows};
use super::prefill;
use super::types::QuantType;
use crate::dispatch::{CpuKernel, Int8Isa, Isa};
use crate::error::{Error, Result};
use crate::matmul::batch_invariant;
use crate::pool::{self, TaskPtr};
use std::cell::RefCell;
use std::mem::MaybeUninit;

/// Rows of `x` from which the dequantize-and-GEMM path runs: below it the integer kernels are
/// faster (measured on this Zen 4, two threads, 5632 x 2048 weights of Q4_0 / Q4_K / Q6_K / Q8_0:
/// at 32 rows the integer path takes 0.65-0.9 of the GEMM path's time, at 64 they are within 10%
/// either way, at 128 the GEMM takes 0.75-0.9, at 256 0.5-0.8).
const GEMM_MIN_M: usize = 48;
/// The same for a part stored in an interleaved layout (`RowLayout::Q4_0x8`, `Q4Kx8`, `Q6Kx8`)
/// on the AVX2 integer kernels, which read eight rows at once: measured on Zen 4 (two threads,
/// `[5632, 2048]` Q4_K), the integer path took 2.8 ms at 48 rows against the GEMM path's 3.7,
/// 3.8 at 64 against 4.3, and they met near 96.
const INTERLEAVED_GEMM_MIN_M: usize = 96;
/// Rows of `x` from which Q4_0, Q4_K and Q6_K weights (any layout) take the integer GEMM
/// (`igemm`) on AVX512-VNNI. Measured on Zen 4 (two threads, `[5632, 2048]` in the interleaved
/// layouts, whose groups unpack eight rows at a time, eight copies read in turn from memory,
/// against the decode kernels in passes of [`STREAM_CHUNK_M`] rows): Q4_K 1.07 against 0.99 ms
/// at 16 rows, 1.62 against 1.42 at 24 (two tiles of 16 either way), 1.62 against 1.97 at 32,
/// 2.20 against 2.70 at 48; Q6_K 2.10 against 2.01 at 24, 2.04 against 2.59 at 32; Q4_0 1.06
/// against 0.97 at 16, 1.68 against 1.84 at 32, 2.99 against 3.67 at 64. From 2048 rows the
/// GEMM runs at 1.5x (Q4_K), 2.2x (Q6_K) and 1.4x (Q4_0) the decode kernels, 2x the
/// dequantizing `bf16` GEMM.
const IGEMM_MIN_M: usize = 32;
/// The most rows of `x` one pass of the streaming (integer) path takes (bounds its per-task
/// buffer).
const STREAM_MAX_M: usize = 96;
/// Rows of `x` per pass when more take the streaming path (a multiple of 4, the kernels'
/// widest step): each pass streams the weight once more, which costs little beside its
/// products at these row counts.
const STREAM_CHUNK_M: usize = 92;

/// Rows of `x` from which part `p` takes the GEMM path on `isa` (on AVX512-VNNI, for the types
/// `igemm` takes, the integer GEMM).
fn gemm_min_m(p: &QuantPart<'_>, isa: Int8Isa) -> usize {
    match (isa, p.t) {
        (Int8Isa::Avx512Vnni, QuantType::Q4_0 | QuantType::Q4K | QuantType::Q6K) => IGEMM_MIN_M,
        _ if !p.layout.applies(p.t) => GEMM_MIN_M,
        (Int8Isa::Avx2, _) => INTERLEAVED_GEMM_MIN_M,
        _ => GEMM_MIN_M,
    }
}
/// Weight bytes per task of the streaming paths (with at most `MAX_TASK_ROWS` rows: 64 rows of
/// the usual widths, llama.cpp's chunk; measured faster than 48 KiB tasks streaming from memory).
const TASK_BYTES: usize = 256 << 10;
/// Weight bytes times activation rows below which one thread streams everything.
const PARALLEL_MIN_BYTES: usize = 64 << 10;

/// y[m, n] = sum_k x[m, k] * W[n, k] (+ nothing): `W` is `rows` rows of `k` elements of type `t`
/// stored row after row (`w.len() == rows * t.row_bytes(k)`), `x` is `[m, k]` `f32` row-major,
/// `y` is `[m, rows]` `f32` row-major (every element written). Rows are split over tp-cpu's
/// thread pool.
///
/// For quantized `t` and `m < 48` (decode, small batches; for rows in an interleaved layout on
/// the AVX2 integer kernels `m < 96`, in passes of at most 92 rows), each block of `x` is
/// quantized once to 8 bits (Q8_0 blocks of 32 for the legacy types, Q8_K blocks of 256 for the
/// K-quants; `f32` scales `d = amax / 127`, codes rounded to nearest), the dot products run on
/// integers (AVX512-VNNI, AVX2 or portable, as the calling thread's [`CpuKernel`] allows) with
/// `f32` accumulation, and each weight row is streamed once for all `m` rows of `x`. On
/// AVX512-VNNI, Q4_0, Q4_K and Q6_K weights stay on integers at every `m` (from 32 rows in the
/// integer GEMM, whose outputs are bitwise those of the decode kernels of the interleaved
/// layouts). `F32` / `F16` / `BF16` weights take `x` as `f32` there. For more rows
/// (prefill) of the other types, or on a batch-invariant thread
/// ([`crate::set_batch_invariant`]), tiles of `W` are dequantized and multiplied by `x` with the
/// packed GEMM: quantized and `BF16` weights as `bf16` with `x` rounded to `bf16`
/// (the `bf16` micro-kernels; denormal `bf16` values may be flushed to zero there), `F32` and
/// `F16` weights as `f32` with the `f32` `x`.
///
/// Error bound (integer path). Write `d_b = amax_b / 127` for the activation block `b` (32 or 256
/// elements of a row of `x`), `r_b` for the largest magnitude the weight block under it can encode
/// given its scales (Q4_0 `8|d|`, Q4_1 `|m| + 15|d|`, Q5_0 `16|d|`, Q5_1 `|m| + 31|d|`, Q8_0
/// `128|d|`, Q2_K `45|d| + 15|dmin|`, Q3_K `128|d|`, Q4_K `945|d| + 63|dmin|`, Q5_K
/// `1953|d| + 63|dmin|`, Q6_K `4096|d|`), `N` for the blocks in a row and `w` for the dequantized
/// weights. Then each output differs from the exact `Σ_k w_k x_k` by at most
///
/// `Σ_b (d_b / 2)(1 + 2^-20) Σ_{k in b} |w_k|  +  (N + 8) 2^-22 Σ_b r_b Σ_{k in b} (|x_k| + d_b)`:
///
/// the first term is the activation rounding (`|x - d q| <= d / 2` per element), the second the
/// `f32` arithmetic (integer sums are exact; every term that enters the `f32` sums is at most
/// `2 r_b (|x_k| + d_b)` per element, and each passes through at most `N + 8` roundings).
/// The `bf16` GEMM path rounds `w` and `x` by at most `2^-9` each (relative) and accumulates in
/// `f32`: at most `(2^-8 + 2^-17 + (k + 8) 2^-22) Σ_k |w_k x_k|`. The `f32` paths (float
/// weights) carry only the accumulation, at most `(k + 8) 2^-23 Σ_k |w_k x_k|`.
///
/// Errors: [`Error::NotWholeBlocks`] if `k` is not a multiple of `t`'s block;
/// [`Error::ShapeOverflow`] if a buffer size overflows `usize`; [`Error::QuantLength`] if `w` is
/// not `rows * t.row_bytes(k)` bytes; [`Error::OperandLength`] if `x` or `y` has the wrong length.
pub fn quant_matmul(t: QuantType, w: &[u8], rows: usize, k: usize, x: &[f32], m: usize, y: &mut [f32]) -> Result<()> {
    quant_matmul_parts(&[QuantPart { t, w, rows, layout: RowLayout::Ggml }], k, x, m, y)
}

/// One block of weight rows of a [`quant_matmul_parts`] product: `rows` rows of type `t` in `w`,
/// stored in `layout` ([`RowLayout`]: ggml's, or the eight-row interleaving of Q4_0, Q4_K and Q6_K,
/// which the host decode kernels read fastest; every path accepts either).
#[derive(Debug, Clone, Copy)]
pub struct QuantPart<'a> {
    /// The rows' block type.
    pub t: QuantType,
    /// `rows * t.row_bytes(k)` bytes.
    pub w: &'a [u8],
    /// Weight rows (outputs) in this part.
    pub rows: usize,
    /// How the rows are stored.
    pub layout: RowLayout,
}

/// [`quant_matmul`] of a weight made of several parts stacked along the rows (a fused q/k/v or
/// gate/up projection whose parts are stored apart, each of its own type, all with rows of `k`
/// elements): `y` is `[m, Σ rows]`, part `p`'s outputs in the columns after those of the parts
/// before it. Bitwise the same as one [`quant_matmul`] per part with the columns put side by
/// side, but in one pass: on the decode paths `x` is quantized once (per block size the parts
/// need) and every part's rows go to the pool as one job.
///
/// Errors: those of [`quant_matmul`], for any part.
pub fn quant_matmul_parts(parts: &[QuantPart<'_>], k: usize, x: &[f32], m: usize, y: &mut [f32]) -> Result<()> {
    let (shapes, n) = check_parts(parts, k, x, m, y.len(), None)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        y.fill(0.0);
        return Ok(());
    }
    let kernel = CpuKernel::current();
    #[cfg(target_arch = "x86_64")]
    if takes_igemm(parts, m, kernel.int8_isa()) {
        // SAFETY: `takes_igemm` holds only where the CPU has AVX-512 F, BW, VL and VNNI (and
        // AVX2 and FMA, which AVX-512 detection requires); the shapes were checked above, `k`
        // and `m` are positive.
        unsafe { super::igemm::igemm(parts, k, x, m, y) };
        return Ok(());
    }
    parts_apart(parts, &shapes, n, kernel, k, x, m, y)
}

/// Whether the integer GEMM takes a product of `m` rows with `parts`: AVX512-VNNI, every part
/// of a type it takes and at least its threshold of rows, results not made batch-invariant.
#[cfg(target_arch = "x86_64")]
fn takes_igemm(parts: &[QuantPart<'_>], m: usize, isa: Int8Isa) -> bool {
    isa == Int8Isa::Avx512Vnni
        && !batch_invariant()
        && parts.iter().all(|p| super::igemm::takes(p.t) && m >= gemm_min_m(p, isa))
}

/// `f(gate, up, out)`: an element-wise combination of a gate and an up projection's outputs
/// (`out[i]` from `gate[i]` and `up[i]` alone; the three of one length, a block of several
/// activation rows' segments, with columns beyond the product's, whose results are dropped).
pub type PairEpilogue<'a> = dyn Fn(&[f32], &[f32], &mut [f32]) + Sync + 'a;

/// A gate and an up projection's products combined as they are made: where the integer GEMM
/// takes the product (see [`quant_matmul_parts`]: AVX512-VNNI, 32 rows or more; here also one
/// type and one row count `I` for both), `y: [m, I]` receives `f(x gate^T, x up^T)` block by
/// block and the answer is `Ok(true)`: bitwise `f` applied to the two halves of
/// [`quant_matmul_parts`]`(&[gate, up])`'s output, without writing and reading that `[m, 2I]`
/// product. Elsewhere `Ok(false)`, `y` untouched: the caller runs the product and `f` apart.
///
/// Errors: those of [`quant_matmul_parts`] for the two parts (`y` of `m · I` elements).
pub fn quant_matmul_paired(
    gate: &QuantPart<'_>,
    up: &QuantPart<'_>,
    k: usize,
    x: &[f32],
    m: usize,
    y: &mut [f32],
    f: &PairEpilogue<'_>,
) -> Result<bool> {
    let parts = [*gate, *up];
    check_parts(&parts, k, x, m, y.len(), Some(gate.rows))?;
    #[cfg(target_arch = "x86_64")]
    if gate.t == up.t
        && gate.rows == up.rows
        && m > 0
        && k > 0
        && gate.rows > 0
        && takes_igemm(&parts, m, CpuKernel::current().int8_isa())
    {
        // SAFETY: as in `quant_matmul_parts`; both parts of one type and row count.
        unsafe { super::igemm::igemm_paired(gate, up, k, x, m, y, f) };
        return Ok(true);
    }
    Ok(false)
}

/// Checks the parts of a product against `k`, `x` (`[m, k]`) and an output of `y_len`
/// elements (`m` times the parts' rows, or times `y_cols` where given); returns each part's
/// shape and the parts' rows.
fn check_parts(
    parts: &[QuantPart<'_>],
    k: usize,
    x: &[f32],
    m: usize,
    y_len: usize,
    y_cols: Option<usize>,
) -> Result<(Vec<Shape>, usize)> {
    let mut shapes = Vec::with_capacity(parts.len());
    let mut n = 0usize;
    for p in parts {
        let row_bytes = p.t.row_bytes(k).ok_or(Error::NotWholeBlocks {
            ty: p.t.name(),
            operand: "k",
            len: k,
            block: p.t.block_elems(),
            unit: "elements",
        })?;
        n = n.checked_add(p.rows).ok_or(Error::ShapeOverflow { m, n: usize::MAX, k })?;
        let w_len = p.rows.checked_mul(row_bytes).ok_or(Error::ShapeOverflow { m, n, k })?;
        if p.w.len() != w_len {
            return Err(Error::QuantLength {
                ty: p.t.name(),
                operand: "w",
                unit: "bytes",
                expected: w_len,
                got: p.w.len(),
            });
        }
        shapes.push(Shape { t: p.t, rows: p.rows, k, row_bytes, m, layout: p.layout });
    }
    let overflow = Error::ShapeOverflow { m, n, k };
    let cols = y_cols.unwrap_or(n);
    for (operand, got, expected) in [("x", x.len(), m.checked_mul(k)), ("y", y_len, m.checked_mul(cols))] {
        let expected = expected.ok_or(overflow.clone())?;
        if got != expected {
            return Err(Error::OperandLength { operand, expected, got });
        }
    }
    Ok((shapes, n))
}

/// [`quant_matmul_parts`] off the integer GEMM: compute-bound parts each on its own path, or
/// every part streamed together.
#[allow(clippy::too_many_arguments)]
fn parts_apart(
    parts: &[QuantPart<'_>],
    shapes: &[Shape],
    n: usize,
    kernel: CpuKernel,
    k: usize,
    x: &[f32],
    m: usize,
    y: &mut [f32],
) -> Result<()> {
    let isa = kernel.int8_isa();
    let gemm = |p: &QuantPart<'_>| m >= gemm_min_m(p, isa) || batch_invariant();
    if parts.len() > 1 && parts.iter().any(gemm) {
        // Compute-bound parts (and any beside them): each part's product on its own path, its
        // columns copied into place.
        let mut col = 0;
        for p in parts {
            let mut part = vec![0f32; m * p.rows];
            quant_matmul_parts(std::slice::from_ref(p), k, x, m, &mut part)?;
            for (dst, src) in y.chunks_exact_mut(n).zip(part.chunks_exact(p.rows.max(1))) {
                dst[col..col + p.rows].copy_from_slice(src);
            }
            col += p.rows;
        }
        return Ok(());
    }
    if let [p] = parts
        && gemm(p)
    {
        prefill::gemm_tiles(kernel, (p.t, p.layout), p.w, p.rows, k, x, m, y);
        return Ok(());
    }
    if m >= STREAM_MAX_M {
        // Every part streams, in passes of at most STREAM_CHUNK_M rows of x (and of y).
        for (xc, yc) in x.chunks(STREAM_CHUNK_M * k).zip(y.chunks_mut(STREAM_CHUNK_M * n)) {
            quant_matmul_parts(parts, k, xc, xc.len() / k, yc)?;
        }
        return Ok(());
    }
    // `x` quantized once per block size that a quantized part needs.
    let quantized = |block: usize| {
        parts
            .iter()
            .any(|p| !p.t.is_float() && (p.t.is_k_quant() == (block == 256)))
            .then(|| QuantX::new(x, m, k, block))
    };
    let (q32, q256) = (quantized(32), quantized(256));
    fn rows_of(q: &Option<QuantX>, m: usize) -> Option<Vec<XRow<'_>>> {
        q.as_ref().map(|q| (0..m).map(|i| q.row(i)).collect())
    }
    let (x32, x256) = (rows_of(&q32, m), rows_of(&q256, m));
    let dots = |p: usize, j0: usize, nr: usize, out: &mut [f32]| {
        let s = shapes[p];
        let w = &parts[p].w[j0 * s.row_bytes..(j0 + nr) * s.row_bytes];
        if s.t.is_float() {
            for (r, out) in out.chunks_exact_mut(m).enumerate().take(nr) {
                float_row(kernel, s, &w[r * s.row_bytes..][..s.row_bytes], x, out);
            }
        } else {
            let xs = if s.t.is_k_quant() { &x256 } else { &x32 };
            rows_dots(isa, s.t, s.layout, w, s.row_bytes, xs.as_deref().unwrap_or_default(), out)
        }
    };
    stream(shapes, n, y, &dots);
    Ok(())
}

/// The sizes of one product.
#[derive(Clone, Copy)]
struct Shape {
    t: QuantType,
    layout: RowLayout,
    rows: usize,
    k: usize,
    row_bytes: usize,
    m: usize,
}

/// Weight rows against every activation row, on `isa` (`out[r * m + i]`).
fn rows_dots(
    isa: Int8Isa,
    t: QuantType,
    layout: RowLayout,
    w: &[u8],
    row_bytes: usize,
    xs: &[XRow<'_>],
    out: &mut [f32],
) {
    match isa {
        // SAFETY: `int8_isa` returns `Avx512Vnni` only where the CPU has AVX-512 F/BW/VL/VNNI
        // (and AVX2, FMA, F16C, which AVX-512 detection requires).
        #[cfg(target_arch = "x86_64")]
        Int8Isa::Avx512Vnni => unsafe { super::dot_x86::vnni::rows_dots(t, layout, w, row_bytes, xs, out) },
        // SAFETY: `int8_isa` returns `Avx2` only where the CPU has AVX2, FMA and F16C.
        #[cfg(target_arch = "x86_64")]
        Int8Isa::Avx2 => unsafe { super::dot_x86::avx2::rows_dots(t, layout, w, row_bytes, xs, out) },
        // The portable kernels read ggml's layout.
        _ => with_ggml_rows(t, layout, w, row_bytes, |w| dot_portable::rows_dots(t, w, row_bytes, xs, out)),
    }
}

/// Weight rows per task of the streaming paths, at most.
const MAX_TASK_ROWS: usize = 64;

/// `dots(p, j0, n, out)`: rows `j0 .. j0 + n` of part `p` against every row of `x` (see [`stream`]).
type PartDots<'a> = dyn Fn(usize, usize, usize, &mut [f32]) + Sync + 'a;

/// Runs `dots(p, j0, n, out)` for groups of `n <= MAX_TASK_ROWS` consecutive rows from `j0` of
/// part `p` (`out[r * m + i]` receives the part's row `j0 + r` against row `i` of `x`,
/// `m < STREAM_MAX_M`), every part's groups in one job on the pool when the product is large
/// enough, and writes the results into those columns of `y` (`[m, n]`, the parts' columns side
/// by side).
fn stream(parts: &[Shape], n: usize, y: &mut [f32], dots: &PartDots<'_>) {
    let m = parts.first().map_or(0, |s| s.m);
    assert!(m < STREAM_MAX_M && y.len() == m * n, "stream: operands");
    let threads = pool::num_threads();
    // (part, its first column in `y`, first row, rows) of every task.
    let mut tasks = Vec::new();
    let (mut col, mut bytes) = (0, 0usize);
    for (p, s) in parts.iter().enumerate() {
        let mut per_task = (TASK_BYTES / s.row_bytes).clamp(1, MAX_TASK_ROWS).min(n.div_ceil(4 * threads).max(1));
        if s.layout.applies(s.t) {
            // Whole groups of eight interleaved rows (MAX_TASK_ROWS is a multiple of 8).
            per_task = per_task.next_multiple_of(8);
        }
        tasks.extend((0..s.rows).step_by(per_task).map(|j0| (p, col, j0, per_task.min(s.rows - j0))));
        col += s.rows;
        bytes = bytes.saturating_add(s.rows * s.row_bytes);
    }
    let out = TaskPtr(y.as_mut_ptr());
    let task = |i: usize| {
        let (p, col, j0, nr) = tasks[i];
        // Only the `nr · m` values this task uses are initialised: zeroing the whole 24 KiB
        // array per task cost about 3% of a one-row decode step (a `memset` per 64 rows).
        let mut buf = [MaybeUninit::<f32>::uninit(); MAX_TASK_ROWS * STREAM_MAX_M];
        let vals = &mut buf[..nr * m];
        vals.iter_mut().for_each(|v| {
            v.write(0.0);
        });
        // SAFETY: every element of `vals` was initialised just above, and `MaybeUninit<f32>` has
        // `f32`'s layout.
        let vals = unsafe { &mut *(std::ptr::from_mut::<[MaybeUninit<f32>]>(vals) as *mut [f32]) };
        dots(p, j0, nr, vals);
        // Row by row of `y`, so that each task writes runs of `nr` consecutive columns.
        for i in 0..m {
            for r in 0..nr {
                // SAFETY: (i, col + j0 + r) is inside `y` (`i < m`, `col + j0 + r < n`: the
                // part's columns start at `col` and it has more than `j0 + r` rows) and that
                // column belongs to this task alone.
                unsafe { *out.get().add(i * n + col + j0 + r) = vals[r * m + i] };
            }
        }
    };
    if tasks.len() == 1 || bytes.saturating_mul(m) < PARALLEL_MIN_BYTES {
        (0..tasks.len()).for_each(task);
    } else {
        pool::run(tasks.len(), &task);
    }
}

thread_local! {
    /// A weight row widened to `f32` (the float types' streaming path), kept between calls.
    static WIDE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// An `F32` / `F16` / `BF16` weight row: widened into a buffer, then dotted with every row of `x`
/// in `f32`.
fn float_row(kernel: CpuKernel, s: Shape, w: &[u8], x: &[f32], out: &mut [f32]) {
    WIDE.with(|wide| {
        let mut wide = wide.borrow_mut();
        wide.resize(s.k, 0.0);
        dequantize_unchecked(kernel, s.t, w, &mut wide);
        for (o, xi) in out.iter_mut().zip(x.chunks_exact(s.k)) {
            *o = match kernel.f32_isa() {
                // SAFETY: `f32_isa` returns `Avx2` or `Avx512` only where the CPU has AVX2 and FMA.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 | Isa::Avx512 => unsafe { dot_f32_avx2(&wide, xi) },
                _ => dot_f32(&wide, xi),
            };
        }
    });
}

/// `Σ a_l b_l` in 16 `f32` lanes (vectorises), then summed pairwise.
#[inline(always)]
fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (a_main, a_tail) = a.split_at(a.len() / 16 * 16);
    let (b_main, b_tail) = b.split_at(a_main.len());
    for (a, b) in a_main.chunks_exact(16).zip(b_main.chunks_exact(16)) {
        for l in 0..16 {
            acc[l] += a[l] * b[l];
        }
    }
    for (l, (a, b)) in a_tail.iter().zip(b_tail).enumerate() {
        acc[l] += a * b;
    }
    crate::gemv::pairwise(acc)
}

/// [`dot_f32`] compiled for AVX2.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_f32_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_f32(a, b)
}
