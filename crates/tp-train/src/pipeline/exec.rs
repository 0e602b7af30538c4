//! The pipeline executor: runs one rank's list of [`Action`]s of a [`Schedule`] on its model
//! chunks, moving hidden states and their gradients between stages over the pipeline group
//! (for a mixture of experts trained with its load-balancing loss, each message is followed
//! by the rows' router sums to the same peer, see [`Handoff`]).
//!
//! Rank `s` of the pipeline group holds chunk `c` = virtual stage `c·p + s` (one chunk unless
//! the schedule is interleaved). Every rank of a stage's tensor-parallel group runs the same
//! list, so their collectives line up. A forward keeps what its backward needs until the
//! backward runs (the schedule bounds how many micro-batches are in flight); a send is posted
//! and left to complete while the rank goes on, a receive waits (with the group's deadline).
//! Sends are posted together with the receive that follows them (one batch, as Megatron's
//! `send_forward_recv_backward`): in 1F1B both neighbours send before they receive, which on
//! NCCL's one stream per rank must be one group; before any other action they are posted
//! alone, so no send waits behind computation.
//! `BackwardInput` runs the backward with the linear layers' weight gradients deferred
//! ([`tp_layers::defer_weight_grads`]) and `BackwardWeight` computes them, one micro-batch's
//! worth, in the same order, so a zero-bubble step has the bits of a 1F1B step.
//!
//! A failure on any rank aborts the caller's groups (the executor returns the error; the
//! trainer aborts the mesh), so every other rank's pending receive ends at once with the
//! reason rather than at its deadline.

use super::schedule::{Action, Schedule};
use super::trace::TraceEvent;
use crate::{Result, TrainError};
use std::collections::HashMap;
use std::time::Instant;
use tp_comm::{DeviceGroup, P2p, Work};
use tp_core::{DType, Tensor};
use tp_layers::Param;
use tp_models::{Handoff, MicroBatch, ParallelCausalLm, Recompute, StageSaved};

/// What one rank's run of a schedule did.
#[derive(Debug, Clone, Default)]
pub struct StageStep {
    /// `Σ loss_t` of the micro-batches whose loss this rank computed (the last virtual stage;
    /// 0 elsewhere).
    pub loss_sum: f64,
    /// Seconds of forwards (including the loss and the LM head's backward on the last stage).
    pub forward_secs: f64,
    /// Seconds of backwards (input and weight gradients).
    pub backward_secs: f64,
    /// Seconds spent waiting for receives and for sends to be taken.
    pub wait_secs: f64,
    /// Wall seconds of the whole list.
    pub wall_secs: f64,
    /// One event per compute action and per wait, when tracing.
    pub events: Vec<TraceEvent>,
}

impl StageStep {
    /// Seconds of compute (forwards and backwards).
    pub fn busy_secs(&self) -> f64 {
        self.forward_secs + self.backward_secs
    }
}

/// Where this rank's trace events go: its global rank and the run's time origin.
#[derive(Debug, Clone, Copy)]
pub struct TraceClock {
    /// The global rank (the trace's process id).
    pub rank: usize,
    /// Time zero of the trace.
    pub origin: Instant,
}

/// What the executor needs of one model chunk: its forward, backward and deferred weight
/// gradients for a micro-batch, and the shape of what travels. [`ModelChunk`] is the model's;
/// a benchmark may stand in a chunk of known cost.
pub trait StageWork {
    /// What a forward keeps for its backward.
    type Saved;
    /// Forward of micro-batch `mb` from `input` (`None` on the first virtual stage): the output
    /// for the next stage (`None` on the last) and the loss it computed (0 but on the last).
    fn forward(&mut self, mb: usize, input: Option<Handoff>) -> Result<(Option<Handoff>, f64, Self::Saved)>;
    /// Backward of `mb` from the next stage's gradient (`None` on the last stage), adding the
    /// parameters' gradients (their weight part deferred when `defer_weights`); the input
    /// gradient for the previous stage (`None` on the first).
    fn backward(
        &mut self,
        mb: usize,
        saved: Self::Saved,
        dy: Option<Handoff>,
        defer_weights: bool,
    ) -> Result<Option<Handoff>>;
    /// The oldest deferred weight gradients (one micro-batch's).
    fn backward_weight(&mut self) -> Result<()>;
    /// Shape and dtype of the hidden states entering this chunk for `mb` (its gradient is f32).
    fn activation(&self, mb: usize) -> Result<(Vec<usize>, DType)>;
    /// Shape of the router sums (`I64`) that follow the hidden states and their gradient for
    /// `mb`, if any ([`Handoff::router_sums`]); none by default.
    fn router_sums(&self, _mb: usize) -> Result<Option<Vec<usize>>> {
        Ok(None)
    }
}

/// A model chunk driven by the executor: the model, the step's micro-batches, the loss weight,
/// and the data-parallel group over which its blocks' gradients are summed as soon as they are
/// final (the last micro-batch's backward of each block, or its last weight gradient), one
/// asynchronous all-reduce per block (a bucket of its parameters), overlapping the backward of
/// the blocks before it.
pub struct ModelChunk<'a> {
    /// The chunk.
    pub model: &'a mut ParallelCausalLm,
    /// The step's micro-batches (the same list on every rank).
    pub micro_batches: &'a [MicroBatch],
    /// The weight of each token's loss in the gradients (`1/N` over the whole step).
    pub loss_scale: f32,
    /// What forwards keep.
    pub recompute: Recompute,
    /// Sum the blocks' gradients over these groups' replicas as backward produces them (the
    /// data-parallel group; a routed expert's over the expert-data-parallel group).
    pub dp: Option<crate::StepGroups<'a>>,
    /// Backwards (or input halves) and weight halves run so far.
    done: (usize, usize),
    /// The all-reduces in flight.
    buckets: Vec<Bucket>,
}

/// One block's gradients, flattened into one buffer, being summed over the data-parallel group.
struct Bucket {
    /// Each parameter's key and shape, in buffer order.
    params: Vec<(String, Vec<usize>)>,
    work: Work,
}

/// A parameter's identity across calls: its checkpoint names.
pub(crate) fn param_key(p: &Param<'_>) -> String {
    p.placements.iter().map(|pl| pl.name.as_str()).collect::<Vec<_>>().join("+")
}

/// Issues the sums of `params`' gradients over their replicas ([`crate::StepGroups`]): one flat
/// buffer over the data-parallel group and, under expert parallelism, one of the routed
/// experts' over the expert-data-parallel group.
fn issue_buckets(params: &[Param<'_>], groups: &crate::StepGroups<'_>) -> tp_models::Result<Vec<Bucket>> {
    let Some(x) = groups.experts else { return Ok(vec![issue_bucket(&params.iter().collect::<Vec<_>>(), groups.dp)?]) };
    let (experts, rest): (Vec<&Param<'_>>, Vec<&Param<'_>>) =
        params.iter().partition(|p| crate::trainer::is_routed_expert(p));
    Ok(vec![issue_bucket(&rest, groups.dp)?, issue_bucket(&experts, x.edp)?])
}

/// Issues the sum over `dp` of `params`' gradients (zeros for a parameter without one) as one
/// flat buffer.
fn issue_bucket(params: &[&Param<'_>], dp: &DeviceGroup) -> tp_models::Result<Bucket> {
    let mut flat = Vec::with_capacity(params.len());
    let mut keys = Vec::with_capacity(params.len());
    for p in params {
        let dims = p.value.dims().to_vec();
        let g = match p.grad.get() {
            Some(g) => g.to_device(&tp_core::Device::Cpu)?,
            None => Tensor::zeros(&dims, DType::F32, &tp_core::Device::Cpu)?,
        };
        flat.push(g.reshape(&[g.numel()])?);
        keys.push((param_key(p), dims));
    }
    if flat.is_empty() {
        return Ok(Bucket {
            params: keys,
            work: Work::done(Ok(Tensor::zeros(&[0], DType::F32, &tp_core::Device::Cpu)?)),
        });
    }
    let flat = Tensor::cat(&flat, 0)?.to_device(&dp.device())?;
    Ok(Bucket { params: keys, work: dp.all_reduce_async(&flat, tp_comm::ReduceOp::Sum)? })
}

impl<'a> ModelChunk<'a> {
    /// A chunk for one step.
    pub fn new(
        model: &'a mut ParallelCausalLm,
        micro_batches: &'a [MicroBatch],
        loss_scale: f32,
        recompute: Recompute,
        dp: Option<crate::StepGroups<'a>>,
    ) -> ModelChunk<'a> {
        let dp = dp.filter(|g| g.dp.world_size() > 1);
        ModelChunk { model, micro_batches, loss_scale, recompute, dp, done: (0, 0), buckets: Vec::new() }
    }

    /// Waits for the data-parallel sums issued during the step and puts them in place; returns
    /// the keys of the parameters summed (the others, the embedding, final norm and LM head,
    /// are the caller's to sum).
    pub fn finish(self) -> Result<std::collections::HashSet<String>> {
        let mut sums: HashMap<String, Tensor> = HashMap::new();
        for b in self.buckets {
            let flat = b.work.wait()?.to_device(&tp_core::Device::Cpu)?;
            let mut at = 0;
            for (key, dims) in b.params {
                let n: usize = dims.iter().product();
                sums.insert(key, flat.narrow(0, at, n)?.reshape(&dims)?);
                at += n;
            }
        }
        let mut done = std::collections::HashSet::new();
        for p in self.model.params_mut()? {
            let key = param_key(&p);
            if let Some(g) = sums.remove(&key) {
                p.grad.set(Some(g.to_device(&p.value.device())?));
                done.insert(key);
            }
        }
        Ok(done)
    }
}

impl StageWork for ModelChunk<'_> {
    type Saved = StageSaved;
    fn forward(&mut self, mb: usize, input: Option<Handoff>) -> Result<(Option<Handoff>, f64, StageSaved)> {
        let f = self.model.stage_forward(&self.micro_batches[mb], input, self.loss_scale, self.recompute)?;
        Ok((f.output, f.loss_sum, f.saved))
    }
    fn backward(&mut self, mb: usize, saved: StageSaved, dy: Option<Handoff>, defer: bool) -> Result<Option<Handoff>> {
        let (model, mb) = (&mut *self.model, &self.micro_batches[mb]);
        self.done.0 += 1;
        let (dx, _) = if defer {
            tp_layers::defer_weight_grads(|| model.stage_backward(mb, saved, dy))?
        } else if let Some(dp) = self.dp.filter(|_| self.done.0 == self.micro_batches.len()) {
            // The last backward: each block's gradients are final once its backward is done.
            let mut buckets = Vec::new();
            let mut hook = |ps: &mut [Param<'_>]| -> tp_models::Result<()> {
                buckets.extend(issue_buckets(ps, &dp)?);
                Ok(())
            };
            let out = model.stage_backward_with(mb, saved, dy, Some(&mut hook))?;
            self.buckets.extend(buckets);
            out
        } else {
            model.stage_backward(mb, saved, dy)?
        };
        Ok(dx)
    }
    fn backward_weight(&mut self) -> Result<()> {
        for p in self.model.params_mut()? {
            p.grad.flush_one()?;
        }
        self.done.1 += 1;
        if let Some(dp) = self.dp.filter(|_| self.done.1 == self.micro_batches.len()) {
            // The last weight gradients: every block's are final now, one bucket per block.
            let mut params = self.model.params_mut()?;
            params.retain(|p| p.placements.first().is_some_and(|pl| pl.name.starts_with("model.layers.")));
            let block = |p: &Param<'_>| p.placements[0].name.split('.').nth(2).map(str::to_string);
            let mut start = 0;
            while start < params.len() {
                let b = block(&params[start]);
                let end = (start..params.len()).find(|&i| block(&params[i]) != b).unwrap_or(params.len());
                self.buckets.extend(issue_buckets(&params[start..end], &dp)?);
                start = end;
            }
        }
        Ok(())
    }
    fn activation(&self, mb: usize) -> Result<(Vec<usize>, DType)> {
        Ok((self.model.stage_activation_dims(&self.micro_batches[mb])?.to_vec(), self.model.dtype()))
    }
    fn router_sums(&self, mb: usize) -> Result<Option<Vec<usize>>> {
        Ok(self.model.stage_router_sums_dims(&self.micro_batches[mb])?.map(|d| d.to_vec()))
    }
}

/// One rank's part of a pipeline step.
pub struct StageRunner<'a, W: StageWork> {
    /// This rank's chunks, chunk `c` being virtual stage `c·p + s`.
    pub chunks: &'a mut [W],
    /// The pipeline group (rank `s` = stage `s`).
    pub pp: &'a DeviceGroup,
    /// The schedule every rank runs.
    pub schedule: &'a Schedule,
    /// Record trace events.
    pub trace: Option<TraceClock>,
}

/// The key of a micro-batch on a chunk.
type Key = (usize, usize);

/// A receive the schedule asks for: micro-batch `mb` of `chunk`, `dims` of `dtype` from stage
/// `peer`.
struct Want {
    chunk: usize,
    mb: usize,
    dims: Vec<usize>,
    dtype: DType,
    peer: usize,
}

impl<W: StageWork> StageRunner<'_, W> {
    /// Runs this rank's actions over the step's `micro_batches`.
    ///
    /// Errors: a schedule for another number of stages, micro-batches or chunks; model and
    /// collective errors (a peer's failure arrives as the group's error).
    pub fn run(&mut self, micro_batches: usize) -> Result<StageStep> {
        let s = self.pp.rank();
        let sched = self.schedule;
        if sched.stages != self.pp.world_size()
            || sched.micro_batches != micro_batches
            || sched.virtual_stages != self.chunks.len()
        {
            return Err(TrainError::Model(format!(
                "a schedule of {} stages x {} micro-batches x {} chunks does not fit {} pipeline ranks, {} \
                 micro-batches and {} chunks on this rank",
                sched.stages,
                sched.micro_batches,
                sched.virtual_stages,
                self.pp.world_size(),
                micro_batches,
                self.chunks.len()
            )));
        }
        let started = Instant::now();
        let mut out = StageStep::default();
        let mut inputs: HashMap<Key, Handoff> = HashMap::new();
        let mut outputs: HashMap<Key, Handoff> = HashMap::new();
        let mut saved: HashMap<Key, W::Saved> = HashMap::new();
        let mut grads_in: HashMap<Key, Handoff> = HashMap::new();
        let mut grads_out: HashMap<Key, Handoff> = HashMap::new();
        let mut sends: Vec<(Key, Work)> = Vec::new();
        let missing = |what: &str, (mb, chunk): Key| {
            TrainError::Model(format!(
                "pipeline stage {s}: {what} of micro-batch {mb}, chunk {chunk} is not there (the schedule is out of order)"
            ))
        };
        // Sends not yet posted: (micro-batch and chunk, what, to which stage).
        let mut queued: Vec<(Key, Handoff, usize)> = Vec::new();
        for &action in sched.rank_actions(s) {
            let t0 = Instant::now();
            if !matches!(
                action,
                Action::SendActivation { .. }
                    | Action::SendGrad { .. }
                    | Action::RecvActivation { .. }
                    | Action::RecvGrad { .. }
            ) {
                self.exchange(&mut queued, None, &mut sends)?;
            }
            let (name, key) = match action {
                Action::Forward { mb, chunk } => {
                    let key = (mb, chunk);
                    let input = inputs.remove(&key);
                    let (output, loss_sum, kept) = self.chunks[chunk].forward(mb, input)?;
                    out.loss_sum += loss_sum;
                    if let Some(o) = output {
                        outputs.insert(key, o);
                    }
                    saved.insert(key, kept);
                    out.forward_secs += t0.elapsed().as_secs_f64();
                    ("forward", Some(key))
                }
                Action::Backward { mb, chunk } | Action::BackwardInput { mb, chunk } => {
                    let key = (mb, chunk);
                    let kept = saved.remove(&key).ok_or_else(|| missing("the forward", key))?;
                    let dy = grads_in.remove(&key);
                    let defer = matches!(action, Action::BackwardInput { .. });
                    if let Some(dx) = self.chunks[chunk].backward(mb, kept, dy, defer)? {
                        grads_out.insert(key, dx);
                    }
                    out.backward_secs += t0.elapsed().as_secs_f64();
                    let name = if matches!(action, Action::Backward { .. }) { "backward" } else { "backward-input" };
                    (name, Some(key))
                }
                Action::BackwardWeight { mb, chunk } => {
                    self.chunks[chunk].backward_weight()?;
                    out.backward_secs += t0.elapsed().as_secs_f64();
                    ("backward-weight", Some((mb, chunk)))
                }
                Action::SendActivation { mb, chunk, peer } => {
                    let h = outputs.remove(&(mb, chunk)).ok_or_else(|| missing("the forward output", (mb, chunk)))?;
                    queued.push(((mb, chunk), h, peer));
                    continue;
                }
                Action::SendGrad { mb, chunk, peer } => {
                    let h = grads_out.remove(&(mb, chunk)).ok_or_else(|| missing("the input gradient", (mb, chunk)))?;
                    queued.push(((mb, chunk), h, peer));
                    continue;
                }
                Action::RecvActivation { mb, chunk, peer } => {
                    let (dims, dtype) = self.chunks[chunk].activation(mb)?;
                    let want = Want { chunk, mb, dims, dtype, peer };
                    let got = self.exchange(&mut queued, Some(want), &mut sends)?;
                    inputs.insert((mb, chunk), got.ok_or_else(|| missing("the received activation", (mb, chunk)))?);
                    out.wait_secs += t0.elapsed().as_secs_f64();
                    ("recv-wait", Some((mb, chunk)))
                }
                Action::RecvGrad { mb, chunk, peer } => {
                    let (dims, _) = self.chunks[chunk].activation(mb)?;
                    let want = Want { chunk, mb, dims, dtype: DType::F32, peer };
                    let got = self.exchange(&mut queued, Some(want), &mut sends)?;
                    grads_in.insert((mb, chunk), got.ok_or_else(|| missing("the received gradient", (mb, chunk)))?);
                    out.wait_secs += t0.elapsed().as_secs_f64();
                    ("recv-wait", Some((mb, chunk)))
                }
                Action::OptimizerStep => {
                    // The sends of this step complete before the update touches any weight.
                    let t0 = Instant::now();
                    for (key, w) in sends.drain(..) {
                        w.wait()?;
                        self.record(&mut out.events, "send-wait", Some(key), t0, t0.elapsed().as_secs_f64());
                    }
                    out.wait_secs += t0.elapsed().as_secs_f64();
                    continue;
                }
            };
            self.record(&mut out.events, name, key, t0, t0.elapsed().as_secs_f64());
        }
        self.exchange(&mut queued, None, &mut sends)?;
        for (_, w) in sends {
            w.wait()?;
        }
        if let Some(key) = saved.keys().next().copied() {
            return Err(missing("the backward", key));
        }
        out.wall_secs = started.elapsed().as_secs_f64();
        Ok(out)
    }

    /// Posts the `queued` sends (each hidden state or gradient, then its router sums if there
    /// are any) together with the receive of `want` if given, as one batch; the sends' works go
    /// to `sends`, and the receive is waited for and returned: `want`'s dims of its dtype, then
    /// the router sums where the chunk expects them.
    fn exchange(
        &self,
        queued: &mut Vec<(Key, Handoff, usize)>,
        want: Option<Want>,
        sends: &mut Vec<(Key, Work)>,
    ) -> Result<Option<Handoff>> {
        let sums = match &want {
            Some(w) => self.chunks[w.chunk].router_sums(w.mb)?,
            None => None,
        };
        let mut ops = Vec::new();
        let mut keys = Vec::new();
        for (key, h, peer) in queued.iter() {
            ops.push(P2p::Send { x: &h.hidden, peer: *peer });
            keys.push(*key);
            if let Some(s) = &h.router_sums {
                ops.push(P2p::Send { x: s, peer: *peer });
                keys.push(*key);
            }
        }
        if let Some(w) = &want {
            ops.push(P2p::Recv { dims: &w.dims, dtype: w.dtype, peer: w.peer });
            if let Some(d) = &sums {
                ops.push(P2p::Recv { dims: d, dtype: DType::I64, peer: w.peer });
            }
        }
        if ops.is_empty() {
            return Ok(None);
        }
        let mut works = self.pp.send_recv_async(&ops)?.into_iter();
        drop(ops);
        queued.clear();
        let mut next = || works.next().ok_or_else(|| TrainError::Model("a batch returned too few works".into()));
        for key in keys {
            sends.push((key, next()?));
        }
        if want.is_none() {
            return Ok(None);
        }
        let hidden = next()?.wait()?;
        let router_sums = match sums {
            Some(_) => Some(next()?.wait()?),
            None => None,
        };
        Ok(Some(Handoff { hidden, router_sums }))
    }

    fn record(&self, events: &mut Vec<TraceEvent>, name: &str, key: Option<Key>, start: Instant, secs: f64) {
        let Some(clock) = self.trace else { return };
        events.push(TraceEvent {
            rank: clock.rank,
            stage: self.pp.rank(),
            name: name.to_string(),
            mb: key.map(|k| k.0),
            chunk: key.map(|k| k.1),
            start_us: start.duration_since(clock.origin).as_secs_f64() * 1e6,
            dur_us: secs * 1e6,
        });
    }
}
