//! Host products for few rows of `x` against an `[N, K]` weight (decode-shaped: `M` tokens,
//! `M` small): `y[i, j] = Σ_l x[i, l] · w[j, l] + b[j]`.
//!
//! Packing-based GEMM wastes its time packing the whole weight when `M` is tiny; here each
//! weight row is read once, straight from its own dtype (`f16`/`bf16` widened chunk by chunk in
//! L1, never as a whole-matrix copy), and dotted with every row of `x`. The work is cut by
//! weight rows (output columns) across threads. Accumulation is `f32` in 16 independent lanes.
//! The loop is compiled three times (AVX-512, AVX2+FMA, baseline) and picked at run time.

use crate::Element;
use crate::cpu_gemm::num_threads;

/// Largest `M` sent here instead of the packed GEMM (measured crossover on the CI machine).
pub(crate) const MAX_ROWS: usize = 4;
/// Weight elements widened per step (fits L1 with room for `x`).
const CHUNK: usize = 256;
/// Independent partial sums per dot product.
const LANES: usize = 16;
/// Weight elements below which one thread does everything.
const PARALLEL_MIN_WEIGHT: usize = 1 << 16;

/// `y = x W^T (+ b)`: `x` is `m×k` f32 row-major, `w` is `n×k` row-major in its dtype, `bias`
/// (f32) has `n` entries, `y` is `m×n` row-major. `m <= MAX_ROWS`.
pub(crate) fn skinny_nk<T: Element>(
    x: &[f32],
    w: &[T],
    bias: Option<&[f32]>,
    m: usize,
    k: usize,
    n: usize,
    y: &mut [f32],
) {
    assert!(m <= MAX_ROWS && x.len() == m * k && w.len() == n * k && y.len() == m * n, "skinny_nk: operands");
    assert!(bias.is_none_or(|b| b.len() == n), "skinny_nk: bias");
    let threads = if n * k < PARALLEL_MIN_WEIGHT { 1 } else { num_threads().min(n) };
    if threads <= 1 {
        columns(x, w, bias, m, k, 0, n, y, n);
        return;
    }
    // Each thread computes a block of output columns into its own buffer; then they are placed.
    let (q, r) = (n / threads, n % threads);
    let blocks: Vec<(usize, usize)> = (0..threads).map(|i| (i * q + i.min(r), q + usize::from(i < r))).collect();
    let results: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = blocks
            .iter()
            .map(|&(j0, width)| {
                s.spawn(move || {
                    let mut out = vec![0f32; m * width];
                    columns(x, w, bias, m, k, j0, width, &mut out, width);
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
    });
    for (&(j0, width), out) in blocks.iter().zip(&results) {
        for i in 0..m {
            y[i * n + j0..i * n + j0 + width].copy_from_slice(&out[i * width..(i + 1) * width]);
        }
    }
}

/// Output columns `j0..j0+width` into `out` (`m` rows at stride `ld`), dispatched on CPU features.
#[allow(clippy::too_many_arguments)]
fn columns<T: Element>(
    x: &[f32],
    w: &[T],
    bias: Option<&[f32]>,
    m: usize,
    k: usize,
    j0: usize,
    width: usize,
    out: &mut [f32],
    ld: usize,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports AVX-512F and FMA (checked just above), the only
            // requirement `#[target_feature]` adds to this otherwise safe function.
            return unsafe { columns_avx512(x, w, bias, m, k, j0, width, out, ld) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above).
            return unsafe { columns_avx2(x, w, bias, m, k, j0, width, out, ld) };
        }
    }
    columns_body::<T, false>(x, w, bias, m, k, j0, width, out, ld)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
#[allow(clippy::too_many_arguments)]
fn columns_avx512<T: Element>(
    x: &[f32],
    w: &[T],
    bias: Option<&[f32]>,
    m: usize,
    k: usize,
    j0: usize,
    width: usize,
    out: &mut [f32],
    ld: usize,
) {
    columns_body::<T, true>(x, w, bias, m, k, j0, width, out, ld)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
fn columns_avx2<T: Element>(
    x: &[f32],
    w: &[T],
    bias: Option<&[f32]>,
    m: usize,
    k: usize,
    j0: usize,
    width: usize,
    out: &mut [f32],
    ld: usize,
) {
    columns_body::<T, true>(x, w, bias, m, k, j0, width, out, ld)
}

/// The portable body; `FMA` selects fused multiply-add (only where the CPU has it).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn columns_body<T: Element, const FMA: bool>(
    x: &[f32],
    w: &[T],
    bias: Option<&[f32]>,
    m: usize,
    k: usize,
    j0: usize,
    width: usize,
    out: &mut [f32],
    ld: usize,
) {
    let mut wide = [0f32; CHUNK];
    for jj in 0..width {
        let j = j0 + jj;
        let row = &w[j * k..(j + 1) * k];
        let mut acc = [[0f32; LANES]; MAX_ROWS];
        for (c, w_chunk) in row.chunks(CHUNK).enumerate() {
            let wide = &mut wide[..w_chunk.len()];
            T::slice_to_f32(w_chunk, wide);
            let base = c * CHUNK;
            for (i, acc) in acc.iter_mut().enumerate().take(m) {
                let xs = &x[i * k + base..i * k + base + wide.len()];
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
            // Pairwise reduction of the lanes.
            let mut v = *acc;
            let mut half = LANES / 2;
            while half > 0 {
                for l in 0..half {
                    v[l] += v[l + half];
                }
                half /= 2;
            }
            out[i * ld + jj] = v[0] + bias.map_or(0.0, |b| b[j]);
        }
    }
}
