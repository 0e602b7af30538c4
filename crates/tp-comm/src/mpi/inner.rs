//! [`Inner`]: what every round and work of one MPI communicator shares: the handle, this
//! rank's place, the deadline, the collectives' sequence number, the group's failure (and the
//! abort notices that carry it between ranks), and the pool of receive buffers.

use super::sys;
use super::{Mpi, is_finalized};
use crate::deadline::Deadline;
use crate::{CommError, Result};
use std::os::raw::c_int;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

/// The tag of abort notices.
const TAG_ABORT: c_int = 0x7405;
/// `MPI_ANY_SOURCE` in Open MPI.
const ANY_SOURCE: c_int = -1;
/// Longest abort notice, in bytes.
const ABORT_BYTES: usize = 512;

/// An `MPI_Comm` handle.
#[derive(Clone, Copy)]
pub(crate) struct Handle(pub(crate) sys::MPI_Comm);
// SAFETY: a communicator handle is an opaque pointer that is only passed to MPI, under the
// library's lock.
unsafe impl Send for Handle {}
// SAFETY: as above.
unsafe impl Sync for Handle {}

/// What every round and work of one communicator shares.
pub(crate) struct Inner {
    pub(crate) mpi: &'static Mpi,
    pub(crate) comm: Handle,
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) timeout: Duration,
    /// The next collective's sequence number (every rank counts alike).
    pub(crate) seq: AtomicU64,
    /// Why the group failed, once it has.
    pub(crate) poisoned: Mutex<Option<String>>,
    /// Receive buffers kept between calls (a fresh one would be faulted in page by page on
    /// every large collective).
    pub(crate) pool: Mutex<Vec<Vec<u64>>>,
}

/// Most receive buffers a communicator keeps for reuse.
const POOL_BUFFERS: usize = 16;

impl Inner {
    /// A receive buffer of at least `bytes` (8-byte aligned) from the pool, or a new one.
    pub(crate) fn scratch(&self, bytes: usize) -> Vec<u64> {
        let words = bytes.div_ceil(8);
        let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        // The smallest buffer that fits.
        let fit = (0..pool.len()).filter(|&i| pool[i].len() >= words).min_by_key(|&i| pool[i].len());
        match fit {
            Some(i) => pool.swap_remove(i),
            None => vec![0u64; words],
        }
    }

    /// Returns a receive buffer to the pool; a full pool keeps the larger buffers (a large
    /// collective after many small ones still finds its buffers).
    pub(crate) fn give_back(&self, buf: Vec<u64>) {
        let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        if pool.len() < POOL_BUFFERS {
            pool.push(buf);
        } else if let Some(i) = (0..pool.len()).min_by_key(|&i| pool[i].len())
            && pool[i].len() < buf.len()
        {
            pool[i] = buf;
        }
    }

    /// Runs `f` on the library under its lock, unless MPI has been finalised.
    pub(crate) fn call<R>(&self, op: &'static str, f: impl FnOnce(&sys::MpiLib) -> R) -> Result<R> {
        let _guard = self.mpi.lock();
        if is_finalized(self.mpi) {
            return Err(CommError::Mpi { op, message: "MPI has been finalized in this process".into() });
        }
        Ok(f(self.mpi.lib()))
    }

    /// [`CommError::Poisoned`] if the group has failed, here or (through an abort notice
    /// waiting to be received) on any other rank.
    pub(crate) fn check_poisoned(&self, op: &str) -> Result<()> {
        if let Some(reason) = self.poisoned.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            return Err(CommError::Poisoned { op: op.into(), reason });
        }
        let notice = self.call("abort notice", |lib| -> Result<Option<String>> {
            let mut flag: c_int = 0;
            // SAFETY: MPI_Iprobe writes one int; the status is ignored.
            let code =
                unsafe { (lib.MPI_Iprobe)(ANY_SOURCE, TAG_ABORT, self.comm.0, &mut flag, sys::MPI_STATUS_IGNORE) };
            self.mpi.check("MPI_Iprobe", code)?;
            if flag == 0 {
                return Ok(None);
            }
            let mut buf = [0u8; ABORT_BYTES];
            // SAFETY: a message is waiting (probed above, under the same lock); it is at most
            // ABORT_BYTES long (every notice is), received into a buffer of that size.
            let code = unsafe {
                (lib.MPI_Recv)(
                    buf.as_mut_ptr().cast(),
                    ABORT_BYTES as c_int,
                    lib.byte,
                    ANY_SOURCE,
                    TAG_ABORT,
                    self.comm.0,
                    sys::MPI_STATUS_IGNORE,
                )
            };
            self.mpi.check("MPI_Recv", code)?;
            let end = buf.iter().position(|&b| b == 0).unwrap_or(ABORT_BYTES);
            Ok(Some(crate::peer_text(&buf[..end])))
        })??;
        match notice {
            Some(reason) => {
                *self.poisoned.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason.clone());
                Err(CommError::Poisoned { op: op.into(), reason })
            }
            None => Ok(()),
        }
    }

    /// Marks the group failed and sends `reason` to every other rank (once), then gives the
    /// notices up to a second to leave this process (their buffer is leaked, not freed, if MPI
    /// still holds it then).
    pub(crate) fn abort_with(&self, reason: &str) {
        {
            let mut p = self.poisoned.lock().unwrap_or_else(|p| p.into_inner());
            if p.is_some() {
                return;
            }
            *p = Some(reason.to_string());
        }
        let text = format!("rank {} aborted: {reason}", self.rank);
        let mut notice = vec![0u8; ABORT_BYTES];
        let n = text.len().min(ABORT_BYTES - 1);
        notice[..n].copy_from_slice(&text.as_bytes()[..n]);
        let mut reqs: Vec<sys::MPI_Request> = Vec::with_capacity(self.size);
        let posted = self.call("abort", |lib| {
            for peer in (0..self.size).filter(|&p| p != self.rank) {
                let (Ok(peer), mut req) = (c_int::try_from(peer), std::ptr::null_mut()) else { continue };
                // SAFETY: `notice` holds ABORT_BYTES bytes and outlives the request (it is
                // leaked below unless every request completed); the communicator is live.
                let code = unsafe {
                    (lib.MPI_Isend)(
                        notice.as_ptr().cast(),
                        ABORT_BYTES as c_int,
                        lib.byte,
                        peer,
                        TAG_ABORT,
                        self.comm.0,
                        &mut req,
                    )
                };
                if code == sys::MPI_SUCCESS {
                    reqs.push(req);
                }
            }
        });
        if posted.is_err() || reqs.is_empty() {
            return;
        }
        let deadline = Deadline::after(Duration::from_secs(1));
        let mut polls = 0;
        loop {
            let done = self.call("abort", |lib| {
                reqs.retain_mut(|r| {
                    let mut flag: c_int = 0;
                    // SAFETY: a request posted above and not yet completed.
                    let code = unsafe { (lib.MPI_Test)(r, &mut flag, sys::MPI_STATUS_IGNORE) };
                    code == sys::MPI_SUCCESS && flag == 0
                });
                reqs.is_empty()
            });
            match done {
                Ok(true) => return,
                Err(_) => break,
                Ok(false) if deadline.has_passed() => break,
                Ok(false) => backoff(&mut polls),
            }
        }
        std::mem::forget(notice);
    }
}

/// Between polls: spin briefly, then yield the core, then sleep (up to 200 µs), so that
/// ranks sharing cores (more processes than cores) let each other run.
pub(crate) fn backoff(polls: &mut u32) {
    *polls = polls.saturating_add(1);
    match *polls {
        0..=64 => std::hint::spin_loop(),
        65..=512 => std::thread::yield_now(),
        n => std::thread::sleep(Duration::from_micros(u64::from((n - 512).min(200)))),
    }
}
