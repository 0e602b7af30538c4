//! A schedule's timeline for given pass costs ([`simulate`]), and each schedule's bubble on
//! paper ([`bubble_formula`]).
//!
//! The bubble is the pipeline's idle fraction, `1 - Σ busy / (p × T)`: `busy` a rank's time in
//! forwards and backwards, `T` the step's makespan (the same quantity `tp train` logs as
//! `bubble`). With `f`, `b`, `w` the times of one chunk's forward, input gradient and weight
//! gradient (a fused backward costs `b + w`), one rank is busy `m·v·(f + b + w)` and
//!
//! * GPipe and 1F1B idle `(p - 1)(f + b + w)`: bubble `(p - 1) / (m + p - 1)`;
//! * interleaved 1F1B idles `(p - 1)(f + b + w)` per rank over `v` chunks each `v` times
//!   cheaper: against the ideal `m·v·(f + b + w)` that is Megatron-LM's `(p - 1) / (v·m)`;
//!   as an idle fraction `(p - 1) / (v·m + p - 1)`;
//! * ZB-H1 idles `(p - 1)(f + b - w)` (the weight gradients fill the rest): bubble
//!   `(p - 1)(f + b - w) / (m(f + b + w) + (p - 1)(f + b - w))`, a third of 1F1B's idle time
//!   when `f = b = w`. Exact for `m >= p` with equal costs; with fewer micro-batches than
//!   stages the greedy order cannot reach it.

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
    /// The compute events as trace events (times in the costs' unit read as milliseconds), for
    /// drawing a schedule with [`timeline_svg`](super::timeline_svg).
    pub fn to_trace(&self) -> Vec<TraceEvent> {
        self.events
            .iter()
            .filter_map(|e| {
                let (mb, chunk) = e.action.compute_key()?;
                Some(TraceEvent {
                    rank: e.rank,
                    stage: e.rank,
                    name: compute_name(&e.action).to_string(),
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

/// The bubble of `kind` on paper (see the module docs): `p` ranks, `m` micro-batches, `v`
/// chunks per rank, one chunk's forward `f`, input gradient `b` and weight gradient `w`.
pub fn bubble_formula(kind: ScheduleKind, p: usize, m: usize, v: usize, f: f64, b: f64, w: f64) -> f64 {
    let (p1, m, v) = ((p.max(1) - 1) as f64, m.max(1) as f64, v.max(1) as f64);
    let pass = f + b + w;
    let (idle, busy) = match kind {
        ScheduleKind::GPipe | ScheduleKind::OneFOneB => (p1 * pass, m * pass),
        ScheduleKind::Interleaved1F1B => (p1 * pass, v * m * pass),
        ScheduleKind::ZeroBubbleH1 => (p1 * (f + b - w).max(0.0), m * pass),
    };
    if idle + busy > 0.0 { idle / (idle + busy) } else { 0.0 }
}
