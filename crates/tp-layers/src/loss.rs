//! Training's loss: vocab-parallel cross-entropy over the LM head's logits, forward and
//! backward in one pass, without ever gathering the logits (Megatron-LM's
//! `vocab_parallel_cross_entropy`).
//!
//! Rank `r` computes its columns `L_r = h W_r^T` (soft-capped where the head caps) of the
//! logits. Per token `t` with target `y_t`: the global maximum `M_t` (one all-reduce, max),
//! then `S_t = Σ_j e^{L_tj - M_t}` and the target's logit `L_{t,y_t}` (one all-reduce, sum, of
//! `[2, T]`: each rank's own columns' parts), give `loss_t = M_t + ln S_t - L_{t,y_t}`. The
//! gradient of `Σ_t w_t loss_t` on the rank's own columns is local,
//! `dL_r = w_t (softmax - onehot)`, then `dh = Σ_r dL_r W_r` (one all-reduce) and
//! `dW_r += dL_r^T h`. Tokens go through in chunks so that a chunk's logits stay within a
//! fixed budget; every rank cuts the same chunks.

use crate::error::{LayerError, Result};
use crate::lm_head::ParallelLmHead;
use tp_comm::ReduceOp;
use tp_core::{DType, Device, Tensor};

/// Logit elements (of the full vocabulary) one chunk of tokens may span.
const CHUNK_LOGITS: usize = 1 << 24;

/// The result of [`ParallelLmHead::loss_backward`].
#[derive(Debug, Clone)]
pub struct LossOutput {
    /// `Σ_t loss_t` over the tokens with a target (unweighted, f64).
    pub loss_sum: f64,
    /// Tokens with a target.
    pub targets: usize,
    /// `d(Σ_t w·loss_t)/dh: [T, H]` (f32, every rank the same).
    pub dh: Tensor,
    /// Seconds spent in the forward part (logits and the loss's reductions); the rest of the
    /// call is the backward.
    pub forward_secs: f64,
}

impl ParallelLmHead {
    /// Training: cross-entropy of the rows of `h: [T, H]` against `targets[t]` (a global token
    /// id, or `None` for no loss), and the backward of `weight · Σ_t loss_t` (the caller's
    /// `weight` is `1 / N` for a mean over the step's `N` target tokens): returns the summed
    /// loss and `dh`, and accumulates `dW_r` (for a head tied to the embedding, the caller
    /// moves it into the table's gradient, [`take_grad`](Self::take_grad)).
    ///
    /// Errors: a target outside the vocabulary, `targets` not one per row, shapes, collective
    /// failures.
    pub fn loss_backward(&mut self, h: &Tensor, targets: &[Option<usize>], weight: f32) -> Result<LossOutput> {
        let (rows, hidden) = match *h.dims() {
            [r, c] => (r, c),
            ref d => return Err(LayerError::Config(format!("loss input must be [tokens, hidden], got {d:?}"))),
        };
        let vocab = self.vocab_size();
        if targets.len() != rows {
            return Err(LayerError::Config(format!("{} targets for {rows} tokens", targets.len())));
        }
        if let Some(&bad) = targets.iter().flatten().find(|&&y| y >= vocab) {
            return Err(LayerError::Config(format!("target {bad} is outside the vocabulary of {vocab}")));
        }
        let group = self.group().clone();
        let (start, len) = (self.shard().start(), self.shard().len());
        // A quantized head (a frozen GGUF base) is dequantized once for the input gradients.
        let w = match self.weights() {
            crate::Weight::Quant(q) => q.dequantize()?,
            dense => dense.dense()?.clone(),
        };
        let chunk = (CHUNK_LOGITS / vocab.max(1)).clamp(1, rows.max(1));
        let (mut loss_sum, mut count, mut dh_parts) = (0f64, 0usize, Vec::new());
        let mut forward_secs = 0f64;
        let to_group = |t: Tensor| -> Result<Tensor> { Ok(t.to_device(&group.device())?) };
        for r0 in (0..rows).step_by(chunk) {
            let n = chunk.min(rows - r0);
            let hc = h.narrow(0, r0, n)?;
            let tc = &targets[r0..r0 + n];
            let local_t: Vec<Option<usize>> =
                tc.iter().map(|t| t.and_then(|y| (y >= start && y < start + len).then(|| y - start))).collect();
            let started = std::time::Instant::now();
            let l32 = self.forward_local(&hc)?.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
            let max = group.all_reduce(&to_group(l32.row_max()?)?, ReduceOp::Max)?.to_device(&Device::Cpu)?;
            let parts = l32.cross_entropy_parts(&max, &local_t)?;
            let parts = group.all_reduce(&to_group(parts)?, ReduceOp::Sum)?.to_device(&Device::Cpu)?;
            let (sum_exp, tgt) = (parts.narrow(0, 0, 1)?.reshape(&[n])?, parts.narrow(0, 1, 1)?.reshape(&[n])?);
            let (mv, sv, tv) = (max.to_f64_vec()?, sum_exp.to_f64_vec()?, tgt.to_f64_vec()?);
            for (i, t) in tc.iter().enumerate() {
                if t.is_some() {
                    loss_sum += mv[i] + sv[i].ln() - tv[i];
                    count += 1;
                }
            }
            forward_secs += started.elapsed().as_secs_f64();
            let weights: Vec<f32> = tc.iter().map(|t| if t.is_some() { weight } else { 0.0 }).collect();
            let dl = match self.softcap() {
                // The capped logits are needed for the cap's backward.
                Some(cap) => {
                    l32.softcap_backward(cap, &l32.cross_entropy_backward(&max, &sum_exp, &local_t, &weights)?)?
                }
                None => {
                    let mut l32 = l32;
                    l32.cross_entropy_backward_in_place(&max, &sum_exp, &local_t, &weights)?;
                    l32
                }
            };
            let dh_partial = crate::linear::grad_input(&w, &dl)?;
            let work = if group.world_size() > 1 {
                Some(group.all_reduce_async(&to_group(dh_partial.clone())?, ReduceOp::Sum)?)
            } else {
                None
            };
            // `dW_r += dL^T h` into the accumulated gradient itself (immediate, never deferred:
            // a chunk's logits gradient is dropped here).
            let grads = self.grad.accumulate_weight_grad(&hc, &dl);
            let dh = match work {
                Some(w) => w.wait()?.to_device(&Device::Cpu)?,
                None => dh_partial,
            };
            grads?;
            dh_parts.push(dh);
        }
        let dh = if dh_parts.is_empty() {
            Tensor::zeros(&[0, hidden], DType::F32, &Device::Cpu)?
        } else {
            Tensor::cat(&dh_parts, 0)?
        };
        Ok(LossOutput { loss_sum, targets: count, dh, forward_secs })
    }

    /// Takes the accumulated `dW_r` (leaving it empty).
    pub fn take_grad(&mut self) -> Option<Tensor> {
        self.grad.take()
    }

    /// `W_r` as the parameter `{prefix}.weight` (an untied head): rows `shard` of `[V, H]`.
    pub fn params<'a>(&'a mut self, prefix: &str, f: &mut dyn FnMut(crate::Param<'a>)) -> Result<()> {
        let s = *self.shard();
        let hidden = self.weights().in_features();
        let p = crate::Placement::block(
            crate::parts::join(prefix, "weight"),
            &[s.global_len(), hidden],
            0,
            (0, s.start(), s.len()),
        );
        let (value, grad) = self.weight_and_grad()?;
        f(crate::Param { value, grad, placements: vec![p] });
        Ok(())
    }
}
