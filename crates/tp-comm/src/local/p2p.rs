//! Point-to-point messages between the threads of a [`LocalGroup`](super::LocalGroup):
//! pipeline stages sending activations and gradients to their neighbours.
//!
//! Messages from `src` to `dst` are numbered in the order they are sent and received: the
//! `k`-th send from `src` to `dst` matches the `k`-th receive at `dst` from `src` (NCCL's
//! rule), whatever the order in which the pending [`Work`]s are waited for. A send deposits a
//! reference-counted clone of a host tensor (a CUDA tensor is copied to the host) in a mailbox
//! kept apart from the collectives' exchanges, so messages in flight never disturb them. The
//! receiver checks the dims and dtype it expects; a mismatch is a [`CommError::Mismatch`] on
//! both sides (the sender's wait returns it too). A send completes when its receiver has taken
//! the message. Every wait has the group's deadline: a receive whose sender never sends, or a
//! send nobody receives, returns [`CommError::Timeout`] naming the peer and poisons the group
//! (so every other rank stops too); a poisoned group fails pending sends and receives within
//! a few milliseconds.

use super::Member;
use crate::error::{CommError, Result, tensor_err};
use crate::work::PendingWork;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tp_core::{DType, Device, Tensor};

/// How often a waiting send or receive looks at the group's poison flag.
const POLL: Duration = Duration::from_millis(5);

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
    /// Messages sent and not yet received.
    waiting: HashMap<Key, Tensor>,
    /// What the receiver said of each taken message (for the sender's wait): `None` when it
    /// matched, else why not.
    outcome: HashMap<Key, Option<String>>,
    /// Messages sent / receives posted so far per `(src, dst)`.
    sent: HashMap<(usize, usize), u64>,
    posted: HashMap<(usize, usize), u64>,
    /// Receives dropped before their message arrived: it is taken (and discarded) on arrival,
    /// so its sender completes, as a posted NCCL receive completes whether or not anyone waits.
    abandoned: std::collections::HashSet<Key>,
    /// Sends dropped before their receiver took them: no outcome is kept for them.
    orphaned: std::collections::HashSet<Key>,
}

impl Boxes {
    /// Records the receiver's word on message `key` for its sender (unless the send was dropped).
    fn answer(&mut self, key: Key, why: Option<String>) {
        if !self.orphaned.remove(&key) {
            self.outcome.insert(key, why);
        }
    }
}

impl Mailboxes {
    fn lock(&self) -> MutexGuard<'_, Boxes> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The shape a receive expects.
fn describe(dims: &[usize], dtype: DType) -> String {
    format!("{dims:?} {dtype}")
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

    fn check_poison(&self, op: &'static str) -> Result<()> {
        if self.shared.poisoned.load(Ordering::Acquire) {
            let reason = self.shared.lock().poisoned.clone().unwrap_or_default();
            return Err(CommError::Poisoned { op: op.into(), reason });
        }
        Ok(())
    }

    /// A timeout naming `peer`, after poisoning the group with the same reason.
    fn p2p_timeout(&self, op: &'static str, peer: usize, what: &str) -> CommError {
        let reason = format!("rank {} timed out after {:?} in {op} {what} rank {peer}", self.rank, self.shared.timeout);
        self.shared.poison(reason);
        self.shared.mailboxes.changed.notify_all();
        CommError::Timeout { op: op.into(), rank: self.rank, missing: vec![peer], waited: self.shared.timeout }
    }

    /// Posts `x` to `dst`; the work completes once `dst` has received it.
    pub(super) fn send(&self, x: &Tensor, dst: usize) -> Result<SendWork> {
        const OP: &str = "send";
        self.check_peer(OP, dst)?;
        self.check_poison(OP)?;
        let x =
            if x.device() == Device::Cpu { x.clone() } else { x.to_device(&Device::Cpu).map_err(tensor_err(OP))? };
        let mb = &self.shared.mailboxes;
        let mut st = mb.lock();
        let k = st.sent.entry((self.rank, dst)).or_insert(0);
        let key = (self.rank, dst, *k);
        *k += 1;
        if st.abandoned.remove(&key) {
            st.answer(key, None); // its receive was dropped: delivered to nobody, complete
        } else {
            st.waiting.insert(key, x.clone());
        }
        drop(st);
        mb.changed.notify_all();
        let deadline = Instant::now() + self.shared.timeout;
        Ok(SendWork { member: self.clone(), key, tensor: x, deadline, waited: false })
    }

    /// Posts a receive of a `dims`/`dtype` tensor from `src`.
    pub(super) fn recv(&self, dims: &[usize], dtype: DType, src: usize) -> Result<RecvWork> {
        const OP: &str = "recv";
        self.check_peer(OP, src)?;
        self.check_poison(OP)?;
        let mut st = self.shared.mailboxes.lock();
        let k = st.posted.entry((src, self.rank)).or_insert(0);
        let key = (src, self.rank, *k);
        *k += 1;
        Ok(RecvWork {
            member: self.clone(),
            key,
            dims: dims.to_vec(),
            dtype,
            deadline: Instant::now() + self.shared.timeout,
            waited: false,
        })
    }
}

/// A send in flight.
pub(super) struct SendWork {
    member: Member,
    key: Key,
    tensor: Tensor,
    deadline: Instant,
    /// Whether `wait` ran (else dropping it forgets its outcome).
    waited: bool,
}

impl Drop for SendWork {
    fn drop(&mut self) {
        if !self.waited {
            let mut st = self.member.shared.mailboxes.lock();
            if st.outcome.remove(&self.key).is_none() {
                st.orphaned.insert(self.key);
            }
        }
    }
}

impl PendingWork for SendWork {
    fn is_done(&mut self) -> bool {
        self.member.shared.mailboxes.lock().outcome.contains_key(&self.key)
    }

    /// The sent tensor, once the receiver took it.
    fn wait(mut self: Box<Self>) -> Result<Tensor> {
        const OP: &str = "send";
        self.waited = true;
        let m = &self.member;
        let mb = &m.shared.mailboxes;
        let mut st = mb.lock();
        loop {
            if let Some(out) = st.outcome.remove(&self.key) {
                return match out {
                    None => Ok(self.tensor.clone()),
                    Some(why) => Err(CommError::Mismatch { op: "send/recv".into(), why }),
                };
            }
            drop(st);
            m.check_poison(OP)?;
            let now = Instant::now();
            if now >= self.deadline {
                return Err(m.p2p_timeout(OP, self.key.1, "waiting for its message to be received by"));
            }
            st = mb.lock();
            if st.outcome.contains_key(&self.key) {
                continue;
            }
            st = mb.changed.wait_timeout(st, POLL.min(self.deadline - now)).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

/// A receive in flight. Dropped without waiting, it still takes its message (discarding it),
/// so that the sender completes and later messages keep their order.
pub(super) struct RecvWork {
    member: Member,
    key: Key,
    dims: Vec<usize>,
    dtype: DType,
    deadline: Instant,
    /// Whether `wait` ran.
    waited: bool,
}

impl Drop for RecvWork {
    fn drop(&mut self) {
        if self.waited {
            return;
        }
        let mb = &self.member.shared.mailboxes;
        let mut st = mb.lock();
        if st.waiting.remove(&self.key).is_some() {
            st.answer(self.key, None);
            drop(st);
            mb.changed.notify_all();
        } else {
            st.abandoned.insert(self.key);
        }
    }
}

impl PendingWork for RecvWork {
    fn is_done(&mut self) -> bool {
        self.member.shared.mailboxes.lock().waiting.contains_key(&self.key)
    }

    /// The received tensor, on the host.
    fn wait(mut self: Box<Self>) -> Result<Tensor> {
        const OP: &str = "recv";
        self.waited = true;
        let m = &self.member;
        let mb = &m.shared.mailboxes;
        let mut st = mb.lock();
        loop {
            if let Some(t) = st.waiting.remove(&self.key) {
                let ok = t.dims() == self.dims.as_slice() && t.dtype() == self.dtype;
                let why = (!ok).then(|| {
                    format!(
                        "rank {} sent {} but rank {} expected {}",
                        self.key.0,
                        describe(t.dims(), t.dtype()),
                        self.key.1,
                        describe(&self.dims, self.dtype)
                    )
                });
                st.answer(self.key, why.clone());
                drop(st);
                mb.changed.notify_all();
                return match why {
                    None => Ok(t),
                    Some(why) => Err(CommError::Mismatch { op: "send/recv".into(), why }),
                };
            }
            drop(st);
            m.check_poison(OP)?;
            let now = Instant::now();
            if now >= self.deadline {
                return Err(m.p2p_timeout(OP, self.key.0, "waiting for a message from"));
            }
            st = mb.lock();
            if st.waiting.contains_key(&self.key) {
                continue;
            }
            st = mb.changed.wait_timeout(st, POLL.min(self.deadline - now)).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}
