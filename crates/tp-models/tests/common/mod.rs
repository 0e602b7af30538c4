//! Shared helpers: tiny random models on disk, an independent float64 forward, threads per rank.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;
use tp_comm::DeviceGroup;
use tp_core::{Device, Tensor};
use tp_layers::Checkpoint;
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
fn freqs(c: &ModelConfig) -> Vec<f64> {
    let d = c.head_dim;
    (0..d / 2)
        .map(|i| {
            let f = c.rope_theta.powf(-((2 * i) as f64) / d as f64);
            match c.rope_scaling {
                tp_core::RopeScaling::Default => f,
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

/// The logits `[T, V]` of the whole sequence `ids` (positions 0..T) in float64, straight from
/// the files and the config: embedding, every block, final norm, LM head (tied or not).
pub fn reference_logits(dir: &Path, ids: &[i64]) -> Vec<f64> {
    let c = ModelConfig::from_dir(dir).unwrap();
    let ckpt = Checkpoint::open(dir).unwrap();
    let (h, d, nq, nkv) = (c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads);
    let t = ids.len();
    let emb = get(&ckpt, "model.embed_tokens.weight").unwrap();
    let mut x: Vec<f64> = ids.iter().flat_map(|&i| emb[i as usize * h..(i as usize + 1) * h].to_vec()).collect();
    let fr = freqs(&c);
    let rope = |v: &mut [f64], heads: usize| {
        for (r, head) in v.chunks_mut(d).enumerate() {
            let p = (r / heads) as f64;
            for i in 0..d / 2 {
                let (cs, sn) = ((p * fr[i]).cos(), (p * fr[i]).sin());
                let (a, b) = (head[i], head[d / 2 + i]);
                head[i] = a * cs - b * sn;
                head[d / 2 + i] = b * cs + a * sn;
            }
        }
    };
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let w = |n: &str| get(&ckpt, &format!("{p}.{n}.weight")).unwrap();
        let b = |n: &str| get(&ckpt, &format!("{p}.{n}.bias"));
        let xn = rms(&x, &w("input_layernorm"), c.rms_norm_eps);
        let mut q = lin(&xn, &w("self_attn.q_proj"), b("self_attn.q_proj").as_ref(), h);
        let mut k = lin(&xn, &w("self_attn.k_proj"), b("self_attn.k_proj").as_ref(), h);
        let v = lin(&xn, &w("self_attn.v_proj"), b("self_attn.v_proj").as_ref(), h);
        rope(&mut q, nq);
        rope(&mut k, nkv);
        let mut o = vec![0.0; t * nq * d];
        for pos in 0..t {
            let lo = c.sliding_window.map_or(0, |win| (pos + 1).saturating_sub(win));
            for hh in 0..nq {
                let g = hh / (nq / nkv);
                let qv = &q[(pos * nq + hh) * d..][..d];
                let s: Vec<f64> = (lo..=pos)
                    .map(|j| {
                        qv.iter().zip(&k[(j * nkv + g) * d..][..d]).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt()
                    })
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
        let a = lin(&o, &w("self_attn.o_proj"), b("self_attn.o_proj").as_ref(), nq * d);
        x.iter_mut().zip(&a).for_each(|(x, a)| *x += a);
        let xn = rms(&x, &w("post_attention_layernorm"), c.rms_norm_eps);
        let gate = lin(&xn, &w("mlp.gate_proj"), b("mlp.gate_proj").as_ref(), h);
        let up = lin(&xn, &w("mlp.up_proj"), b("mlp.up_proj").as_ref(), h);
        let act: Vec<f64> = gate.iter().zip(&up).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
        let m = lin(&act, &w("mlp.down_proj"), b("mlp.down_proj").as_ref(), c.intermediate_size);
        x.iter_mut().zip(&m).for_each(|(x, m)| *x += m);
    }
    let xn = rms(&x, &get(&ckpt, "model.norm.weight").unwrap(), c.rms_norm_eps);
    let head = if c.tie_word_embeddings { emb } else { get(&ckpt, "lm_head.weight").unwrap() };
    lin(&xn, &head, None, h)
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
