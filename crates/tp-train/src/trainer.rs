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
use crate::pipeline::{ModelChunk, Schedule, ScheduleKind, StageRunner, StageStep, TraceClock, TraceEvent};
use crate::schedule::LrSchedule;
use crate::{Result, TrainError};
use tp_comm::{DeviceGroup, ReduceOp};
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
    /// The pipeline schedule (with one stage every kind runs forward, backward, forward, ...).
    pub pp_schedule: ScheduleKind,
    /// Model chunks per pipeline rank (interleaved 1F1B; 1 otherwise).
    pub virtual_stages: usize,
    /// The distributed optimizer (ZeRO stage 1, [`crate::zero`]): the optimizer state shared
    /// out over the data-parallel replicas (nothing changes with one replica).
    pub zero: bool,
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
    /// The pipeline's measured idle fraction: `1 - busy compute / (ranks x step time)` (see
    /// [`Accumulated::bubble`]).
    pub bubble: f64,
    /// Bytes of optimizer state (moments and master weights) on the reporting rank after the
    /// update: under the distributed optimizer, its replica's share.
    pub optimizer_bytes: u64,
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
            bubble: acc.bubble,
            optimizer_bytes: 0,
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
    /// One per parameter, in [`ParallelCausalLm::params_mut`]'s order (chunk after chunk);
    /// empty before the first update.
    states: Vec<ParamState>,
    /// The last schedule built (rebuilt when the shape of a step changes).
    pipeline: Option<Schedule>,
}

/// The groups a step runs on besides each chunk's own tensor-parallel group: the pipeline
/// group (rank `s` = stage `s`), the data-parallel group (replicas of the same stage and
/// tensor-parallel rank), a mesh's expert-parallel groups if it has them, and where trace
/// events go.
#[derive(Debug, Clone, Copy)]
pub struct StepGroups<'a> {
    /// The pipeline group.
    pub pp: &'a DeviceGroup,
    /// The data-parallel group.
    pub dp: &'a DeviceGroup,
    /// Expert parallelism over replicas ([`tp_comm::Mesh::ep`]); `None` without.
    pub experts: Option<ExpertGroups<'a>>,
    /// Record the step's trace events.
    pub trace: Option<TraceClock>,
}

/// The groups of expert parallelism over data-parallel replicas.
#[derive(Debug, Clone, Copy)]
pub struct ExpertGroups<'a> {
    /// The replicas sharing out a mixture's experts (the tokens' all-to-all runs over it).
    pub ep: &'a DeviceGroup,
    /// The replicas holding the same experts, over which the experts' gradients are summed.
    pub edp: &'a DeviceGroup,
}

impl<'a> StepGroups<'a> {
    /// Pipeline and data-parallel groups, without expert parallelism.
    pub fn new(pp: &'a DeviceGroup, dp: &'a DeviceGroup, trace: Option<TraceClock>) -> StepGroups<'a> {
        StepGroups { pp, dp, experts: None, trace }
    }
    /// The groups of `mesh`, with its expert parallelism where it has some.
    pub fn of_mesh(mesh: &'a tp_comm::Mesh, trace: Option<TraceClock>) -> StepGroups<'a> {
        let experts = (mesh.ep().world_size() > 1).then(|| ExpertGroups { ep: mesh.ep(), edp: mesh.edp() });
        StepGroups { pp: mesh.pp(), dp: mesh.dp(), experts, trace }
    }
    /// The group over which `p`'s gradient is summed across replicas: the expert-data-parallel
    /// group for a routed expert's parameter under expert parallelism, else the data-parallel
    /// group.
    pub(crate) fn replicas_of(&self, p: &Param<'_>) -> &'a DeviceGroup {
        match self.experts {
            Some(x) if is_routed_expert(p) => x.edp,
            _ => self.dp,
        }
    }
}

/// Whether `p` is a routed expert's parameter ([`is_routed_expert_name`]).
pub(crate) fn is_routed_expert(p: &Param<'_>) -> bool {
    p.placements.first().is_some_and(|pl| is_routed_expert_name(&pl.name))
}

/// Whether the checkpoint name `name` is a routed expert's tensor (`...experts.{e}...`, shared
/// experts excluded): what expert parallelism over replicas places on one replica each.
pub fn is_routed_expert_name(name: &str) -> bool {
    name.contains(".experts.")
}

/// The gradients of a step, accumulated and completed, before clipping and the update.
#[derive(Debug, Clone, PartialEq)]
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
    /// The schedule's measured idle fraction over every rank: `1 - Σ busy / (ranks × T)`, with
    /// `busy` a rank's seconds of forward and backward compute and `T` the longest rank's time
    /// through its list of actions (the pipeline's bubble; waits for peers count as idle).
    pub bubble: f64,
    /// With tracing, this rank's events of the step.
    pub events: Vec<TraceEvent>,
    /// Parameters of this rank whose data-parallel sum was issued during the backward
    /// (overlapping it), not after it.
    pub overlapped_params: usize,
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
        if config.virtual_stages == 0 {
            return Err(TrainError::InvalidArgument {
                name: "virtual_stages",
                value: "0".into(),
                why: "at least 1 model chunk per pipeline rank",
            });
        }
        Ok(Trainer { config, step: 0, states: Vec::new(), pipeline: None })
    }

    /// The configuration.
    pub fn config(&self) -> &TrainConfig {
        &self.config
    }
    /// Steps completed.
    pub fn steps_done(&self) -> u64 {
        self.step
    }
    /// Rows a step takes on one data-parallel replica (`B × K`); a step of `D` replicas takes
    /// `D` times as many.
    pub fn rows_per_step(&self) -> usize {
        self.config.micro_batch_size * self.config.grad_accum
    }
    /// The optimizer state, one entry per parameter (empty before the first update).
    pub fn states(&self) -> &[ParamState] {
        &self.states
    }
    /// Bytes of optimizer state this rank holds (moments and master weights).
    pub fn state_bytes(&self) -> u64 {
        let floats: usize =
            self.states.iter().map(|s| s.adam.m.len() + s.adam.v.len() + s.master.as_ref().map_or(0, Vec::len)).sum();
        (floats * 4) as u64
    }

    /// Under the distributed optimizer, a copy of this trainer whose state is whole again
    /// (gathered over `dp` from every replica's range), for a checkpoint: collective over `dp`.
    /// `None` when the state is not shared out.
    pub fn unsharded(&self, chunks: &mut [ParallelCausalLm], dp: &DeviceGroup) -> Result<Option<Trainer>> {
        if !self.zero_over(dp) || self.states.is_empty() {
            return Ok(None);
        }
        let mut numel = Vec::with_capacity(self.states.len());
        for c in chunks.iter_mut() {
            numel.extend(c.params_mut()?.iter().map(|p| p.value.numel()));
        }
        let states = crate::zero::unshard_states(&self.states, &numel, dp)?;
        Ok(Some(Trainer { config: self.config.clone(), step: self.step, states, pipeline: None }))
    }

    /// Under the distributed optimizer, puts every replica's range of the gradients together,
    /// so that each replica holds whole gradients (for a dump of them): collective over `dp`.
    pub fn gather_grads(&self, chunks: &mut [ParallelCausalLm], dp: &DeviceGroup) -> Result<()> {
        if !self.zero_over(dp) {
            return Ok(());
        }
        for c in chunks.iter_mut() {
            for p in c.params_mut()? {
                let mut g = match p.grad.get() {
                    Some(g) => g.clone(),
                    None => Tensor::zeros(p.value.dims(), DType::F32, &p.value.device())?,
                };
                crate::zero::gather_value(&mut g, crate::zero::shard(&p, dp), dp)?;
                p.grad.set(Some(g));
            }
        }
        Ok(())
    }

    /// Restores a saved state: `step` steps done, and the per-parameter state.
    pub fn restore(&mut self, step: u64, states: Vec<ParamState>) {
        self.step = step;
        self.states = states;
    }

    /// Step `steps_done() + 1`'s forward and backward over `rows` (its `B × K` rows, split into
    /// micro-batches of `B` in order) through the whole `model`, then completes the gradients
    /// and takes their global norm. The gradients stay in the model for [`apply`](Self::apply).
    ///
    /// Errors: no target token in the whole step, a non-finite loss or norm, model errors.
    pub fn accumulate(&mut self, model: &mut ParallelCausalLm, rows: &[Example]) -> Result<Accumulated> {
        let single = single_groups(model.group())?;
        let groups = StepGroups::new(&single, &single, None);
        self.accumulate_with(std::slice::from_mut(model), &groups, rows, ScheduleKind::OneFOneB)
    }

    /// A step's forward and backward on this rank's pipeline `chunks` (chunk `c` = virtual
    /// stage `c·p + s`, all on one tensor-parallel group), by the configured schedule, then the
    /// gradients completed over every axis and their global norm.
    ///
    /// `rows` are the whole step's rows, `D × B × K` for `D` data-parallel replicas: replica
    /// `d` trains on the `d`-th `B × K` of them. The loss is the sum over every target token of
    /// all of them divided by their number `N`, counted here before anything runs, so neither
    /// the split into micro-batches, nor the pipeline, nor the replicas change a step's loss or
    /// gradients. After the schedule, in order:
    ///
    /// 1. tied embeddings held by two stages: the last stage's head gradient and the first
    ///    stage's table gradient are summed, and both take the sum (so both copies update
    ///    alike);
    /// 2. partial gradients completed over the tensor-parallel group;
    /// 3. every gradient summed over the data-parallel group (each replica's is already
    ///    weighted by `1/N`);
    /// 4. the global norm: each rank's owned elements, summed over the tensor and pipeline
    ///    groups (the replicas hold the same gradients, counted once).
    ///
    /// On any error this rank aborts its groups, so every other rank stops at once with the
    /// reason instead of waiting for its deadline.
    ///
    /// Errors: rows not a multiple of the replicas, no target token in the step, a non-finite
    /// loss or norm, a schedule that does not fit, model and collective errors.
    pub fn accumulate_stages(
        &mut self,
        chunks: &mut [ParallelCausalLm],
        groups: &StepGroups<'_>,
        rows: &[Example],
    ) -> Result<Accumulated> {
        self.accumulate_with(chunks, groups, rows, self.config.pp_schedule)
    }

    fn accumulate_with(
        &mut self,
        chunks: &mut [ParallelCausalLm],
        groups: &StepGroups<'_>,
        rows: &[Example],
        kind: ScheduleKind,
    ) -> Result<Accumulated> {
        let out = self.accumulate_inner(chunks, groups, rows, kind);
        if let Err(e) = &out {
            let who = format!("pipeline stage {} (data-parallel replica {})", groups.pp.rank(), groups.dp.rank());
            let why = format!("{who} failed: {e}");
            for c in chunks.iter() {
                c.group().abort(&why);
            }
            groups.pp.abort(&why);
            groups.dp.abort(&why);
            if let Some(x) = groups.experts {
                x.ep.abort(&why);
                x.edp.abort(&why);
            }
        }
        out
    }

    fn accumulate_inner(
        &mut self,
        chunks: &mut [ParallelCausalLm],
        groups: &StepGroups<'_>,
        rows: &[Example],
        kind: ScheduleKind,
    ) -> Result<Accumulated> {
        let step = self.step + 1;
        let Some(tp) = chunks.first().map(|c| c.group().clone()) else {
            return Err(TrainError::Model("no model chunk on this rank".into()));
        };
        let replicas = groups.dp.world_size();
        if rows.is_empty() || rows.len() % replicas != 0 {
            return Err(TrainError::Model(format!(
                "a step of {} rows cannot be split over {replicas} data-parallel replicas",
                rows.len()
            )));
        }
        let targets: usize = rows.iter().map(Example::targets).sum();
        if targets == 0 {
            return Err(TrainError::NoTargets { step, rows: rows.len() });
        }
        let tokens: usize = rows.iter().map(|e| e.input_ids.len()).sum();
        let per_replica = rows.len() / replicas;
        let mine = &rows[groups.dp.rank() * per_replica..][..per_replica];
        for c in chunks.iter_mut() {
            c.set_sequence_parallel(self.config.sequence_parallel);
            c.zero_grads()?;
        }
        let micro = mine
            .chunks(self.config.micro_batch_size)
            .map(|m| {
                let batch: Vec<TrainRow<'_>> =
                    m.iter().map(|e| TrainRow { input_ids: &e.input_ids, labels: &e.labels }).collect();
                // A mixture's load-balancing loss: the mean over the step's rows.
                chunks[0].micro_batch(&batch).map(|mb| mb.with_router_aux_scale(1.0 / rows.len() as f32))
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let (p, v) = (groups.pp.world_size(), chunks.len());
        let fits =
            |s: &Schedule| s.kind == kind && s.stages == p && s.micro_batches == micro.len() && s.virtual_stages == v;
        if !self.pipeline.as_ref().is_some_and(fits) {
            let s = Schedule::new(kind, p, micro.len(), v)
                .map_err(|e| TrainError::Model(format!("pipeline schedule: {e}")))?;
            self.pipeline = Some(s);
        }
        let schedule = self.pipeline.as_ref().expect("built above");
        let scale = (1.0 / targets as f64) as f32;
        let recompute = self.config.recompute;
        // The distributed optimizer reduce-scatters after the backward instead of summing each
        // block's gradients during it.
        let sums = (!self.zero_over(groups.dp)).then_some(*groups);
        let mut work: Vec<ModelChunk<'_>> =
            chunks.iter_mut().map(|model| ModelChunk::new(model, &micro, scale, recompute, sums)).collect();
        let ran = StageRunner { chunks: &mut work, pp: groups.pp, schedule, trace: groups.trace }.run(micro.len())?;
        let summed = work.into_iter().map(ModelChunk::finish).collect::<Result<Vec<_>>>()?;

        let sync_started = std::time::Instant::now();
        let loss_sum = step_loss_sum(ran.loss_sum, groups)?;
        let loss = loss_sum / targets as f64;
        if !loss.is_finite() {
            return Err(TrainError::NotFinite { step, what: "loss", value: loss });
        }
        sync_tied_copies(chunks, groups.pp)?;
        let (mut local, mut experts_local) = (0f64, 0f64);
        for (c, summed) in chunks.iter_mut().zip(&summed) {
            let mut params = c.params_mut()?;
            sync_partial_grads(&mut params, &tp)?;
            if self.zero_over(groups.dp) {
                if groups.experts.is_some() {
                    return Err(TrainError::Model(
                        "the distributed optimizer does not share out expert-parallel replicas yet".into(),
                    ));
                }
                crate::zero::reduce_scatter_grads(&mut params, groups.dp)?;
                local += crate::zero::sum_squares(&params, groups.dp)?;
                continue;
            }
            all_reduce_grads(&mut params, groups, summed)?;
            match groups.experts {
                // Each expert-parallel replica holds other experts: their squares are summed
                // over the expert-parallel group too, the replicated parameters' are not.
                Some(_) => {
                    let (experts, rest): (Vec<_>, Vec<_>) = params.into_iter().partition(is_routed_expert);
                    local += owned_sum_squares(&rest)?;
                    experts_local += owned_sum_squares(&experts)?;
                }
                None => local += owned_sum_squares(&params)?,
            }
        }
        // f32 is enough for a norm (torch reduces the per-tensor norms in the grads' dtype).
        let mut total = sum_over(local, &[&tp, groups.pp])?;
        if let Some(x) = groups.experts {
            total += sum_over(experts_local, &[&tp, groups.pp, x.ep])?;
        }
        let grad_norm = total.sqrt();
        if !grad_norm.is_finite() {
            return Err(TrainError::NotFinite { step, what: "gradient norm", value: grad_norm });
        }
        let bubble = measured_bubble(&ran, &[&tp, groups.pp, groups.dp])?;
        let sync_secs = sync_started.elapsed().as_secs_f64();
        Ok(Accumulated {
            loss_sum,
            targets,
            tokens,
            grad_norm,
            forward_secs: ran.forward_secs,
            backward_secs: ran.backward_secs,
            sync_secs,
            bubble,
            events: ran.events,
            overlapped_params: summed.iter().map(|s| s.len()).sum(),
        })
    }

    /// Clips the accumulated gradients by `grad_norm` (from [`accumulate`](Self::accumulate))
    /// and applies AdamW at the step's rate; the step counts as done. Returns the rate.
    pub fn apply(&mut self, model: &mut ParallelCausalLm, grad_norm: f64) -> Result<f64> {
        self.apply_stages(std::slice::from_mut(model), grad_norm)
    }

    /// [`apply`](Self::apply) to every chunk of this rank (their parameters in order).
    pub fn apply_stages(&mut self, chunks: &mut [ParallelCausalLm], grad_norm: f64) -> Result<f64> {
        let single = match chunks.first() {
            Some(c) => single_groups(c.group())?,
            None => return Err(TrainError::Model("no model chunk on this rank".into())),
        };
        self.apply_over(chunks, grad_norm, &single)
    }

    /// Whether the optimizer state is shared out over `dp` (the distributed optimizer with
    /// more than one replica).
    fn zero_over(&self, dp: &DeviceGroup) -> bool {
        self.config.zero && dp.world_size() > 1
    }

    /// [`apply_stages`](Self::apply_stages) on a rank whose data-parallel group is `dp`: with
    /// the distributed optimizer, this replica updates its range of each parameter and the
    /// ranges are all-gathered ([`crate::zero`]); every replica calls it alike.
    pub fn apply_over(&mut self, chunks: &mut [ParallelCausalLm], grad_norm: f64, dp: &DeviceGroup) -> Result<f64> {
        let sharded = self.zero_over(dp);
        let step = self.step + 1;
        let lr = self.config.schedule.lr(step);
        let coef = clip_coefficient(grad_norm, self.config.max_grad_norm) as f32;
        let adamw = self.config.adamw;
        let mut params = Vec::new();
        for c in chunks.iter_mut() {
            params.extend(c.params_mut()?);
        }
        let range_of = |p: &Param<'_>| -> Result<std::ops::Range<usize>> {
            Ok(if sharded { crate::zero::shard(p, dp) } else { 0..p.value.numel() })
        };
        if self.states.is_empty() {
            self.states = params.iter().map(|p| new_state(p, range_of(p)?)).collect::<Result<_>>()?;
        }
        if self.states.len() != params.len() {
            return Err(TrainError::Model(format!(
                "the optimizer holds {} parameters' state but the model has {}",
                self.states.len(),
                params.len()
            )));
        }
        for (p, st) in params.iter_mut().zip(&mut self.states) {
            // torch skips parameters without a gradient. The gradient stays where it is: the next
            // step's `zero_grads` zeroes that buffer in place and accumulates into it again.
            // (Under the distributed optimizer every parameter has one: the reduce-scatter
            // counts a missing one as zeros, as the unsharded sum over replicas does.)
            let Some(g) = p.grad.get() else { continue };
            let range = range_of(p)?;
            if sharded {
                crate::zero::take_shard(st, p.value.numel(), range.clone())?;
            }
            let g = g.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
            let (g, decay) = (&g.as_slice::<f32>()?[range.clone()], p.decays());
            match &mut st.master {
                None => {
                    let value = &mut p.value.as_mut_slice::<f32>()?[range];
                    adamw.step_clipped(value, g, coef, &mut st.adam, step, lr, decay)?;
                }
                Some(master) => {
                    adamw.step_clipped(master, g, coef, &mut st.adam, step, lr, decay)?;
                    store_master(p.value, master, range)?;
                }
            }
            if sharded {
                crate::zero::gather_value(p.value, range_of(p)?, dp)?;
            }
        }
        drop(params);
        for c in chunks.iter_mut() {
            c.sync_tied_head()?;
        }
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

/// `value = master` rounded to `value`'s dtype (round to nearest even, as `to_dtype`): a host
/// bf16 or f16 weight in place, on the host's threads for a large one (no copy of the master,
/// no fresh buffer whose pages fault in every step); elsewhere through a new tensor.
fn store_master(value: &mut Tensor, master: &[f32], range: std::ops::Range<usize>) -> Result<()> {
    if value.device() == Device::Cpu && range.len() == master.len() && range.end <= value.numel() {
        match value.dtype() {
            DType::BF16 => return round_into(master, &mut value.as_mut_slice::<tp_core::bf16>()?[range]),
            DType::F16 => return round_into(master, &mut value.as_mut_slice::<tp_core::f16>()?[range]),
            _ => {}
        }
    }
    if range.len() != value.numel() {
        return Err(TrainError::Model("the distributed optimizer keeps bf16 or f16 weights on the host".into()));
    }
    let dims = value.dims().to_vec();
    let updated = Tensor::from_slice(master, &dims, &Device::Cpu)?.to_dtype(value.dtype())?;
    *value = updated.to_device(&value.device())?;
    Ok(())
}

/// `dst = src` narrowed (`Element::slice_from_f32`), in contiguous pieces, one a thread, for a
/// large slice: each element rounded alone, so the same bits whatever the split.
fn round_into<T: tp_core::Element + Send>(src: &[f32], dst: &mut [T]) -> Result<()> {
    const PARALLEL_MIN: usize = 1 << 18;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(src.len() / PARALLEL_MIN).max(1);
    if threads == 1 {
        T::slice_from_f32(src, dst);
        return Ok(());
    }
    let piece = src.len().div_ceil(threads);
    std::thread::scope(|s| {
        for (d, x) in dst.chunks_mut(piece).zip(src.chunks(piece)) {
            s.spawn(move || T::slice_from_f32(x, d));
        }
    });
    Ok(())
}

/// Size-1 pipeline and data-parallel groups on `tp`'s device (a step without either).
pub(crate) fn single_groups(tp: &DeviceGroup) -> Result<DeviceGroup> {
    let device = tp.device();
    let mut g = DeviceGroup::local(1, tp_comm::DEFAULT_TIMEOUT, |_| device)?;
    Ok(g.remove(0))
}

/// The step's `Σ loss`: computed by the last pipeline stage (exact f64, broadcast as its bits),
/// summed over the data-parallel replicas in replica order (the same bits on every rank).
fn step_loss_sum(mine: f64, groups: &StepGroups<'_>) -> Result<f64> {
    let bits = |x: f64| Tensor::from_vec(vec![x.to_bits() as i64], &[1], &Device::Cpu);
    let value = |t: &Tensor| -> Result<Vec<f64>> {
        Ok(t.to_device(&Device::Cpu)?.to_i64_vec()?.into_iter().map(|b| f64::from_bits(b as u64)).collect())
    };
    let mut loss = mine;
    let pp = groups.pp;
    if pp.world_size() > 1 {
        let t = pp.broadcast(&bits(loss)?.to_device(&pp.device())?, pp.world_size() - 1)?;
        loss = value(&t)?[0];
    }
    let dp = groups.dp;
    if dp.world_size() > 1 {
        let all = dp.all_gather(&bits(loss)?.to_device(&dp.device())?, 0)?;
        loss = value(&all)?.iter().sum();
    }
    Ok(loss)
}

/// Tied embeddings split over two stages: the first stage's table gradient and the last
/// stage's head gradient (its copy of the table) are summed, and both copies take the sum, so
/// the two copies receive the same update. One exchange over the pipeline group between its
/// first and last rank (each tensor-parallel rank its own vocabulary shard).
fn sync_tied_copies(chunks: &mut [ParallelCausalLm], pp: &DeviceGroup) -> Result<()> {
    const NAME: &str = "model.embed_tokens.weight";
    let Some(first) = chunks.first() else { return Ok(()) };
    if !first.config().tie_word_embeddings {
        return Ok(());
    }
    // (chunk, is the copy) of this rank's tied tensors.
    let mut found: Vec<(usize, bool)> = Vec::new();
    for (i, c) in chunks.iter_mut().enumerate() {
        let copy = c.holds_tied_copy();
        if c.part().embedding || copy {
            found.push((i, copy));
        }
    }
    let grad_of = |c: &mut ParallelCausalLm| -> Result<Option<(Tensor, Vec<usize>)>> {
        for p in c.params_mut()? {
            if p.placements.first().is_some_and(|pl| pl.name == NAME) {
                let dims = p.value.dims().to_vec();
                let g = match p.grad.take() {
                    Some(g) => g,
                    None => Tensor::zeros(&dims, DType::F32, &p.value.device())?,
                };
                return Ok(Some((g, dims)));
            }
        }
        Ok(None)
    };
    let set_grad = |c: &mut ParallelCausalLm, g: Tensor| -> Result<()> {
        for p in c.params_mut()? {
            if p.placements.first().is_some_and(|pl| pl.name == NAME) {
                p.grad.set(Some(g));
                return Ok(());
            }
        }
        Ok(())
    };
    let (s, last) = (pp.rank(), pp.world_size() - 1);
    match found.as_slice() {
        // Both on this rank (one stage, or interleaved chunks of one rank).
        [(e, false), (h, true)] => {
            let (e, h) = (*e, *h);
            let (Some((ge, _)), Some((gh, _))) = (grad_of(&mut chunks[e])?, grad_of(&mut chunks[h])?) else {
                return Ok(());
            };
            let mut sum = ge;
            sum.add_assign(&gh)?;
            set_grad(&mut chunks[e], sum.clone())?;
            set_grad(&mut chunks[h], sum)?;
        }
        [(e, false)] if s == 0 && last > 0 && !chunks[*e].part().head => {
            let e = *e;
            let Some((ge, dims)) = grad_of(&mut chunks[e])? else { return Ok(()) };
            let gh = pp.recv(&dims, DType::F32, last)?;
            let mut sum = ge.to_device(&pp.device())?;
            sum.add_assign(&gh)?;
            pp.send(&sum, last)?;
            set_grad(&mut chunks[e], sum)?;
        }
        [(h, true)] if s == last && last > 0 => {
            let h = *h;
            let Some((gh, dims)) = grad_of(&mut chunks[h])? else { return Ok(()) };
            pp.send(&gh.to_device(&pp.device())?, 0)?;
            let sum = pp.recv(&dims, DType::F32, 0)?;
            set_grad(&mut chunks[h], sum)?;
        }
        _ => {}
    }
    Ok(())
}

/// Sums over the data-parallel group (a routed expert's over the expert-data-parallel group
/// under expert parallelism) the gradients the executor did not sum already (`done`:
/// the blocks'; here the embedding, final norm and LM head), all issued before any is waited
/// for (a parameter without a gradient counts as zeros, so every replica makes the same calls).
fn all_reduce_grads(
    params: &mut [Param<'_>],
    groups: &StepGroups<'_>,
    done: &std::collections::HashSet<String>,
) -> Result<()> {
    if groups.dp.world_size() == 1 {
        return Ok(());
    }
    let mut params: Vec<&mut Param<'_>> =
        params.iter_mut().filter(|p| !done.contains(&crate::pipeline::exec::param_key(p))).collect();
    let mut works = Vec::with_capacity(params.len());
    for p in params.iter() {
        let dp = groups.replicas_of(p);
        let g = match p.grad.get() {
            Some(g) => g.to_device(&dp.device())?,
            None => Tensor::zeros(p.value.dims(), DType::F32, &dp.device())?,
        };
        works.push(dp.all_reduce_async(&g, ReduceOp::Sum)?);
    }
    for (p, w) in params.iter_mut().zip(works) {
        p.grad.set(Some(w.wait()?));
    }
    Ok(())
}

/// `x` summed over each group in turn.
fn sum_over(x: f64, groups: &[&DeviceGroup]) -> Result<f64> {
    let mut x = x;
    for g in groups {
        if g.world_size() > 1 {
            let t = Tensor::from_vec(vec![x as f32], &[1], &Device::Cpu)?.to_device(&g.device())?;
            x = g.all_reduce(&t, ReduceOp::Sum)?.to_f64_vec()?[0];
        }
    }
    Ok(x)
}

/// `1 - Σ busy / (ranks × max wall)` over every rank of the groups.
fn measured_bubble(ran: &StageStep, groups: &[&DeviceGroup]) -> Result<f64> {
    let mut busy = ran.busy_secs();
    let mut wall = ran.wall_secs;
    let mut ranks = 1usize;
    for g in groups {
        if g.world_size() > 1 {
            let t = Tensor::from_vec(vec![busy as f32], &[1], &Device::Cpu)?.to_device(&g.device())?;
            busy = g.all_reduce(&t, ReduceOp::Sum)?.to_f64_vec()?[0];
            let t = Tensor::from_vec(vec![wall as f32], &[1], &Device::Cpu)?.to_device(&g.device())?;
            wall = g.all_reduce(&t, ReduceOp::Max)?.to_f64_vec()?[0];
            ranks *= g.world_size();
        }
    }
    Ok(if wall > 0.0 { (1.0 - busy / (ranks as f64 * wall)).clamp(0.0, 1.0) } else { 0.0 })
}

/// A fresh state for `p`: zero moments, and fp32 master weights unless it is f32 already.
/// Fresh state for elements `range` of `p` (all of it, or a replica's range under the
/// distributed optimizer).
fn new_state(p: &Param<'_>, range: std::ops::Range<usize>) -> Result<ParamState> {
    let n = range.len();
    let master = match p.value.dtype() {
        DType::F32 => {
            if p.value.device() != Device::Cpu {
                return Err(TrainError::Model("training runs on the host backend only for now".into()));
            }
            None
        }
        _ => Some(p.value.to_dtype(DType::F32)?.to_vec::<f32>()?[range].to_vec()),
    };
    Ok(ParamState { master, adam: AdamState::new(n) })
}
