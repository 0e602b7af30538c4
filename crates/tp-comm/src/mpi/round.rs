//! [`Round`]: a set of nonblocking MPI messages posted together and waited on together, with
//! the group's deadline and abort check, and the buffers they point into.
//!
//! A round owns every buffer its requests read or write ([`Owned`]), so that no buffer is
//! freed while MPI may still touch it: if a round is dropped with requests still pending (an
//! error, a timeout, an unwaited [`Work`](crate::Work)), its requests and buffers move to a
//! process-wide list of orphans, which later rounds test and free as they complete.

use super::inner::{Inner, backoff};
use super::sys;
use crate::deadline::Deadline;
use crate::{CommError, Result};
use std::os::raw::{c_int, c_void};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tp_core::Tensor;

/// Largest single MPI message (counts are C `int`s); longer transfers go as several.
const MAX_MESSAGE: usize = 1 << 30;

/// A buffer a round's requests point into.
pub(crate) enum Owned {
    /// A host tensor (sent from, or received into while no one else holds it).
    Tensor(Tensor),
    /// A header's words.
    Words(Box<super::wire::Words>),
    /// Plain bytes (an abort notice).
    Bytes(Vec<u8>),
    /// A reusable receive buffer (8-byte aligned: any element type can be read from it) and
    /// the bytes of it in use ([`Inner::scratch`](super::comm::Inner::scratch)).
    Scratch(Vec<u64>, usize),
    /// A result being assembled: a `Vec<T>` (boxed as `Any`) whose spare capacity, at `ptr`
    /// for `len` bytes, the round's receives and the caller fill.
    Out(Box<dyn std::any::Any + Send>, *mut u8, usize),
}

/// A posted request and the peer at its other end.
struct Req {
    handle: sys::MPI_Request,
    peer: usize,
    recv: bool,
    done: bool,
}

/// Requests and buffers left by rounds that ended before their requests did.
struct Orphans(Vec<(Vec<Req>, Vec<Owned>)>);
// SAFETY: the request handles are only passed to MPI under the library's lock; the buffers
// are plain host memory no one else references.
unsafe impl Send for Orphans {}
static ORPHANS: Mutex<Orphans> = Mutex::new(Orphans(Vec::new()));

/// Messages of one step of a collective (or one point-to-point transfer).
pub(crate) struct Round {
    comm: Arc<Inner>,
    op: &'static str,
    reqs: Vec<Req>,
    owned: Vec<Owned>,
}

// SAFETY: request handles are opaque pointers used only under the MPI lock; the buffers are
// owned by the round.
unsafe impl Send for Round {}

impl Round {
    pub(crate) fn new(comm: &Arc<Inner>, op: &'static str) -> Round {
        Round { comm: comm.clone(), op, reqs: Vec::new(), owned: Vec::new() }
    }

    /// Keeps `o` alive for the round's requests; returns its index.
    pub(crate) fn keep(&mut self, o: Owned) -> usize {
        self.owned.push(o);
        self.owned.len() - 1
    }

    /// The buffer kept at `i`.
    pub(crate) fn owned(&self, i: usize) -> &Owned {
        &self.owned[i]
    }

    /// Whether every request of the round has completed.
    fn all_done(&self) -> bool {
        self.reqs.iter().all(|r| r.done)
    }

    /// Takes the buffer kept at `i` once every request is done (an empty placeholder stays).
    fn take(&mut self, i: usize) -> Option<Owned> {
        self.all_done().then(|| std::mem::replace(&mut self.owned[i], Owned::Bytes(Vec::new())))
    }

    /// Takes the tensor kept at `i` once every request is done.
    pub(crate) fn take_tensor(&mut self, i: usize) -> Option<Tensor> {
        match self.take(i)? {
            Owned::Tensor(t) => Some(t),
            _ => None,
        }
    }

    /// Takes the scratch buffer kept at `i` once every request is done.
    pub(crate) fn take_scratch(&mut self, i: usize) -> Option<Vec<u64>> {
        match self.take(i)? {
            Owned::Scratch(v, _) => Some(v),
            _ => None,
        }
    }

    /// Takes the result buffer kept at `i` once every request is done.
    pub(crate) fn take_out(&mut self, i: usize) -> Option<Box<dyn std::any::Any + Send>> {
        match self.take(i)? {
            Owned::Out(b, _, _) => Some(b),
            _ => None,
        }
    }

    /// The bytes in use of the scratch buffer kept at `i`, once every request is done.
    pub(crate) fn scratch(&self, i: usize) -> Option<&[u64]> {
        match (self.all_done(), &self.owned[i]) {
            (true, Owned::Scratch(v, bytes)) => Some(&v[..bytes.div_ceil(8)]),
            _ => None,
        }
    }

    /// Base pointer and length of buffer `i` (mutable: a receive target; the tensor must not be
    /// shared, which `Arc::make_mut` inside `as_bytes_mut` guarantees by copying otherwise).
    fn bytes(&mut self, i: usize) -> Result<(*mut u8, usize)> {
        match &mut self.owned[i] {
            Owned::Tensor(t) => {
                let b = t.as_bytes_mut().map_err(crate::error::tensor_err(self.op))?;
                Ok((b.as_mut_ptr(), b.len()))
            }
            Owned::Words(w) => Ok((w.as_mut_ptr().cast(), std::mem::size_of::<super::wire::Words>())),
            Owned::Bytes(b) => Ok((b.as_mut_ptr(), b.len())),
            Owned::Scratch(v, bytes) => Ok((v.as_mut_ptr().cast(), *bytes)),
            Owned::Out(_, ptr, len) => Ok((*ptr, *len)),
        }
    }

    /// Sends bytes `range` of buffer `i` to `peer` with `tag`.
    pub(crate) fn send(&mut self, peer: usize, tag: c_int, i: usize, range: std::ops::Range<usize>) -> Result<()> {
        let (ptr, len) = match &self.owned[i] {
            Owned::Tensor(t) => {
                let b = t.as_bytes().map_err(crate::error::tensor_err(self.op))?;
                (b.as_ptr().cast_mut(), b.len())
            }
            Owned::Words(w) => (w.as_ptr().cast::<u8>().cast_mut(), std::mem::size_of::<super::wire::Words>()),
            Owned::Bytes(b) => (b.as_ptr().cast_mut(), b.len()),
            Owned::Scratch(v, bytes) => (v.as_ptr().cast::<u8>().cast_mut(), *bytes),
            Owned::Out(_, ptr, len) => (*ptr, *len),
        };
        self.post(peer, tag, ptr, len, range, false)
    }

    /// Receives bytes `range` of buffer `i` from `peer` with `tag`.
    pub(crate) fn recv(&mut self, peer: usize, tag: c_int, i: usize, range: std::ops::Range<usize>) -> Result<()> {
        let (ptr, len) = self.bytes(i)?;
        self.post(peer, tag, ptr, len, range, true)
    }

    fn post(
        &mut self,
        peer: usize,
        tag: c_int,
        base: *mut u8,
        len: usize,
        range: std::ops::Range<usize>,
        recv: bool,
    ) -> Result<()> {
        assert!(range.start <= range.end && range.end <= len, "round: message range past its buffer");
        let inner = &self.comm;
        let peer_c = c_int::try_from(peer).map_err(|_| CommError::RankOutOfRange {
            op: self.op,
            rank: peer,
            world_size: inner.size,
        })?;
        let mut start = range.start;
        loop {
            let n = (range.end - start).min(MAX_MESSAGE);
            let mut handle: sys::MPI_Request = std::ptr::null_mut();
            let code = inner.call(self.op, |lib| {
                // SAFETY: `base + start .. + n` lies within a buffer this round owns (asserted
                // above), which outlives the request (the round, or the orphan list, keeps it);
                // the communicator is live; `n` fits in an int (MAX_MESSAGE).
                unsafe {
                    let p = base.add(start).cast::<c_void>();
                    if recv {
                        (lib.MPI_Irecv)(p, n as c_int, lib.byte, peer_c, tag, inner.comm.0, &mut handle)
                    } else {
                        (lib.MPI_Isend)(p, n as c_int, lib.byte, peer_c, tag, inner.comm.0, &mut handle)
                    }
                }
            })?;
            inner.mpi.check(self.op, code)?;
            self.reqs.push(Req { handle, peer, recv, done: false });
            start += n;
            if start >= range.end {
                return Ok(());
            }
        }
    }

    /// Tests every pending request once; whether all are done.
    pub(crate) fn test(&mut self) -> Result<bool> {
        let (comm, op) = (self.comm.clone(), self.op);
        let reqs = &mut self.reqs;
        comm.call(op, |lib| -> Result<bool> {
            let mut all = true;
            for r in reqs.iter_mut().filter(|r| !r.done) {
                let mut flag: c_int = 0;
                // SAFETY: `r.handle` is a request this round posted and that has not completed
                // (completion sets `done` and MPI nulls the handle).
                let code = unsafe { (lib.MPI_Test)(&mut r.handle, &mut flag, sys::MPI_STATUS_IGNORE) };
                comm.mpi.check(op, code)?;
                r.done = flag != 0;
                all &= r.done;
            }
            Ok(all)
        })?
    }

    /// Waits for every request until `deadline`, polling (and yielding the core between
    /// polls). Errors: [`CommError::Poisoned`] as soon as any rank of the group aborts it (or
    /// this rank's group was aborted); [`CommError::Timeout`] naming the peers whose messages
    /// had not arrived (or, if every receive is done, had not taken this rank's), after which
    /// the group is aborted so that the others stop waiting too.
    pub(crate) fn wait(&mut self, deadline: Deadline) -> Result<()> {
        reap(&self.comm);
        let started = Instant::now();
        let mut polls = 0u32;
        loop {
            if self.test()? {
                // A notice that arrived while these messages did (MPI_Iprobe only sees what
                // earlier progress has taken in): a group that failed elsewhere fails here too.
                return self.comm.check_poisoned(self.op);
            }
            self.comm.check_poisoned(self.op)?;
            if deadline.has_passed() {
                let pending = |recv: bool| {
                    let mut v: Vec<usize> =
                        self.reqs.iter().filter(|r| !r.done && r.recv == recv).map(|r| r.peer).collect();
                    v.dedup();
                    v
                };
                let missing = if pending(true).is_empty() { pending(false) } else { pending(true) };
                let err = CommError::Timeout {
                    op: self.op.to_string(),
                    rank: self.comm.rank,
                    missing,
                    waited: started.elapsed(),
                };
                self.comm.abort_with(&err.to_string());
                return Err(err);
            }
            backoff(&mut polls);
        }
    }
}

impl Drop for Round {
    fn drop(&mut self) {
        if self.all_done() {
            return;
        }
        let reqs = std::mem::take(&mut self.reqs).into_iter().filter(|r| !r.done).collect();
        let owned = std::mem::take(&mut self.owned);
        if let Ok(mut o) = ORPHANS.lock() {
            o.0.push((reqs, owned));
        } else {
            // A poisoned list: leak the buffers rather than free memory MPI may still use.
            std::mem::forget(owned);
        }
    }
}

/// Tests the orphans' requests and frees the buffers of those whose requests are all done.
fn reap(comm: &Arc<Inner>) {
    let Ok(mut orphans) = ORPHANS.lock() else { return };
    if orphans.0.is_empty() {
        return;
    }
    let _ = comm.call("reap", |lib| {
        orphans.0.retain_mut(|(reqs, _)| {
            reqs.retain_mut(|r| {
                let mut flag: c_int = 0;
                // SAFETY: a request posted by a dropped round and not yet completed.
                let code = unsafe { (lib.MPI_Test)(&mut r.handle, &mut flag, sys::MPI_STATUS_IGNORE) };
                code == sys::MPI_SUCCESS && flag == 0
            });
            !reqs.is_empty()
        });
    });
}
