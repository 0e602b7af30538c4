//! Pipeline schedules as data: for every pipeline rank, the list of [`Action`]s it runs in one
//! optimizer step.
//!
//! # Virtual stages
//!
//! `p` ranks, `m` micro-batches, `v` model chunks per rank (`v = 1` except for the interleaved
//! schedule). Chunk `c` on rank `s` is virtual stage `c·p + s` of `V = v·p` (Megatron-LM's
//! interleaving: with `p = 4, v = 2`, rank 0 holds stages 0 and 4, rank 3 stages 3 and 7).
//! Virtual stage 0 holds the embedding, stage `V - 1` the loss. The forward output of stage
//! `k` goes to stage `k + 1`: rank `s + 1`'s same chunk, or, from rank `p - 1`, rank 0's chunk
//! `c + 1`. Input gradients go the other way. Within a rank, `mb` and `chunk` name the work.
//!
//! # Actions and how they run
//!
//! Each rank runs its list in order. A send is posted and does not wait (it completes later);
//! a receive waits until its message has arrived. Messages from one rank to another are matched
//! first in, first out, as NCCL's are: the `k`-th send from `a` to `b` is the `k`-th receive at
//! `b` from `a`, and both name the same kind (activation or gradient), micro-batch and
//! consistent chunks (a send names the sender's chunk, a receive the receiver's). Each receive
//! comes right before the compute that needs it, each send right after the compute that
//! produced it. (Were a rank to need a peer's messages out of the order they are sent, the
//! receives of the earlier ones would come first; none of these schedules does, as the tests
//! check.) The first virtual stage's backward sends no gradient (the embedding's input gradient
//! goes nowhere); the last virtual stage's forward computes the loss and its gradient, so its
//! backward receives none. [`Action::OptimizerStep`] is every rank's last action, once. With
//! `p = 1` there are no sends or receives.
//!
//! Each schedule is generated in two steps: one function per kind gives each rank's order of
//! compute, then [`Schedule::new`] places the messages, and every schedule passes
//! [`validate`](super::validate()) before it is returned.
//!
//! # The orders, per rank `s`
//!
//! * **GPipe**: every forward, then every backward, in micro-batch order. Activations of all
//!   `m` micro-batches are held at once.
//! * **1F1B** (PipeDream-flush): `min(p - s - 1, m)` warm-up forwards, then one forward and one
//!   backward in turn, then the remaining backwards: at most `p - s` micro-batches in flight
//!   (forward done, backward not) on rank `s`.
//! * **Interleaved 1F1B** (Megatron-LM): the `m·v` forwards in groups of `p` micro-batches per
//!   chunk: the `k`-th forward is chunk `⌊k/p⌋ mod v` of micro-batch `⌊k/(p·v)⌋·p + k mod p`;
//!   the `k`-th backward the same with the chunks reversed (`v - 1 - ⌊k/p⌋ mod v`). Warm-up
//!   `min(2(p - s - 1) + (v - 1)·p, m·v)` forwards, then one forward and one backward in turn,
//!   then the remaining backwards. Needs `m` a multiple of `p` (Megatron-LM's rule) and
//!   `p >= 2`. Older Megatron-LM runs every forward first when `m = p`; this follows the
//!   formula there too (current Megatron-LM's `min`), with the same bubble. With `v = 1` it is
//!   still this formula (warm-up `2(p - s - 1)`, more memory than 1F1B for the same bubble).
//! * **ZB-H1** (Qi et al., *Zero Bubble Pipeline Parallelism*, handcrafted schedule H1): every
//!   backward split into its input gradient `B` ([`Action::BackwardInput`]), which the previous
//!   stage waits for, and its weight gradient `W` ([`Action::BackwardWeight`]), which nobody
//!   waits for. Forwards and `B`s keep 1F1B's order; the `W`s follow in micro-batch order, rank
//!   `s` holding back `s` of them: after the `B` of micro-batch `j` comes the `W` of
//!   micro-batch `j - s` (if `j >= s`), and the last `s` `W`s close the list, filling the
//!   cool-down's idle time. So every rank has at most `p - s` micro-batches between `F` and
//!   `B` (1F1B's) and at most `p` between `F` and `W` (1F1B's peak, that of rank 0), the
//!   paper's "same number of in-flight micro-batches on every stage".

use std::collections::HashMap;

/// One pipeline rank's action. `mb` is the micro-batch (`0..m`), `chunk` the model chunk on
/// this rank (`0..v`; virtual stage `chunk·p + rank`), `peer` the pipeline rank on the other end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(missing_docs)] // the fields are the three named above, the same in every variant
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
#[allow(missing_docs)] // each variant's fields are named in its documentation and message
pub enum ScheduleError {
    /// The arguments do not make a schedule.
    #[error("{0}")]
    Arguments(String),
    /// Rank `rank`'s action at `index` (`None` past the end of its list) breaks the rules.
    #[error("rank {rank}, action {index}{}: {why}", describe(action))]
    Action { rank: usize, index: usize, action: Option<Action>, why: String },
    /// The ranks wait for each other: what each stuck rank waits at.
    #[error("deadlock: {0}")]
    Deadlock(String),
}

/// ` (the action)`, or ` (end of the list)`.
fn describe(action: &Option<Action>) -> String {
    match action {
        Some(a) => format!(" ({a:?})"),
        None => " (end of the list)".into(),
    }
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
    /// Errors ([`ScheduleError::Arguments`], naming the argument): `stages`, `micro_batches` or
    /// `virtual_stages` zero; `virtual_stages > 1` for a kind other than interleaved;
    /// interleaved with `stages < 2` or with `micro_batches` not a multiple of `stages`
    /// (Megatron-LM's rule). A generated schedule that failed [`validate`](super::validate())
    /// would be a bug here, reported as that error.
    pub fn new(
        kind: ScheduleKind,
        stages: usize,
        micro_batches: usize,
        virtual_stages: usize,
    ) -> Result<Schedule, ScheduleError> {
        let (p, m, v) = (stages, micro_batches, virtual_stages);
        check_arguments(kind, p, m, v)?;
        if kind == ScheduleKind::Interleaved1F1B && m % p != 0 {
            return Err(ScheduleError::Arguments(format!(
                "the interleaved schedule needs micro_batches ({m}) to be a multiple of stages ({p}), as Megatron-LM's \
                 does (it orders the work in groups of `stages` micro-batches)"
            )));
        }
        let orders: Vec<Vec<Action>> = match kind {
            ScheduleKind::GPipe => (0..p).map(|_| gpipe(m)).collect(),
            ScheduleKind::OneFOneB => (0..p).map(|s| one_f_one_b(p, s, m)).collect(),
            ScheduleKind::Interleaved1F1B => (0..p).map(|s| interleaved(p, s, m, v)).collect(),
            ScheduleKind::ZeroBubbleH1 => (0..p).map(|s| zero_bubble_h1(p, s, m)).collect(),
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

/// The rules on the arguments that any schedule of `kind` keeps (the validator's too).
pub(crate) fn check_arguments(kind: ScheduleKind, p: usize, m: usize, v: usize) -> Result<(), ScheduleError> {
    let bad = |why: String| Err(ScheduleError::Arguments(why));
    for (name, value) in [("stages", p), ("micro_batches", m), ("virtual_stages", v)] {
        if value == 0 {
            return bad(format!("{name} must be at least 1 (got 0)"));
        }
    }
    if v > 1 && kind != ScheduleKind::Interleaved1F1B {
        return bad(format!("virtual_stages {v} needs the interleaved schedule, not {}", kind.name()));
    }
    if kind == ScheduleKind::Interleaved1F1B && p < 2 {
        return bad(format!("the interleaved schedule needs at least 2 stages (got {p})"));
    }
    Ok(())
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

/// ZB-H1's order on rank `s`: 1F1B's forwards and input gradients, each weight gradient
/// held back by `s` input gradients (see the module docs).
fn zero_bubble_h1(p: usize, s: usize, m: usize) -> Vec<Action> {
    let mut out = Vec::with_capacity(3 * m);
    let mut nw = 0;
    for a in one_f_one_b(p, s, m) {
        match a {
            Action::Backward { mb, chunk } => {
                out.push(Action::BackwardInput { mb, chunk });
                if mb >= s {
                    out.push(Action::BackwardWeight { mb: nw, chunk });
                    nw += 1;
                }
            }
            other => out.push(other),
        }
    }
    out.extend((nw..m).map(|mb| Action::BackwardWeight { mb, chunk: 0 }));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_virtual_stage_mapping_is_megatrons() {
        // p = 4, v = 2: rank s holds virtual stages s and s + 4; stage 3 (rank 3, chunk 0)
        // feeds stage 4 (rank 0, chunk 1); stage 7 is the last.
        let (p, v) = (4, 2);
        assert_eq!(next_stage(p, v, 0, 0), Some((1, 0)));
        assert_eq!(next_stage(p, v, 3, 0), Some((0, 1)));
        assert_eq!(next_stage(p, v, 3, 1), None);
        assert_eq!(prev_stage(p, 0, 1), Some((3, 0)));
        assert_eq!(prev_stage(p, 0, 0), None);
        for rank in 0..p {
            for chunk in 0..v {
                if let Some((r, c)) = next_stage(p, v, rank, chunk) {
                    assert_eq!(c * p + r, chunk * p + rank + 1);
                    assert_eq!(prev_stage(p, r, c), Some((rank, chunk)));
                }
            }
        }
        assert_eq!(next_stage(1, 1, 0, 0), None);
        assert_eq!(prev_stage(1, 0, 0), None);
    }

    #[test]
    fn messages_are_placed_around_their_compute() {
        let s = Schedule::new(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
        let (f, b) = (|mb| Action::Forward { mb, chunk: 0 }, |mb| Action::Backward { mb, chunk: 0 });
        let send_a = |mb| Action::SendActivation { mb, chunk: 0, peer: 1 };
        let recv_g = |mb| Action::RecvGrad { mb, chunk: 0, peer: 1 };
        let recv_a = |mb| Action::RecvActivation { mb, chunk: 0, peer: 0 };
        let send_g = |mb| Action::SendGrad { mb, chunk: 0, peer: 0 };
        let opt = Action::OptimizerStep;
        let want0 = [f(0), send_a(0), f(1), send_a(1), recv_g(0), b(0), recv_g(1), b(1), opt];
        assert_eq!(s.rank_actions(0), want0);
        let want1 = [recv_a(0), f(0), b(0), send_g(0), recv_a(1), f(1), b(1), send_g(1), opt];
        assert_eq!(s.rank_actions(1), want1);
        assert!(s.rank_actions(2).is_empty());
        assert_eq!(s.virtual_stage(1, 0), 1);
    }
}
