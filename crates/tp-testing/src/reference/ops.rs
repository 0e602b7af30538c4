//! Float64 building blocks of a decoder, on plain row-major vectors, written from the formulas
//! (the papers' and transformers' documented math, never from tp's code): rounding to a dtype,
//! linear layers, RMSNorm in every weight style, rotary frequencies of every scaling kind, the
//! rotation, causal attention with windows, scales and KV groups, gated activations.

use tp_core::{Activation, AttentionSpec, DType, KvGroups, NormStyle, RopeScaling, bf16, f16};

/// `v` rounded once (nearest even) to `dtype`, back in f64.
pub fn round_to(dtype: DType, v: f64) -> f64 {
    match dtype {
        DType::F32 => f64::from(v as f32),
        DType::F16 => f16::from_f64(v).to_f64(),
        DType::BF16 => bf16::from_f64(v).to_f64(),
        DType::I32 | DType::I64 => v.round(),
    }
}

/// The spacing of `dtype`'s values around `v` (one ulp), subnormals included.
pub fn ulp(dtype: DType, v: f64) -> f64 {
    let (mantissa, min_exp) = match dtype {
        DType::F32 => (23, -126),
        DType::F16 => (10, -14),
        DType::BF16 => (7, -126),
        DType::I32 | DType::I64 => return 1.0,
    };
    let e = if v == 0.0 { min_exp } else { (v.abs().log2().floor() as i32).max(min_exp) };
    2f64.powi(e - mantissa)
}

/// `y[i, j] = Σ_l x[i, l] · w(l, j)` for `x: [m, k]`, with `w(l, j)` read from an `[n, k]`
/// (`nk`) or `[k, n]` weight; returns `(y, Σ_l |x[i, l] · w(l, j)|)` for error bounds.
pub fn matmul_f64(x: &[f64], w: &[f64], m: usize, k: usize, n: usize, nk: bool) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0.0; m * n];
    let mut abs = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let (mut s, mut a) = (0.0, 0.0);
            for l in 0..k {
                let wv = if nk { w[j * k + l] } else { w[l * n + j] };
                s += x[i * k + l] * wv;
                a += (x[i * k + l] * wv).abs();
            }
            y[i * n + j] = s;
            abs[i * n + j] = a;
        }
    }
    (y, abs)
}

/// `x W^T + b` for rows `x: [t, k]` and `w: [n, k]`, with `Σ|x·w| + |b|` per element.
pub fn linear_abs(x: &[f64], w: &[f64], b: Option<&[f64]>, k: usize) -> (Vec<f64>, Vec<f64>) {
    let n = w.len() / k;
    let (mut y, mut abs) = matmul_f64(x, w, x.len() / k, k, n, true);
    if let Some(b) = b {
        for (i, (y, a)) in y.iter_mut().zip(&mut abs).enumerate() {
            *y += b[i % n];
            *a += b[i % n].abs();
        }
    }
    (y, abs)
}

/// `x W^T + b` for rows `x: [t, k]` and `w: [n, k]`.
pub fn lin(x: &[f64], w: &[f64], b: Option<&[f64]>, k: usize) -> Vec<f64> {
    linear_abs(x, w, b, k).0
}

/// `1 / sqrt(sum_squares / n + eps)`: RMSNorm's factor for a row whose `n` features have
/// `sum_squares`.
pub fn rstd(sum_squares: f64, n: usize, eps: f64) -> f64 {
    1.0 / (sum_squares / n as f64 + eps).sqrt()
}

/// One row `x · rstd` times the weight in `style`, rounded to `dtype` where PyTorch rounds
/// (`Some`): `round(w · round(x·r))` (Llama), `round(x·r · (1 + w))` (Gemma), `round(w · x·r)`
/// (OLMo 2's f32 product); `None`: no rounding at all.
pub fn norm_row(row: &[f64], w: &[f64], rstd: f64, style: NormStyle, dtype: Option<DType>) -> Vec<f64> {
    let r = |v: f64| dtype.map_or(v, |d| round_to(d, v));
    row.iter()
        .zip(w)
        .map(|(v, w)| match style {
            NormStyle::Weight => r(w * r(v * rstd)),
            NormStyle::OnePlusWeight => r(v * rstd * (1.0 + w)),
            NormStyle::WeightF32 => r(w * (v * rstd)),
        })
        .collect()
}

/// RMSNorm of every row of `x` (rows of `w.len()` features) in f64, the weight in `style`.
pub fn rms(x: &[f64], w: &[f64], eps: f64, style: NormStyle) -> Vec<f64> {
    let h = w.len();
    x.chunks(h).flat_map(|row| norm_row(row, w, rstd(row.iter().map(|v| v * v).sum(), h, eps), style, None)).collect()
}

/// The rotary frequencies of a call over `seq_len` tokens (its largest position + 1) for heads
/// of `head_dim` with base `theta`, every scaling kind: dynamic NTK's base grows past the
/// trained length, LongRoPE takes its long factors past the original length.
pub fn inv_freq_f64_at(head_dim: usize, theta: f64, scaling: &RopeScaling, seq_len: usize) -> Vec<f64> {
    let d = head_dim as f64;
    let theta = match *scaling {
        RopeScaling::Dynamic { factor, max_position_embeddings: m } => {
            let l = (seq_len as f64).max(m);
            theta * (factor * l / m - (factor - 1.0)).powf(d / (d - 2.0))
        }
        _ => theta,
    };
    (0..head_dim / 2).map(|i| scaled_freq(i, theta.powf(-((2 * i) as f64) / d), d, theta, scaling, seq_len)).collect()
}

/// The frequencies of calls within the trained length ([`inv_freq_f64_at`] for 0 tokens).
pub fn inv_freq_f64(head_dim: usize, theta: f64, scaling: &RopeScaling) -> Vec<f64> {
    inv_freq_f64_at(head_dim, theta, scaling, 0)
}

/// Pair `i`'s base frequency `f` after `scaling`.
fn scaled_freq(i: usize, f: f64, d: f64, theta: f64, scaling: &RopeScaling, seq_len: usize) -> f64 {
    match *scaling {
        RopeScaling::Default | RopeScaling::Dynamic { .. } => f,
        RopeScaling::Linear { factor } => f / factor,
        RopeScaling::LongRope { ref short_factor, ref long_factor, original_max_position_embeddings: old, .. } => {
            f / if seq_len as f64 > old { long_factor[i] } else { short_factor[i] }
        }
        RopeScaling::Yarn { factor, original_max_position_embeddings: old, beta_fast, beta_slow, truncate, .. } => {
            // Pair index at which a wavelength fits `rotations` times into `old` positions.
            let pair = |rotations: f64| d * (old / (2.0 * std::f64::consts::PI * rotations)).ln() / (2.0 * theta.ln());
            let (lo, hi) = if truncate {
                (pair(beta_fast).floor(), pair(beta_slow).ceil())
            } else {
                (pair(beta_fast), pair(beta_slow))
            };
            let (lo, hi) = (lo.max(0.0), hi.min(d - 1.0));
            let hi = if lo == hi { hi + 0.001 } else { hi };
            // 0 below `lo` (keep f), 1 above `hi` (interpolate: f / factor).
            let ramp = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
            ramp * f / factor + (1.0 - ramp) * f
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor: lo,
            high_freq_factor: hi,
            original_max_position_embeddings: old,
        } => {
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen < old / hi {
                f
            } else if wavelen > old / lo {
                f / factor
            } else {
                let s = (old / wavelen - lo) / (hi - lo);
                (1.0 - s) * f / factor + s * f
            }
        }
    }
}

/// The multiplier of cos and sin: YaRN's and LongRoPE's attention factor, else 1.
pub fn attention_factor_f64(scaling: &RopeScaling) -> f64 {
    match *scaling {
        RopeScaling::Yarn { attention_factor, .. } | RopeScaling::LongRope { attention_factor, .. } => attention_factor,
        _ => 1.0,
    }
}

/// Rotate-half RoPE in place on `x: [t, heads, head_dim]`, token `t` at `positions[t]`, with pair
/// frequencies `freq` and cos/sin times `m`: the first `2 * freq.len()` features of each head
/// rotate, the rest (partial rotary) stay.
pub fn rotate(x: &mut [f64], positions: &[usize], (heads, head_dim): (usize, usize), freq: &[f64], m: f64) {
    let half = freq.len();
    for (r, head) in x.chunks_mut(head_dim).enumerate() {
        let p = positions[r / heads] as f64;
        for (i, f) in freq.iter().enumerate() {
            let (c, s) = (m * (p * f).cos(), m * (p * f).sin());
            let (a, b) = (head[i], head[half + i]);
            head[i] = a * c - b * s;
            head[half + i] = b * c + a * s;
        }
    }
}

/// The shape and rule of one causal attention: `t` queries of `hq` heads over the first
/// `kv_len` rows of keys and values of `hkv` heads, all of `d` features.
#[derive(Debug, Clone, PartialEq)]
pub struct Attn {
    /// Query tokens (the last `t` of the `kv_len` positions).
    pub t: usize,
    /// Query heads.
    pub hq: usize,
    /// Key/value heads.
    pub hkv: usize,
    /// Features per head.
    pub d: usize,
    /// Key/value rows attended to.
    pub kv_len: usize,
    /// Multiplier of the scores.
    pub scale: f64,
    /// Each query sees at most this many positions, its own included.
    pub window: Option<usize>,
    /// Query head `h` reads KV head `(h + offset) / size`; `None`: `h / (hq / hkv)`.
    pub kv_groups: Option<KvGroups>,
    /// One attention-sink logit per query head (gpt-oss), counted in the softmax and dropped.
    pub sinks: Option<Vec<f64>>,
}

impl Attn {
    /// A whole sequence of `t` tokens attending to itself, scale `1/sqrt(d)`, no window.
    pub fn causal(t: usize, (hq, hkv, d): (usize, usize, usize)) -> Attn {
        let scale = 1.0 / (d as f64).sqrt();
        Attn { t, hq, hkv, d, kv_len: t, scale, window: None, kv_groups: None, sinks: None }
    }

    /// What `spec` asks of `t` queries of heads `(hq, hkv, d)` (its f32 scale, widened).
    pub fn of_spec(t: usize, (hq, hkv, d): (usize, usize, usize), spec: &AttentionSpec) -> Attn {
        Attn {
            t,
            hq,
            hkv,
            d,
            kv_len: spec.kv_len,
            scale: f64::from(spec.scale),
            window: spec.sliding_window,
            kv_groups: spec.kv_groups,
            sinks: spec.sinks.as_ref().map(|s| s.iter().map(|&x| f64::from(x)).collect()),
        }
    }
}

/// Causal attention in f64: `q: [t, hq, d]`, `k, v: [>= kv_len, hkv, d]`, out `[t, hq, d]`.
pub fn attention_f64(q: &[f64], k: &[f64], v: &[f64], a: &Attn) -> Vec<f64> {
    let Attn { t, hq, hkv, d, .. } = a.clone();
    let mut out = vec![0.0; t * hq * d];
    for tok in 0..t {
        let p = a.kv_len - t + tok;
        let lo = a.window.map_or(0, |w| (p + 1).saturating_sub(w));
        for h in 0..hq {
            let g = match a.kv_groups {
                Some(KvGroups { size, offset }) => (h + offset) / size,
                None => h / (hq / hkv),
            };
            let qv = &q[(tok * hq + h) * d..][..d];
            let scores: Vec<f64> = (lo..=p)
                .map(|j| qv.iter().zip(&k[(j * hkv + g) * d..][..d]).map(|(a, b)| a * b).sum::<f64>() * a.scale)
                .collect();
            let sink = a.sinks.as_ref().map(|s| s[h]);
            let m = scores.iter().cloned().fold(sink.unwrap_or(f64::NEG_INFINITY), f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - m).exp());
            for (j, w) in (lo..=p).zip(&e) {
                for i in 0..d {
                    out[(tok * hq + h) * d + i] += w / z * v[(j * hkv + g) * d + i];
                }
            }
        }
    }
    out
}

/// The activation `act(g)` in f64: SiLU `g / (1 + e^-g)`, or GELU's tanh approximation.
pub fn act_f64(act: Activation, g: f64) -> f64 {
    match act {
        Activation::Silu => g / (1.0 + (-g).exp()),
        Activation::GeluTanh => {
            0.5 * g * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g.powi(3))).tanh())
        }
        Activation::ClampedSwiglu { alpha, limit } => {
            let g = g.min(f64::from(limit));
            g / (1.0 + (-f64::from(alpha) * g).exp())
        }
    }
}

/// The factor on `act(gate)`: `up`, or the clamped SwiGLU's `clamp(up, -limit, limit) + 1`.
pub fn up_f64(act: Activation, u: f64) -> f64 {
    match act {
        Activation::ClampedSwiglu { limit, .. } => u.clamp(-f64::from(limit), f64::from(limit)) + 1.0,
        _ => u,
    }
}

/// The gated activation `act(gate) · up(up)`, element by element.
pub fn glu_f64(gate: &[f64], up: &[f64], act: Activation) -> Vec<f64> {
    gate.iter().zip(up).map(|(g, u)| act_f64(act, *g) * up_f64(act, *u)).collect()
}

/// YaRN with transformers' defaults, written out: ramp over 32..1 rotations, truncated to
/// whole pairs, cos and sin times `0.1·ln(factor) + 1` (1 for `factor <= 1`).
pub fn yarn_defaults(factor: f64, original_max_position_embeddings: f64) -> RopeScaling {
    RopeScaling::Yarn {
        factor,
        original_max_position_embeddings,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
        attention_factor: if factor <= 1.0 { 1.0 } else { 0.1 * factor.ln() + 1.0 },
    }
}
