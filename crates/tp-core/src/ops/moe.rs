//! Mixture-of-experts routing and combining: which experts each token goes to with what
//! weight ([`route`]), and the weighted sum of the experts' outputs back into the tokens' rows
//! ([`Tensor::add_rows_scaled`]).
//!
//! Routing runs over the router's logits `[T, E]` in `f32` as transformers computes it:
//! `p = softmax(logits)`, the `k` largest (ties to the lower expert id), optionally
//! renormalised to sum to 1 (`norm_topk_prob`; Mixtral always). A row's routing depends on that
//! row alone. Logits on a GPU are routed there (`kernels/moe.cu`: only the `T · k` choices and
//! weights come back; sums in another order, so within rounding of the host's), and
//! [`moe_combine`] adds the experts' outputs there too.
//!
//! Each thread counts the routing decisions it made per expert, summed over every routing call
//! (every MoE layer) until [`take_routed`] reads and resets them: a serving engine takes them
//! around each step's forward pass for its routing histogram.

use crate::storage::Storage;
use crate::{DType, Device, Error, Result, Shape, Tensor};
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
    if let Storage::Cuda(s) = logits.storage()
        && e <= tp_kernels::MAX_ROUTED_EXPERTS
    {
        let RouterKind::SoftmaxTopK { renormalize } = kind;
        let (experts, weights) = super::cuda::moe_route(s, (t, e, k), renormalize)?;
        return Ok(counted(Routing { top_k: k, num_experts: e, experts, weights }));
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
    Ok(counted(Routing { top_k: k, num_experts: e, experts, weights }))
}

/// `routing`, its choices added to this thread's counts ([`take_routed`]).
fn counted(routing: Routing) -> Routing {
    let e = routing.num_experts;
    ROUTED.with(|r| {
        let mut r = r.borrow_mut();
        if r.len() < e {
            r.resize(e, 0);
        }
        for (c, n) in r.iter_mut().zip(routing.counts()) {
            *c += n;
        }
    });
    routing
}

/// The experts' outputs combined into the tokens' rows: `out[r] = Σ_j weights[r·k + j] ·
/// y[pos[r·k + j]]` for `j < k` in order, `k = pos.len() / rows`, each product and sum rounded
/// to f32 in that order (as [`Tensor::add_rows_scaled`] adds expert after expert); a negative
/// `pos` adds nothing. `y: [n, H]` of any float dtype; the result is `[rows, H]` f32 on `y`'s
/// device (on a GPU one kernel, `tp_moe_combine`).
///
/// Errors: `y` not 2-D or not float, `pos` and `weights` of different lengths or not a multiple
/// of `rows`, a position past `y`'s rows.
pub fn moe_combine(y: &Tensor, pos: &[i64], weights: &[f32], rows: usize) -> Result<Tensor> {
    const OP: &str = "moe_combine";
    let &[n, h] = y.dims() else {
        return Err(Error::RankMismatch { op: OP, expected: "2 ([rows, width])", dims: y.dims().to_vec() });
    };
    y.require_float()?;
    let k = pos.len().checked_div(rows).unwrap_or(0);
    if pos.len() != weights.len() || k * rows != pos.len() {
        return Err(Error::InvalidArgument {
            op: OP,
            why: format!("{} positions and {} weights for {rows} rows", pos.len(), weights.len()),
        });
    }
    if let Some(&p) = pos.iter().find(|&&p| p >= n as i64) {
        return Err(Error::InvalidArgument { op: OP, why: format!("position {p} is past the {n} rows") });
    }
    if let Storage::Cuda(s) = y.storage() {
        let out = super::cuda::moe_combine(s, pos, weights, (rows, k, h, n))?;
        return Ok(Tensor::from_cuda(Shape::new(&[rows, h])?, out));
    }
    let yv = y.to_dtype(DType::F32)?.to_vec::<f32>()?;
    let mut out = vec![0f32; rows * h];
    for (r, row) in out.chunks_exact_mut(h.max(1)).enumerate().take(rows) {
        for j in 0..k {
            let Ok(p) = usize::try_from(pos[r * k + j]) else { continue };
            let w = weights[r * k + j];
            row.iter_mut().zip(&yv[p * h..(p + 1) * h]).for_each(|(o, &v)| *o += w * v);
        }
    }
    Tensor::from_vec(out, &[rows, h], &Device::Cpu)
}

/// `softmax(x)` in f32: `exp(x - max) / Σ exp(x - max)` (a router's probabilities).
pub fn softmax(x: &[f32]) -> Vec<f32> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = x.iter().map(|&v| (v - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    exps.into_iter().map(|v| v / sum).collect()
}

/// A mixture's experts' linear layers over their rows in one product: `x: [rows, k]` holds the
/// tokens' rows sorted by expert, expert `e`'s being `offsets[e] .. offsets[e + 1]`, and its
/// rows of the result `[rows, n]` are `x_e W_e^T + b_e` (`experts[e]`: the `[n, k]` weight and
/// its bias, if any). On a GPU with f16/bf16 operands one launch
/// (`tp_gemm_mma_T_grouped`, the same bits as a product per expert); elsewhere a
/// [`Tensor::linear`] per expert.
///
/// Errors: `offsets` not `E + 1` non-decreasing entries from 0 to `x`'s rows, weights of other
/// shapes or dtypes than the first's, operands on different devices.
pub fn grouped_linear(x: &Tensor, experts: &[(&Tensor, Option<&Tensor>)], offsets: &[usize]) -> Result<Tensor> {
    const OP: &str = "grouped_linear";
    let &[rows, k] = x.dims() else {
        return Err(Error::RankMismatch { op: OP, expected: "2 ([rows, in])", dims: x.dims().to_vec() });
    };
    let Some(&(w0, _)) = experts.first() else {
        return Err(Error::InvalidArgument { op: OP, why: "no expert".into() });
    };
    let &[n, k0] = w0.dims() else {
        return Err(Error::RankMismatch { op: OP, expected: "2 ([out, in])", dims: w0.dims().to_vec() });
    };
    if k0 != k
        || offsets.len() != experts.len() + 1
        || offsets.first() != Some(&0)
        || offsets.last() != Some(&rows)
        || offsets.windows(2).any(|w| w[1] < w[0])
        || experts.iter().any(|(w, b)| {
            w.dims() != [n, k] || w.dtype() != x.dtype() || b.is_some_and(|b| b.dims() != [n] || b.dtype() != x.dtype())
        })
    {
        return Err(Error::InvalidArgument {
            op: OP,
            why: format!(
                "{} experts of [{n}, {k0}] over {rows} rows of {k} split at {offsets:?} (need one shape and dtype, \
                 E + 1 offsets from 0 to the rows)",
                experts.len()
            ),
        });
    }
    if let Storage::Cuda(xs) = x.storage()
        && matches!(x.dtype(), DType::F16 | DType::BF16)
    {
        let mut ws = Vec::with_capacity(experts.len());
        for (w, b) in experts {
            let Storage::Cuda(w) = w.storage() else {
                return Err(Error::UnsupportedDevice { op: OP, device: w.device() });
            };
            let b = match b.map(|b| b.storage()) {
                None => None,
                Some(Storage::Cuda(b)) => Some(b),
                Some(_) => return Err(Error::UnsupportedDevice { op: OP, device: Device::Cpu }),
            };
            ws.push((w, b));
        }
        let out = super::cuda::grouped_linear(xs, &ws, offsets, (rows, n, k))?;
        return Ok(Tensor::from_cuda(Shape::new(&[rows, n])?, out));
    }
    let parts = experts
        .iter()
        .zip(offsets.windows(2))
        .filter(|(_, w)| w[1] > w[0])
        .map(|((w, b), r)| x.narrow(0, r[0], r[1] - r[0])?.linear(w, *b))
        .collect::<Result<Vec<_>>>()?;
    if parts.is_empty() {
        return Tensor::zeros(&[0, n], x.dtype(), &x.device());
    }
    Tensor::cat(&parts, 0)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The grouped product is each expert's `x_e W_e^T + b_e` (float64 reference), experts
    /// without rows included; bad splits and shapes are refused.
    #[test]
    fn the_grouped_product_is_each_experts_linear() {
        let (k, n) = (19, 13);
        let offsets = [0usize, 3, 3, 10, 11];
        let x = Tensor::randn(&[11, k], DType::F32, 1, &Device::Cpu).unwrap();
        let ws: Vec<Tensor> =
            (0..4).map(|e| Tensor::randn(&[n, k], DType::F32, 10 + e, &Device::Cpu).unwrap()).collect();
        let b = Tensor::randn(&[n], DType::F32, 99, &Device::Cpu).unwrap();
        let experts: Vec<(&Tensor, Option<&Tensor>)> =
            ws.iter().enumerate().map(|(e, w)| (w, (e % 2 == 0).then_some(&b))).collect();
        let got = grouped_linear(&x, &experts, &offsets).unwrap().to_vec::<f32>().unwrap();
        let (xv, bv) = (x.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        for (e, r) in offsets.windows(2).enumerate() {
            let wv = ws[e].to_vec::<f32>().unwrap();
            for row in r[0]..r[1] {
                for j in 0..n {
                    let mut want: f64 = (0..k).map(|c| f64::from(xv[row * k + c]) * f64::from(wv[j * k + c])).sum();
                    if e % 2 == 0 {
                        want += f64::from(bv[j]);
                    }
                    assert!((f64::from(got[row * n + j]) - want).abs() < 1e-4, "expert {e} row {row} col {j}");
                }
            }
        }
        assert!(grouped_linear(&x, &experts, &[0, 3, 3, 10]).is_err());
        assert!(grouped_linear(&x, &experts, &[0, 3, 2, 10, 11]).is_err());
        assert!(grouped_linear(&x, &experts, &[0, 3, 3, 10, 12]).is_err());
        let wrong = Tensor::zeros(&[n, k + 1], DType::F32, &Device::Cpu).unwrap();
        assert!(grouped_linear(&x, &[(&ws[0], None), (&wrong, None)], &[0, 5, 11]).is_err());
    }

    /// The combine gives `add_rows_scaled`'s bits when each row's slots come in expert order
    /// (the order the host adds the experts in), skipped slots adding nothing; bad positions
    /// and lengths are refused.
    #[test]
    fn the_combine_adds_as_add_rows_scaled_adds() {
        let (t, h, k) = (5, 7, 3);
        let y = Tensor::randn(&[12, h], DType::BF16, 3, &Device::Cpu).unwrap();
        // Expert e's outputs are rows 4e.. of y; token r's slots pick experts in order.
        let experts: [[i64; 3]; 5] = [[0, 1, 2], [0, 2, -1], [1, 2, -1], [0, 1, -1], [2, -1, -1]];
        let mut used = [0usize; 3];
        let (mut pos, mut weights) = (Vec::new(), Vec::new());
        let mut want = Tensor::zeros(&[t, h], DType::F32, &Device::Cpu).unwrap();
        let mut per_expert: Vec<Vec<(usize, usize, f32)>> = vec![Vec::new(); 3];
        for (r, row) in experts.iter().enumerate() {
            for (j, &e) in row.iter().enumerate() {
                let w = 0.25 + 0.1 * (r * k + j) as f32;
                match usize::try_from(e) {
                    Ok(e) => {
                        let p = 4 * e + used[e];
                        used[e] += 1;
                        pos.push(p as i64);
                        weights.push(w);
                        per_expert[e].push((r, p, w));
                    }
                    Err(_) => {
                        pos.push(-1);
                        weights.push(w);
                    }
                }
            }
        }
        for list in &per_expert {
            let rows: Vec<usize> = list.iter().map(|x| x.0).collect();
            let src = Tensor::cat(&list.iter().map(|x| y.narrow(0, x.1, 1).unwrap()).collect::<Vec<_>>(), 0).unwrap();
            let w: Vec<f32> = list.iter().map(|x| x.2).collect();
            want.add_rows_scaled(&rows, &src, &w).unwrap();
        }
        let got = moe_combine(&y, &pos, &weights, t).unwrap();
        assert_eq!(got.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
        assert!(moe_combine(&y, &[12], &[1.0], 1).is_err());
        assert!(moe_combine(&y, &[0, 1], &[1.0], 1).is_err());
        assert!(moe_combine(&y, &[0, 1, 2], &[1.0; 3], 2).is_err());
    }
}
