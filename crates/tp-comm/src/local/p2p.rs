//! Point-to-point messages between the threads of a [`LocalGroup`](super::LocalGroup):
//! pipeline stages sending activations and gradients to their neighbours.
//!
//! Matching: messages from `src` to `dst` are numbered in the order they are sent, receives at
//! `dst` from `src` in the order they are posted, and the `k`-th send matches the `k`-th receive
//! (NCCL's rule), whatever the order in which the pending [`Work`](crate::Work)s are waited for.
//! A send and its receive are matched as soon as both are posted, by whichever call comes
//! second: the receiver's dims and dtype are checked then, and both sides' works complete then,
//! with the tensor or a [`CommError::Mismatch`] naming both shapes. So a send completes once its
//! receive is posted, even before the receiver waits (as a posted NCCL receive completes on its
//! own), and a work dropped unwaited still counts: its message is matched and discarded.
//!
//! Nothing is copied and sends never block: a message is a reference-counted clone of the
//! sender's tensor (host storage is copy-on-write, device buffers are immutable, so the sender
//! may go on writing its tensor), kept in mailboxes apart from the collectives' exchanges, so
//! messages in flight never disturb collectives. A CUDA tensor stays on its GPU: the receiver
//! gets it where the sender had it ([`DeviceGroup::recv`](crate::DeviceGroup::recv) moves it to
//! its own device: nothing when the ranks share a GPU, through the host otherwise).
//!
//! Every wait has the group's deadline, counted from the send or receive call: a receive whose
//! sender never sends, or a send nobody receives, returns [`CommError::Timeout`] naming the peer
//! and poisons the group (so every other rank stops too); a poisoned group (a failed or aborted
//! rank) wakes pending sends and receives at once and fails them with its reason.

use super::Member;
use crate::deadline::Deadline;
use crate::error::{CommError, Result};
use crate::work::PendingWork;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tp_core::{DType, Tensor};

/// Longest a waiting send or receive sleeps between looks at its state (a backstop: matches
/// and poisoning wake it at once).
const POLL: Duration = Duration::from_millis(50);

/// `(src, dst, k)`: the `k`-th message from `src` to `dst`.
type Key = (usize, usize, u64);

/// The mailboxes of one group.
#[derive(Default)]
pub(super) struct Mailboxes {
    state: Mutex<Boxes>,
    changed: Condvar,
}

#[derive(Default)]
struct Boxes {
    /// Messages sent whose receive is not posted yet.
    unmatched_sends: HashMap<Key, Tensor>,
    /// Receives posted whose message is not sent yet: the dims and dtype they expect.
    unmatched_recvs: HashMap<Key, (Vec<usize>, DType)>,
    /// Matched messages for the receivers' waits: the tensor, or why it did not match.
    delivered: HashMap<Key, std::result::Result<Tensor, String>>,
    /// Matched messages for the senders' waits: `None` when it matched, else why not.
    outcome: HashMap<Key, Option<String>>,
    /// Works dropped unwaited before their match: nothing is kept for them once matched.
    dropped_sends: HashSet<Key>,
    dropped_recvs: HashSet<Key>,
    /// Messages sent / receives posted so far per `(src, dst)`.
    sent: HashMap<(usize, usize), u64>,
    posted: HashMap<(usize, usize), u64>,
}

impl Boxes {
    /// Matches message `key`, `t`, with its receive, which expects `dims` and `dtype`: the
    /// result for each side's wait (unless that side's work was dropped).
    fn matched(&mut self, key: Key, t: Tensor, dims: &[usize], dtype: DType) {
        let why = (t.dims() != dims || t.dtype() != dtype).then(|| {
            format!(
                "rank {} sent {} but rank {} expected {}",
                key.0,
                describe(t.dims(), t.dtype()),
                key.1,
                describe(dims, dtype)
            )
        });
        if !self.dropped_sends.remove(&key) {
            self.outcome.insert(key, why.clone());
        }
        if !self.dropped_recvs.remove(&key) {
            self.delivered.insert(key, why.map_or(Ok(t), Err));
        }
    }
}

impl Mailboxes {
    fn lock(&self) -> MutexGuard<'_, Boxes> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes every waiting send and receive (the group was poisoned). Taking the lock first
    /// means a waiter that saw the group healthy under the lock is already parked, so it gets
    /// this notification.
    pub(super) fn wake(&self) {
        drop(self.lock());
        self.changed.notify_all();
    }
}

/// A message's shape, as errors name it.
fn describe(dims: &[usize], dtype: DType) -> String {
    format!("{dims:?} {dtype}")
}

/// The side of a message a pending work is.
#[derive(Clone, Copy)]
enum Side {
    Send,
    Recv,
}

impl Member {
    fn check_peer(&self, op: &'static str, peer: usize) -> Result<()> {
        let world = self.shared.world;
        if peer >= world {
            return Err(CommError::RankOutOfRange { op, rank: peer, world_size: world });
        }
        if peer == self.rank {
            return Err(CommError::Mismatch {
                op: op.into(),
                why: format!("rank {peer} cannot send to or receive from itself"),
            });
        }
        Ok(())
    }

    fn is_poisoned(&self) -> bool {
        self.shared.poisoned.load(Ordering::Acquire)
    }

    /// The error of a poisoned group, with its reason.
    fn poisoned_err(&self, op: &'static str) -> CommError {
        let reason = self.shared.lock().poisoned.clone().unwrap_or_default();
        CommError::Poisoned { op: op.into(), reason }
    }

    /// Posts `x` to `dst` (a clone: nothing is copied); the work completes once `dst` has
    /// posted the matching receive.
    pub(super) fn send(&self, x: &Tensor, dst: usize) -> Result<P2pWork> {
        const OP: &str = "send";
        self.check_peer(OP, dst)?;
        if self.is_poisoned() {
            return Err(self.poisoned_err(OP));
        }
        let deadline = Deadline::after(self.shared.timeout).instant();
        let mb = &self.shared.mailboxes;
        let mut st = mb.lock();
        let k = st.sent.entry((self.rank, dst)).or_insert(0);
        let key = (self.rank, dst, *k);
        *k += 1;
        match st.unmatched_recvs.remove(&key) {
            Some((dims, dtype)) => {
                st.matched(key, x.clone(), &dims, dtype);
                drop(st);
                mb.changed.notify_all();
            }
            None => {
                st.unmatched_sends.insert(key, x.clone());
            }
        }
        Ok(P2pWork { member: self.clone(), key, side: Side::Send, sent: Some(x.clone()), deadline, waited: false })
    }

    /// Posts a receive of a `dims`/`dtype` tensor from `src`.
    pub(super) fn recv(&self, dims: &[usize], dtype: DType, src: usize) -> Result<P2pWork> {
        const OP: &str = "recv";
        self.check_peer(OP, src)?;
        if self.is_poisoned() {
            return Err(self.poisoned_err(OP));
        }
        let deadline = Deadline::after(self.shared.timeout).instant();
        let mb = &self.shared.mailboxes;
        let mut st = mb.lock();
        let k = st.posted.entry((src, self.rank)).or_insert(0);
        let key = (src, self.rank, *k);
        *k += 1;
        match st.unmatched_sends.remove(&key) {
            Some(t) => {
                st.matched(key, t, dims, dtype);
                drop(st);
                mb.changed.notify_all();
            }
            None => {
                st.unmatched_recvs.insert(key, (dims.to_vec(), dtype));
            }
        }
        Ok(P2pWork { member: self.clone(), key, side: Side::Recv, sent: None, deadline, waited: false })
    }
}

/// A send or a receive in flight.
pub(super) struct P2pWork {
    member: Member,
    key: Key,
    side: Side,
    /// The sender's tensor (what a send's wait returns).
    sent: Option<Tensor>,
    deadline: Instant,
    /// Whether `wait` ran (else dropping it tells the mailboxes to keep nothing for it).
    waited: bool,
}

impl P2pWork {
    /// This side's result, if the message has been matched (taken out of the mailboxes).
    fn take(&mut self, st: &mut Boxes) -> Option<Result<Tensor>> {
        let mismatch = |why| CommError::Mismatch { op: "send/recv".into(), why };
        match self.side {
            Side::Send => {
                let why = st.outcome.remove(&self.key)?;
                Some(match why {
                    None => self.sent.take().ok_or_else(|| mismatch("the send was waited for twice".into())),
                    Some(why) => Err(mismatch(why)),
                })
            }
            Side::Recv => Some(st.delivered.remove(&self.key)?.map_err(mismatch)),
        }
    }

    fn has_result(&self, st: &Boxes) -> bool {
        match self.side {
            Side::Send => st.outcome.contains_key(&self.key),
            Side::Recv => st.delivered.contains_key(&self.key),
        }
    }

    /// The timeout of this work, naming its peer, after poisoning the group with the reason.
    fn timeout(&self) -> CommError {
        let m = &self.member;
        let (op, peer, what) = match self.side {
            Side::Send => ("send", self.key.1, "waiting for its message to be received by"),
            Side::Recv => ("recv", self.key.0, "waiting for a message from"),
        };
        let sh = &m.shared;
        sh.poison(format!("rank {} timed out after {:?} in {op} {what} rank {peer}", m.rank, sh.timeout));
        CommError::Timeout { op: op.into(), rank: m.rank, missing: vec![peer], waited: sh.timeout }
    }
}

impl PendingWork for P2pWork {
    fn is_done(&mut self) -> bool {
        let m = &self.member;
        self.has_result(&m.shared.mailboxes.lock()) || m.is_poisoned() || Instant::now() >= self.deadline
    }

    /// A send: the sender's `x`, once its receive was posted. A receive: the tensor, where the
    /// sender had it.
    fn wait(mut self: Box<Self>) -> Result<Tensor> {
        self.waited = true;
        let m = self.member.clone();
        let mb = &m.shared.mailboxes;
        let op = match self.side {
            Side::Send => "send",
            Side::Recv => "recv",
        };
        let mut st = mb.lock();
        loop {
            if let Some(r) = self.take(&mut st) {
                return r;
            }
            // Checked under the mailbox lock, which `Mailboxes::wake` takes after poisoning:
            // no wake-up is lost between this check and the wait below.
            if m.is_poisoned() {
                drop(st);
                return Err(m.poisoned_err(op));
            }
            let now = Instant::now();
            if now >= self.deadline {
                drop(st);
                return Err(self.timeout());
            }
            st = mb.changed.wait_timeout(st, POLL.min(self.deadline - now)).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

impl Drop for P2pWork {
    /// Unwaited work still counts: once matched, nothing is kept for it (the message of a
    /// dropped receive is discarded; its sender completes all the same).
    fn drop(&mut self) {
        if self.waited {
            return;
        }
        let mut st = self.member.shared.mailboxes.lock();
        let (kept, dropped) = match self.side {
            Side::Send => (st.outcome.remove(&self.key).is_some(), &mut st.dropped_sends),
            Side::Recv => (st.delivered.remove(&self.key).is_some(), &mut st.dropped_recvs),
        };
        if !kept {
            dropped.insert(self.key);
        }
    }
}
