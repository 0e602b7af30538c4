//! [`Trainer`]: one optimizer step of a tensor-parallel model, every rank running the same
//! calls on its own shards.
//!
//! A step takes `micro_batch_size × grad_accum` rows. Its loss is the sum of cross-entropy over
//! every target token of all its rows divided by their number `N` (transformers'
//! `num_items_in_batch`): each micro-batch's backward is weighted by `1/N`, counted before any
//! runs, so the split into micro-batches changes nothing. Then, in order:
//!
//! 1. partial gradients are completed (KV heads and q/k norm weights that several ranks apply,
//!    [`tp_layers::sync_partial_grads`]);
//! 2. the global gradient norm `‖g‖` counts every element of the model once (a sharded
//!    parameter once per shard, a replicated one once) with one all-reduce of a scalar, as
//!    torch's `clip_grad_norm_` over the unsplit model;
//! 3. gradients are multiplied by `min(1, C / (‖g‖ + 1e-6))`;
//! 4. AdamW updates the fp32 master weights (the parameters themselves in f32; a copy beside
//!    them in bf16/f16, rounded back after each update), with the step's rate from the
//!    schedule, and no weight decay on 1-D parameters (biases, norm weights).

use crate::data::Example;
use crate::optim::{AdamState, AdamW, clip_coefficient};
use crate::schedule::LrSchedule;
use crate::{Result, TrainError};
use tp_comm::ReduceOp;
use tp_core::{DType, Device, Tensor};
use tp_layers::{Param, owned_sum_squares, sync_partial_grads};
use tp_models::{ParallelCausalLm, Recompute, TrainRow};

/// What a step does besides its data.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainConfig {
    /// Rows per micro-batch (`B`).
    pub micro_batch_size: usize,
    /// Micro-batches per step (`K`).
    pub grad_accum: usize,
    /// The optimizer's hyper-parameters.
    pub adamw: AdamW,
    /// The learning rate of each step.
    pub schedule: LrSchedule,
    /// Global gradient-norm clipping (`<= 0`: none).
    pub max_grad_norm: f64,
    /// What the forward keeps for the backward.
    pub recompute: Recompute,
    /// Sequence parallelism: norms and residuals on sequence shards.
    pub sequence_parallel: bool,
}

/// A finished step, as `tp train --log-json` writes it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepLog {
    /// The step, counting from 1.
    pub step: u64,
    /// The loss before the update (mean over the target tokens).
    pub loss: f64,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
    /// The rate the step used.
    pub lr: f64,
    /// Target tokens of the step (the loss's denominator).
    pub tokens: usize,
    /// All tokens of the step's rows.
    pub input_tokens: usize,
    /// Seconds of the step's forwards, backwards, and gradient sync + norm + update.
    pub forward_secs: f64,
    /// See `forward_secs`.
    pub backward_secs: f64,
    /// See `forward_secs`.
    pub optimizer_secs: f64,
}

impl StepLog {
    /// The log of step `step` from its accumulated gradients, the rate it used and the
    /// seconds its update took.
    pub fn new(step: u64, acc: &Accumulated, lr: f64, update_secs: f64) -> StepLog {
        StepLog {
            step,
            loss: acc.loss_sum / acc.targets as f64,
            grad_norm: acc.grad_norm,
            lr,
            tokens: acc.targets,
            input_tokens: acc.tokens,
            forward_secs: acc.forward_secs,
            backward_secs: acc.backward_secs,
            optimizer_secs: acc.sync_secs + update_secs,
        }
    }
}

/// The optimizer state of one parameter on this rank.
#[derive(Debug, Clone)]
pub struct ParamState {
    /// fp32 master weights when the parameter is held in a narrower dtype.
    pub master: Option<Vec<f32>>,
    /// AdamW's moments.
    pub adam: AdamState,
}

/// The optimizer's state on one rank, and the step count.
#[derive(Debug, Clone)]
pub struct Trainer {
    config: TrainConfig,
    /// Steps completed.
    step: u64,
    /// One per parameter, in [`ParallelCausalLm::params_mut`]'s order; empty before the first
    /// update.
    states: Vec<ParamState>,
}

/// The gradients of a step, accumulated and completed, before clipping and the update.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Accumulated {
    /// `Σ loss` over the step's target tokens.
    pub loss_sum: f64,
    /// Target tokens.
    pub targets: usize,
    /// All tokens.
    pub tokens: usize,
    /// The global gradient norm.
    pub grad_norm: f64,
    /// Seconds of the forwards.
    pub forward_secs: f64,
    /// Seconds of the backwards.
    pub backward_secs: f64,
    /// Seconds of the gradients' sync and norm.
    pub sync_secs: f64,
}

impl Trainer {
    /// A trainer that has run no step.
    pub fn new(config: TrainConfig) -> Result<Trainer> {
        config.adamw.validate()?;
        if config.micro_batch_size == 0 || config.grad_accum == 0 {
            return Err(TrainError::InvalidArgument {
                name: "micro_batch_size x grad_accum",
                value: format!("{} x {}", config.micro_batch_size, config.grad_accum),
                why: "both must be at least 1",
            });
        }
        Ok(Trainer { config, step: 0, states: Vec::new() })
    }

    /// The configuration.
    pub fn config(&self) -> &TrainConfig {
        &self.config
    }
    /// Steps completed.
    pub fn steps_done(&self) -> u64 {
        self.step
    }
    /// Rows a step takes (`B × K`).
    pub fn rows_per_step(&self) -> usize {
        self.config.micro_batch_size * self.config.grad_accum
    }
    /// The optimizer state, one entry per parameter (empty before the first update).
    pub fn states(&self) -> &[ParamState] {
        &self.states
    }
    /// Restores a saved state: `step` steps done, and the per-parameter state.
    pub fn restore(&mut self, step: u64, states: Vec<ParamState>) {
        self.step = step;
        self.states = states;
    }

    /// Step `steps_done() + 1`'s forward and backward over `rows` (its `B × K` rows, split into
    /// micro-batches of `B` in order), then completes the gradients and takes their global
    /// norm. The gradients stay in the model for [`apply`](Self::apply).
    ///
    /// Errors: no target token in the whole step, a non-finite loss or norm, model errors.
    pub fn accumulate(&mut self, model: &mut ParallelCausalLm, rows: &[Example]) -> Result<Accumulated> {
        let step = self.step + 1;
        let targets: usize = rows.iter().map(Example::targets).sum();
        if targets == 0 {
            return Err(TrainError::NoTargets { step, rows: rows.len() });
        }
        model.set_sequence_parallel(self.config.sequence_parallel);
        model.zero_grads()?;
        let scale = (1.0 / targets as f64) as f32;
        let (mut loss_sum, mut tokens, mut forward_secs, mut backward_secs) = (0f64, 0usize, 0f64, 0f64);
        for micro in rows.chunks(self.config.micro_batch_size) {
            let batch: Vec<TrainRow<'_>> =
                micro.iter().map(|e| TrainRow { input_ids: &e.input_ids, labels: &e.labels }).collect();
            let out = model.train_micro_batch(&batch, scale, self.config.recompute)?;
            loss_sum += out.loss_sum;
            tokens += out.tokens;
            forward_secs += out.forward_secs;
            backward_secs += out.backward_secs;
        }
        let sync_started = std::time::Instant::now();
        let loss = loss_sum / targets as f64;
        if !loss.is_finite() {
            return Err(TrainError::NotFinite { step, what: "loss", value: loss });
        }
        let group = model.group().clone();
        let mut params = model.params_mut()?;
        sync_partial_grads(&mut params, &group)?;
        let local = owned_sum_squares(&params)?;
        let total = if group.world_size() > 1 {
            let t = Tensor::from_vec(vec![local as f32], &[1], &Device::Cpu)?;
            // f32 is enough for a norm (torch reduces the per-tensor norms in the grads' dtype).
            let t = group.all_reduce(&t.to_device(&group.device())?, ReduceOp::Sum)?;
            t.to_f64_vec()?[0]
        } else {
            local
        };
        let grad_norm = total.sqrt();
        if !grad_norm.is_finite() {
            return Err(TrainError::NotFinite { step, what: "gradient norm", value: grad_norm });
        }
        let sync_secs = sync_started.elapsed().as_secs_f64();
        Ok(Accumulated { loss_sum, targets, tokens, grad_norm, forward_secs, backward_secs, sync_secs })
    }

    /// Clips the accumulated gradients by `grad_norm` (from [`accumulate`](Self::accumulate))
    /// and applies AdamW at the step's rate; the step counts as done. Returns the rate.
    pub fn apply(&mut self, model: &mut ParallelCausalLm, grad_norm: f64) -> Result<f64> {
        let step = self.step + 1;
        let lr = self.config.schedule.lr(step);
        let coef = clip_coefficient(grad_norm, self.config.max_grad_norm) as f32;
        let adamw = self.config.adamw;
        let mut params = model.params_mut()?;
        if self.states.is_empty() {
            self.states = params.iter().map(|p| new_state(p)).collect::<Result<_>>()?;
        }
        if self.states.len() != params.len() {
            return Err(TrainError::Model(format!(
                "the optimizer holds {} parameters' state but the model has {}",
                self.states.len(),
                params.len()
            )));
        }
        for (p, st) in params.iter_mut().zip(&mut self.states) {
            let Some(g) = p.grad.take() else { continue }; // torch skips parameters without a gradient
            let g = g.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
            let (g, decay) = (g.as_slice::<f32>()?, p.decays());
            match &mut st.master {
                None => {
                    let value = p.value.as_mut_slice::<f32>()?;
                    adamw.step_clipped(value, g, coef, &mut st.adam, step, lr, decay)?;
                }
                Some(master) => {
                    adamw.step_clipped(master, g, coef, &mut st.adam, step, lr, decay)?;
                    let dims = p.value.dims().to_vec();
                    let updated = Tensor::from_slice(master, &dims, &Device::Cpu)?.to_dtype(p.value.dtype())?;
                    *p.value = updated.to_device(&p.value.device())?;
                }
            }
        }
        drop(params);
        model.sync_tied_head()?;
        self.step = step;
        Ok(lr)
    }

    /// One whole step: [`accumulate`](Self::accumulate) then [`apply`](Self::apply).
    pub fn step(&mut self, model: &mut ParallelCausalLm, rows: &[Example]) -> Result<StepLog> {
        let acc = self.accumulate(model, rows)?;
        let started = std::time::Instant::now();
        let lr = self.apply(model, acc.grad_norm)?;
        Ok(StepLog::new(self.step, &acc, lr, started.elapsed().as_secs_f64()))
    }
}

/// A fresh state for `p`: zero moments, and fp32 master weights unless it is f32 already.
fn new_state(p: &Param<'_>) -> Result<ParamState> {
    let n = p.value.numel();
    let master = match p.value.dtype() {
        DType::F32 => {
            if p.value.device() != Device::Cpu {
                return Err(TrainError::Model("training runs on the host backend only for now".into()));
            }
            None
        }
        _ => Some(p.value.to_dtype(DType::F32)?.to_vec::<f32>()?),
    };
    Ok(ParamState { master, adam: AdamState::new(n) })
}
