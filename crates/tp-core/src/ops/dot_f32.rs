//! The `f32` dot product of attention's host loops (the decode rows of
//! [`Tensor::attention`](crate::Tensor::attention) and every row of paged attention):
//! `Σ a_i b_i` in sixteen partial sums (lane `l` takes the elements `i ≡ l mod 16`), added
//! pairwise at the end (lanes `l` and `l + 8`, then `l + 4`, `l + 2`, `l + 1`), then the
//! remainder past the last whole 16 added as a plain sum of products.
//!
//! With `FMA` the partial sums are fused multiply-adds in two 8-lane AVX registers and the
//! pairwise sum is a few shuffles; without, the same order in portable code. One machine takes
//! one path for every row, so a row's bits never depend on the path of another call.

/// `Σ a_i b_i` over the common length of `a` and `b`, in the order of the module docs.
///
/// # Safety
/// With `FMA`, the CPU must have AVX2 and FMA (and the caller be compiled with them, for speed).
#[inline(always)]
pub(super) unsafe fn dot<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if FMA {
        // SAFETY: the caller guarantees AVX2 and FMA.
        return unsafe { dot_avx2(a, b) };
    }
    dot_portable::<FMA>(a, b)
}

/// The portable path (also the reference for the AVX2 one, which it matches bit for bit when
/// `FMA` is set).
#[inline(always)]
fn dot_portable<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    const L: usize = 16;
    let mut acc = [0f32; L];
    let (ac, bc) = (a.chunks_exact(L), b.chunks_exact(L));
    let tail: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..L {
            acc[l] = if FMA { x[l].mul_add(y[l], acc[l]) } else { acc[l] + x[l] * y[l] };
        }
    }
    let mut width = L / 2;
    while width > 0 {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
        width /= 2;
    }
    acc[0] + tail
}

/// [`dot_portable`] with `FMA`, on AVX2 registers: lanes 0-7 in `lo`, 8-15 in `hi`.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let main = n / 16 * 16;
    let tail: f32 = a[main..n].iter().zip(&b[main..n]).map(|(x, y)| x * y).sum();
    // SAFETY: every load reads 8 floats at `i` or `i + 8` with `i + 16 <= main <= n`, inside
    // both slices; the instructions are the caller's guarantee.
    unsafe {
        let s8 = lanes8(a.as_ptr(), b.as_ptr(), main); // l + (l + 8)
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8)); // l + (l + 4)
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4)); // l + (l + 2)
        let s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2)); // 0 + 1
        _mm_cvtss_f32(s1) + tail
    }
}

/// [`dot`] of `a` with each of `b[0..8]`, bit for bit, the eight computed together: each key's
/// sixteen partial sums as in [`dot`], then the same pairwise additions for all eight at once
/// (lane halves across pairs of keys, then pairs and neighbours within 128-bit lanes), so that
/// one shuffle does the work of eight horizontal sums' steps.
///
/// # Safety
/// With `FMA`, the CPU must have AVX2 and FMA. Every `b[i]` at least as long as `a`.
#[inline(always)]
pub(super) unsafe fn dots8<const FMA: bool>(a: &[f32], b: [&[f32]; 8]) -> [f32; 8] {
    #[cfg(target_arch = "x86_64")]
    if FMA {
        // SAFETY: the caller guarantees AVX2 and FMA.
        return unsafe { dots8_avx2(a, b) };
    }
    // SAFETY: without `FMA` `dot` needs nothing.
    b.map(|b| unsafe { dot::<FMA>(a, b) })
}

/// The sixteen partial sums of `Σ a_i b_i` over `i < main` (a multiple of 16; lane `l` takes
/// `i ≡ l mod 16`, fused multiply-adds in order), lanes `l` and `l + 8` added: the first step of
/// [`dot`]'s pairwise sum.
///
/// # Safety
/// `pa` and `pb` readable for `main` floats; the CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn lanes8(pa: *const f32, pb: *const f32, main: usize) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // SAFETY: as stated; every load reads 8 floats at `i` or `i + 8` with `i + 16 <= main`.
    unsafe {
        let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i < main {
            lo = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), lo);
            hi = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8)), _mm256_loadu_ps(pb.add(i + 8)), hi);
            i += 16;
        }
        _mm256_add_ps(lo, hi)
    }
}

/// [`dots8`] on AVX2 registers.
///
/// # Safety
/// The CPU must have AVX2 and FMA; every `b[i]` at least as long as `a`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dots8_avx2(a: &[f32], b: [&[f32]; 8]) -> [f32; 8] {
    use std::arch::x86_64::*;
    let n = a.len();
    let main = n / 16 * 16;
    for bk in &b {
        assert!(bk.len() >= n, "dots8: short row");
    }
    // SAFETY: every load reads 8 floats at `i` or `i + 8` with `i + 16 <= main <= n`, inside `a`
    // and every `b[k]`; the instructions are the caller's guarantee. (Plain loops, not closures:
    // a closure would not inherit the caller's target features.)
    unsafe {
        let pa = a.as_ptr();
        // Per key, lanes 0-7 plus lanes 8-15 (`s8` of `dot_avx2`).
        let mut s8 = [_mm256_setzero_ps(); 8];
        for k in 0..8 {
            s8[k] = lanes8(pa, b[k].as_ptr(), main);
        }
        // l + (l + 4): keys 2p and 2p + 1 in the low and high halves.
        let mut s4 = [_mm256_setzero_ps(); 4];
        for p in 0..4 {
            let (x, y) = (s8[2 * p], s8[2 * p + 1]);
            s4[p] = _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(x, y), _mm256_permute2f128_ps::<0x31>(x, y));
        }
        // l + (l + 2): [k0 k0 k2 k2 | k1 k1 k3 k3] and [k4 k4 k6 k6 | k5 k5 k7 k7].
        let mut s2 = [_mm256_setzero_ps(); 2];
        for h in 0..2 {
            let (x, y) = (s4[2 * h], s4[2 * h + 1]);
            s2[h] = _mm256_add_ps(_mm256_shuffle_ps::<0b0100_0100>(x, y), _mm256_shuffle_ps::<0b1110_1110>(x, y));
        }
        // 0 + 1: [k0 k2 k4 k6 | k1 k3 k5 k7].
        let s1 = _mm256_add_ps(
            _mm256_shuffle_ps::<0b1000_1000>(s2[0], s2[1]),
            _mm256_shuffle_ps::<0b1101_1101>(s2[0], s2[1]),
        );
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), s1);
        let mut out = [0f32; 8];
        for (k, o) in out.iter_mut().enumerate() {
            let tail: f32 = a[main..n].iter().zip(&b[k][main..n]).map(|(x, y)| x * y).sum();
            *o = lanes[[0, 4, 1, 5, 2, 6, 3, 7][k]] + tail;
        }
        out
    }
}

/// `y[c] = Σ_j w[j] v[j · stride + c]` for every column `c < y.len()`, each sum in `j` order
/// from zero (fused multiply-adds with `FMA`): attention's weighted sum of value rows. The
/// columns go 64 at a time, their sums held in registers across all the rows, rather than `y`
/// read and written once per row (a store-to-load chain per key).
///
/// Panics if `v` is too short: `(w.len() - 1) · stride + y.len()` values are read.
#[inline(always)]
pub(super) fn weighted_rows<const FMA: bool>(y: &mut [f32], w: &[f32], v: &[f32], stride: usize) {
    weighted::<FMA, _>(y, w, |j| &v[j * stride..]);
}

/// [`weighted_rows`] over rows held apart (`v[j]` the row of weight `w[j]`, each at least
/// `y.len()` long): the same sums, in the same order, bit for bit.
#[inline(always)]
pub(super) fn weighted_refs<const FMA: bool>(y: &mut [f32], w: &[f32], v: &[&[f32]]) {
    weighted::<FMA, _>(y, w, |j| v[j]);
}

/// The body of [`weighted_rows`] and [`weighted_refs`]: `row(j)` starts the row of weight `w[j]`
/// (at least `y.len()` values).
#[inline(always)]
fn weighted<'a, const FMA: bool, R: Fn(usize) -> &'a [f32]>(y: &mut [f32], w: &[f32], row: R) {
    const C: usize = 64;
    let d = y.len();
    for c0 in (0..d).step_by(C) {
        let cw = C.min(d - c0);
        let mut acc = [0f32; C];
        if cw == C {
            for (j, &wj) in w.iter().enumerate() {
                let vj: &[f32; C] = row(j)[c0..][..C].try_into().expect("64 values");
                for l in 0..C {
                    acc[l] = if FMA { wj.mul_add(vj[l], acc[l]) } else { acc[l] + wj * vj[l] };
                }
            }
        } else {
            for (j, &wj) in w.iter().enumerate() {
                let vj = &row(j)[c0..][..cw];
                for (a, &b) in acc[..cw].iter_mut().zip(vj) {
                    *a = if FMA { wj.mul_add(b, *a) } else { *a + wj * b };
                }
            }
        }
        y[c0..c0 + cw].copy_from_slice(&acc[..cw]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The weighted sum of rows equals the row-by-row accumulation it replaces, bit for bit, at
    /// widths around the 64-column chunk.
    #[test]
    fn weighted_rows_is_the_row_by_row_sum() {
        let mut state = 7u64;
        let mut next = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        for (d, stride, n) in [(1, 3, 5), (63, 64, 9), (64, 256, 17), (65, 70, 3), (96, 384, 40), (128, 128, 1)] {
            let w: Vec<f32> = (0..n).map(|_| next()).collect();
            let v: Vec<f32> = (0..(n - 1) * stride + d).map(|_| next()).collect();
            let mut want = vec![0f32; d];
            for (j, &wj) in w.iter().enumerate() {
                for (c, a) in want.iter_mut().enumerate() {
                    *a = wj.mul_add(v[j * stride + c], *a);
                }
            }
            let mut got = vec![f32::NAN; d];
            weighted_rows::<true>(&mut got, &w, &v, stride);
            assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "d {d} stride {stride}");
            // The same rows held apart.
            let rows: Vec<&[f32]> = (0..n).map(|j| &v[j * stride..j * stride + d]).collect();
            let mut apart = vec![f32::NAN; d];
            weighted_refs::<true>(&mut apart, &w, &rows);
            assert!(apart.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "apart: d {d} stride {stride}");
        }
    }

    /// The AVX2 path gives the portable path's bits, at lengths around every multiple of 16.
    #[test]
    fn the_avx2_path_matches_the_portable_order_bit_for_bit() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            let mut state = 0x2545_F491_4F6C_DD1Du64;
            let mut next = || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            };
            for n in [0, 1, 15, 16, 17, 31, 32, 33, 64, 80, 127, 128, 129, 256] {
                let (a, b): (Vec<f32>, Vec<f32>) = (0..n).map(|_| (next(), next() * 100.0)).unzip();
                let want = dot_portable::<true>(&a, &b);
                // SAFETY: AVX2 and FMA checked above.
                let got = unsafe { dot_avx2(&a, &b) };
                assert_eq!(got.to_bits(), want.to_bits(), "n {n}: {got} vs {want}");
                let exact: f64 = a.iter().zip(&b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
                let scale: f64 = a.iter().zip(&b).map(|(x, y)| f64::from((x * y).abs())).sum();
                assert!((f64::from(got) - exact).abs() <= 1e-6 * scale.max(1.0), "n {n}");
                // Eight keys at once: each the same bits as alone (keys of different lengths'
                // worth of data; only the first n elements count).
                let keys: Vec<Vec<f32>> = (0..8).map(|k| (0..n + k).map(|_| next() * 3.0).collect()).collect();
                let refs: [&[f32]; 8] = std::array::from_fn(|k| &keys[k][..]);
                // SAFETY: AVX2 and FMA checked above.
                let eight = unsafe { dots8::<true>(&a, refs) };
                for (k, got) in eight.iter().enumerate() {
                    let want = dot_portable::<true>(&a, &keys[k][..n]);
                    assert_eq!(got.to_bits(), want.to_bits(), "n {n} key {k}: {got} vs {want}");
                }
            }
        }
    }
}
