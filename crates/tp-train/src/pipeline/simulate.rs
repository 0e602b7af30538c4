//! A schedule's timeline for given pass costs ([`simulate`]), and each schedule's bubble on
//! paper ([`bubble_formula`]).
//!
//! # The simulation
//!
//! Every rank runs its list in order from time 0. A forward takes `F`, an input gradient `B`, a
//! weight gradient `W`, a whole backward `B + W`; sends, receives and the optimizer step take
//! no time, but a receive ends at `max(now, the time its matching send was posted)` (matched
//! first in, first out per pair of ranks, as the executor's are). No timing enters the order.
//!
//! # The bubble
//!
//! One normalisation throughout: the idle fraction `1 - Σ busy / (p × T)`, `busy` a rank's
//! time in forwards and backwards and `T` the makespan (the same quantity `tp train` logs as
//! `bubble`). Each rank is busy `m·v·(f + b + w)`, the same on every rank, so with `I` the idle
//! time of one rank the bubble is `I / (I + m·v·(f + b + w))`. With `f`, `b`, `w` one chunk's
//! forward, input gradient and weight gradient:
//!
//! * **GPipe and 1F1B**: `I = (p - 1)(f + b + w)`, bubble `(p - 1) / (m + p - 1)`, for any
//!   costs.
//! * **Interleaved 1F1B**: `I = (p - 1)(f + b + w)` with `v` chunks per rank, each `1/v` of the
//!   rank's layers: Megatron-LM's bubble `(p - 1) / (v·m)` is `I` against the ideal time
//!   `m·v·(f + b + w)`; as an idle fraction that is `(p - 1) / (v·m + p - 1)`, which is what
//!   this module returns (convert with `x ↦ x / (1 + x)`). Exact for any costs (the schedule
//!   needs `m` a multiple of `p`).
//! * **ZB-H1**: `I = (p - 1)(f + b) - (min(m, p) - 1)·min(f, b, w)`. With `m >= p` and
//!   `w <= min(f, b)` (the paper's `F = B = W` included) that is the paper's
//!   `(p - 1)(F + B - W)`, a third of 1F1B's `(p - 1)(F + B + W)` when all are equal. With `w`
//!   above `f` or `b`, only `min(f, b, w)` of each of the `p - 1` held-back `W`s hides in idle
//!   time, and with fewer micro-batches than stages only `m - 1` of them do. This form is what
//!   the simulator gives for [`Schedule::new`]'s ZB-H1 order, checked to 1e-9 over every
//!   `p <= 8`, `m <= 16` and hundreds of random costs (a fit to the simulated schedule, not a
//!   proof; the paper gives only the equal-cost case).
//!
//! Sends and receives are free here; on a real run their latency adds to `I`.

use super::schedule::{Action, Schedule, ScheduleKind, next_stage, prev_stage};
use super::trace::TraceEvent;
use std::collections::HashMap;

/// The cost of one chunk's passes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Costs {
    /// Forward.
    pub forward: f64,
    /// Input gradient (a fused backward costs this plus `weight`).
    pub input_grad: f64,
    /// Weight gradient.
    pub weight_grad: f64,
}

/// One action's place in time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimelineEvent {
    /// The pipeline rank.
    pub rank: usize,
    /// The action.
    pub action: Action,
    /// Start and end times.
    pub start: f64,
    /// See `start`.
    pub end: f64,
}

/// Every action of a simulated step.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// The events, rank by rank in each rank's order.
    pub events: Vec<TimelineEvent>,
    /// Pipeline ranks.
    pub stages: usize,
}

impl Timeline {
    /// The step's duration.
    pub fn makespan(&self) -> f64 {
        self.events.iter().fold(0.0, |t, e| t.max(e.end))
    }
    /// Time spent in forwards and backwards, over every rank.
    pub fn busy(&self) -> f64 {
        self.events.iter().filter(|e| e.action.compute_key().is_some()).map(|e| e.end - e.start).sum()
    }
    /// `1 - busy / (p × makespan)`.
    pub fn bubble(&self) -> f64 {
        let t = self.makespan();
        if t > 0.0 { 1.0 - self.busy() / (self.stages as f64 * t) } else { 0.0 }
    }
    /// The step as trace events, for drawing a schedule with
    /// [`timeline_svg`](super::timeline_svg) or [`chrome_trace_json`](super::chrome_trace_json)
    /// without running a model: one event per forward and backward (or half), and a
    /// `recv-wait` event per receive that waited. Times in the costs' unit are read as
    /// milliseconds; `rank` and `stage` are both the pipeline rank.
    pub fn to_trace(&self) -> Vec<TraceEvent> {
        self.events
            .iter()
            .filter_map(|e| {
                let (name, mb, chunk) = match e.action {
                    Action::RecvActivation { mb, chunk, .. } | Action::RecvGrad { mb, chunk, .. }
                        if e.end > e.start =>
                    {
                        ("recv-wait", mb, chunk)
                    }
                    a => {
                        let (mb, chunk) = a.compute_key()?;
                        (compute_name(&a), mb, chunk)
                    }
                };
                Some(TraceEvent {
                    rank: e.rank,
                    stage: e.rank,
                    name: name.to_string(),
                    mb: Some(mb),
                    chunk: Some(chunk),
                    start_us: e.start * 1e3,
                    dur_us: (e.end - e.start) * 1e3,
                })
            })
            .collect()
    }
}

/// The trace name of a compute action.
pub(crate) fn compute_name(a: &Action) -> &'static str {
    match a {
        Action::Forward { .. } => "forward",
        Action::Backward { .. } => "backward",
        Action::BackwardInput { .. } => "backward-input",
        Action::BackwardWeight { .. } => "backward-weight",
        _ => "",
    }
}

/// Runs `s` with the given costs (sends and receives take no time; a receive waits for its
/// send). `s` must be valid ([`Schedule::new`] returns only such).
pub fn simulate(s: &Schedule, costs: Costs) -> Timeline {
    let (p, v) = (s.stages, s.virtual_stages);
    let mut clock = vec![0f64; p];
    let mut at = vec![0usize; p];
    // When each message became available, by (from, to, index in the channel).
    let mut sent: HashMap<(usize, usize), Vec<f64>> = HashMap::new();
    let mut taken: HashMap<(usize, usize), usize> = HashMap::new();
    let mut events = Vec::new();
    loop {
        let mut progressed = false;
        for r in 0..p {
            while let Some(&a) = s.actions[r].get(at[r]) {
                let (start, end) = match a {
                    Action::SendActivation { chunk, .. } => {
                        let (to, _) = next_stage(p, v, r, chunk).expect("valid schedule");
                        sent.entry((r, to)).or_default().push(clock[r]);
                        (clock[r], clock[r])
                    }
                    Action::SendGrad { chunk, .. } => {
                        let (to, _) = prev_stage(p, r, chunk).expect("valid schedule");
                        sent.entry((r, to)).or_default().push(clock[r]);
                        (clock[r], clock[r])
                    }
                    Action::RecvActivation { peer, .. } | Action::RecvGrad { peer, .. } => {
                        let i = taken.entry((peer, r)).or_insert(0);
                        let Some(&t) = sent.get(&(peer, r)).and_then(|q| q.get(*i)) else { break };
                        *i += 1;
                        (clock[r], clock[r].max(t))
                    }
                    Action::Forward { .. } => (clock[r], clock[r] + costs.forward),
                    Action::Backward { .. } => (clock[r], clock[r] + costs.input_grad + costs.weight_grad),
                    Action::BackwardInput { .. } => (clock[r], clock[r] + costs.input_grad),
                    Action::BackwardWeight { .. } => (clock[r], clock[r] + costs.weight_grad),
                    Action::OptimizerStep => (clock[r], clock[r]),
                };
                clock[r] = end;
                events.push(TimelineEvent { rank: r, action: a, start, end });
                at[r] += 1;
                progressed = true;
            }
        }
        if !progressed {
            break;
        }
    }
    events.sort_by_key(|e| e.rank);
    Timeline { events, stages: p }
}

/// The bubble of `kind` on paper, as the idle fraction `1 - Σ busy / (p × T)` (see the module
/// docs for each formula and where it is exact): `p` ranks, `m` micro-batches, `v` chunks per
/// rank, one chunk's forward `f`, input gradient `b` and weight gradient `w` (a whole backward
/// costs `b + w`). Zero and degenerate arguments count as one; no costs give 0.
pub fn bubble_formula(kind: ScheduleKind, p: usize, m: usize, v: usize, f: f64, b: f64, w: f64) -> f64 {
    let (p1, m, v) = ((p.max(1) - 1) as f64, m.max(1) as f64, v.max(1) as f64);
    let pass = f + b + w;
    let (idle, busy) = match kind {
        ScheduleKind::GPipe | ScheduleKind::OneFOneB => (p1 * pass, m * pass),
        ScheduleKind::Interleaved1F1B => (p1 * pass, v * m * pass),
        ScheduleKind::ZeroBubbleH1 => (p1 * (f + b) - (m.min(p1 + 1.0) - 1.0) * f.min(b).min(w), m * pass),
    };
    if idle + busy > 0.0 { idle / (idle + busy) } else { 0.0 }
}
