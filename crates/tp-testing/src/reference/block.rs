//! A float64 Llama decoder block (RMSNorm, q/k/v/o projections, RoPE, causal GQA attention,
//! SwiGLU MLP) over the full (unsharded) weights of tp-layers' layers, built from
//! [`super::ops`], to check the parallel layers.

use super::ops::{Attn, attention_f64, attention_factor_f64, glu_f64, inv_freq_f64_at, linear_abs, rms, rotate};
use tp_core::{Activation, DType, Device, NormStyle, RopeScaling, Tensor};
use tp_layers::Linear;

/// The tensor's elements as f64, panicking on error (tests only).
pub fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_f64_vec().expect("to_f64_vec")
}

/// A random `[out, in]` layer (uniform weights, optionally a bias) of `dtype` on the host.
pub fn random_linear(out: usize, inp: usize, bias: bool, dtype: DType, seed: u64) -> Linear {
    let w = Tensor::rand(&[out, inp], dtype, seed, &Device::Cpu).expect("random weight");
    let b = bias.then(|| Tensor::rand(&[out], dtype, seed + 1, &Device::Cpu).expect("random bias"));
    Linear::new(w, b).expect("a layer of matching shapes")
}

/// `x W^T + b` of layer `l` for rows `x: [t, in]`, with `Σ|x·w| + |b|` per element.
pub fn layer_abs(x: &[f64], l: &Linear) -> (Vec<f64>, Vec<f64>) {
    let b = l.bias().map(f64s);
    linear_abs(x, &f64s(l.weight().expect("a dense weight")), b.as_deref(), l.in_features())
}

/// `x W^T + b` of layer `l` for rows `x: [t, in]`.
pub fn layer(x: &[f64], l: &Linear) -> Vec<f64> {
    layer_abs(x, l).0
}

/// The full (unsharded) weights of one attention block.
pub struct AttnWeights {
    /// The query projection.
    pub q: Linear,
    /// The key projection.
    pub k: Linear,
    /// The value projection.
    pub v: Linear,
    /// The output projection.
    pub o: Linear,
}

impl AttnWeights {
    /// Random weights for `hidden` features, `nq` query and `nkv` KV heads of `d`.
    pub fn random(hidden: usize, nq: usize, nkv: usize, d: usize, bias: bool, dtype: DType, seed: u64) -> AttnWeights {
        let s = 0.3; // keeps scores O(1) so softmax is not one-hot
        let scaled = |out, inp, b, seed| {
            let l = random_linear(out, inp, b, dtype, seed);
            let wv = f64s(l.weight().expect("a dense weight"));
            let w = Tensor::from_fn_f64(l.weight().expect("a dense weight").dims(), dtype, &Device::Cpu, |i| wv[i] * s)
                .expect("scaled weight");
            Linear::new(w, l.bias().cloned()).expect("a layer of matching shapes")
        };
        AttnWeights {
            q: scaled(nq * d, hidden, bias, seed),
            k: scaled(nkv * d, hidden, bias, seed + 10),
            v: scaled(nkv * d, hidden, bias, seed + 20),
            o: random_linear(hidden, nq * d, bias, dtype, seed + 30),
        }
    }
}

/// The attention block over a whole sequence `x: [t, hidden]` (token `i` at position `i`).
pub fn attention_block(
    x: &[f64],
    w: &AttnWeights,
    (nq, nkv, d): (usize, usize, usize),
    theta: f64,
    scaling: &RopeScaling,
    window: Option<usize>,
) -> Vec<f64> {
    let (mut q, mut k, v) = (layer(x, &w.q), layer(x, &w.k), layer(x, &w.v));
    let t = x.len() / w.q.in_features();
    let positions: Vec<usize> = (0..t).collect();
    let (freq, m) = (inv_freq_f64_at(d, theta, scaling, t), attention_factor_f64(scaling));
    rotate(&mut q, &positions, (nq, d), &freq, m);
    rotate(&mut k, &positions, (nkv, d), &freq, m);
    let o = attention_f64(&q, &k, &v, &Attn { window, ..Attn::causal(t, (nq, nkv, d)) });
    layer(&o, &w.o)
}

/// The SwiGLU MLP `down(silu(gate x) · up x)` in f64.
pub fn mlp(x: &[f64], gate: &Linear, up: &Linear, down: &Linear) -> Vec<f64> {
    layer(&glu_f64(&layer(x, gate), &layer(x, up), Activation::Silu), down)
}

/// The SwiGLU MLP's output with two per-element error scales.
pub struct MlpRef {
    /// `down(silu(gate x) · up x)`.
    pub y: Vec<f64>,
    /// `Σ_j |Wd_ij| (1 + |g_j|)(1 + |u_j|) + |b|`: how far rounding of every intermediate can
    /// move the result.
    pub scale: Vec<f64>,
    /// `Σ_j |Wd_ij a_j| + |b|`: the sum of absolute partial products.
    pub partial_abs: Vec<f64>,
}

/// [`mlp`] of `x: [t, hidden]` with its error scales ([`MlpRef`]).
pub fn mlp_f64(x: &Tensor, gate: &Linear, up: &Linear, down: &Linear) -> MlpRef {
    let xv = f64s(x);
    let (g, u) = (layer(&xv, gate), layer(&xv, up));
    let act = glu_f64(&g, &u, Activation::Silu);
    let (y, partial_abs) = layer_abs(&act, down);
    let (wd, bd) = (f64s(down.weight().expect("a dense weight")), down.bias().map(f64s));
    let (h, inter) = (down.out_features(), gate.out_features());
    let scale = (0..y.len())
        .map(|e| {
            let (i, o) = (e / h, e % h);
            let spread = (0..inter)
                .map(|j| wd[o * inter + j].abs() * (1.0 + g[i * inter + j].abs()) * (1.0 + u[i * inter + j].abs()))
                .sum::<f64>();
            spread + bd.as_ref().map_or(0.0, |b| b[o].abs())
        })
        .collect();
    MlpRef { y, scale, partial_abs }
}

/// The full weights of one decoder block.
pub struct BlockWeights {
    /// The attention's projections.
    pub attn: AttnWeights,
    /// The RMSNorm weight before attention.
    pub norm1: Tensor,
    /// The RMSNorm weight before the MLP.
    pub norm2: Tensor,
    /// The MLP's gate projection.
    pub gate: Linear,
    /// The MLP's up projection.
    pub up: Linear,
    /// The MLP's down projection.
    pub down: Linear,
}

impl BlockWeights {
    /// Random weights: attention as [`AttnWeights::random`], norms near one, an MLP of `inter`.
    #[allow(clippy::too_many_arguments)]
    pub fn random(
        hidden: usize,
        inter: usize,
        nq: usize,
        nkv: usize,
        d: usize,
        bias: bool,
        dtype: DType,
        seed: u64,
    ) -> Self {
        let norm = |s: f64| {
            Tensor::from_fn_f64(&[hidden], dtype, &Device::Cpu, |i| 0.75 + 0.5 * ((i as f64 * s).sin().abs()))
                .expect("norm weight")
        };
        BlockWeights {
            attn: AttnWeights::random(hidden, nq, nkv, d, bias, dtype, seed),
            norm1: norm(0.37),
            norm2: norm(0.71),
            gate: random_linear(inter, hidden, false, dtype, seed + 40),
            up: random_linear(inter, hidden, false, dtype, seed + 41),
            down: random_linear(hidden, inter, false, dtype, seed + 42),
        }
    }

    /// `(name, tensor)` pairs under Hugging Face's names for block `prefix`.
    pub fn named(&self, prefix: &str) -> Vec<(String, Tensor)> {
        let mut v = vec![
            (format!("{prefix}.input_layernorm.weight"), self.norm1.clone()),
            (format!("{prefix}.post_attention_layernorm.weight"), self.norm2.clone()),
        ];
        let a = &self.attn;
        let parts = [
            ("self_attn.q_proj", &a.q),
            ("self_attn.k_proj", &a.k),
            ("self_attn.v_proj", &a.v),
            ("self_attn.o_proj", &a.o),
            ("mlp.gate_proj", &self.gate),
            ("mlp.up_proj", &self.up),
            ("mlp.down_proj", &self.down),
        ];
        for (n, l) in parts {
            v.push((format!("{prefix}.{n}.weight"), l.weight().expect("a dense weight").clone()));
            if let Some(b) = l.bias() {
                v.push((format!("{prefix}.{n}.bias"), b.clone()));
            }
        }
        v
    }
}

/// One pre-norm decoder block over a whole sequence in f64 (default RoPE, no window).
pub fn block(x: &[f64], w: &BlockWeights, heads: (usize, usize, usize), theta: f64, eps: f64) -> Vec<f64> {
    let n1 = rms(x, &f64s(&w.norm1), eps, NormStyle::Weight);
    let a = attention_block(&n1, &w.attn, heads, theta, &RopeScaling::Default, None);
    let h: Vec<f64> = x.iter().zip(&a).map(|(x, a)| x + a).collect();
    let m = mlp(&rms(&h, &f64s(&w.norm2), eps, NormStyle::Weight), &w.gate, &w.up, &w.down);
    h.iter().zip(&m).map(|(h, m)| h + m).collect()
}
