//! An independent float64 decoder block (RMSNorm, q/k/v/o projections, RoPE, causal GQA
//! attention, SwiGLU MLP), written from the formulas on plain vectors, to check the layers.

use super::f64s;
use tp_core::{DType, RopeScaling, Tensor};
use tp_layers::Linear;

/// The full (unsharded) weights of one attention block.
pub struct AttnWeights {
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
}

impl AttnWeights {
    /// Random weights for `hidden` features, `nq` query and `nkv` KV heads of `d`.
    pub fn random(hidden: usize, nq: usize, nkv: usize, d: usize, bias: bool, dtype: DType, seed: u64) -> AttnWeights {
        let s = 0.3; // keeps scores O(1) so softmax is not one-hot
        let scaled = |out, inp, b, seed| {
            let l = super::linear(out, inp, b, dtype, seed);
            let wv = f64s(l.weight());
            let w = Tensor::from_fn_f64(l.weight().dims(), dtype, &tp_core::Device::Cpu, |i| wv[i] * s).unwrap();
            Linear::new(w, l.bias().cloned()).unwrap()
        };
        AttnWeights {
            q: scaled(nq * d, hidden, bias, seed),
            k: scaled(nkv * d, hidden, bias, seed + 10),
            v: scaled(nkv * d, hidden, bias, seed + 20),
            o: super::linear(hidden, nq * d, bias, dtype, seed + 30),
        }
    }
}

/// `x W^T + b` for `x: [t, in]` (f64 rows).
pub fn lin(x: &[f64], l: &Linear) -> Vec<f64> {
    let (w, b) = (f64s(l.weight()), l.bias().map(f64s));
    let (n, k) = (l.out_features(), l.in_features());
    let t = x.len() / k;
    let mut y = vec![0.0; t * n];
    for i in 0..t {
        for j in 0..n {
            y[i * n + j] = b.as_ref().map_or(0.0, |b| b[j]) + (0..k).map(|l| x[i * k + l] * w[j * k + l]).sum::<f64>();
        }
    }
    y
}

/// RMSNorm in f64 (no intermediate rounding).
pub fn rms(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let h = w.len();
    x.chunks(h)
        .flat_map(|row| {
            let r = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / h as f64 + eps).sqrt();
            row.iter().zip(w).map(move |(v, w)| v * r * w)
        })
        .collect()
}

/// Rotary frequencies in f64 from the formulas.
pub fn inv_freq(d: usize, theta: f64, scaling: RopeScaling) -> Vec<f64> {
    (0..d / 2)
        .map(|i| {
            let f = theta.powf(-((2 * i) as f64) / d as f64);
            match scaling.clone() {
                RopeScaling::Default => f,
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor: lo,
                    high_freq_factor: hi,
                    original_max_position_embeddings: old,
                } => {
                    let wl = 2.0 * std::f64::consts::PI / f;
                    if wl < old / hi {
                        f
                    } else if wl > old / lo {
                        f / factor
                    } else {
                        let s = (old / wl - lo) / (hi - lo);
                        (1.0 - s) * f / factor + s * f
                    }
                }
                // The kinds added since (linear, dynamic, yarn) are checked in tp-core's tests.
                other => panic!("this reference implements default and llama3 frequencies, not {other:?}"),
            }
        })
        .collect()
}

/// Rotate-half RoPE of `x: [t, heads, d]`, token `i` at position `i`.
pub fn rope(x: &mut [f64], heads: usize, d: usize, freq: &[f64]) {
    let half = d / 2;
    for (r, head) in x.chunks_mut(d).enumerate() {
        let p = (r / heads) as f64;
        for i in 0..half {
            let (c, s) = ((p * freq[i]).cos(), (p * freq[i]).sin());
            let (a, b) = (head[i], head[half + i]);
            head[i] = a * c - b * s;
            head[half + i] = b * c + a * s;
        }
    }
}

/// The attention block over a whole sequence `x: [t, hidden]` (token `i` at position `i`).
pub fn attention_block(
    x: &[f64],
    w: &AttnWeights,
    (nq, nkv, d): (usize, usize, usize),
    theta: f64,
    scaling: RopeScaling,
    window: Option<usize>,
) -> Vec<f64> {
    let (mut q, mut k, v) = (lin(x, &w.q), lin(x, &w.k), lin(x, &w.v));
    let freq = inv_freq(d, theta, scaling);
    rope(&mut q, nq, d, &freq);
    rope(&mut k, nkv, d, &freq);
    let t = x.len() / w.q.in_features();
    let scale = 1.0 / (d as f64).sqrt();
    let mut o = vec![0.0; t * nq * d];
    for p in 0..t {
        let lo = window.map_or(0, |w| (p + 1).saturating_sub(w));
        for h in 0..nq {
            let g = h / (nq / nkv);
            let qv = &q[(p * nq + h) * d..][..d];
            let s: Vec<f64> = (lo..=p)
                .map(|j| qv.iter().zip(&k[(j * nkv + g) * d..][..d]).map(|(a, b)| a * b).sum::<f64>() * scale)
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|s| (s - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for (j, e) in (lo..=p).zip(&e) {
                for i in 0..d {
                    o[(p * nq + h) * d + i] += e / z * v[(j * nkv + g) * d + i];
                }
            }
        }
    }
    lin(&o, &w.o)
}

/// SwiGLU MLP in f64.
pub fn mlp(x: &[f64], gate: &Linear, up: &Linear, down: &Linear) -> Vec<f64> {
    let (g, u) = (lin(x, gate), lin(x, up));
    let a: Vec<f64> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
    lin(&a, down)
}

/// The full weights of one decoder block.
pub struct BlockWeights {
    pub attn: AttnWeights,
    pub norm1: Tensor,
    pub norm2: Tensor,
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

impl BlockWeights {
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
        let cpu = tp_core::Device::Cpu;
        let norm = |s: f64| {
            Tensor::from_fn_f64(&[hidden], dtype, &cpu, |i| 0.75 + 0.5 * ((i as f64 * s).sin().abs())).unwrap()
        };
        BlockWeights {
            attn: AttnWeights::random(hidden, nq, nkv, d, bias, dtype, seed),
            norm1: norm(0.37),
            norm2: norm(0.71),
            gate: super::linear(inter, hidden, false, dtype, seed + 40),
            up: super::linear(inter, hidden, false, dtype, seed + 41),
            down: super::linear(hidden, inter, false, dtype, seed + 42),
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
            v.push((format!("{prefix}.{n}.weight"), l.weight().clone()));
            if let Some(b) = l.bias() {
                v.push((format!("{prefix}.{n}.bias"), b.clone()));
            }
        }
        v
    }
}

/// One decoder block over a whole sequence in f64.
pub fn block(x: &[f64], w: &BlockWeights, heads: (usize, usize, usize), theta: f64, eps: f64) -> Vec<f64> {
    let a = attention_block(&rms(x, &f64s(&w.norm1), eps), &w.attn, heads, theta, RopeScaling::Default, None);
    let h: Vec<f64> = x.iter().zip(&a).map(|(x, a)| x + a).collect();
    let m = mlp(&rms(&h, &f64s(&w.norm2), eps), &w.gate, &w.up, &w.down);
    h.iter().zip(&m).map(|(h, m)| h + m).collect()
}
