//! Pipeline schedules as data: for every pipeline rank, the list of [`Action`]s it runs in one
//! optimizer step.
//!
//! `p` ranks, `m` micro-batches, `v` model chunks per rank: chunk `c` on rank `s` is virtual
//! stage `c·p + s` of `V = v·p` (Megatron-LM's interleaving; `v = 1` otherwise). Virtual stage
//! 0 holds the embedding, stage `V - 1` the loss. A forward's output goes to the rank of the
//! next virtual stage (`s + 1`, or rank 0's next chunk from rank `p - 1`), an input gradient to
//! the previous one.
//!
//! Each schedule is generated in two steps: one function per kind gives each rank's order of
//! compute (forwards and backwards), then [`Schedule::new`] places the messages: a send right
//! after the compute that produced it, and receives in the order the peer sends them (messages
//! between two ranks are matched first in, first out, as NCCL's are), each before the first
//! compute that needs it. Sends are posted without waiting; receives wait. Every schedule
//! passes [`validate`](super::validate()) before it is returned.
//!
//! The orders, per rank `s`:
//!
//! * **GPipe**: every forward, then every backward, in micro-batch order.
//! * **1F1B**: `min(p - s - 1, m)` warm-up forwards, then one forward and one backward in turn,
//!   then the remaining backwards: at most `p - s` micro-batches in flight on rank `s`.
//! * **Interleaved 1F1B** (Megatron-LM): the `m·v` forwards ordered in groups of `p`
//!   micro-batches per chunk (`k`-th forward: chunk `⌊k/p⌋ mod v`, micro-batch
//!   `⌊k/(p·v)⌋·p + k mod p`; backwards the same with the chunks reversed); `2(p - s - 1) +
//!   (v - 1)·p` warm-up forwards, then 1F1B. Needs `m` a multiple of `p` and `p >= 2`.
//! * **ZB-H1** (Qi et al., *Zero Bubble Pipeline Parallelism*): every backward split into its
//!   input gradient `B`, which the previous stage waits for, and its weight gradient `W`, which
//!   nobody waits for. The order is what a greedy list scheduler does with equal costs: a rank
//!   that is free runs a ready `B` first, else a forward if fewer than `p - s` micro-batches
//!   are in flight (1F1B's activation memory), else its oldest pending `W`; so the `W`s fill
//!   the cool-down's idle time, in micro-batch order.

use std::collections::{HashMap, VecDeque};

/// One pipeline rank's action. `mb` is the micro-batch (`0..m`), `chunk` the model chunk on
/// this rank (`0..v`; virtual stage `chunk·p + rank`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Forward of micro-batch `mb` through chunk `chunk` (on the last virtual stage, with the
    /// loss and its gradient).
    Forward { mb: usize, chunk: usize },
    /// Backward: input and weight gradients together.
    Backward { mb: usize, chunk: usize },
    /// The input gradient only (zero-bubble schedules); its weight gradient comes later.
    BackwardInput { mb: usize, chunk: usize },
    /// The weight gradient of an earlier [`BackwardInput`](Action::BackwardInput).
    BackwardWeight { mb: usize, chunk: usize },
    /// Send the forward output of (`mb`, `chunk`) to rank `peer` (the next virtual stage's).
    SendActivation { mb: usize, chunk: usize, peer: usize },
    /// Receive the input of (`mb`, `chunk`)'s forward from `peer`; `chunk` is the receiving one.
    RecvActivation { mb: usize, chunk: usize, peer: usize },
    /// Send the input gradient of (`mb`, `chunk`) to `peer` (the previous virtual stage's).
    SendGrad { mb: usize, chunk: usize, peer: usize },
    /// Receive the output gradient of (`mb`, `chunk`)'s backward from `peer`; `chunk` is the
    /// receiving one.
    RecvGrad { mb: usize, chunk: usize, peer: usize },
    /// The optimizer step: every rank's last action, once.
    OptimizerStep,
}

impl Action {
    /// `(mb, chunk)` of a compute action.
    pub fn compute_key(&self) -> Option<(usize, usize)> {
        match *self {
            Action::Forward { mb, chunk }
            | Action::Backward { mb, chunk }
            | Action::BackwardInput { mb, chunk }
            | Action::BackwardWeight { mb, chunk } => Some((mb, chunk)),
            _ => None,
        }
    }
}

/// The schedules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScheduleKind {
    /// All forwards, then all backwards.
    GPipe,
    /// One forward, one backward.
    OneFOneB,
    /// 1F1B over `v` chunks per rank.
    Interleaved1F1B,
    /// 1F1B with the weight gradients deferred into the bubbles.
    ZeroBubbleH1,
}

impl ScheduleKind {
    /// Every kind.
    pub const ALL: [ScheduleKind; 4] =
        [ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved1F1B, ScheduleKind::ZeroBubbleH1];

    /// `gpipe`, `1f1b`, `interleaved` or `zb-h1` (case-insensitive).
    pub fn parse(s: &str) -> Result<ScheduleKind, String> {
        let k = s.trim().to_ascii_lowercase();
        Self::ALL
            .into_iter()
            .find(|x| x.name() == k)
            .ok_or_else(|| format!("unknown pipeline schedule {s:?}: use gpipe, 1f1b, interleaved or zb-h1"))
    }

    /// The name `--pp-schedule` takes.
    pub fn name(&self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved1F1B => "interleaved",
            ScheduleKind::ZeroBubbleH1 => "zb-h1",
        }
    }
}

/// Why a schedule cannot be built, or a list of actions is not a valid schedule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// The arguments do not make a schedule.
    #[error("{0}")]
    Arguments(String),
    /// Rank `rank`'s action at `index` breaks the rules.
    #[error("rank {rank}, action {index} ({action:?}): {why}")]
    Action { rank: usize, index: usize, action: Option<Action>, why: String },
    /// The ranks wait for each other.
    #[error("deadlock: {0}")]
    Deadlock(String),
}

/// Every pipeline rank's actions for one step.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    /// Which schedule.
    pub kind: ScheduleKind,
    /// Pipeline ranks `p`.
    pub stages: usize,
    /// Micro-batches `m`.
    pub micro_batches: usize,
    /// Chunks per rank `v`.
    pub virtual_stages: usize,
    /// Rank `s`'s actions, in order.
    pub actions: Vec<Vec<Action>>,
}

impl Schedule {
    /// The `kind` schedule of `stages` ranks, `micro_batches` micro-batches and `virtual_stages`
    /// chunks per rank, validated.
    ///
    /// Errors: a zero argument; more than one chunk per rank for a kind other than
    /// interleaved; interleaved with one rank or with micro-batches not a multiple of the ranks
    /// (Megatron-LM's rule).
    pub fn new(
        kind: ScheduleKind,
        stages: usize,
        micro_batches: usize,
        virtual_stages: usize,
    ) -> Result<Schedule, ScheduleError> {
        let (p, m, v) = (stages, micro_batches, virtual_stages);
        let bad = |why: String| Err(ScheduleError::Arguments(why));
        if p == 0 || m == 0 || v == 0 {
            return bad(format!("stages ({p}), micro-batches ({m}) and virtual stages ({v}) must each be at least 1"));
        }
        if v > 1 && kind != ScheduleKind::Interleaved1F1B {
            return bad(format!("{v} virtual stages need the interleaved schedule, not {}", kind.name()));
        }
        if kind == ScheduleKind::Interleaved1F1B {
            if p < 2 {
                return bad("the interleaved schedule needs at least 2 pipeline stages".into());
            }
            if m % p != 0 {
                return bad(format!(
                    "the interleaved schedule needs the micro-batches ({m}) to be a multiple of the pipeline stages \
                     ({p}), as Megatron-LM's does"
                ));
            }
        }
        let orders = match kind {
            ScheduleKind::GPipe => (0..p).map(|_| gpipe(m)).collect(),
            ScheduleKind::OneFOneB => (0..p).map(|s| one_f_one_b(p, s, m)).collect(),
            ScheduleKind::Interleaved1F1B => (0..p).map(|s| interleaved(p, s, m, v)).collect(),
            ScheduleKind::ZeroBubbleH1 => zero_bubble_h1(p, m),
        };
        let actions = place_messages(p, v, &orders)?;
        let s = Schedule { kind, stages: p, micro_batches: m, virtual_stages: v, actions };
        super::validate(&s)?;
        Ok(s)
    }

    /// Rank `rank`'s actions (empty past the last rank).
    pub fn rank_actions(&self, rank: usize) -> &[Action] {
        self.actions.get(rank).map_or(&[], Vec::as_slice)
    }

    /// The virtual stage of `chunk` on `rank`.
    pub fn virtual_stage(&self, rank: usize, chunk: usize) -> usize {
        chunk * self.stages + rank
    }
}

fn gpipe(m: usize) -> Vec<Action> {
    let f = (0..m).map(|mb| Action::Forward { mb, chunk: 0 });
    f.chain((0..m).map(|mb| Action::Backward { mb, chunk: 0 })).collect()
}

fn one_f_one_b(p: usize, s: usize, m: usize) -> Vec<Action> {
    let warm = (p - s - 1).min(m);
    let mut out: Vec<Action> = (0..warm).map(|mb| Action::Forward { mb, chunk: 0 }).collect();
    for i in 0..m - warm {
        out.push(Action::Forward { mb: warm + i, chunk: 0 });
        out.push(Action::Backward { mb: i, chunk: 0 });
    }
    out.extend((m - warm..m).map(|mb| Action::Backward { mb, chunk: 0 }));
    out
}

fn interleaved(p: usize, s: usize, m: usize, v: usize) -> Vec<Action> {
    let total = m * v;
    let mb_of = |k: usize| (k / (p * v)) * p + k % p;
    let fwd = |k: usize| Action::Forward { mb: mb_of(k), chunk: (k / p) % v };
    let bwd = |k: usize| Action::Backward { mb: mb_of(k), chunk: v - 1 - (k / p) % v };
    let warm = (2 * (p - s - 1) + (v - 1) * p).min(total);
    let mut out: Vec<Action> = (0..warm).map(fwd).collect();
    for i in 0..total - warm {
        out.push(fwd(warm + i));
        out.push(bwd(i));
    }
    out.extend((total - warm..total).map(bwd));
    out
}

/// ZB-H1's orders: the greedy list schedule of unit-cost F, B and W (see the module docs).
fn zero_bubble_h1(p: usize, m: usize) -> Vec<Vec<Action>> {
    // Finish times of each stage's forwards and input gradients, by micro-batch.
    let mut f_done: Vec<Vec<Option<u64>>> = vec![vec![None; m]; p];
    let mut b_done: Vec<Vec<Option<u64>>> = vec![vec![None; m]; p];
    let (mut clock, mut nf, mut nb, mut nw) = (vec![0u64; p], vec![0usize; p], vec![0usize; p], vec![0usize; p]);
    let mut out: Vec<Vec<Action>> = vec![Vec::with_capacity(3 * m); p];
    while nw.iter().sum::<usize>() < p * m {
        // (start, priority, stage, action): the earliest startable action of any stage.
        let mut best: Option<(u64, u8, usize, Action)> = None;
        for s in 0..p {
            let mut consider = |start: u64, prio: u8, a: Action| {
                if best.is_none_or(|(t, q, r, _)| (start, prio, s) < (t, q, r)) {
                    best = Some((start, prio, s, a));
                }
            };
            if nb[s] < nf[s] {
                let mb = nb[s];
                let ready = if s + 1 < p { b_done[s + 1][mb] } else { f_done[s][mb] };
                if let Some(t) = ready {
                    consider(clock[s].max(t), 0, Action::BackwardInput { mb, chunk: 0 });
                }
            }
            if nf[s] < m && nf[s] - nb[s] < p - s {
                let mb = nf[s];
                let ready = if s > 0 { f_done[s - 1][mb] } else { Some(0) };
                if let Some(t) = ready {
                    consider(clock[s].max(t), 1, Action::Forward { mb, chunk: 0 });
                }
            }
            if nw[s] < nb[s] {
                consider(clock[s], 2, Action::BackwardWeight { mb: nw[s], chunk: 0 });
            }
        }
        let Some((start, _, s, a)) = best else { break };
        clock[s] = start + 1;
        match a {
            Action::Forward { mb, .. } => {
                f_done[s][mb] = Some(clock[s]);
                nf[s] += 1;
            }
            Action::BackwardInput { mb, .. } => {
                b_done[s][mb] = Some(clock[s]);
                nb[s] += 1;
            }
            _ => nw[s] += 1,
        }
        out[s].push(a);
    }
    out
}

/// A message on the way from one rank to another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Message {
    /// An activation (else a gradient).
    pub activation: bool,
    pub mb: usize,
    /// The receiving chunk.
    pub chunk: usize,
}

/// Where (`mb`, `chunk`) on `rank` sends its forward output / input gradient: (peer, the
/// receiving chunk), or `None` at the last / first virtual stage.
pub(crate) fn next_stage(p: usize, v: usize, rank: usize, chunk: usize) -> Option<(usize, usize)> {
    let vs = chunk * p + rank;
    (vs + 1 < p * v).then(|| ((rank + 1) % p, if rank + 1 == p { chunk + 1 } else { chunk }))
}

/// See [`next_stage`]: the previous virtual stage's (rank, chunk).
pub(crate) fn prev_stage(p: usize, rank: usize, chunk: usize) -> Option<(usize, usize)> {
    let vs = chunk * p + rank;
    (vs > 0).then(|| ((rank + p - 1) % p, if rank == 0 { chunk - 1 } else { chunk }))
}

/// Adds the sends and receives to each rank's compute order, and the optimizer step.
fn place_messages(p: usize, v: usize, orders: &[Vec<Action>]) -> Result<Vec<Vec<Action>>, ScheduleError> {
    // Each channel's messages in the order its sender sends them.
    let mut channels: HashMap<(usize, usize), Vec<Message>> = HashMap::new();
    for (a, order) in orders.iter().enumerate() {
        for act in order {
            match *act {
                Action::Forward { mb, chunk } => {
                    if let Some((b, c)) = next_stage(p, v, a, chunk) {
                        channels.entry((a, b)).or_default().push(Message { activation: true, mb, chunk: c });
                    }
                }
                Action::Backward { mb, chunk } | Action::BackwardInput { mb, chunk } => {
                    if let Some((b, c)) = prev_stage(p, a, chunk) {
                        channels.entry((a, b)).or_default().push(Message { activation: false, mb, chunk: c });
                    }
                }
                _ => {}
            }
        }
    }
    let mut out = Vec::with_capacity(p);
    for (b, order) in orders.iter().enumerate() {
        let mut cursor: HashMap<usize, usize> = HashMap::new();
        let mut list = Vec::with_capacity(order.len() * 3 + 1);
        // Receives from `from` up to and including `want`, in the channel's order.
        let mut receive = |list: &mut Vec<Action>, from: usize, want: Message| -> Result<(), ScheduleError> {
            let ch = channels.get(&(from, b)).map_or(&[][..], Vec::as_slice);
            let at = cursor.entry(from).or_insert(0);
            if ch[..*at].contains(&want) {
                return Ok(());
            }
            let Some(j) = ch[*at..].iter().position(|m| *m == want).map(|j| j + *at) else {
                return Err(ScheduleError::Arguments(format!(
                    "internal: rank {b} needs {want:?} from rank {from}, which never sends it"
                )));
            };
            for m in &ch[*at..=j] {
                list.push(if m.activation {
                    Action::RecvActivation { mb: m.mb, chunk: m.chunk, peer: from }
                } else {
                    Action::RecvGrad { mb: m.mb, chunk: m.chunk, peer: from }
                });
            }
            *at = j + 1;
            Ok(())
        };
        for act in order {
            match *act {
                Action::Forward { mb, chunk } => {
                    if let Some((from, _)) = prev_stage(p, b, chunk) {
                        receive(&mut list, from, Message { activation: true, mb, chunk })?;
                    }
                    list.push(*act);
                    if let Some((peer, _)) = next_stage(p, v, b, chunk) {
                        list.push(Action::SendActivation { mb, chunk, peer });
                    }
                }
                Action::Backward { mb, chunk } | Action::BackwardInput { mb, chunk } => {
                    if let Some((from, _)) = next_stage(p, v, b, chunk) {
                        receive(&mut list, from, Message { activation: false, mb, chunk })?;
                    }
                    list.push(*act);
                    if let Some((peer, _)) = prev_stage(p, b, chunk) {
                        list.push(Action::SendGrad { mb, chunk, peer });
                    }
                }
                other => list.push(other),
            }
        }
        list.push(Action::OptimizerStep);
        out.push(list);
    }
    Ok(out)
}

/// Messages still queued per channel, for the validator's deadlock report.
pub(crate) type Channels = HashMap<(usize, usize), VecDeque<Message>>;
