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
use super::load_balancing::RouterSums;
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

/// Called with a block's parameters once its backward is done
/// ([`ParallelCausalLm::stage_backward_with`]).
pub type BlockHook<'h> = &'h mut dyn FnMut(&mut [Param<'_>]) -> Result<()>;

/// A micro-batch checked and laid out for the training calls: its flat token ids, each
/// token's target, and the token layout ([`SeqBatch`]). Every stage of a pipeline builds the
/// same one from the same rows.
#[derive(Debug, Clone)]
pub struct MicroBatch {
    ids: Tensor,
    targets: Vec<Option<usize>>,
    batch: SeqBatch,
    /// The weight of each row's load-balancing loss (`1 / rows` of the step: the loss is the
    /// mean over the step's rows; by default over this micro-batch's).
    router_aux_scale: f32,
    /// The seed of its LoRA dropout masks (the same on every rank of a stage, which make their
    /// micro-batches in the same order).
    dropout_seed: u64,
}

impl MicroBatch {
    /// Tokens of the micro-batch.
    pub fn tokens(&self) -> usize {
        self.batch.tokens()
    }
    /// Tokens with a target (the loss's terms).
    pub fn targets(&self) -> usize {
        self.targets.iter().filter(|t| t.is_some()).count()
    }
    /// The token layout.
    pub fn layout(&self) -> &SeqBatch {
        &self.batch
    }
    /// The micro-batch with each row's load-balancing loss weighted by `scale` (`1 / rows` of
    /// the whole step, so that the loss is the mean over the step's rows whatever its split).
    pub fn with_router_aux_scale(mut self, scale: f32) -> MicroBatch {
        self.router_aux_scale = scale;
        self
    }
}

/// What one pipeline stage hands the next (after its forward) or the previous (after its
/// backward).
#[derive(Debug)]
pub struct Handoff {
    /// Forward: the hidden states, this rank's rows (all `T`, or its sequence shard under
    /// sequence parallelism), `[rows, H]` in the model dtype. Backward: their gradient, f32.
    pub hidden: Tensor,
    /// For a mixture of experts trained with its load-balancing loss, each row's router sums
    /// (expert counts and probability sums, `[rows, 2E]` as the bits of `f64`s in `I64`):
    /// forward, over the MoE layers of the stages before the receiver; backward, over every
    /// MoE layer of the model. `None` otherwise
    /// ([`stage_router_sums_dims`](ParallelCausalLm::stage_router_sums_dims)).
    pub router_sums: Option<Tensor>,
}

/// What a stage's training forward returns ([`ParallelCausalLm::stage_forward`]).
#[derive(Debug)]
pub struct StageForward {
    /// What goes to the next stage; `None` on the last stage.
    pub output: Option<Handoff>,
    /// `Σ loss_t` over the micro-batch's target tokens (the last stage; 0 elsewhere), plus,
    /// for a mixture-of-experts model trained with `output_router_logits`, its weighted
    /// load-balancing loss in the same units (divided by the `loss_scale` the call was given),
    /// so that `loss_sum · loss_scale` summed over a step is its whole loss.
    pub loss_sum: f64,
    /// What [`stage_backward`](ParallelCausalLm::stage_backward) needs.
    pub saved: StageSaved,
    /// Seconds of the forward (embedding, blocks, final norm, logits and the loss).
    pub forward_secs: f64,
}

/// What a stage's training forward keeps for its backward (opaque).
#[derive(Debug)]
pub struct StageSaved {
    /// Each block's input and, unless recomputed, what its backward needs.
    blocks: Vec<(Tensor, Option<BlockSaved>)>,
    /// The last block's output (the final norm's input), on the last stage.
    last: Option<Tensor>,
    /// `d loss / d h` of the final norm's output (this rank's rows), on the last stage.
    dh: Option<Tensor>,
    /// On the last stage of a mixture trained with its load-balancing loss: every MoE layer's
    /// router sums (the previous stages' backward needs them).
    router_totals: Option<RouterSums>,
    /// Seconds the LM head's backward took inside the forward call.
    head_backward_secs: f64,
}

impl ParallelCausalLm {
    /// Checks `rows` and lays them out as one micro-batch for [`stage_forward`](Self::stage_forward).
    ///
    /// Errors: an empty row, labels of another length, ids or labels outside the vocabulary,
    /// a row longer than `max_position_embeddings`.
    pub fn micro_batch(&self, rows: &[TrainRow<'_>]) -> Result<MicroBatch> {
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
        let batch = SeqBatch::new(&lens, self.sequence_parallel && self.group.world_size() > 1);
        let n = self.micro_batches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dropout_seed =
            self.lora_dropout.map_or(0, |(seed, _)| seed).wrapping_add(n.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        Ok(MicroBatch { ids, targets, batch, router_aux_scale: 1.0 / rows.len().max(1) as f32, dropout_seed })
    }

    /// The shape of the hidden states that enter and leave this stage for `mb` on this rank:
    /// `[rows, H]` (its sequence shard's rows under sequence parallelism).
    pub fn stage_activation_dims(&self, mb: &MicroBatch) -> Result<[usize; 2]> {
        Ok([mb.batch.shard(&self.group)?.len(), self.config.hidden_size])
    }

    /// The shape of the router sums that travel between stages with the hidden states (both
    /// ways, `I64`) for `mb`: `Some([rows, 2E])` for a mixture of experts trained with its
    /// load-balancing loss, else `None`.
    ///
    /// Errors: a config this forward refuses (`router_jitter_noise`).
    pub fn stage_router_sums_dims(&self, mb: &MicroBatch) -> Result<Option<[usize; 2]>> {
        Ok(self.load_balancing()?.map(|(e, _)| RouterSums::dims(mb.batch.lens().len(), e)))
    }

    /// For a mixture of experts trained with its load-balancing loss
    /// (`output_router_logits`), its expert count and MoE layer count; else `None`.
    ///
    /// Errors: `router_jitter_noise`, which tp does not train with.
    fn load_balancing(&self) -> Result<Option<(usize, usize)>> {
        let Some(moe) = self.config.moe.as_ref() else { return Ok(None) };
        if moe.router_jitter_noise > 0.0 {
            return Err(ModelError::Request(format!(
                "router_jitter_noise ({}) scales a training forward's inputs at random; tp trains without it",
                moe.router_jitter_noise
            )));
        }
        let layers = moe.sparse_layers.iter().filter(|&&s| s).count();
        Ok((moe.output_router_logits && layers > 0).then_some((moe.num_experts, layers)))
    }

    /// The router sums this stage starts from: zeros on the first stage, else the previous
    /// stage's (`given`); `None` without a load-balancing loss.
    fn router_sums_in(
        &self,
        mb: &MicroBatch,
        balancing: Option<(usize, usize)>,
        given: Option<Tensor>,
    ) -> Result<Option<RouterSums>> {
        let rows = mb.batch.lens().len();
        match (balancing, self.embed.is_some(), given) {
            (None, _, None) => Ok(None),
            (None, _, Some(_)) => {
                Err(self.stage_input_error("router sums given to a model trained without a load-balancing loss"))
            }
            (Some((e, _)), true, None) => Ok(Some(RouterSums::zeros(rows, e))),
            (Some((e, _)), false, Some(t)) => Ok(Some(RouterSums::from_tensor(&t, rows, e)?)),
            (Some(_), true, Some(_)) => Err(self.stage_input_error("the first stage takes no router sums")),
            (Some(_), false, None) => {
                Err(self.stage_input_error("this stage needs the previous stage's router sums (load-balancing loss)"))
            }
        }
    }

    /// Training forward of this stage for `mb`: from the token ids on the first stage, else
    /// from `input` (the previous stage's [`StageForward::output`]); through this stage's
    /// blocks; on the last stage the final norm, the LM head and the loss, whose gradient
    /// (weighted by `loss_scale`) the LM head's backward computes at once (its weight gradient
    /// accumulated here). A mixture trained with its load-balancing loss adds its layers'
    /// router sums to the previous stage's; the last stage adds the loss
    /// (see `load_balancing.rs`).
    ///
    /// Errors: `input` given to the first stage or missing elsewhere, or of another shape;
    /// router sums missing or unexpected; layer and collective errors.
    pub fn stage_forward(
        &mut self,
        mb: &MicroBatch,
        input: Option<Handoff>,
        loss_scale: f32,
        recompute: Recompute,
    ) -> Result<StageForward> {
        self.frozen_if_lora(mb, |m| m.stage_forward_inner(mb, input, loss_scale, recompute))
    }

    /// Runs `f` with the base frozen when training adapters ([`tp_layers::lora::frozen_base`]:
    /// the loss's and the backward's weight gradients are the adapters' only), and their input
    /// dropped by `mb`'s masks when a dropout is set.
    fn frozen_if_lora<R>(&mut self, mb: &MicroBatch, f: impl FnOnce(&mut Self) -> R) -> R {
        if self.lora.is_none() {
            return f(self);
        }
        let p = self.lora_dropout.map_or(0.0, |(_, p)| p);
        tp_layers::lora::frozen_base(|| tp_layers::lora::with_dropout(mb.dropout_seed, p, || f(self)))
    }

    fn stage_forward_inner(
        &mut self,
        mb: &MicroBatch,
        input: Option<Handoff>,
        loss_scale: f32,
        recompute: Recompute,
    ) -> Result<StageForward> {
        if self.part.head {
            self.sync_tied_head()?;
        }
        let started = std::time::Instant::now();
        let batch = &mb.batch;
        let (input, sums_in) = match input {
            Some(h) => (Some(h.hidden), h.router_sums),
            None => (None, None),
        };
        let balancing = self.load_balancing()?;
        let mut sums = self.router_sums_in(mb, balancing, sums_in)?;
        let mut x = match (&self.embed, input) {
            (Some(embed), None) => embed.forward_train(&mb.ids, batch)?,
            (None, Some(x)) => {
                let want = self.stage_activation_dims(mb)?;
                if x.dims() != want {
                    return Err(ModelError::Request(format!(
                        "stage input of shape {:?}, expected {want:?} for this micro-batch",
                        x.dims()
                    )));
                }
                x
            }
            (Some(_), Some(_)) => {
                return Err(self.stage_input_error("the first stage takes token ids, not hidden states"));
            }
            (None, None) => return Err(self.stage_input_error("this stage needs the previous stage's hidden states")),
        };
        let mut blocks: Vec<(Tensor, Option<BlockSaved>)> = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            let (y, s) = layer.forward_train(&x, batch)?;
            if let (Some(sums), Some(r)) = (&mut sums, layer.router_stats(&s)) {
                sums.add(r, batch.lens())?;
            }
            let keep = if recompute == Recompute::Full { None } else { Some(s) };
            blocks.push((std::mem::replace(&mut x, y), keep));
        }
        // The loss is the last stage's (it holds the totals).
        let aux_loss = match (&sums, balancing) {
            (Some(s), Some((_, layers))) => s.loss(batch.lens(), layers, self.router_aux_coef_scale(mb)),
            _ => 0.0,
        };
        let Some((norm, lm_head)) = &mut self.head else {
            let router_sums = sums.map(|s| s.to_tensor()).transpose()?;
            let saved = StageSaved { blocks, last: None, dh: None, router_totals: None, head_backward_secs: 0.0 };
            let forward_secs = started.elapsed().as_secs_f64();
            return Ok(StageForward {
                output: Some(Handoff { hidden: x, router_sums }),
                loss_sum: 0.0,
                saved,
                forward_secs,
            });
        };
        let aux_sum = if loss_scale > 0.0 { aux_loss / f64::from(loss_scale) } else { 0.0 };
        let h = norm.forward(&x)?;
        // The LM head sees every token (vocab-parallel); its dh is the same on every rank.
        let before_head = started.elapsed().as_secs_f64();
        let head_started = std::time::Instant::now();
        let out = lm_head.loss_backward(&batch.gather(&h, &self.group)?, &mb.targets, loss_scale)?;
        let head_backward_secs = head_started.elapsed().as_secs_f64() - out.forward_secs;
        let dh = batch.local(&out.dh, &self.group)?;
        let saved = StageSaved { blocks, last: Some(x), dh: Some(dh), router_totals: sums, head_backward_secs };
        let loss_sum = out.loss_sum + aux_sum;
        Ok(StageForward { output: None, loss_sum, saved, forward_secs: before_head + out.forward_secs })
    }

    /// `router_aux_loss_coef` times `mb`'s weight of each row's load-balancing loss.
    fn router_aux_coef_scale(&self, mb: &MicroBatch) -> f64 {
        self.config.moe.as_ref().map_or(0.0, |m| m.router_aux_loss_coef * f64::from(mb.router_aux_scale))
    }

    fn stage_input_error(&self, why: &str) -> ModelError {
        ModelError::Request(format!("pipeline stage of layers {:?}: {why}", self.part.layers))
    }

    /// Training backward of this stage for `mb`, from what its [`stage_forward`](Self::stage_forward)
    /// kept and, except on the last stage, `dy` (the next stage's [`Handoff`]: the input
    /// gradient, f32, this rank's rows, and for a mixture trained with its load-balancing loss
    /// the model's router sums). Adds every parameter's gradient; with tied embeddings on one
    /// stage, the LM head's gradient goes into the table's. Returns what goes to the previous
    /// stage (`None` on the first stage) and the seconds it took.
    ///
    /// Errors: `dy` missing or given to the last stage, router sums missing or unexpected;
    /// layer and collective errors.
    pub fn stage_backward(
        &mut self,
        mb: &MicroBatch,
        saved: StageSaved,
        dy: Option<Handoff>,
    ) -> Result<(Option<Handoff>, f64)> {
        self.stage_backward_with(mb, saved, dy, None)
    }

    /// [`stage_backward`](Self::stage_backward), calling `after_block` with each block's
    /// parameters as soon as that block's backward is done (last block first): how a
    /// data-parallel step starts summing a block's gradients while the blocks before it still
    /// run their backward.
    pub fn stage_backward_with(
        &mut self,
        mb: &MicroBatch,
        saved: StageSaved,
        dy: Option<Handoff>,
        after_block: Option<BlockHook<'_>>,
    ) -> Result<(Option<Handoff>, f64)> {
        self.frozen_if_lora(mb, |m| m.stage_backward_inner(mb, saved, dy, after_block))
    }

    fn stage_backward_inner(
        &mut self,
        mb: &MicroBatch,
        saved: StageSaved,
        dy: Option<Handoff>,
        mut after_block: Option<BlockHook<'_>>,
    ) -> Result<(Option<Handoff>, f64)> {
        let lora = self.lora.is_some();
        let started = std::time::Instant::now();
        let names = self.config.architecture.spec().names;
        let (sp, first) = (self.sequence_parallel, self.part.layers.start);
        let batch = &mb.batch;
        let (dy, sums_back) = match dy {
            Some(h) => (Some(h.hidden), h.router_sums),
            None => (None, None),
        };
        let balancing = self.load_balancing()?;
        let totals = match (balancing, saved.router_totals, sums_back) {
            (None, None, None) => None,
            (Some(_), Some(t), None) => Some(t),
            (Some((e, _)), None, Some(t)) => Some(RouterSums::from_tensor(&t, batch.lens().len(), e)?),
            (Some(_), None, None) => {
                return Err(self.stage_input_error("this stage's backward needs the next stage's router sums"));
            }
            _ => return Err(self.stage_input_error("router sums given to the last stage's backward")),
        };
        let prob_grad = match (&totals, balancing) {
            (Some(t), Some((_, layers))) => Some(t.prob_grad(batch.lens(), layers, self.router_aux_coef_scale(mb))),
            _ => None,
        };
        let mut dx = match (&mut self.head, saved.last, saved.dh, dy) {
            (Some((norm, _)), Some(last), Some(dh), None) => norm.backward(&last, &dh)?,
            (None, None, None, Some(dy)) => dy,
            (Some(_), ..) => return Err(self.stage_input_error("the last stage's gradient comes from its loss")),
            _ => return Err(self.stage_input_error("this stage's backward needs the next stage's gradient")),
        };
        for (i, (layer, (input, s))) in self.layers.iter_mut().zip(saved.blocks).enumerate().rev() {
            let mut s = match s {
                Some(s) => s,
                None => layer.forward_train(&input, batch)?.1,
            };
            if let Some(g) = &prob_grad {
                layer.set_router_prob_grad(&mut s, g.clone());
            }
            dx = layer.backward(s, &dx)?;
            if let Some(hook) = after_block.as_mut() {
                let mut params = Vec::new();
                layer.params(&format!("model.layers.{}", first + i), &names, sp, &mut |p| {
                    if !lora || p.grad.is_adapter() {
                        params.push(p)
                    }
                })?;
                hook(&mut params)?;
            }
        }
        let dx = match &mut self.embed {
            Some(embed) => {
                embed.backward(&mb.ids, &dx, batch)?;
                if self.config.tie_word_embeddings
                    && let Some((_, lm_head)) = &mut self.head
                    && let Some(g) = lm_head.take_grad()
                {
                    embed.add_grad(&g)?;
                }
                None
            }
            None => Some(Handoff { hidden: dx, router_sums: totals.map(|t| t.to_tensor()).transpose()? }),
        };
        Ok((dx, saved.head_backward_secs + started.elapsed().as_secs_f64()))
    }

    /// Training: forward and backward of the micro-batch `rows` through the whole model,
    /// adding `loss_scale · d(Σ loss_t)` into every parameter's fp32 gradient (they accumulate
    /// over calls until [`zero_grads`](Self::zero_grads)). Returns the summed loss of its
    /// target tokens.
    ///
    /// Errors: as [`micro_batch`](Self::micro_batch); a pipeline stage (use
    /// [`stage_forward`](Self::stage_forward)); layer and collective errors.
    pub fn train_micro_batch(
        &mut self,
        rows: &[TrainRow<'_>],
        loss_scale: f32,
        recompute: Recompute,
    ) -> Result<MicroBatchLoss> {
        if !self.part.is_whole(self.config.num_hidden_layers) {
            return Err(
                self.stage_input_error("train_micro_batch runs the whole model; drive a stage with stage_forward")
            );
        }
        let mb = self.micro_batch(rows)?;
        let f = self.stage_forward(&mb, None, loss_scale, recompute)?;
        let (_, backward_secs) = self.stage_backward(&mb, f.saved, None)?;
        Ok(MicroBatchLoss {
            loss_sum: f.loss_sum,
            targets: mb.targets(),
            tokens: mb.tokens(),
            forward_secs: f.forward_secs,
            backward_secs,
        })
    }

    /// Every trainable parameter of this rank, in a fixed order (the same on every rank of a
    /// stage): the embedding, the blocks, the final norm, and the LM head unless tied. Named as
    /// in the checkpoint; see [`Param`] and [`Placement`]. After updating a tied table, call
    /// [`sync_tied_head`](Self::sync_tied_head) (the LM head holds its own handle to it).
    ///
    /// A last pipeline stage of a tied model without the embedding lists its head's copy of
    /// the table as `model.embed_tokens.weight`, not owned (the first stage's counts; see
    /// [`holds_tied_copy`](Self::holds_tied_copy)).
    ///
    /// Training adapters ([`add_lora`](Self::add_lora)), only the adapters are listed: every
    /// `{module}.lora_A.weight` and `{module}.lora_B.weight`, in the same order.
    ///
    /// Errors: quantized weights (a GGUF model loaded without a dtype cannot be trained, but
    /// can carry adapters).
    pub fn params_mut(&mut self) -> Result<Vec<Param<'_>>> {
        if self.lora.is_some() {
            let params = tp_layers::lora::frozen_base(|| self.layer_params())?;
            return Ok(params.into_iter().filter(|p| p.grad.is_adapter()).collect());
        }
        self.all_params()
    }

    /// Every parameter of the base.
    fn all_params(&mut self) -> Result<Vec<Param<'_>>> {
        let names = self.config.architecture.spec().names;
        let sp = self.sequence_parallel;
        let tied_copy = self.holds_tied_copy();
        let first = self.part.layers.start;
        let mut out = Vec::new();
        let mut push = |p| out.push(p);
        if let Some(embed) = &mut self.embed {
            embed.params("model.embed_tokens", &mut push);
        }
        for (i, layer) in self.layers.iter_mut().enumerate() {
            layer.params(&format!("model.layers.{}", first + i), &names, sp, &mut push)?;
        }
        let h = self.config.hidden_size;
        let rank = self.group.rank();
        if let Some((norm, lm_head)) = &mut self.head {
            norm.param(vec![Placement::replicated("model.norm.weight".into(), &[h], rank, sp)], &mut push);
            if tied_copy {
                lm_head.params("model.embed_tokens", &mut |mut p: Param<'_>| {
                    p.placements.iter_mut().for_each(|pl| pl.owned = false);
                    push(p)
                })?;
            } else if !self.config.tie_word_embeddings {
                lm_head.params("lm_head", &mut push)?;
            }
        }
        Ok(out)
    }

    /// Whether this is a last pipeline stage of a tied model without the embedding: its LM
    /// head holds a copy of the table, whose gradient must be summed with the first stage's
    /// before each update (so that both copies stay equal).
    pub fn holds_tied_copy(&self) -> bool {
        self.config.tie_word_embeddings && self.head.is_some() && self.embed.is_none()
    }

    /// Sequence parallelism for the training calls that follow (norms and residuals on
    /// sequence shards, [`SeqBatch`]); off by default. No effect at world size 1.
    pub fn set_sequence_parallel(&mut self, on: bool) {
        self.sequence_parallel = on;
    }

    /// Points a tied LM head at the embedding table again (after the table was updated in
    /// place; a no-op for an untied head or a stage that holds only one of the two).
    pub fn sync_tied_head(&mut self) -> Result<()> {
        if !self.config.tie_word_embeddings {
            return Ok(());
        }
        if let (Some(embed), Some((_, lm_head))) = (&self.embed, &mut self.head)
            && lm_head.weights().quant().is_none()
        {
            let mut head = tp_layers::ParallelLmHead::tied(embed);
            if let Some(cap) = lm_head.softcap() {
                head = head.with_softcap(cap)?;
            }
            *lm_head = head;
        }
        Ok(())
    }

    /// Zeroes every parameter's gradient (in place, keeping the buffers).
    pub fn zero_grads(&mut self) -> Result<()> {
        // Zeroed in place: the next step accumulates into the same buffers (no fresh pages).
        for p in self.params_mut()? {
            p.grad.zero()?;
        }
        // A tied head's gradient moves into the embedding's each step; nothing stays.
        if self.config.tie_word_embeddings
            && let Some((_, lm_head)) = &mut self.head
        {
            lm_head.take_grad();
        }
        Ok(())
    }
}
