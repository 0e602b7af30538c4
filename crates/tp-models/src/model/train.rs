//! Training of [`ParallelCausalLm`]: the forward and backward of a micro-batch, the loss, and
//! the parameters a training loop updates.
//!
//! A micro-batch is whole rows (token ids and unshifted labels, transformers' convention:
//! position `t`'s logits predict `labels[t + 1]`, `-100` none). The rows' tokens run one after
//! the other as one flat batch through every GEMM, each row attending only within itself from
//! position 0, so a row's result is that of the row alone and padding never enters any
//! computation. The loss is the vocab-parallel cross-entropy of the LM head
//! ([`ParallelLmHead::loss_backward`](tp_layers::ParallelLmHead::loss_backward)), weighted by
//! the caller's `loss_scale` (`1/N` for the mean over a step's `N` target tokens, so that how
//! a step is split into micro-batches changes nothing). Backward runs the blocks in reverse,
//! each adding into its parameters' fp32 gradients; with tied embeddings the LM head's gradient
//! is added to the table's (one parameter, the sum of both uses).

use super::ParallelCausalLm;
use crate::error::{ModelError, Result};
use tp_core::{Device, Tensor};
use tp_layers::{BlockSaved, Param, Placement, SeqBatch};

/// What a training forward keeps of the blocks for the backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Recompute {
    /// Keep every block's activations (attention's scores are never stored: the backward
    /// recomputes them from q, k, v in any mode).
    #[default]
    None,
    /// The same as `None` here: attention scores are the one activation selective recompute
    /// drops, and tp never stores them.
    Selective,
    /// Keep only each block's input and run the block's forward again in the backward.
    Full,
}

/// One row of a micro-batch.
#[derive(Debug, Clone, Copy)]
pub struct TrainRow<'a> {
    /// Token ids.
    pub input_ids: &'a [u32],
    /// Labels, unshifted (same length), `-100` for none.
    pub labels: &'a [i64],
}

impl TrainRow<'_> {
    /// The row's prediction targets: position `t` predicts `labels[t + 1]` where that is not
    /// `-100`; the last position predicts nothing.
    pub fn targets(&self) -> Vec<Option<usize>> {
        (0..self.input_ids.len()).map(|t| self.labels.get(t + 1).and_then(|&y| usize::try_from(y).ok())).collect()
    }
}

/// The result of [`ParallelCausalLm::train_micro_batch`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MicroBatchLoss {
    /// `Σ loss_t` over the micro-batch's target tokens (unweighted).
    pub loss_sum: f64,
    /// Its target tokens.
    pub targets: usize,
    /// Its tokens.
    pub tokens: usize,
    /// Seconds of the forward (embedding, blocks, final norm, logits and the loss).
    pub forward_secs: f64,
    /// Seconds of the backward (with `Recompute::Full`, the blocks' recomputed forwards too).
    pub backward_secs: f64,
}

impl ParallelCausalLm {
    /// Training: forward and backward of the micro-batch `rows`, adding `loss_scale ·
    /// d(Σ loss_t)` into every parameter's fp32 gradient (they accumulate over calls until
    /// [`zero_grads`](Self::zero_grads)). Returns the summed loss of its target tokens.
    ///
    /// Errors: an empty row, labels of another length, ids or labels outside the vocabulary,
    /// a row longer than `max_position_embeddings`; layer and collective errors.
    pub fn train_micro_batch(
        &mut self,
        rows: &[TrainRow<'_>],
        loss_scale: f32,
        recompute: Recompute,
    ) -> Result<MicroBatchLoss> {
        let vocab = self.config.vocab_size;
        for (i, r) in rows.iter().enumerate() {
            let bad = |why: String| Err(ModelError::Request(format!("row {i} of the micro-batch: {why}")));
            if r.input_ids.is_empty() || r.labels.len() != r.input_ids.len() {
                return bad(format!(
                    "{} ids and {} labels (need the same, at least 1)",
                    r.input_ids.len(),
                    r.labels.len()
                ));
            }
            if r.input_ids.len() > self.config.max_position_embeddings {
                return bad(format!(
                    "{} tokens exceed max_position_embeddings ({})",
                    r.input_ids.len(),
                    self.config.max_position_embeddings
                ));
            }
            if let Some(id) = r.input_ids.iter().find(|&&id| id as usize >= vocab) {
                return bad(format!("id {id} is outside the vocabulary of {vocab}"));
            }
            if let Some(y) = r.labels.iter().find(|&&y| y != -100 && usize::try_from(y).map_or(true, |y| y >= vocab)) {
                return bad(format!("label {y} is neither -100 nor in the vocabulary of {vocab}"));
            }
        }
        let lens: Vec<usize> = rows.iter().map(|r| r.input_ids.len()).collect();
        let ids: Vec<i64> = rows.iter().flat_map(|r| r.input_ids.iter().map(|&i| i64::from(i))).collect();
        let targets: Vec<Option<usize>> = rows.iter().flat_map(TrainRow::targets).collect();
        let ids = Tensor::from_vec(ids, &[targets.len()], &Device::Cpu)?;

        self.sync_tied_head()?;
        let batch = SeqBatch::new(&lens, self.sequence_parallel && self.group.world_size() > 1);
        let started = std::time::Instant::now();
        // Forward (this rank's rows of every activation outside attention and the MLP: all of
        // them, or its sequence shard).
        let mut x = self.embed.forward_train(&ids, &batch)?;
        let mut saved: Vec<(Tensor, Option<BlockSaved>)> = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            let (y, s) = layer.forward_train(&x, &batch)?;
            let keep = if recompute == Recompute::Full { None } else { Some(s) };
            saved.push((std::mem::replace(&mut x, y), keep));
        }
        let h = self.norm.forward(&x)?;
        // The LM head sees every token (vocab-parallel); its dh is the same on every rank.
        let before_head = started.elapsed().as_secs_f64();
        let head_started = std::time::Instant::now();
        let out = self.lm_head.loss_backward(&batch.gather(&h, &self.group)?, &targets, loss_scale)?;
        let head_secs = head_started.elapsed().as_secs_f64();
        let backward_started = std::time::Instant::now();

        // Backward.
        let mut dx = self.norm.backward(&x, &batch.local(&out.dh, &self.group)?)?;
        for (layer, (input, s)) in self.layers.iter_mut().zip(saved).rev() {
            let s = match s {
                Some(s) => s,
                None => layer.forward_train(&input, &batch)?.1,
            };
            dx = layer.backward(s, &dx)?;
        }
        self.embed.backward(&ids, &dx, &batch)?;
        if self.config.tie_word_embeddings
            && let Some(g) = self.lm_head.take_grad()
        {
            self.embed.add_grad(&g)?;
        }
        let forward_secs = before_head + out.forward_secs;
        let backward_secs = head_secs - out.forward_secs + backward_started.elapsed().as_secs_f64();
        Ok(MicroBatchLoss {
            loss_sum: out.loss_sum,
            targets: out.targets,
            tokens: lens.iter().sum(),
            forward_secs,
            backward_secs,
        })
    }

    /// Every trainable parameter of this rank, in a fixed order (the same on every rank):
    /// the embedding, the blocks, the final norm, and the LM head unless tied. Named as in the
    /// checkpoint; see [`Param`] and [`Placement`]. After updating a tied table, call
    /// [`sync_tied_head`](Self::sync_tied_head) (the LM head holds its own handle to it).
    ///
    /// Errors: quantized weights (a GGUF model loaded without a dtype cannot be trained).
    pub fn params_mut(&mut self) -> Result<Vec<Param<'_>>> {
        let names = self.config.architecture.spec().names;
        let sp = self.sequence_parallel;
        let mut out = Vec::new();
        let mut push = |p| out.push(p);
        self.embed.params("model.embed_tokens", &mut push);
        for (i, layer) in self.layers.iter_mut().enumerate() {
            layer.params(&format!("model.layers.{i}"), &names, sp, &mut push)?;
        }
        let h = self.config.hidden_size;
        self.norm
            .param(vec![Placement::replicated("model.norm.weight".into(), &[h], self.group.rank(), sp)], &mut push);
        if !self.config.tie_word_embeddings {
            self.lm_head.params("lm_head", &mut push)?;
        }
        Ok(out)
    }

    /// Sequence parallelism for the training calls that follow (norms and residuals on
    /// sequence shards, [`SeqBatch`]); off by default. No effect at world size 1.
    pub fn set_sequence_parallel(&mut self, on: bool) {
        self.sequence_parallel = on;
    }

    /// Points a tied LM head at the embedding table again (after the table was updated in
    /// place; a no-op for an untied head).
    pub fn sync_tied_head(&mut self) -> Result<()> {
        if self.config.tie_word_embeddings && self.lm_head.weights().quant().is_none() {
            let mut head = tp_layers::ParallelLmHead::tied(&self.embed);
            if let Some(cap) = self.lm_head.softcap() {
                head = head.with_softcap(cap)?;
            }
            self.lm_head = head;
        }
        Ok(())
    }

    /// Empties every parameter's gradient.
    pub fn zero_grads(&mut self) -> Result<()> {
        for p in self.params_mut()? {
            p.grad.take();
        }
        self.lm_head.take_grad();
        Ok(())
    }
}
