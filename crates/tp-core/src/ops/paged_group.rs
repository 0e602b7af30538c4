//! The host's paged attention for the query heads of one GQA group at once, on AVX-512: the
//! heads that share a KV head (up to [`HEADS`] per pass) read each key and value row once
//! instead of once per head, and the scores, softmax and weighted sums run sixteen lanes wide.
//!
//! For each head `h` of the pass, over its keys `k_j` and values `v_j` (`j < n`, position
//! order):
//!
//! - `s_hj = scale · Σ_c q_hc k_jc`: lane `l` of one `f32` accumulator takes the elements
//!   `c ≡ l (mod 16)` in order (fused multiply-adds), and the sixteen lanes are added by one
//!   fixed tree ([`hsum16`]: lanes `l + 8`, then `l + 4`, then `l + 2`, then `l + 1`);
//! - `m_h = max_j s_hj`, `e_hj = exp(s_hj − m_h)` ([`exp_neg16`], the same bits as the scalar
//!   `exp_neg`), `Z_h = Σ_j e_hj` (lane `l` takes `j ≡ l (mod 16)` in order, then the same tree);
//!   with an attention sink `σ_h`, `m_h` also covers `σ_h` and `e^{σ_h − m_h}` is added to `Z_h`
//!   last;
//! - `y_h = (Σ_j e_hj v_j) · (1 / Z_h)`, each output element one fused multiply-add per key in
//!   position order.
//!
//! Every head's arithmetic is the same whichever heads share its pass (each head has its own
//! accumulators; the tree reduces every vector alike), so a row's result depends only on its
//! query and its sequence's keys, as the module `paged` promises.

use std::arch::x86_64::*;

/// Query heads per pass over the keys: four heads' accumulators of one 64-element piece of the
/// values (16 registers) leave room for the values and the weight.
const HEADS: usize = 4;

/// Value elements per pass of the weighted sum, in 16-lane pieces.
const PIECES: usize = 4;

/// The run of rows from row `r` (token `r / hq`, query head `r % hq`; at most `left` rows) whose
/// query heads belong to one token and share a KV head: `(token, KV head, rows in the run)`.
pub(super) fn gqa_run(r: usize, left: usize, hq: usize, groups: crate::KvGroups) -> (usize, usize, usize) {
    let kv_head = |r: usize| ((r % hq) + groups.offset) / groups.size;
    let (tok, kvh) = (r / hq, kv_head(r));
    let mut g = 1;
    while g < left && (r + g) / hq == tok && kv_head(r + g) == kvh {
        g += 1;
    }
    (tok, kvh, g)
}

/// Attention of the query heads `q: [g, d]` (one token's heads that share one KV head) over the
/// key rows `keys[j]` and value rows `vals[j]` (`d` floats each, position order), written to
/// `y: [g, d]`, with the score scale and, if the call has them, the `g` heads' sink logits;
/// `scores` is scratch.
///
/// # Safety
/// The CPU must have AVX-512F and FMA; every `keys[j]` and `vals[j]` readable for `d` floats;
/// `keys` and `vals` of one length.
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn group_rows(
    q: &[f32],
    d: usize,
    keys: &[*const f32],
    vals: &[*const f32],
    (scale, sinks): (f32, Option<&[f32]>),
    scores: &mut Vec<f32>,
    y: &mut [f32],
) {
    assert!(
        d > 0
            && q.len() == y.len()
            && q.len().is_multiple_of(d)
            && keys.len() == vals.len()
            && sinks.is_none_or(|s| s.len() == q.len() / d),
        "group_rows: operands"
    );
    let g = q.len() / d;
    let np = keys.len().next_multiple_of(16);
    scores.resize(HEADS * np, 0.0);
    let mut h0 = 0;
    while h0 < g {
        let hs = HEADS.min(g - h0);
        let (qs, ys) = (&q[h0 * d..(h0 + hs) * d], &mut y[h0 * d..(h0 + hs) * d]);
        let sk = (scale, sinks.map(|s| &s[h0..h0 + hs]));
        // SAFETY: the caller's guarantees, and `scores` holds `HEADS · np` floats.
        unsafe {
            match hs {
                1 => pass::<1>(qs, d, keys, vals, sk, scores, np, ys),
                2 => pass::<2>(qs, d, keys, vals, sk, scores, np, ys),
                3 => pass::<3>(qs, d, keys, vals, sk, scores, np, ys),
                _ => pass::<4>(qs, d, keys, vals, sk, scores, np, ys),
            }
        }
        h0 += hs;
    }
}

/// One pass of `H` heads (see the module docs).
///
/// # Safety
/// As [`group_rows`]; `q` and `y` hold `H · d` floats, `s` at least `H · np`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn pass<const H: usize>(
    q: &[f32],
    d: usize,
    keys: &[*const f32],
    vals: &[*const f32],
    (scale, sinks): (f32, Option<&[f32]>),
    s: &mut [f32],
    np: usize,
    y: &mut [f32],
) {
    // SAFETY: as stated.
    unsafe {
        scores::<H>(q, d, keys, vals, scale, s, np);
        let n = keys.len();
        let mut inv = [0f32; H];
        for (h, inv) in inv.iter_mut().enumerate() {
            *inv = 1.0 / softmax(&mut s[h * np..h * np + np], n, sinks.map(|s| s[h]));
        }
        let nc = d.div_ceil(16);
        let mut c0 = 0;
        while c0 + PIECES <= nc {
            weighted::<H, PIECES>(d, c0, vals, s, np, &inv, y);
            c0 += PIECES;
        }
        while c0 < nc {
            weighted::<H, 1>(d, c0, vals, s, np, &inv, y);
            c0 += 1;
        }
    }
}

/// The mask of piece `c` of a `d`-element row (the last one may be partial).
#[inline(always)]
fn piece_mask(d: usize, c: usize) -> __mmask16 {
    let left = d - 16 * c;
    if left >= 16 { 0xFFFF } else { (1u16 << left) - 1 }
}

/// `s[h · np + j] = scale · q_h · k_j` for every key, sixteen keys at a time.
///
/// # Safety
/// As [`pass`].
#[inline(always)]
unsafe fn scores<const H: usize>(
    q: &[f32],
    d: usize,
    keys: &[*const f32],
    vals: &[*const f32],
    scale: f32,
    s: &mut [f32],
    np: usize,
) {
    let n = keys.len();
    let nc = d.div_ceil(16);
    // SAFETY: every load reads a piece of a `d`-float row under its mask; every store lands in
    // `s[h · np .. h · np + np]` (`j0 + 16 <= np`).
    unsafe {
        let mut part = [[_mm512_setzero_ps(); 16]; H];
        // The cache's rows are scattered over its blocks, where the hardware prefetchers do
        // not follow them: each key row is asked for sixteen keys ahead, each value row as its
        // key is scored (the weighted sums read them next).
        for &k in keys.iter().take(16) {
            prefetch_row::<_MM_HINT_T0>(k, d);
        }
        for j0 in (0..n).step_by(16) {
            for jj in 0..16 {
                if let Some(&k) = keys.get(j0 + jj + 16) {
                    prefetch_row::<_MM_HINT_T0>(k, d);
                }
                if let Some(&v) = vals.get(j0 + jj) {
                    prefetch_row::<_MM_HINT_T1>(v, d);
                }
                let mut acc = [_mm512_setzero_ps(); H];
                if let Some(&k) = keys.get(j0 + jj) {
                    for c in 0..nc {
                        let m = piece_mask(d, c);
                        let kc = _mm512_maskz_loadu_ps(m, k.add(16 * c));
                        for (h, a) in acc.iter_mut().enumerate() {
                            let qc = _mm512_maskz_loadu_ps(m, q.as_ptr().add(h * d + 16 * c));
                            *a = _mm512_fmadd_ps(qc, kc, *a);
                        }
                    }
                }
                for (p, a) in part.iter_mut().zip(acc) {
                    p[jj] = a;
                }
            }
            let sc = _mm512_set1_ps(scale);
            for (h, p) in part.iter().enumerate() {
                _mm512_storeu_ps(s.as_mut_ptr().add(h * np + j0), _mm512_mul_ps(hsum16(p), sc));
            }
        }
    }
}

/// Asks for the cache lines of the `d`-float row at `p`.
#[inline(always)]
fn prefetch_row<const HINT: i32>(p: *const f32, d: usize) {
    for b in (0..4 * d).step_by(64) {
        // SAFETY: a prefetch never faults, whatever the address.
        unsafe { _mm_prefetch::<HINT>(p.cast::<i8>().wrapping_add(b)) };
    }
}

/// Lane `i` holds the sum of `v[i]`'s sixteen lanes, every vector added by one tree: lanes
/// `l + 8` onto `l`, then `l + 4`, `l + 2`, `l + 1` (see [`tree_sum`]).
///
/// # Safety
/// AVX-512F.
#[inline(always)]
unsafe fn hsum16(v: &[__m512; 16]) -> __m512 {
    // Where each input goes so that output lane `i` is `v[i]`'s sum: the shuffles below leave
    // the sum of their input `i` in lane `PERM[i]` (`PERM` is its own inverse).
    const PERM: [usize; 16] = [0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15];
    // SAFETY: register operations only; AVX-512F as stated.
    unsafe {
        // (A plain loop: a closure would not inherit this function's target features.)
        let mut x = [_mm512_setzero_ps(); 16];
        for i in 0..16 {
            x[i] = v[PERM[i]];
        }
        // Lanes l and l + 8 of inputs i and i + 8 (their 128-bit quarters 0+2 and 1+3).
        let mut t = [_mm512_setzero_ps(); 8];
        for i in 0..8 {
            let a = _mm512_shuffle_f32x4::<0b01_00_01_00>(x[i], x[i + 8]);
            let b = _mm512_shuffle_f32x4::<0b11_10_11_10>(x[i], x[i + 8]);
            t[i] = _mm512_add_ps(a, b);
        }
        // Then l + 4.
        let mut u = [_mm512_setzero_ps(); 4];
        for i in 0..4 {
            let a = _mm512_shuffle_f32x4::<0b10_00_10_00>(t[i], t[i + 4]);
            let b = _mm512_shuffle_f32x4::<0b11_01_11_01>(t[i], t[i + 4]);
            u[i] = _mm512_add_ps(a, b);
        }
        // Then l + 2, within 128-bit lanes.
        let mut w = [_mm512_setzero_ps(); 2];
        for i in 0..2 {
            let a = _mm512_shuffle_ps::<0b01_00_01_00>(u[i], u[i + 2]);
            let b = _mm512_shuffle_ps::<0b11_10_11_10>(u[i], u[i + 2]);
            w[i] = _mm512_add_ps(a, b);
        }
        // Then l + 1.
        let a = _mm512_shuffle_ps::<0b10_00_10_00>(w[0], w[1]);
        let b = _mm512_shuffle_ps::<0b11_01_11_01>(w[0], w[1]);
        _mm512_add_ps(a, b)
    }
}

/// The sum of sixteen lanes by [`hsum16`]'s tree.
pub(super) fn tree_sum(l: &[f32; 16]) -> f32 {
    let a: [f32; 8] = std::array::from_fn(|i| l[i] + l[i + 8]);
    let b: [f32; 4] = std::array::from_fn(|i| a[i] + a[i + 4]);
    (b[0] + b[2]) + (b[1] + b[3])
}

/// Replaces the first `n` scores of `row` by `exp(s − max)` and returns their sum, the sink's
/// `exp(σ − max)` included where there is one (`max` covering it too; see the module docs).
///
/// # Safety
/// AVX-512F; `row` holds a multiple of 16 floats, at least `n`.
#[inline(always)]
unsafe fn softmax(row: &mut [f32], n: usize, sink: Option<f32>) -> f32 {
    let p = row.as_mut_ptr();
    let mask = |j0: usize| if n - j0 >= 16 { 0xFFFF } else { (1u16 << (n - j0)) - 1 };
    // SAFETY: every access is a masked piece of `row` at `j0 < n <= row.len()`, `j0 + 16 <=
    // row.len()`.
    unsafe {
        let mut mx = _mm512_set1_ps(f32::NEG_INFINITY);
        for j0 in (0..n).step_by(16) {
            mx = _mm512_mask_max_ps(mx, mask(j0), mx, _mm512_loadu_ps(p.add(j0)));
        }
        let top = _mm512_reduce_max_ps(mx);
        let top = sink.map_or(top, |s| top.max(s));
        let max = _mm512_set1_ps(top);
        let mut sum = _mm512_setzero_ps();
        for j0 in (0..n).step_by(16) {
            let m = mask(j0);
            let e = exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(p.add(j0)), max));
            _mm512_mask_storeu_ps(p.add(j0), m, e);
            sum = _mm512_mask_add_ps(sum, m, sum, e);
        }
        let mut lanes = [0f32; 16];
        _mm512_storeu_ps(lanes.as_mut_ptr(), sum);
        tree_sum(&lanes) + sink.map_or(0.0, |s| super::attention::exp_neg(s - top))
    }
}

/// `exp(x)` for `x <= 0` on sixteen lanes: the operations of the scalar `exp_neg` in its order
/// (no fused multiply-add), so the same bits.
///
/// # Safety
/// AVX-512F.
#[inline(always)]
pub(super) unsafe fn exp_neg16(x: __m512) -> __m512 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0;
    const C: [f32; 5] = [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5];
    // SAFETY: register operations only; AVX-512F as stated.
    unsafe {
        let s = _mm512_set1_ps;
        let x = _mm512_min_ps(_mm512_max_ps(x, s(-87.0)), s(0.0));
        let n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, s(LOG2E)), s(ROUND)), s(ROUND));
        let r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, s(LN2_HI))), _mm512_mul_ps(n, s(LN2_LO)));
        let mut p = s(1.987_569_1e-4);
        for c in C {
            p = _mm512_add_ps(_mm512_mul_ps(p, r), s(c));
        }
        let y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), s(1.0));
        let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)));
        _mm512_mul_ps(y, _mm512_castsi512_ps(e))
    }
}

/// `y_h[piece c0 .. c0 + C] = (Σ_j e_hj v_j) · inv_h` over those pieces of the value rows.
///
/// # Safety
/// As [`pass`]; `c0 + C <= d.div_ceil(16)`.
#[inline(always)]
unsafe fn weighted<const H: usize, const C: usize>(
    d: usize,
    c0: usize,
    vals: &[*const f32],
    s: &[f32],
    np: usize,
    inv: &[f32; H],
    y: &mut [f32],
) {
    // SAFETY: every load and store is a masked piece of a `d`-float row (`c0 + c` a piece of
    // it); `s[h · np + j]` with `j < n <= np`.
    unsafe {
        let mut masks = [0 as __mmask16; C];
        for (c, m) in masks.iter_mut().enumerate() {
            *m = piece_mask(d, c0 + c);
        }
        let mut acc = [[_mm512_setzero_ps(); C]; H];
        for (j, &v) in vals.iter().enumerate() {
            let mut vc = [_mm512_setzero_ps(); C];
            for c in 0..C {
                vc[c] = _mm512_maskz_loadu_ps(masks[c], v.add(16 * (c0 + c)));
            }
            for (h, a) in acc.iter_mut().enumerate() {
                let e = _mm512_set1_ps(*s.get_unchecked(h * np + j));
                for c in 0..C {
                    a[c] = _mm512_fmadd_ps(e, vc[c], a[c]);
                }
            }
        }
        for h in 0..H {
            let i = _mm512_set1_ps(inv[h]);
            for c in 0..C {
                let at = y.as_mut_ptr().add(h * d + 16 * (c0 + c));
                _mm512_mask_storeu_ps(at, masks[c], _mm512_mul_ps(acc[h][c], i));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn avx512() -> bool {
        std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma")
    }

    #[target_feature(enable = "avx512f")]
    fn hsum16_lanes(v: &[[f32; 16]; 16]) -> [f32; 16] {
        // SAFETY: AVX-512F by this function's feature; loads of 16 floats from 16-float arrays.
        unsafe {
            let mut x = [_mm512_setzero_ps(); 16];
            for i in 0..16 {
                x[i] = _mm512_loadu_ps(v[i].as_ptr());
            }
            let mut out = [0f32; 16];
            _mm512_storeu_ps(out.as_mut_ptr(), hsum16(&x));
            out
        }
    }

    #[test]
    fn hsum16_sums_each_vector_by_the_tree() {
        if !avx512() {
            eprintln!("skipped: no AVX-512F (the tree is only used on AVX-512 machines)");
            return;
        }
        let mut rng = crate::rng::SplitMix64::new(5);
        for _ in 0..200 {
            let v: [[f32; 16]; 16] =
                std::array::from_fn(|_| std::array::from_fn(|_| (rng.next_u64() >> 40) as f32 / 1e5 - 80.0));
            // SAFETY: AVX-512F checked above.
            let got = unsafe { hsum16_lanes(&v) };
            for i in 0..16 {
                assert_eq!(got[i].to_bits(), tree_sum(&v[i]).to_bits(), "lane {i}");
                let exact: f64 = v[i].iter().map(|&x| f64::from(x)).sum();
                assert!((f64::from(got[i]) - exact).abs() < 1e-3, "lane {i}: {} vs {exact}", got[i]);
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    fn exp16(x: &[f32; 16]) -> [f32; 16] {
        // SAFETY: AVX-512F by this function's feature.
        unsafe {
            let mut out = [0f32; 16];
            _mm512_storeu_ps(out.as_mut_ptr(), exp_neg16(_mm512_loadu_ps(x.as_ptr())));
            out
        }
    }

    #[test]
    fn exp_neg16_gives_the_scalar_bits() {
        if !avx512() {
            eprintln!("skipped: no AVX-512F");
            return;
        }
        let xs: Vec<f32> =
            (0..=90_000).map(|i| -(i as f32) * 1e-3).chain([-1e30, f32::NEG_INFINITY, -0.0, 0.0]).collect();
        for c in xs.chunks(16) {
            let mut x = [0f32; 16];
            x[..c.len()].copy_from_slice(c);
            // SAFETY: AVX-512F checked above.
            let got = unsafe { exp16(&x) };
            for (g, &xi) in got.iter().zip(&x) {
                assert_eq!(g.to_bits(), super::super::attention::exp_neg(xi).to_bits(), "exp({xi})");
            }
        }
    }
}
