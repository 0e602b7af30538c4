//! Mixture-of-experts routing and combining: which experts each token goes to with what
//! weight ([`route`]), and the weighted sum of the experts' outputs back into the tokens' rows
//! ([`Tensor::add_rows_scaled`]).
//!
//! Routing runs on the host over the router's logits `[T, E]` (a few numbers per token), in
//! `f32` as transformers computes it: `p = softmax(logits)`, the `k` largest (ties to the lower
//! expert id), optionally renormalised to sum to 1 (`norm_topk_prob`; Mixtral always). A row's
//! routing depends on that row alone.
//!
//! Each thread counts the routing decisions it made per expert, summed over every routing call
//! (every MoE layer) until [`take_routed`] reads and resets them: a serving engine takes them
//! around each step's forward pass for its routing histogram.

use crate::{DType, Device, Error, Result, Tensor};
use std::cell::RefCell;

thread_local! {
    static ROUTED: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// The tokens this thread routed to each expert (index = expert id; summed over the MoE layers)
/// since its last call, reset to none.
pub fn take_routed() -> Vec<u64> {
    ROUTED.with(|r| std::mem::take(&mut *r.borrow_mut()))
}

/// How a router turns logits into the chosen experts' weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterKind {
    /// `softmax` over all experts, then the top `k` (Mixtral, Qwen2/3-MoE, OLMoE); with
    /// `renormalize` their weights are divided by their sum.
    SoftmaxTopK {
        /// Divide the top `k` weights by their sum.
        renormalize: bool,
    },
}

/// The experts and weights of each token: `experts[t * k + j]` is token `t`'s `j`-th choice
/// (in descending weight), `weights[t * k + j]` its weight.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// Experts per token.
    pub top_k: usize,
    /// Experts in the router.
    pub num_experts: usize,
    /// `[T * k]` expert ids.
    pub experts: Vec<u32>,
    /// `[T * k]` weights.
    pub weights: Vec<f32>,
}

impl Routing {
    /// Tokens routed.
    pub fn tokens(&self) -> usize {
        self.experts.len().checked_div(self.top_k).unwrap_or(0)
    }

    /// For each expert, the `(token, weight)` pairs routed to it, tokens ascending.
    pub fn by_expert(&self) -> Vec<Vec<(usize, f32)>> {
        let mut out = vec![Vec::new(); self.num_experts];
        for (i, (&e, &w)) in self.experts.iter().zip(&self.weights).enumerate() {
            if let Some(list) = out.get_mut(e as usize) {
                list.push((i / self.top_k.max(1), w));
            }
        }
        out
    }

    /// Tokens per expert (the routing histogram).
    pub fn counts(&self) -> Vec<u64> {
        let mut out = vec![0u64; self.num_experts];
        for &e in &self.experts {
            if let Some(c) = out.get_mut(e as usize) {
                *c += 1;
            }
        }
        out
    }
}

/// Routes the tokens whose router logits are `logits: [T, E]` (any float dtype, any device:
/// they are read to the host) to `k` experts each.
///
/// Errors: [`Error::RankMismatch`] unless `logits` is 2-D, [`Error::InvalidArgument`] for
/// `k = 0` or `k > E`, [`Error::NotFloat`] for integer logits.
pub fn route(logits: &Tensor, k: usize, kind: RouterKind) -> Result<Routing> {
    const OP: &str = "moe_route";
    let &[t, e] = logits.dims() else {
        return Err(Error::RankMismatch { op: OP, expected: "2 ([tokens, experts])", dims: logits.dims().to_vec() });
    };
    logits.require_float()?;
    if k == 0 || k > e {
        return Err(Error::InvalidArgument { op: OP, why: format!("top-k {k} must lie in 1..={e} (the experts)") });
    }
    let values = logits.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.to_vec::<f32>()?;
    let (mut experts, mut weights) = (Vec::with_capacity(t * k), Vec::with_capacity(t * k));
    let mut order: Vec<usize> = Vec::with_capacity(e);
    for row in values.chunks_exact(e.max(1)).take(t) {
        let probs = match kind {
            RouterKind::SoftmaxTopK { .. } => softmax(row),
        };
        order.clear();
        order.extend(0..e);
        // Descending weight; NaN last; ties to the lower id (the sort is stable).
        order.sort_by(|&a, &b| {
            probs[b].partial_cmp(&probs[a]).unwrap_or_else(|| probs[a].is_nan().cmp(&probs[b].is_nan()))
        });
        let top = &order[..k];
        let sum: f32 = top.iter().map(|&i| probs[i]).sum();
        for &i in top {
            experts.push(i as u32);
            weights.push(match kind {
                RouterKind::SoftmaxTopK { renormalize: true } => probs[i] / sum,
                RouterKind::SoftmaxTopK { renormalize: false } => probs[i],
            });
        }
    }
    let routing = Routing { top_k: k, num_experts: e, experts, weights };
    ROUTED.with(|r| {
        let mut r = r.borrow_mut();
        if r.len() < e {
            r.resize(e, 0);
        }
        for (c, n) in r.iter_mut().zip(routing.counts()) {
            *c += n;
        }
    });
    Ok(routing)
}

/// `softmax(x)` in f32: `exp(x - max) / Σ exp(x - max)` (a router's probabilities).
pub fn softmax(x: &[f32]) -> Vec<f32> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = x.iter().map(|&v| (v - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    exps.into_iter().map(|v| v / sum).collect()
}

impl Tensor {
    /// `self[rows[i]] += scales[i] · src[i]` for every row `i` of `src: [n, H]`, in order of
    /// `i`, on an `f32` host tensor `self: [T, H]` (`src` of any float dtype, widened).
    ///
    /// Errors: [`Error::DTypeMismatch`] unless `self` is `f32`, [`Error::ShapeMismatch`] for
    /// widths that differ or `rows`/`scales` not one per row of `src`,
    /// [`Error::InvalidArgument`] for a row past `T`, [`Error::UnsupportedDevice`] off the host.
    pub fn add_rows_scaled(&mut self, rows: &[usize], src: &Tensor, scales: &[f32]) -> Result<()> {
        const OP: &str = "add_rows_scaled";
        if self.dtype() != DType::F32 {
            return Err(Error::DTypeMismatch { op: OP, lhs: self.dtype(), rhs: DType::F32 });
        }
        for t in [&*self, src] {
            if t.device() != Device::Cpu {
                return Err(Error::UnsupportedDevice { op: OP, device: t.device() });
            }
        }
        let (&[t, h], &[n, hs]) = (self.dims(), src.dims()) else {
            let dims = if self.ndim() == 2 { src.dims() } else { self.dims() }.to_vec();
            return Err(Error::RankMismatch { op: OP, expected: "2 ([rows, width])", dims });
        };
        if h != hs || rows.len() != n || scales.len() != n {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.dims().to_vec(),
                rhs: src.dims().to_vec(),
                why: "needs the same width and one row index and scale per source row",
            });
        }
        if let Some(&r) = rows.iter().find(|&&r| r >= t) {
            return Err(Error::InvalidArgument { op: OP, why: format!("row {r} is past the {t} rows") });
        }
        let src = src.to_dtype(DType::F32)?.to_vec::<f32>()?;
        let out = self.as_mut_slice::<f32>()?;
        for ((&r, &s), row) in rows.iter().zip(scales).zip(src.chunks_exact(h.max(1))) {
            out[r * h..(r + 1) * h].iter_mut().zip(row).for_each(|(o, &v)| *o += s * v);
        }
        Ok(())
    }
}
