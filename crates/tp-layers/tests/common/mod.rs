//! Shared helpers: random layers, float64 references, threads per rank.
#![allow(dead_code)]

pub mod decoder_ref;

use std::time::Duration;
use tp_comm::DeviceGroup;
use tp_core::{DType, Device, Tensor};
use tp_layers::Linear;

pub const CPU: Device = Device::Cpu;

pub fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_f64_vec().unwrap()
}

/// A random `[out, in]` layer (optionally with bias) of `dtype` on the host.
pub fn linear(out: usize, inp: usize, bias: bool, dtype: DType, seed: u64) -> Linear {
    let w = Tensor::rand(&[out, inp], dtype, seed, &CPU).unwrap();
    let b = bias.then(|| Tensor::rand(&[out], dtype, seed + 1, &CPU).unwrap());
    Linear::new(w, b).unwrap()
}

/// `(y, abs)`: `y = x W^T + b` in f64 and `Σ|x w| + |b|` per element, for `x: [m, k]`.
pub fn linear_f64(x: &Tensor, l: &Linear) -> (Vec<f64>, Vec<f64>) {
    let (xv, wv) = (f64s(x), f64s(l.weight()));
    let bv = l.bias().map(f64s);
    let (n, k) = (l.out_features(), l.in_features());
    let m = xv.len() / k;
    let mut y = vec![0.0; m * n];
    let mut a = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut s = bv.as_ref().map_or(0.0, |b| b[j]);
            let mut t = s.abs();
            for l in 0..k {
                s += xv[i * k + l] * wv[j * k + l];
                t += (xv[i * k + l] * wv[j * k + l]).abs();
            }
            y[i * n + j] = s;
            a[i * n + j] = t;
        }
    }
    (y, a)
}

/// Bound for a product rounded to `dtype` (and, for row-parallel, partials rounded before the
/// sum): `2u·Σ|x w| + u|y| + (k + 2)·2^-24·Σ|x w|` plus f16's half subnormal gap.
pub fn tol(dtype: DType, k: usize, y: f64, abs: f64) -> f64 {
    let u = dtype.unit_roundoff();
    2.0 * u * abs + u * y.abs() + (k as f64 + 2.0) * 2f64.powi(-24) * abs + 2f64.powi(-24)
}

pub fn assert_close(what: &str, got: &[f64], want: &[f64], tol: impl Fn(usize) -> f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for i in 0..got.len() {
        assert!(
            (got[i] - want[i]).abs() <= tol(i),
            "{what}: element {i}: got {} want {} tol {}",
            got[i],
            want[i],
            tol(i)
        );
    }
}

/// Runs `f` on every rank of a LocalGroup on `device`; results in rank order.
pub fn on_ranks<R: Send>(world: usize, device: Device, f: impl Fn(DeviceGroup) -> R + Sync) -> Vec<R> {
    let groups = DeviceGroup::local(world, Duration::from_secs(60), |_| device).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = groups.into_iter().map(|g| s.spawn(|| f(g))).collect();
        hs.into_iter().map(|h| h.join().expect("rank panicked")).collect()
    })
}

/// The SwiGLU MLP in f64: `down(silu(gate x) * up x)`, with two per-element error scales:
/// `Σ_j |Wd_ij| (1 + |g_j|)(1 + |u_j|) + |b|` (how far rounding of every intermediate can move
/// the result) and `Σ_j |Wd_ij a_j| + |b|` (the sum of absolute partial products).
pub struct MlpRef {
    pub y: Vec<f64>,
    pub scale: Vec<f64>,
    pub partial_abs: Vec<f64>,
}

pub fn mlp_f64(x: &Tensor, gate: &Linear, up: &Linear, down: &Linear) -> MlpRef {
    let (g, _) = linear_f64(x, gate);
    let (u, _) = linear_f64(x, up);
    let inter = gate.out_features();
    let act: Vec<f64> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
    let (wd, bd) = (f64s(down.weight()), down.bias().map(f64s));
    let (h, m) = (down.out_features(), act.len() / inter);
    let mut r = MlpRef { y: vec![0.0; m * h], scale: vec![0.0; m * h], partial_abs: vec![0.0; m * h] };
    for i in 0..m {
        for o in 0..h {
            let mut s = bd.as_ref().map_or(0.0, |b| b[o]);
            let (mut t, mut p) = (s.abs(), s.abs());
            for j in 0..inter {
                let (w, a) = (wd[o * inter + j], act[i * inter + j]);
                s += w * a;
                p += (w * a).abs();
                t += w.abs() * (1.0 + g[i * inter + j].abs()) * (1.0 + u[i * inter + j].abs());
            }
            r.y[i * h + o] = s;
            r.scale[i * h + o] = t;
            r.partial_abs[i * h + o] = p;
        }
    }
    r
}

/// The SwiGLU MLP under `prefix` of `ckpt`, loaded for `g` with Hugging Face's names.
pub fn load_mlp(
    ckpt: &tp_layers::Checkpoint,
    prefix: &str,
    g: &tp_comm::DeviceGroup,
) -> tp_layers::Result<tp_layers::ParallelMlp> {
    let ld = tp_layers::Loader::new(ckpt, g, tp_layers::LoadOptions::new()).pp(prefix);
    tp_layers::ParallelMlp::load(&ld, tp_layers::MlpNames::default(), tp_core::Activation::Silu)
}
