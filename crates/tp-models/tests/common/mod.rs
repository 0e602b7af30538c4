//! Shared helpers: tiny random models on disk, an independent float64 forward, threads per rank.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;
use tp_comm::DeviceGroup;
use tp_core::{Activation, NormStyle};
use tp_core::{Device, Tensor};
use tp_layers::{Checkpoint, Projections, QkNormSpan};
use tp_models::{Architecture, ModelConfig};

pub const CPU: Device = Device::Cpu;

/// A fresh temporary folder for one test.
pub fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tp-models-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs `f` on every rank of a LocalGroup; results in rank order.
pub fn on_ranks<R: Send>(world: usize, device: Device, f: impl Fn(DeviceGroup) -> R + Sync) -> Vec<R> {
    let groups = DeviceGroup::local(world, Duration::from_secs(120), |_| device).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = groups.into_iter().map(|g| s.spawn(|| f(g))).collect();
        hs.into_iter().map(|h| h.join().expect("rank panicked")).collect()
    })
}

pub fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_f64_vec().unwrap()
}

/// The checkpoint's tensor `name` as f64 (whole), or `None` if absent.
fn get(ckpt: &Checkpoint, name: &str) -> Option<Vec<f64>> {
    ckpt.contains(name).then(|| f64s(&ckpt.load(name, None, &CPU).unwrap()))
}

/// `x W^T + b`, `x: [t, k]`, `w: [n, k]`.
fn lin(x: &[f64], w: &[f64], b: Option<&Vec<f64>>, k: usize) -> Vec<f64> {
    let n = w.len() / k;
    let t = x.len() / k;
    let mut y = vec![0.0; t * n];
    for i in 0..t {
        for j in 0..n {
            let mut s = b.map_or(0.0, |b| b[j]);
            for l in 0..k {
                s += x[i * k + l] * w[j * k + l];
            }
            y[i * n + j] = s;
        }
    }
    y
}

fn rms(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let h = w.len();
    x.chunks(h)
        .flat_map(|r| {
            let s = 1.0 / (r.iter().map(|v| v * v).sum::<f64>() / h as f64 + eps).sqrt();
            r.iter().zip(w).map(move |(v, w)| v * s * w)
        })
        .collect()
}

/// Frequencies from the formulas (default, or llama3 with its four parameters).
fn freqs(d: usize, theta: f64, scaling: tp_core::RopeScaling, seq_len: usize) -> Vec<f64> {
    (0..d / 2)
        .map(|i| {
            let f = theta.powf(-((2 * i) as f64) / d as f64);
            match scaling.clone() {
                tp_core::RopeScaling::Default => f,
                tp_core::RopeScaling::LongRope {
                    short_factor, long_factor, original_max_position_embeddings, ..
                } => {
                    let e = if seq_len as f64 > original_max_position_embeddings { long_factor } else { short_factor };
                    f / e[i]
                }
                tp_core::RopeScaling::Llama3 {
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

/// RMSNorm of each row in f64, the weight applied in the config's style (Gemma: `1 + w`).
fn norm(x: &[f64], w: &[f64], c: &ModelConfig) -> Vec<f64> {
    let w: Vec<f64> = match c.norm_style {
        NormStyle::OnePlusWeight => w.iter().map(|v| 1.0 + v).collect(),
        _ => w.to_vec(),
    };
    rms(x, &w, c.rms_norm_eps)
}

/// The gate activation in f64, from its formula.
fn act(c: &ModelConfig, g: f64) -> f64 {
    match c.hidden_act {
        Activation::GeluTanh => {
            0.5 * g * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g.powi(3))).tanh())
        }
        _ => g / (1.0 + (-g).exp()),
    }
}

/// Rows `start..start + len` of a row-major `[rows, k]` matrix.
fn rows(w: &[f64], k: usize, start: usize, len: usize) -> Vec<f64> {
    w[start * k..(start + len) * k].to_vec()
}

/// The logits `[T, V]` of the whole sequence `ids` (positions 0..T) in float64, straight from
/// the files and the config, for every family of the architecture table: embedding (scaled
/// where the family scales it), every block (its norms before and/or after attention and the
/// MLP, q/k norms per head or over the full width, fused or separate projections, rope and
/// window per layer, the family's attention scale and activation), final norm, LM head (tied
/// or not, soft-capped where the config says).
pub fn reference_logits(dir: &Path, ids: &[i64]) -> Vec<f64> {
    let c = ModelConfig::from_dir(dir).unwrap();
    let names = c.architecture.decoder_names();
    let ckpt = Checkpoint::open(dir).unwrap();
    let (h, d, nq, nkv) = (c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads);
    let t = ids.len();
    let emb = get(&ckpt, "model.embed_tokens.weight").unwrap();
    let mut x: Vec<f64> = ids.iter().flat_map(|&i| emb[i as usize * h..(i as usize + 1) * h].to_vec()).collect();
    if let Some(s) = c.embedding_scale {
        x.iter_mut().for_each(|v| *v *= s);
    }
    let scale = c.attention_scale.unwrap_or(1.0 / (d as f64).sqrt());
    for l in 0..c.num_hidden_layers {
        let window = c.window_of(l);
        let (theta, scaling) = match (window, c.local_rope.clone()) {
            (Some(_), Some(local)) => local,
            _ => (c.rope_theta, c.rope_scaling.clone()),
        };
        let m = match &scaling {
            tp_core::RopeScaling::LongRope { attention_factor, .. } => *attention_factor,
            _ => 1.0,
        };
        let fr = freqs(d, theta, scaling, t);
        let rope = |v: &mut [f64], heads: usize| {
            for (r, head) in v.chunks_mut(d).enumerate() {
                let p = (r / heads) as f64;
                for i in 0..d / 2 {
                    let (cs, sn) = (m * (p * fr[i]).cos(), m * (p * fr[i]).sin());
                    let (a, b) = (head[i], head[d / 2 + i]);
                    head[i] = a * cs - b * sn;
                    head[d / 2 + i] = b * cs + a * sn;
                }
            }
        };
        let p = format!("model.layers.{l}");
        let w = |n: &str| get(&ckpt, &format!("{p}.{n}.weight")).unwrap();
        let b = |n: &str| get(&ckpt, &format!("{p}.{n}.bias"));
        let opt_norm = |n: Option<&str>, v: Vec<f64>| match n {
            Some(n) => norm(&v, &w(n), &c),
            None => v,
        };
        let attn = names.attn;
        let an = names.attn_names;
        let a_in = opt_norm(names.norms.attn_in, x.clone());
        let (mut q, mut k, v) = match an.qkv {
            Projections::Separate([qn, kn, vn]) => {
                let pr = |n: &str| lin(&a_in, &w(&format!("{attn}.{n}")), b(&format!("{attn}.{n}")).as_ref(), h);
                (pr(qn), pr(kn), pr(vn))
            }
            Projections::Fused(f) => {
                let (wf, bf) = (w(&format!("{attn}.{f}")), b(&format!("{attn}.{f}")));
                let part = |start: usize, len: usize| {
                    let bias = bf.as_ref().map(|bf| bf[start..start + len].to_vec());
                    lin(&a_in, &rows(&wf, h, start, len), bias.as_ref(), h)
                };
                (part(0, nq * d), part(nq * d, nkv * d), part((nq + nkv) * d, nkv * d))
            }
        };
        match c.qk_norm {
            Some(QkNormSpan::PerHead) => {
                q = norm(&q, &w(&format!("{attn}.{}", an.q_norm)), &c);
                k = norm(&k, &w(&format!("{attn}.{}", an.k_norm)), &c);
            }
            Some(QkNormSpan::FullWidth) => {
                q = norm(&q, &w(&format!("{attn}.{}", an.q_norm)), &c);
                k = norm(&k, &w(&format!("{attn}.{}", an.k_norm)), &c);
            }
            None => {}
        }
        rope(&mut q, nq);
        rope(&mut k, nkv);
        let mut o = vec![0.0; t * nq * d];
        for pos in 0..t {
            let lo = window.map_or(0, |win| (pos + 1).saturating_sub(win));
            for hh in 0..nq {
                let g = hh / (nq / nkv);
                let qv = &q[(pos * nq + hh) * d..][..d];
                let s: Vec<f64> = (lo..=pos)
                    .map(|j| qv.iter().zip(&k[(j * nkv + g) * d..][..d]).map(|(a, b)| a * b).sum::<f64>() * scale)
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (j, e) in (lo..=pos).zip(&e) {
                    for i in 0..d {
                        o[(pos * nq + hh) * d + i] += e / z * v[(j * nkv + g) * d + i];
                    }
                }
            }
        }
        let on = format!("{attn}.{}", an.o);
        let a = opt_norm(names.norms.attn_out, lin(&o, &w(&on), b(&on).as_ref(), nq * d));
        x.iter_mut().zip(&a).for_each(|(x, a)| *x += a);
        let m_in = opt_norm(names.norms.mlp_in, x.clone());
        let mlp = names.mlp;
        let inter = c.intermediate_size;
        let (gate, up) = match names.mlp_names.gate_up {
            Projections::Separate([gn, un]) => {
                let pr = |n: &str| lin(&m_in, &w(&format!("{mlp}.{n}")), b(&format!("{mlp}.{n}")).as_ref(), h);
                (pr(gn), pr(un))
            }
            Projections::Fused(f) => {
                let (wf, bf) = (w(&format!("{mlp}.{f}")), b(&format!("{mlp}.{f}")));
                let part = |start: usize| {
                    let bias = bf.as_ref().map(|bf| bf[start..start + inter].to_vec());
                    lin(&m_in, &rows(&wf, h, start, inter), bias.as_ref(), h)
                };
                (part(0), part(inter))
            }
        };
        let a: Vec<f64> = gate.iter().zip(&up).map(|(g, u)| act(&c, *g) * u).collect();
        let dn = format!("{mlp}.{}", names.mlp_names.down);
        let m = opt_norm(names.norms.mlp_out, lin(&a, &w(&dn), b(&dn).as_ref(), inter));
        x.iter_mut().zip(&m).for_each(|(x, m)| *x += m);
    }
    let xn = norm(&x, &get(&ckpt, "model.norm.weight").unwrap(), &c);
    let head = if c.tie_word_embeddings { emb } else { get(&ckpt, "lm_head.weight").unwrap() };
    let logits = lin(&xn, &head, None, h);
    match c.final_logit_softcapping {
        Some(cap) => logits.iter().map(|l| cap * (l / cap).tanh()).collect(),
        None => logits,
    }
}

/// Asserts `got` is within `tol` (absolute, scaled by the largest |want|) of `want`.
pub fn assert_close(what: &str, got: &[f64], want: &[f64], rel: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= rel * scale, "{what}: element {i}: got {g}, want {w} (scale {scale})");
    }
}

/// Argmax with torch's rule (first maximum).
pub fn argmax(row: &[f64]) -> usize {
    let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    row.iter().position(|&v| v == m).unwrap()
}

pub fn is_llama(c: &ModelConfig) -> bool {
    c.architecture == Architecture::Llama
}
