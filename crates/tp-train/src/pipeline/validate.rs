//! The one validator every schedule passes ([`validate`]).
//!
//! First each rank's list on its own:
//!
//! * the arguments keep [`Schedule::new`]'s rules (at least one stage, micro-batch and chunk;
//!   more than one chunk per rank only for the interleaved schedule), and there is one list per
//!   rank;
//! * every action's micro-batch is below `m` and its chunk below `v`;
//! * each `(mb, chunk)` has one forward and either one backward or one input-gradient and one
//!   weight-gradient half, in that order (the halves only in ZB-H1, and every backward split
//!   there);
//! * every send and receive names the rank of the neighbouring virtual stage (none before the
//!   first virtual stage's forward or after the last one's; see
//!   [`schedule`](super::schedule)'s mapping);
//! * the optimizer step comes last, once.
//!
//! Then all ranks run together as the executor runs them, without timing: a send is posted and
//! never blocks, a receive blocks until a message is at the head of the channel from its peer
//! (first in, first out, as NCCL's). The run must end with every rank done (else a deadlock,
//! naming what every stuck rank waits at), every received message the one the receiver names
//! (same kind, micro-batch and the receiver's chunk of the next or previous virtual stage),
//! every send after the compute that produced it, every compute after the receive of its input
//! (the forward of virtual stage `k + 1` uses the activation of stage `k`, the backward of stage
//! `k` the gradient of stage `k + 1`), and no message left unreceived. The errors name the
//! rank, the action's index in its list and why.

use super::schedule::{
    Action, Message, Schedule, ScheduleError, ScheduleKind, check_arguments, next_stage, prev_stage,
};
use std::collections::{HashMap, HashSet, VecDeque};

/// Checks `s` (see the module docs).
///
/// Errors: the first rule broken ([`ScheduleError::Action`], naming the rank, the action's
/// index and why; [`ScheduleError::Arguments`] for the arguments); or
/// [`ScheduleError::Deadlock`], naming the action every stuck rank waits at.
pub fn validate(s: &Schedule) -> Result<(), ScheduleError> {
    let p = s.stages;
    check_arguments(s.kind, p, s.micro_batches, s.virtual_stages)?;
    if s.actions.len() != p {
        return Err(ScheduleError::Arguments(format!("{} ranks' lists for {p} stages", s.actions.len())));
    }
    for (rank, list) in s.actions.iter().enumerate() {
        check_rank(s, rank, list)?;
    }
    run_together(s)
}

/// The messages posted from one rank to another, oldest first, each with its send's index in
/// the sender's list.
type Channels = HashMap<(usize, usize), VecDeque<(Message, usize)>>;

/// What one rank has done so far in [`run_together`].
#[derive(Default)]
struct RankState {
    arrived: HashSet<Message>,
    forwarded: HashSet<(usize, usize)>,
    backwarded: HashSet<(usize, usize)>,
}

/// Runs every rank's list, sends posted, receives blocking (see the module docs).
fn run_together(s: &Schedule) -> Result<(), ScheduleError> {
    let (p, v) = (s.stages, s.virtual_stages);
    let mut channels: Channels = HashMap::new();
    let mut at = vec![0usize; p];
    let mut state: Vec<RankState> = (0..p).map(|_| RankState::default()).collect();
    loop {
        let mut progressed = false;
        for rank in 0..p {
            while let Some(&a) = s.actions[rank].get(at[rank]) {
                let index = at[rank];
                let err = |why: String| ScheduleError::Action { rank, index, action: Some(a), why };
                let st = &mut state[rank];
                match a {
                    Action::RecvActivation { mb, chunk, peer } | Action::RecvGrad { mb, chunk, peer } => {
                        let want = Message { activation: matches!(a, Action::RecvActivation { .. }), mb, chunk };
                        let queue = channels.entry((peer, rank)).or_default();
                        let Some(&(head, sent_at)) = queue.front() else { break };
                        if head != want {
                            return Err(err(format!(
                                "receives {} but the next message from rank {peer} is {} (its action {sent_at}); \
                                 messages between two ranks arrive first in, first out",
                                show(&want),
                                show(&head)
                            )));
                        }
                        queue.pop_front();
                        if !st.arrived.insert(want) {
                            return Err(err("receives the same message twice".into()));
                        }
                    }
                    Action::SendActivation { mb, chunk, peer } => {
                        if !st.forwarded.contains(&(mb, chunk)) {
                            return Err(err("sends an activation before the forward that produces it".into()));
                        }
                        let (_, c) = next_stage(p, v, rank, chunk).expect("checked per rank");
                        let message = Message { activation: true, mb, chunk: c };
                        channels.entry((rank, peer)).or_default().push_back((message, index));
                    }
                    Action::SendGrad { mb, chunk, peer } => {
                        if !st.backwarded.contains(&(mb, chunk)) {
                            return Err(err("sends an input gradient before the backward that produces it".into()));
                        }
                        let (_, c) = prev_stage(p, rank, chunk).expect("checked per rank");
                        let message = Message { activation: false, mb, chunk: c };
                        channels.entry((rank, peer)).or_default().push_back((message, index));
                    }
                    Action::Forward { mb, chunk } => {
                        if prev_stage(p, rank, chunk).is_some()
                            && !st.arrived.contains(&Message { activation: true, mb, chunk })
                        {
                            return Err(err("runs before its input activation is received".into()));
                        }
                        st.forwarded.insert((mb, chunk));
                    }
                    Action::Backward { mb, chunk } | Action::BackwardInput { mb, chunk } => {
                        if next_stage(p, v, rank, chunk).is_some()
                            && !st.arrived.contains(&Message { activation: false, mb, chunk })
                        {
                            return Err(err("runs before its output gradient is received".into()));
                        }
                        st.backwarded.insert((mb, chunk));
                    }
                    Action::BackwardWeight { .. } | Action::OptimizerStep => {}
                }
                at[rank] += 1;
                progressed = true;
            }
        }
        if at.iter().enumerate().all(|(r, &i)| i == s.actions[r].len()) {
            break;
        }
        if !progressed {
            let stuck: Vec<String> = (0..p)
                .filter(|&r| at[r] < s.actions[r].len())
                .map(|r| format!("rank {r} waits at action {} ({:?})", at[r], s.actions[r][at[r]]))
                .collect();
            return Err(ScheduleError::Deadlock(format!(
                "{}; no rank can go on (each waits for a message that is sent only after it)",
                stuck.join("; ")
            )));
        }
    }
    let mut left: Vec<_> = channels.iter().filter_map(|(&(a, b), q)| Some((a, b, *q.front()?, q.len()))).collect();
    left.sort_by_key(|&(a, b, (_, i), _)| (a, i, b));
    if let Some(&(a, b, (message, index), n)) = left.first() {
        return Err(ScheduleError::Action {
            rank: a,
            index,
            action: s.actions[a].get(index).copied(),
            why: format!("sends {} that rank {b} never receives ({n} message(s) left)", show(&message)),
        });
    }
    Ok(())
}

/// A message in words.
fn show(m: &Message) -> String {
    let what = if m.activation { "the activation" } else { "the gradient" };
    format!("{what} of micro-batch {} for chunk {}", m.mb, m.chunk)
}

/// The rules one rank's list keeps on its own.
fn check_rank(s: &Schedule, rank: usize, list: &[Action]) -> Result<(), ScheduleError> {
    let (p, m, v) = (s.stages, s.micro_batches, s.virtual_stages);
    let split = s.kind == ScheduleKind::ZeroBubbleH1;
    let err = |index: usize, why: String| ScheduleError::Action { rank, index, action: list.get(index).copied(), why };
    // Per (mb, chunk): the index of the forward, backward, input and weight halves.
    let mut seen: HashMap<(usize, usize), [Option<usize>; 4]> = HashMap::new();
    let mut optimizer = None;
    for (i, &a) in list.iter().enumerate() {
        if optimizer.is_some() {
            return Err(err(i, "comes after the optimizer step".into()));
        }
        let (mb, chunk) = match a {
            Action::OptimizerStep => {
                optimizer = Some(i);
                continue;
            }
            Action::Forward { mb, chunk }
            | Action::Backward { mb, chunk }
            | Action::BackwardInput { mb, chunk }
            | Action::BackwardWeight { mb, chunk }
            | Action::SendActivation { mb, chunk, .. }
            | Action::RecvActivation { mb, chunk, .. }
            | Action::SendGrad { mb, chunk, .. }
            | Action::RecvGrad { mb, chunk, .. } => (mb, chunk),
        };
        if mb >= m {
            return Err(err(i, format!("micro-batch {mb} is out of range (there are {m})")));
        }
        if chunk >= v {
            return Err(err(i, format!("chunk {chunk} is out of range (there are {v} per rank)")));
        }
        let peer_ok = |want: Option<(usize, usize)>, peer: usize, what: &str| match want {
            Some((r, _)) if r == peer => Ok(()),
            Some((r, _)) => Err(err(i, format!("{what} rank {peer}, but that stage's peer is rank {r}"))),
            None => {
                Err(err(i, format!("{what} rank {peer}, but virtual stage {} has no such neighbour", chunk * p + rank)))
            }
        };
        let slot = match a {
            Action::Forward { .. } => 0,
            Action::Backward { .. } if split => {
                return Err(err(i, "a whole backward in ZB-H1, which splits every backward".into()));
            }
            Action::Backward { .. } => 1,
            Action::BackwardInput { .. } | Action::BackwardWeight { .. } if !split => {
                return Err(err(i, format!("a split backward in {}, which runs whole backwards", s.kind.name())));
            }
            Action::BackwardInput { .. } => 2,
            Action::BackwardWeight { .. } => 3,
            Action::SendActivation { peer, .. } => {
                peer_ok(next_stage(p, v, rank, chunk), peer, "sends an activation to")?;
                continue;
            }
            Action::RecvActivation { peer, .. } => {
                peer_ok(prev_stage(p, rank, chunk), peer, "receives an activation from")?;
                continue;
            }
            Action::SendGrad { peer, .. } => {
                peer_ok(prev_stage(p, rank, chunk), peer, "sends a gradient to")?;
                continue;
            }
            Action::RecvGrad { peer, .. } => {
                peer_ok(next_stage(p, v, rank, chunk), peer, "receives a gradient from")?;
                continue;
            }
            Action::OptimizerStep => unreachable!("handled above"),
        };
        let e = seen.entry((mb, chunk)).or_default();
        if e[slot].is_some() {
            return Err(err(i, "runs twice".into()));
        }
        match slot {
            1 | 2 if e[0].is_none() => return Err(err(i, "a backward before its forward".into())),
            3 if e[2].is_none() => return Err(err(i, "a weight gradient before its input gradient".into())),
            _ => {}
        }
        e[slot] = Some(i);
    }
    if optimizer.is_none() {
        return Err(err(list.len(), "no optimizer step".into()));
    }
    for mb in 0..m {
        for chunk in 0..v {
            let e = seen.get(&(mb, chunk)).copied().unwrap_or_default();
            let missing = match e {
                [None, ..] => Some("forward"),
                [_, None, _, _] if !split => Some("backward"),
                [_, _, None, _] if split => Some("input gradient"),
                [_, _, _, None] if split => Some("weight gradient"),
                _ => None,
            };
            if let Some(what) = missing {
                return Err(ScheduleError::Action {
                    rank,
                    index: list.len(),
                    action: None,
                    why: format!("micro-batch {mb} of chunk {chunk} has no {what}"),
                });
            }
        }
    }
    Ok(())
}
