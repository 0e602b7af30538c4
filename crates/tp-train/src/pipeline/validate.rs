//! The one validator every schedule passes ([`validate`]).
//!
//! It checks each rank's list on its own (indices in range; each micro-batch's forward once
//! and its backward once, or its input and weight halves once each, in that order; the
//! optimizer step last; sends and receives naming the right peer), then runs all ranks together
//! as the executor does, without timing: a send is posted and never blocks, a receive blocks
//! until its message is at the head of the channel from its peer (first in, first out, as
//! NCCL). The run must end with every rank done, every received message the one the receiver
//! names, every compute finding its input there (the forward of virtual stage `k + 1` uses the
//! activation of stage `k`, the backward of stage `k` the gradient of stage `k + 1`), and no
//! message left unreceived; else the error names the rank, the action and why, or the ranks
//! that wait for each other.

use super::schedule::{Action, Channels, Message, Schedule, ScheduleError, next_stage, prev_stage};
use std::collections::{HashMap, HashSet};

/// Checks `s` (see the module docs).
///
/// Errors: the first rule broken, naming the rank and the action's index; a deadlock, naming
/// what every stuck rank waits for.
pub fn validate(s: &Schedule) -> Result<(), ScheduleError> {
    let (p, m, v) = (s.stages, s.micro_batches, s.virtual_stages);
    if s.actions.len() != p {
        return Err(ScheduleError::Arguments(format!("{} ranks' lists for {p} stages", s.actions.len())));
    }
    for (rank, list) in s.actions.iter().enumerate() {
        check_rank(s, rank, list)?;
    }
    // Run all ranks together.
    let mut channels: Channels = HashMap::new();
    let mut at = vec![0usize; p];
    let mut state: Vec<RankState> = (0..p).map(|_| RankState::default()).collect();
    loop {
        let mut progressed = false;
        for rank in 0..p {
            while let Some(&a) = s.actions[rank].get(at[rank]) {
                let err = |why: String| ScheduleError::Action { rank, index: at[rank], action: Some(a), why };
                let st = &mut state[rank];
                match a {
                    Action::RecvActivation { mb, chunk, peer } | Action::RecvGrad { mb, chunk, peer } => {
                        let want = Message { activation: matches!(a, Action::RecvActivation { .. }), mb, chunk };
                        let queue = channels.entry((peer, rank)).or_default();
                        let Some(head) = queue.front().copied() else { break };
                        if head != want {
                            return Err(err(format!(
                                "receives {want:?} but the next message from rank {peer} is {head:?} (first in, first out)"
                            )));
                        }
                        queue.pop_front();
                        if !st.arrived.insert(want) {
                            return Err(err("received twice".into()));
                        }
                    }
                    Action::SendActivation { mb, chunk, peer } => {
                        if !st.forwarded.contains(&(mb, chunk)) {
                            return Err(err("sends an activation its forward has not produced".into()));
                        }
                        let (to, c) = next_stage(p, v, rank, chunk).expect("checked per rank");
                        debug_assert_eq!(to, peer);
                        channels.entry((rank, peer)).or_default().push_back(Message { activation: true, mb, chunk: c });
                    }
                    Action::SendGrad { mb, chunk, peer } => {
                        if !st.backwarded.contains(&(mb, chunk)) {
                            return Err(err("sends an input gradient its backward has not produced".into()));
                        }
                        let (to, c) = prev_stage(p, rank, chunk).expect("checked per rank");
                        debug_assert_eq!(to, peer);
                        channels.entry((rank, peer)).or_default().push_back(Message {
                            activation: false,
                            mb,
                            chunk: c,
                        });
                    }
                    Action::Forward { mb, chunk } => {
                        if prev_stage(p, rank, chunk).is_some()
                            && !st.arrived.contains(&Message { activation: true, mb, chunk })
                        {
                            return Err(err("runs before its input activation was received".into()));
                        }
                        st.forwarded.insert((mb, chunk));
                    }
                    Action::Backward { mb, chunk } | Action::BackwardInput { mb, chunk } => {
                        if next_stage(p, v, rank, chunk).is_some()
                            && !st.arrived.contains(&Message { activation: false, mb, chunk })
                        {
                            return Err(err("runs before its output gradient was received".into()));
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
            return Err(ScheduleError::Deadlock(stuck.join("; ")));
        }
    }
    if let Some(((a, b), q)) = channels.iter().find(|(_, q)| !q.is_empty()) {
        return Err(ScheduleError::Action {
            rank: *a,
            index: 0,
            action: None,
            why: format!("sends {} message(s) to rank {b} that it never receives ({:?})", q.len(), q.front()),
        });
    }
    let _ = m;
    Ok(())
}

#[derive(Default)]
struct RankState {
    arrived: HashSet<Message>,
    forwarded: HashSet<(usize, usize)>,
    backwarded: HashSet<(usize, usize)>,
}

/// The rules one rank's list must keep on its own.
fn check_rank(s: &Schedule, rank: usize, list: &[Action]) -> Result<(), ScheduleError> {
    let (p, m, v) = (s.stages, s.micro_batches, s.virtual_stages);
    let err = |index: usize, why: String| ScheduleError::Action { rank, index, action: list.get(index).copied(), why };
    // Per (mb, chunk): index of the forward, backward, input and weight halves.
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
        if mb >= m || chunk >= v {
            return Err(err(i, format!("micro-batch {mb} or chunk {chunk} is out of range ({m} x {v})")));
        }
        let peer_ok = |want: Option<(usize, usize)>, peer: usize, what: &str| match want {
            Some((r, _)) if r == peer => Ok(()),
            Some((r, _)) => Err(err(i, format!("{what} rank {peer}, but that stage's peer is rank {r}"))),
            None => Err(err(i, format!("{what} rank {peer}, but this virtual stage has no such neighbour"))),
        };
        let slot = match a {
            Action::Forward { .. } => 0,
            Action::Backward { .. } => 1,
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
            1 if e[2].is_some() => return Err(err(i, "a whole backward after an input-gradient half".into())),
            2 if e[1].is_some() => return Err(err(i, "an input-gradient half after a whole backward".into())),
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
            let whole = e[0].is_some() && (e[1].is_some() || (e[2].is_some() && e[3].is_some()));
            if !whole {
                return Err(ScheduleError::Action {
                    rank,
                    index: list.len(),
                    action: None,
                    why: format!("micro-batch {mb} of chunk {chunk} lacks its forward or backward"),
                });
            }
        }
    }
    Ok(())
}
