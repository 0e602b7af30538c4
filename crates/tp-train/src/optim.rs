//! AdamW over fp32 master weights, with torch.optim.AdamW's (single-tensor, non-fused) semantics,
//! and the clipping coefficient of torch's `clip_grad_norm_`.
//!
//! For step `t` (1-based), rate `lr`, parameter `p`, gradient `g` and moments `m`, `v`:
//!
//! ```text
//! p  <- p * (1 - lr * wd)                      (only for decayed parameters, and when wd != 0)
//! m  <- m + (g - m) * (1 - beta1)              (torch's lerp)
//! v  <- v * beta2 + (1 - beta2) * g * g
//! bc1 = 1 - beta1^t          bc2 = 1 - beta2^t
//! p  <- p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
//! ```
//!
//! The scalar factors (`1 - lr*wd`, `1 - beta1`, `beta2`, `1 - beta2`, `lr / bc1`, `sqrt(bc2)`,
//! `eps`) are computed in f64 and cast to f32, as torch does with Python floats; the per-element
//! arithmetic is f32.
//!
//! One [`AdamState`] per parameter; the step number `t` is the caller's, shared by all parameters
//! of a step (torch keeps one per parameter, but they all advance together).

use crate::{Result, TrainError};

/// AdamW's hyperparameters. The default is transformers' Trainer's: betas (0.9, 0.999),
/// eps 1e-8, weight decay 0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW {
    /// The first moment's decay.
    pub beta1: f64,
    /// The second moment's decay.
    pub beta2: f64,
    /// Added to the second moment's square root.
    pub eps: f64,
    /// Decoupled weight decay: each decayed step multiplies the weights by `1 - lr * weight_decay`.
    pub weight_decay: f64,
}

impl Default for AdamW {
    fn default() -> Self {
        Self { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }
    }
}

/// The moments of one parameter: `m` (first) and `v` (second), each as long as the parameter.
/// Save and restore them with the step number to resume training.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AdamState {
    /// The first moment.
    pub m: Vec<f32>,
    /// The second moment.
    pub v: Vec<f32>,
}

impl AdamState {
    /// Zero moments for a parameter of `len` elements (torch's state before the first step).
    pub fn new(len: usize) -> Self {
        Self { m: vec![0.0; len], v: vec![0.0; len] }
    }
}

fn invalid(name: &'static str, value: f64, why: &'static str) -> TrainError {
    TrainError::InvalidArgument { name, value: value.to_string(), why }
}

impl AdamW {
    /// Checks the hyperparameters as torch's constructor does: `0 <= beta1, beta2 < 1`,
    /// `eps >= 0`, `weight_decay >= 0`, all finite.
    pub fn validate(&self) -> Result<()> {
        for (name, beta) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return Err(invalid(name, beta, "must be in [0, 1)"));
            }
        }
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return Err(invalid("eps", self.eps, "must be finite and non-negative"));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(invalid("weight_decay", self.weight_decay, "must be finite and non-negative"));
        }
        Ok(())
    }

    /// One AdamW step of parameter `param` with gradient `grad` at step `t` (1-based) and rate
    /// `lr`, updating `state` in place. `decay` says whether this parameter takes weight decay
    /// (transformers: not for biases and norm weights). Errors on invalid hyperparameters,
    /// `t == 0`, a negative or non-finite `lr`, or lengths that differ; then nothing is changed.
    pub fn step(
        &self,
        param: &mut [f32],
        grad: &[f32],
        state: &mut AdamState,
        t: u64,
        lr: f64,
        decay: bool,
    ) -> Result<()> {
        self.step_clipped(param, grad, 1.0, state, t, lr, decay)
    }

    /// [`step`](Self::step) with the gradient multiplied by `clip` first, element by element
    /// (torch's `clip_grad_norm_` coefficient; the same bits as scaling the gradient in a pass
    /// of its own, without that pass). A `clip` of 1 leaves the gradient as it is.
    #[allow(clippy::too_many_arguments)]
    pub fn step_clipped(
        &self,
        param: &mut [f32],
        grad: &[f32],
        clip: f32,
        state: &mut AdamState,
        t: u64,
        lr: f64,
        decay: bool,
    ) -> Result<()> {
        self.validate()?;
        if t == 0 {
            return Err(TrainError::InvalidArgument {
                name: "AdamW step",
                value: "0".into(),
                why: "steps are counted from 1",
            });
        }
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(invalid("learning rate", lr, "must be finite and non-negative"));
        }
        let n = param.len();
        for (what, got) in [("the gradient", grad.len()), ("state m", state.m.len()), ("state v", state.v.len())] {
            if got != n {
                return Err(TrainError::LengthMismatch { what, expected: n, got });
            }
        }

        if decay && self.weight_decay != 0.0 {
            let keep = (1.0 - lr * self.weight_decay) as f32;
            param.iter_mut().for_each(|p| *p *= keep);
        }
        // beta^t in f64 as Python's `beta ** step` (torch's step count is a float).
        let t = t as f64;
        let bc1 = 1.0 - self.beta1.powf(t);
        let bc2 = 1.0 - self.beta2.powf(t);
        let w1 = (1.0 - self.beta1) as f32;
        let b2 = self.beta2 as f32;
        let w2 = (1.0 - self.beta2) as f32;
        let step_size = (lr / bc1) as f32;
        let bc2_sqrt = bc2.sqrt() as f32;
        let eps = self.eps as f32;
        let f = Factors { w1, b2, w2, step_size, bc2_sqrt, eps, clip };
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(n / PARALLEL_MIN_ELEMS).max(1);
        if threads == 1 {
            update(param, grad, &mut state.m, &mut state.v, f);
        } else {
            // Contiguous pieces, one per thread: the same arithmetic per element, so the same
            // bits as the single-threaded loop.
            let piece = n.div_ceil(threads);
            std::thread::scope(|s| {
                let parts = param
                    .chunks_mut(piece)
                    .zip(grad.chunks(piece))
                    .zip(state.m.chunks_mut(piece))
                    .zip(state.v.chunks_mut(piece));
                for (((p, g), m), v) in parts {
                    s.spawn(move || update(p, g, m, v, f));
                }
            });
        }
        Ok(())
    }
}

/// Parameters with fewer elements per thread than this are updated on the calling thread.
const PARALLEL_MIN_ELEMS: usize = 1 << 16;

/// The f32 scalars of one step.
#[derive(Clone, Copy)]
struct Factors {
    w1: f32,
    b2: f32,
    w2: f32,
    step_size: f32,
    bc2_sqrt: f32,
    eps: f32,
    clip: f32,
}

/// The element-wise update; equal lengths are checked by the caller, and the zipped iterators
/// have no bounds checks, so the loop vectorises.
fn update(param: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32], f: Factors) {
    let Factors { w1, b2, w2, step_size, bc2_sqrt, eps, clip } = f;
    for (((p, &g), m), v) in param.iter_mut().zip(grad).zip(m.iter_mut()).zip(v.iter_mut()) {
        let g = if clip == 1.0 { g } else { g * clip };
        *m += (g - *m) * w1;
        *v = *v * b2 + w2 * g * g;
        let denom = v.sqrt() / bc2_sqrt + eps;
        *p -= step_size * *m / denom;
    }
}

/// The sum of squares of a gradient, accumulated in f64: add these over all gradients (over all
/// ranks for sharded ones, once for replicated ones) and take the square root for the total
/// 2-norm that [`clip_coefficient`] takes.
pub fn sum_of_squares(grad: &[f32]) -> f64 {
    grad.iter().map(|&g| f64::from(g) * f64::from(g)).sum()
}

/// The factor torch's `clip_grad_norm_(max_norm)` multiplies every gradient by:
/// `min(1, max_norm / (total_norm + 1e-6))`. A `max_norm` that is not positive and finite means
/// no clipping (1).
///
/// A non-finite `total_norm` is the caller's to report (torch's `error_if_nonfinite`); the value
/// returned then is 1 for NaN and 0 for infinity, and is not meaningful.
pub fn clip_coefficient(total_norm: f64, max_norm: f64) -> f64 {
    if !(max_norm.is_finite() && max_norm > 0.0) {
        return 1.0;
    }
    (max_norm / (total_norm + 1e-6)).min(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Weights and moments in f64.
    struct Reference {
        p: Vec<f64>,
        m: Vec<f64>,
        v: Vec<f64>,
    }

    /// The same formulas in f64, for reference.
    fn reference_step(r: &mut Reference, g: &[f64], o: &AdamW, t: f64, lr: f64, decay: bool) {
        let Reference { p, m, v } = r;
        for i in 0..p.len() {
            if decay {
                p[i] *= 1.0 - lr * o.weight_decay;
            }
            m[i] += (g[i] - m[i]) * (1.0 - o.beta1);
            v[i] = o.beta2 * v[i] + (1.0 - o.beta2) * g[i] * g[i];
            let bc1 = 1.0 - o.beta1.powf(t);
            let bc2 = 1.0 - o.beta2.powf(t);
            p[i] -= lr / bc1 * m[i] / (v[i].sqrt() / bc2.sqrt() + o.eps);
        }
    }

    fn grads(step: usize, n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 7 + step * 13) % 11) as f32 * 0.37 - 1.8 + 0.01 * step as f32).collect()
    }

    #[test]
    fn matches_an_f64_reference_over_several_steps() {
        let n = 37;
        let opt = AdamW { weight_decay: 0.1, ..AdamW::default() };
        for decay in [true, false] {
            let mut p: Vec<f32> = (0..n).map(|i| (i as f32 - 18.0) * 0.05).collect();
            let mut r = Reference { p: p.iter().map(|&x| f64::from(x)).collect(), m: vec![0.0; n], v: vec![0.0; n] };
            let mut state = AdamState::new(n);
            for t in 1..=6u64 {
                let lr = 1e-2 * t as f64;
                let g = grads(t as usize, n);
                opt.step(&mut p, &g, &mut state, t, lr, decay).unwrap();
                let g64: Vec<f64> = g.iter().map(|&x| f64::from(x)).collect();
                reference_step(&mut r, &g64, &opt, t as f64, lr, decay);
            }
            for (what, got, want) in [("p", &p, &r.p), ("m", &state.m, &r.m), ("v", &state.v, &r.v)] {
                for (i, (&got, &want)) in got.iter().zip(want).enumerate() {
                    let err = (f64::from(got) - want).abs();
                    assert!(err <= 1e-6 * want.abs().max(1.0), "decay {decay}, {what}[{i}]: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn first_step_moves_each_weight_by_about_lr_times_the_sign() {
        let lr = 1e-3;
        let mut p = vec![1.0f32, -2.0, 0.5, 3.0];
        let g = [0.3f32, -1e-3, 250.0, -4.0];
        let mut state = AdamState::new(4);
        AdamW::default().step(&mut p, &g, &mut state, 1, lr, true).unwrap();
        for ((after, before), g) in p.iter().zip([1.0f32, -2.0, 0.5, 3.0]).zip(g) {
            let moved = f64::from(before - after);
            // m/bc1 = g and sqrt(v/bc2) = |g|: the step is lr * g / (|g| + eps).
            assert!((moved - lr * f64::from(g.signum())).abs() < 1e-6, "{before} -> {after}");
        }
    }

    #[test]
    fn weight_decay_only_where_asked() {
        let opt = AdamW { weight_decay: 0.5, ..AdamW::default() };
        let zero_grad = [0.0f32; 3];
        let mut decayed = vec![1.0f32, -2.0, 4.0];
        let mut kept = decayed.clone();
        opt.step(&mut decayed, &zero_grad, &mut AdamState::new(3), 1, 0.1, true).unwrap();
        opt.step(&mut kept, &zero_grad, &mut AdamState::new(3), 1, 0.1, false).unwrap();
        assert_eq!(decayed, vec![0.95, -1.9, 3.8]);
        assert_eq!(kept, vec![1.0, -2.0, 4.0]);
    }

    #[test]
    fn rejects_bad_arguments_without_changing_anything() {
        let opt = AdamW::default();
        let mut p = vec![1.0f32; 3];
        let mut state = AdamState::new(3);
        let err = opt.step(&mut p, &[0.1; 2], &mut state, 1, 1e-3, true).unwrap_err();
        assert_eq!(err.to_string(), "AdamW step: the gradient has 2 elements but the parameter has 3");
        let mut short = AdamState { m: vec![0.0; 3], v: vec![0.0; 4] };
        assert!(opt.step(&mut p, &[0.1; 3], &mut short, 1, 1e-3, true).is_err());
        assert!(opt.step(&mut p, &[0.1; 3], &mut state, 0, 1e-3, true).is_err());
        assert!(opt.step(&mut p, &[0.1; 3], &mut state, 1, f64::NAN, true).is_err());
        assert!(opt.step(&mut p, &[0.1; 3], &mut state, 1, -1.0, true).is_err());
        let bad = AdamW { beta2: 1.0, ..AdamW::default() };
        assert!(bad.step(&mut p, &[0.1; 3], &mut state, 1, 1e-3, true).is_err());
        assert!(AdamW { eps: -1.0, ..AdamW::default() }.validate().is_err());
        assert!(AdamW { weight_decay: f64::INFINITY, ..AdamW::default() }.validate().is_err());
        assert_eq!(p, vec![1.0; 3]);
        assert_eq!(state, AdamState::new(3));
    }

    #[test]
    fn a_huge_step_number_is_fine() {
        let mut p = vec![1.0f32];
        let mut state = AdamState::new(1);
        AdamW::default().step(&mut p, &[1.0], &mut state, u64::MAX, 1e-3, true).unwrap();
        assert!(p[0].is_finite() && p[0] < 1.0);
    }

    #[test]
    fn clip_coefficients() {
        assert_eq!(clip_coefficient(0.5, 1.0), 1.0);
        assert_eq!(clip_coefficient(4.0, 1.0), 1.0 / (4.0 + 1e-6));
        // At exactly max_norm torch still scales, by 1 / (1 + 1e-6).
        assert_eq!(clip_coefficient(1.0, 1.0), 1.0 / (1.0 + 1e-6));
        assert!(clip_coefficient(1.0, 1.0) < 1.0);
        assert_eq!(clip_coefficient(10.0, 0.0), 1.0);
        assert_eq!(clip_coefficient(10.0, -1.0), 1.0);
        assert_eq!(clip_coefficient(10.0, f64::INFINITY), 1.0);
        assert_eq!(clip_coefficient(10.0, f64::NAN), 1.0);
        assert_eq!(clip_coefficient(f64::INFINITY, 1.0), 0.0);
        assert_eq!(clip_coefficient(f64::NAN, 1.0), 1.0);
        assert_eq!(sum_of_squares(&[3.0, -4.0]).sqrt(), 5.0);
    }
}
