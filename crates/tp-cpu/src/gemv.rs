//! Decode-shaped products: few rows of `x` against an `[N, K]` weight,
//! `y[i, j] = Σ_l x[i, l] · w[j, l] + b[j]`.
//!
//! A packed GEMM would spend its time packing the whole weight for a handful of rows; here each
//! weight row is read once, straight from its own dtype, and dotted with every row of `x`, so the
//! product runs at the speed the weight streams from memory. The weight's rows are cut into
//! blocks that the pool's threads claim; a thread walks `R` rows at a time along `K` with
//! `M x R` vector accumulators, then reduces each to its output.
//!
//! * AVX-512, `f32` weight: `vfmadd231ps`; `f16` weight: widened with `vcvtph2ps` as it is loaded;
//!   `bf16` weight without AVX512-BF16: widened with a shift.
//! * AVX512-BF16, `bf16` weight: `vdpbf16ps` on `x`'s own `bf16` values, pairs of products
//!   exact, accumulation in `f32` (denormal inputs read as zero, as the instruction defines).
//! * Portable / AVX2: one generic body (16 `f32` lanes, widening 256 elements at a time in L1),
//!   compiled for the baseline and for AVX2 + FMA.

use crate::dispatch::{CpuKernel, Isa};
use crate::element::{Float, FloatKind};
use crate::pool;
use std::mem::MaybeUninit;

/// Largest `M` sent here instead of the packed GEMM.
pub(crate) const MAX_ROWS: usize = 8;
/// Weight rows per task.
const ROWS_PER_TASK: usize = 32;
/// Weight elements below which one thread does everything.
const PARALLEL_MIN_WEIGHT: usize = 1 << 15;

/// `y` as a raw pointer for the tasks, which write disjoint columns of it.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: used only inside `pool::run`, which returns after every task finished, while the
// `&mut [f32]` it came from is borrowed by `gemv`; each task writes its own columns.
unsafe impl Sync for Out {}

/// `y = x W^T (+ bias)`: `x` is `m x k` row-major in the weight's dtype, `w` is `n x k`
/// row-major, `bias` (f32) has `n` entries, `y` is `m x n` row-major (need not be initialised:
/// every element is written). `m <= MAX_ROWS`, `k > 0`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemv<T: Float>(
    kernel: CpuKernel,
    x: &[T],
    w: &[T],
    bias: Option<&[f32]>,
    m: usize,
    k: usize,
    n: usize,
    y: &mut [MaybeUninit<f32>],
) {
    assert!(m <= MAX_ROWS && x.len() == m * k && w.len() == n * k && y.len() == m * n, "gemv: operands");
    assert!(bias.is_none_or(|b| b.len() == n), "gemv: bias");
    if m == 0 || n == 0 {
        return;
    }
    let isa = kernel.f32_isa();
    let bf16_dot = T::KIND == FloatKind::BF16 && kernel.has_bf16_dot();
    // x widened once (it is small); the bf16 dot product reads x's own bf16 values instead.
    let xf: Vec<f32> = if bf16_dot { Vec::new() } else { x.iter().map(|v| v.widen()).collect() };
    let out = Out(y.as_mut_ptr().cast());
    let tasks = n.div_ceil(ROWS_PER_TASK);
    let task = |t: usize| {
        let j0 = t * ROWS_PER_TASK;
        let rows = ROWS_PER_TASK.min(n - j0);
        let out = &out;
        let mut tile = [0f32; MAX_ROWS * ROWS_PER_TASK];
        let tile = &mut tile[..m * rows];
        let w_rows = &w[j0 * k..(j0 + rows) * k];
        match (isa, bf16_dot) {
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, true) => {
                // SAFETY: `bf16_dot` requires AVX512-BF16 (dispatch), and `T` is bf16.
                unsafe {
                    avx512::rows_bf16_dot(bytemuck::cast_slice(x), bytemuck::cast_slice(w_rows), m, k, rows, tile)
                }
            }
            // SAFETY: `Isa::Avx512` requires AVX-512 F/BW/VL and F16C (dispatch).
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, false) => unsafe { avx512::rows_f32(&xf, w_rows, m, k, rows, tile) },
            // SAFETY: `Isa::Avx2` requires AVX2 and FMA (dispatch).
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, _) => unsafe { rows_avx2(&xf, w_rows, m, k, rows, tile) },
            _ => rows_generic::<T, false>(&xf, w_rows, m, k, rows, tile),
        }
        for i in 0..m {
            for r in 0..rows {
                let j = j0 + r;
                let v = tile[i * rows + r] + bias.map_or(0.0, |b| b[j]);
                // SAFETY: (i, j) is inside `y` (`i < m`, `j < n`), and column `j` belongs to
                // this task alone.
                unsafe { *out.0.add(i * n + j) = v };
            }
        }
    };
    if n * k < PARALLEL_MIN_WEIGHT || tasks == 1 {
        (0..tasks).for_each(task);
    } else {
        pool::run(tasks, &task);
    }
}

/// Portable body: `tile[i * rows + r] = Σ_l x[i, l] · w[r, l]`, 16 lanes per dot product,
/// the weight widened 256 elements at a time.
#[inline(always)]
fn rows_generic<T: Float, const FMA: bool>(x: &[f32], w: &[T], m: usize, k: usize, rows: usize, tile: &mut [f32]) {
    const CHUNK: usize = 256;
    const LANES: usize = 16;
    let mut wide = [0f32; CHUNK];
    for r in 0..rows {
        let row = &w[r * k..(r + 1) * k];
        let mut acc = [[0f32; LANES]; MAX_ROWS];
        for (c, w_chunk) in row.chunks(CHUNK).enumerate() {
            let wide = &mut wide[..w_chunk.len()];
            T::widen_slice(w_chunk, wide);
            for (i, acc) in acc.iter_mut().enumerate().take(m) {
                let xs = &x[i * k + c * CHUNK..][..wide.len()];
                let (w_main, w_tail) = wide.split_at(wide.len() / LANES * LANES);
                let (x_main, x_tail) = xs.split_at(w_main.len());
                for (wv, xv) in w_main.chunks_exact(LANES).zip(x_main.chunks_exact(LANES)) {
                    for l in 0..LANES {
                        acc[l] = if FMA { wv[l].mul_add(xv[l], acc[l]) } else { acc[l] + wv[l] * xv[l] };
                    }
                }
                for (l, (wv, xv)) in w_tail.iter().zip(x_tail).enumerate() {
                    acc[l] += wv * xv;
                }
            }
        }
        for (i, acc) in acc.iter().enumerate().take(m) {
            tile[i * rows + r] = pairwise(*acc);
        }
    }
}

/// Sum of 16 lanes, pairwise.
#[inline(always)]
pub(crate) fn pairwise(mut v: [f32; 16]) -> f32 {
    let mut half = 8;
    while half > 0 {
        for l in 0..half {
            v[l] += v[l + half];
        }
        half /= 2;
    }
    v[0]
}

/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_avx2<T: Float>(x: &[f32], w: &[T], m: usize, k: usize, rows: usize, tile: &mut [f32]) {
    rows_generic::<T, true>(x, w, m, k, rows, tile)
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{MAX_ROWS, ROWS_PER_TASK};
    use crate::element::{Float, FloatKind};
    use std::arch::x86_64::*;

    /// Loads 16 weight elements at `p` (fewer, zero-filled, when `n < 16`) as `f32`.
    ///
    /// # Safety
    /// The `n.min(16)` elements at `p` must be readable; the CPU must have AVX-512 F/BW/VL, F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    #[inline]
    unsafe fn load_w<T: Float>(p: *const T, n: usize) -> __m512 {
        // SAFETY: the (masked) loads read only the elements the caller said are readable.
        unsafe {
            let mask: u16 = if n >= 16 { u16::MAX } else { (1u16 << n) - 1 };
            match T::KIND {
                FloatKind::F32 if n >= 16 => _mm512_loadu_ps(p.cast()),
                FloatKind::F32 => _mm512_maskz_loadu_ps(mask, p.cast()),
                FloatKind::F16 if n >= 16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
                FloatKind::F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p.cast())),
                FloatKind::BF16 => {
                    let h =
                        if n >= 16 { _mm256_loadu_si256(p.cast()) } else { _mm256_maskz_loadu_epi16(mask, p.cast()) };
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
                }
            }
        }
    }

    /// Bytes of x a chunk of K keeps in L1 (all `m` rows of it).
    const X_CHUNK_BYTES: usize = 16 << 10;

    /// Where the rows after a block continue: the same span of the next `R` rows, or the next
    /// span of the first rows when this block is the last of its span. Prefetching it (to L2)
    /// while the block runs hides the latency of starting those streams. The rows being read
    /// are left to the hardware prefetchers: a software prefetch per cache line ahead of each
    /// row cost 10-20% of the bandwidth on Zen 4 (2 cores, 2026-12-03; median of 40
    /// interleaved runs, 27 vs 30 GB/s).
    fn next_block(r0: usize, r: usize, rows: usize, span: (usize, usize), k: usize) -> (usize, usize) {
        if r0 + 2 * r <= rows { (r0 + r, span.0) } else { (0, span.1.min(k)) }
    }

    /// Elements of K per chunk: as many as keep the chunk of x (`m` rows of `elem`-byte values) in
    /// [`X_CHUNK_BYTES`], a multiple of 32.
    fn chunk_len(m: usize, elem: usize) -> usize {
        (X_CHUNK_BYTES / (m * elem) / 32 * 32).max(32)
    }

    /// `R` weight rows at a time against all `M` rows of x (f32), over elements `l0..l1` of K,
    /// `vfmadd231ps`, adding into `partial[(r0 + r) * M + i]` (starting from zero when `first`);
    /// one monomorphisation per `(M, R)` keeps the accumulators in registers.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    fn block_f32<T: Float, const M: usize, const R: usize>(
        x: &[f32],
        w: &[T],
        k: usize,
        (l0, l1): (usize, usize),
        r0: usize,
        partial: &mut [__m512],
        first: bool,
    ) {
        let mut acc = [[_mm512_setzero_ps(); R]; M];
        if !first {
            for (i, acc_i) in acc.iter_mut().enumerate() {
                for (r, a) in acc_i.iter_mut().enumerate() {
                    *a = partial[(r0 + r) * M + i];
                }
            }
        }
        let (next_r, next_l) = next_block(r0, R, partial.len() / M, (l0, l1), k);
        let mut l = l0;
        while l < l1 {
            let n = k - l;
            let mut wv = [_mm512_setzero_ps(); R];
            for (r, slot) in wv.iter_mut().enumerate() {
                let p = w.as_ptr().wrapping_add((r0 + r) * k + l);
                let q = w.as_ptr().wrapping_add((next_r + r) * k + next_l + (l - l0));
                _mm_prefetch::<_MM_HINT_T1>(q.cast());
                // SAFETY: row `r0 + r` has `k` elements from `(r0 + r) * k`; `n` are left.
                *slot = unsafe { load_w(p, n) };
            }
            for (i, acc_i) in acc.iter_mut().enumerate() {
                let p = x.as_ptr().wrapping_add(i * k + l);
                // SAFETY: x row `i` has `k` elements; the loads read at most the `n` left.
                let xv =
                    unsafe { if n >= 16 { _mm512_loadu_ps(p) } else { _mm512_maskz_loadu_ps((1u16 << n) - 1, p) } };
                for (a, &wr) in acc_i.iter_mut().zip(&wv) {
                    *a = _mm512_fmadd_ps(xv, wr, *a);
                }
            }
            l += 16;
        }
        for (i, acc_i) in acc.iter().enumerate() {
            for (r, a) in acc_i.iter().enumerate() {
                partial[(r0 + r) * M + i] = *a;
            }
        }
    }

    /// Like [`block_f32`] with `vdpbf16ps` on bf16 bits of x and w (32 elements per step).
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    fn block_bf16<const M: usize, const R: usize>(
        x: &[u16],
        w: &[u16],
        k: usize,
        (l0, l1): (usize, usize),
        r0: usize,
        partial: &mut [__m512],
        first: bool,
    ) {
        let mut acc = [[_mm512_setzero_ps(); R]; M];
        if !first {
            for (i, acc_i) in acc.iter_mut().enumerate() {
                for (r, a) in acc_i.iter_mut().enumerate() {
                    *a = partial[(r0 + r) * M + i];
                }
            }
        }
        let (next_r, next_l) = next_block(r0, R, partial.len() / M, (l0, l1), k);
        let mut l = l0;
        while l < l1 {
            let n = k - l;
            let mask: u32 = if n >= 32 { u32::MAX } else { (1u32 << n) - 1 };
            let mut wv = [_mm512_setzero_si512(); R];
            for (r, slot) in wv.iter_mut().enumerate() {
                let p = w.as_ptr().wrapping_add((r0 + r) * k + l);
                let q = w.as_ptr().wrapping_add((next_r + r) * k + next_l + (l - l0));
                _mm_prefetch::<_MM_HINT_T1>(q.cast());
                // SAFETY: row `r0 + r` has `k` elements; the loads read at most the `n` left.
                *slot = unsafe {
                    if n >= 32 { _mm512_loadu_si512(p.cast()) } else { _mm512_maskz_loadu_epi16(mask, p.cast()) }
                };
            }
            for (i, acc_i) in acc.iter_mut().enumerate() {
                let p = x.as_ptr().wrapping_add(i * k + l);
                // SAFETY: as above, for x row `i`.
                let xv = unsafe {
                    if n >= 32 { _mm512_loadu_si512(p.cast()) } else { _mm512_maskz_loadu_epi16(mask, p.cast()) }
                };
                // SAFETY: `__m512i` and `__m512bh` are the same 64 bytes; any bits are valid.
                let xb = unsafe { std::mem::transmute::<__m512i, __m512bh>(xv) };
                for (a, &wr) in acc_i.iter_mut().zip(&wv) {
                    // SAFETY: as above.
                    let wb = unsafe { std::mem::transmute::<__m512i, __m512bh>(wr) };
                    *a = _mm512_dpbf16_ps(*a, xb, wb);
                }
            }
            l += 32;
        }
        for (i, acc_i) in acc.iter().enumerate() {
            for (r, a) in acc_i.iter().enumerate() {
                partial[(r0 + r) * M + i] = *a;
            }
        }
    }

    /// `tile[i * rows + r]` from the partial sums `partial[r * m + i]`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn reduce(partial: &[__m512], m: usize, rows: usize, tile: &mut [f32]) {
        for r in 0..rows {
            for i in 0..m {
                tile[i * rows + r] = _mm512_reduce_add_ps(partial[r * m + i]);
            }
        }
    }

    /// Rows per block for `m` rows of x: as many as keep `m x R <= 16` accumulators.
    const fn rows_per_block(m: usize) -> usize {
        match m {
            1 => 8,
            2 => 8,
            3 | 4 => 4,
            _ => 2,
        }
    }

    macro_rules! by_m {
        ($m:expr, $f:ident, $($args:tt)*) => {
            match $m {
                1 => $f!(1, $($args)*),
                2 => $f!(2, $($args)*),
                3 => $f!(3, $($args)*),
                4 => $f!(4, $($args)*),
                5 => $f!(5, $($args)*),
                6 => $f!(6, $($args)*),
                7 => $f!(7, $($args)*),
                _ => $f!(8, $($args)*),
            }
        };
    }

    /// `tile[i * rows + r] = Σ_l x[i, l] · w[r, l]` for `rows <= ROWS_PER_TASK` weight rows,
    /// f32 arithmetic, K in chunks whose slice of x stays in L1.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL, F16C and FMA.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
    pub(super) unsafe fn rows_f32<T: Float>(x: &[f32], w: &[T], m: usize, k: usize, rows: usize, tile: &mut [f32]) {
        assert!(m <= MAX_ROWS && rows <= ROWS_PER_TASK && x.len() >= m * k && w.len() >= rows * k);
        assert!(tile.len() >= m * rows);
        let step = rows_per_block(m);
        let mut partial = [_mm512_setzero_ps(); MAX_ROWS * ROWS_PER_TASK];
        let partial = &mut partial[..rows * m];
        let kb = chunk_len(m, 4);
        for l0 in (0..k).step_by(kb) {
            let span = (l0, (l0 + kb).min(k));
            let first = l0 == 0;
            let mut r0 = 0;
            macro_rules! full {
                ($mm:literal,) => {
                    block_f32::<T, $mm, { rows_per_block($mm) }>(x, w, k, span, r0, partial, first)
                };
            }
            macro_rules! one {
                ($mm:literal,) => {
                    block_f32::<T, $mm, 1>(x, w, k, span, r0, partial, first)
                };
            }
            while r0 + step <= rows {
                by_m!(m, full,);
                r0 += step;
            }
            while r0 < rows {
                by_m!(m, one,);
                r0 += 1;
            }
        }
        reduce(partial, m, rows, tile);
    }

    /// Like [`rows_f32`] on bf16 bits with `vdpbf16ps`.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW and AVX512-BF16.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn rows_bf16_dot(x: &[u16], w: &[u16], m: usize, k: usize, rows: usize, tile: &mut [f32]) {
        assert!(m <= MAX_ROWS && rows <= ROWS_PER_TASK && x.len() >= m * k && w.len() >= rows * k);
        assert!(tile.len() >= m * rows);
        let step = rows_per_block(m);
        let mut partial = [_mm512_setzero_ps(); MAX_ROWS * ROWS_PER_TASK];
        let partial = &mut partial[..rows * m];
        let kb = chunk_len(m, 2);
        for l0 in (0..k).step_by(kb) {
            let span = (l0, (l0 + kb).min(k));
            let first = l0 == 0;
            let mut r0 = 0;
            macro_rules! full {
                ($mm:literal,) => {
                    block_bf16::<$mm, { rows_per_block($mm) }>(x, w, k, span, r0, partial, first)
                };
            }
            macro_rules! one {
                ($mm:literal,) => {
                    block_bf16::<$mm, 1>(x, w, k, span, r0, partial, first)
                };
            }
            while r0 + step <= rows {
                by_m!(m, full,);
                r0 += step;
            }
            while r0 < rows {
                by_m!(m, one,);
                r0 += 1;
            }
        }
        reduce(partial, m, rows, tile);
    }
}
