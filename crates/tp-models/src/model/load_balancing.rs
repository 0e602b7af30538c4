//! The load-balancing loss of a mixture-of-experts model trained with `output_router_logits`
//! (transformers' `load_balancing_loss_func`), and how it spans pipeline stages.
//!
//! Over one row's `N = L · T_row` router outputs (its `L` MoE layers' logits concatenated):
//! `aux = E · Σ_e f_e P_e`, `f_e` the fraction of the `N` tokens that chose expert `e` (summed
//! over the `k` choices), `P_e` the mean probability of `e`. Each row's loss is its own (a row
//! never depends on its neighbours) and the step's is `coef · Σ_rows aux / rows`
//! (`router_aux_scale`). Only `P` carries a gradient: `d aux / d p_{t,e} = E · c_e / N²`,
//! `c_e = N f_e`, the same on every MoE layer.
//!
//! Both need every layer's routing, so under pipeline parallelism the per-row sums travel
//! with the hidden states: stage `s` receives the sums of the layers before it, adds its own
//! (layer by layer, in the order one rank would) and sends them on; the last stage holds the
//! totals, takes the loss, and sends the totals back with its input gradient, so that every
//! stage's backward has the counts. The sums cross stages as the bits of `f64`s, so a pipeline
//! computes the same bits as one rank.

use crate::error::{ModelError, Result};
use std::sync::Arc;
use tp_core::{DType, Device, Tensor};
use tp_layers::RouterStats;

/// Each row's sums over the MoE layers routed so far: `counts[r·E + e]` how many of row `r`'s
/// (token, choice) pairs picked expert `e`, `probs[r·E + e]` the sum of its probabilities.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RouterSums {
    experts: usize,
    counts: Vec<f64>,
    probs: Vec<f64>,
}

impl RouterSums {
    /// No layer yet, for `rows` rows and `experts` experts.
    pub(crate) fn zeros(rows: usize, experts: usize) -> RouterSums {
        RouterSums { experts, counts: vec![0.0; rows * experts], probs: vec![0.0; rows * experts] }
    }

    /// The dims of the tensor that carries the sums: `[rows, 2E]` (counts, then probabilities).
    pub(crate) fn dims(rows: usize, experts: usize) -> [usize; 2] {
        [rows, 2 * experts]
    }

    /// Adds one MoE layer's routing of a micro-batch whose rows have `lens` tokens.
    ///
    /// Errors: a router of another expert count, or stats of another token count.
    pub(crate) fn add(&mut self, r: &RouterStats, lens: &[usize]) -> Result<()> {
        let (e, k) = (r.routing.num_experts, r.routing.top_k);
        let tokens: usize = lens.iter().sum();
        if e != self.experts || lens.len() * e != self.counts.len() || r.probs.len() != tokens * e {
            return Err(ModelError::Request(format!(
                "router stats of {e} experts over {} probabilities do not fit {} rows of {tokens} tokens and {} experts",
                r.probs.len(),
                lens.len(),
                self.experts
            )));
        }
        let mut start = 0;
        for (row, &len) in lens.iter().enumerate() {
            let (c, p) = (&mut self.counts[row * e..][..e], &mut self.probs[row * e..][..e]);
            for t in start..start + len {
                r.routing.experts[t * k..(t + 1) * k].iter().for_each(|&x| c[x as usize] += 1.0);
                r.probs[t * e..(t + 1) * e].iter().zip(p.iter_mut()).for_each(|(&v, s)| *s += f64::from(v));
            }
            start += len;
        }
        Ok(())
    }

    /// `coef_scale · Σ_rows E · Σ_e (c_e / N)(p_e / N)`, `N = layers · len` for each row.
    pub(crate) fn loss(&self, lens: &[usize], layers: usize, coef_scale: f64) -> f64 {
        let e = self.experts;
        let mut total = 0f64;
        for (row, &len) in lens.iter().enumerate() {
            let n = layers as f64 * len as f64;
            let (c, p) = (&self.counts[row * e..][..e], &self.probs[row * e..][..e]);
            total += e as f64 * c.iter().zip(p).map(|(c, p)| (c / n) * (p / n)).sum::<f64>();
        }
        coef_scale * total
    }

    /// `d loss / d p_{t,e} = coef_scale · E · c_e / N²` for every token `t` of each row
    /// (`[T · E]`, f32, the same for every MoE layer).
    pub(crate) fn prob_grad(&self, lens: &[usize], layers: usize, coef_scale: f64) -> Arc<Vec<f32>> {
        let e = self.experts;
        let tokens: usize = lens.iter().sum();
        let mut grad = vec![0f32; tokens * e];
        let mut start = 0;
        for (row, &len) in lens.iter().enumerate() {
            let n = layers as f64 * len as f64;
            let c = &self.counts[row * e..][..e];
            for t in start..start + len {
                for (x, g) in grad[t * e..(t + 1) * e].iter_mut().enumerate() {
                    *g = (coef_scale * e as f64 * c[x] / (n * n)) as f32;
                }
            }
            start += len;
        }
        Arc::new(grad)
    }

    /// The sums as a host tensor of `f64` bits (`I64`, [`dims`](Self::dims)).
    pub(crate) fn to_tensor(&self) -> Result<Tensor> {
        let e = self.experts;
        let rows = self.counts.len() / e.max(1);
        let mut bits = Vec::with_capacity(2 * self.counts.len());
        for row in 0..rows {
            for v in self.counts[row * e..][..e].iter().chain(&self.probs[row * e..][..e]) {
                bits.push(v.to_bits() as i64);
            }
        }
        Ok(Tensor::from_vec(bits, &Self::dims(rows, e), &Device::Cpu)?)
    }

    /// The sums [`to_tensor`](Self::to_tensor) wrote, for `rows` rows and `experts` experts.
    ///
    /// Errors: a tensor of another shape or dtype.
    pub(crate) fn from_tensor(t: &Tensor, rows: usize, experts: usize) -> Result<RouterSums> {
        let want = Self::dims(rows, experts);
        if t.dims() != want || t.dtype() != DType::I64 {
            return Err(ModelError::Request(format!(
                "router sums of shape {:?} and dtype {:?}, expected {want:?} of I64",
                t.dims(),
                t.dtype()
            )));
        }
        let bits = t.to_device(&Device::Cpu)?.to_i64_vec()?;
        let mut sums = RouterSums::zeros(rows, experts);
        for (row, chunk) in bits.chunks_exact(2 * experts).enumerate() {
            for x in 0..experts {
                sums.counts[row * experts + x] = f64::from_bits(chunk[x] as u64);
                sums.probs[row * experts + x] = f64::from_bits(chunk[experts + x] as u64);
            }
        }
        Ok(sums)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tp_core::Routing;

    fn stats(tokens: usize, e: usize, k: usize, seed: u64) -> RouterStats {
        let mut rng = tp_core::rng::SplitMix64::new(seed);
        let experts = (0..tokens * k).map(|_| (rng.next_u64() % e as u64) as u32).collect();
        let weights = vec![0.5; tokens * k];
        let probs = (0..tokens * e).map(|_| (rng.next_u64() % 1000) as f32 / 1000.0).collect();
        RouterStats { routing: Routing { num_experts: e, top_k: k, experts, weights }, probs }
    }

    /// The sums cross a stage boundary bit for bit, and the loss and gradient equal the
    /// definition computed directly in f64.
    #[test]
    fn sums_round_trip_and_give_the_definition() {
        let (e, k, lens) = (5, 2, [3usize, 1, 4]);
        let layers: Vec<RouterStats> = (0..3).map(|i| stats(8, e, k, i)).collect();
        let mut sums = RouterSums::zeros(lens.len(), e);
        for l in &layers {
            sums.add(l, &lens).unwrap();
        }
        let back = RouterSums::from_tensor(&sums.to_tensor().unwrap(), lens.len(), e).unwrap();
        assert_eq!(back, sums);
        let (mut want, mut start) = (0f64, 0);
        for &len in &lens {
            let n = (layers.len() * len) as f64;
            for x in 0..e {
                let mut f = 0f64;
                let mut p = 0f64;
                for l in &layers {
                    for t in start..start + len {
                        f += l.routing.experts[t * k..(t + 1) * k].iter().filter(|&&c| c as usize == x).count() as f64;
                        p += f64::from(l.probs[t * e + x]);
                    }
                }
                want += e as f64 * (f / n) * (p / n);
                let g = sums.prob_grad(&lens, layers.len(), 0.5);
                assert!((f64::from(g[start * e + x]) - 0.5 * e as f64 * f / (n * n)).abs() < 1e-6);
            }
            start += len;
        }
        assert!((sums.loss(&lens, layers.len(), 0.5) - 0.5 * want).abs() < 1e-12);
        assert!(RouterSums::from_tensor(&sums.to_tensor().unwrap(), 2, e).is_err());
        assert!(sums.add(&stats(7, e, k, 9), &lens).is_err());
    }
}
