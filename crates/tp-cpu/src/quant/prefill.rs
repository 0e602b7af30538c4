//! The GEMM path of `quant_matmul` (many rows of `x`, or a batch-invariant thread): tiles of
//! weight rows dequantized and multiplied by `x` with the packed GEMM.
//!
//! Quantized and `BF16` weights are dequantized to `bf16` tiles and `x` is rounded to `bf16` once
//! per call, so the GEMM runs its `bf16` micro-kernel (`vdpbf16ps` / AMX where the CPU has them;
//! widened to `f32` otherwise); `F32` and `F16` weights are widened to `f32` tiles (exactly) and
//! multiplied by the `f32` `x`.

use super::dequant::{dequantize_bf16_unchecked, dequantize_unchecked};
use super::interleave::{RowLayout, with_ggml_rows};
use super::types::QuantType;
use crate::dispatch::CpuKernel;
use crate::element::Float;
use crate::gemm::{self, BSource, Micro};
use crate::pool::{self, TaskPtr};
use crate::shape::Layout;
use half::bf16;
use std::cell::RefCell;
use std::mem::MaybeUninit;

/// Bytes of a dequantized tile, and its rows: at most [`TILE_ROWS`] (each tile packs `x` again,
/// so many rows of `x` take taller tiles: [`TILE_ROWS_TALL`] rows, up to [`TILE_BYTES_TALL`],
/// from [`TALL_M`] rows of `x` on), at least 32 per thread (a panel of the GEMM's columns each).
/// Measured on a Zen 4 (2 threads, `[5632, 2048]` Q4_K): 1024-row tiles take a 512-row product
/// from 22 to 16 ms and a 2048-row one from 72 to 61, and make 64- and 128-row products of Q6_K
/// slower (the tile leaves L2), hence two sizes.
const TILE_BYTES: usize = 4 << 20;
const TILE_ROWS: usize = 256;
const TILE_BYTES_TALL: usize = 8 << 20;
const TILE_ROWS_TALL: usize = 1024;
const TALL_M: usize = 256;
/// Weight rows per dequantization task.
const ROWS_PER_TASK: usize = 16;

thread_local! {
    /// The dequantized tile, kept between calls (as `u32`, viewed as `f32` or `bf16` pairs).
    static TILE: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// `y = x W^T` for `rows` weight rows of `k` elements of `t` (`w` holds them, whole blocks, in
/// `layout`), `x` `[m, k]`, `y` `[m, rows]` (every element written). `k > 0`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_tiles(
    kernel: CpuKernel,
    (t, layout): (QuantType, RowLayout),
    w: &[u8],
    rows: usize,
    k: usize,
    x: &[f32],
    m: usize,
    y: &mut [f32],
) {
    if matches!(t, QuantType::F32 | QuantType::F16) {
        tiles::<f32>(kernel, (t, layout), w, rows, k, x, m, y, &dequantize_unchecked);
    } else {
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        tiles::<bf16>(kernel, (t, layout), w, rows, k, &xb, m, y, &dequantize_bf16_unchecked);
    }
}

/// Fills a tile of `T` with whole blocks of a type, on a kernel family.
type Dequant<T> = dyn Fn(CpuKernel, QuantType, &[u8], &mut [T]) + Sync;

/// [`gemm_tiles`] with tiles of `T`, filled by `dequant`.
#[allow(clippy::too_many_arguments)]
fn tiles<T: Float>(
    kernel: CpuKernel,
    (t, layout): (QuantType, RowLayout),
    w: &[u8],
    rows: usize,
    k: usize,
    x: &[T],
    m: usize,
    y: &mut [f32],
    dequant: &Dequant<T>,
) {
    let row_bytes = w.len() / rows;
    let size = std::mem::size_of::<T>();
    // Whole tasks per tile, so that every task starts on a group of eight interleaved rows.
    let (tile_bytes, tile_rows) = if m >= TALL_M { (TILE_BYTES_TALL, TILE_ROWS_TALL) } else { (TILE_BYTES, TILE_ROWS) };
    let tile_rows = ((tile_bytes / (size * k)).min(tile_rows).max(32 * pool::num_threads()) / ROWS_PER_TASK
        * ROWS_PER_TASK)
        .min(rows);
    let micro = Micro::choose(kernel, T::KIND);
    let mut buf = TILE.with(|b| std::mem::take(&mut *b.borrow_mut()));
    buf.resize((tile_rows * k * size).div_ceil(4), 0);
    let mut y_tile = vec![MaybeUninit::<f32>::uninit(); m * tile_rows];
    for j0 in (0..rows).step_by(tile_rows) {
        let n = tile_rows.min(rows - j0);
        let tile = &mut bytemuck::cast_slice_mut::<u32, T>(&mut buf)[..n * k];
        let src = &w[j0 * row_bytes..(j0 + n) * row_bytes];
        let dst = TaskPtr(tile.as_mut_ptr());
        pool::run(n.div_ceil(ROWS_PER_TASK), &|g| {
            let (r0, r1) = (g * ROWS_PER_TASK, ((g + 1) * ROWS_PER_TASK).min(n));
            // SAFETY: task `g` owns rows `r0..r1` of the tile (disjoint from the others'), inside
            // it; the tile outlives `run`.
            let part = unsafe { std::slice::from_raw_parts_mut(dst.get().add(r0 * k), (r1 - r0) * k) };
            // Whole groups of interleaved rows (and the part's last rows) dequantize from
            // ggml's layout.
            with_ggml_rows(t, layout, &src[r0 * row_bytes..r1 * row_bytes], row_bytes, |w| dequant(kernel, t, w, part));
        });
        let y_tile = &mut y_tile[..m * n];
        gemm::gemm(micro, gemm::ASource::Rows(x), BSource::Pack(tile, Layout::Nk), None, m, k, n, y_tile);
        for (i, yt) in y_tile.chunks_exact(n).enumerate() {
            for (dst, v) in y[i * rows + j0..][..n].iter_mut().zip(yt) {
                // SAFETY: `gemm` wrote every element of `y_tile`.
                *dst = unsafe { v.assume_init() };
            }
        }
    }
    TILE.with(|b| *b.borrow_mut() = buf);
}
