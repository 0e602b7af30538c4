//! The state one NCCL communicator's users and its watchdog share: the raw handle behind a
//! lock held across every NCCL call, the failure (once failed, always failed), and the queue of
//! enqueued work not yet seen complete.
//!
//! Soundness: the handle is only read while its mutex is held, for the whole NCCL call that uses
//! it (and the poll that follows an `ncclInProgress`), and it becomes null under the same lock
//! when the communicator is aborted or destroyed. So no call overlaps another on one
//! communicator (NCCL forbids that), and no call can reach a freed communicator.

use super::Nccl;
use super::sys::{self, ncclResult_t};
use crate::CommError;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tp_kernels::Gpu;
use tp_kernels::cudarc::driver::CudaEvent;

/// The raw communicator; null once aborted or destroyed.
pub(super) struct Handle(pub(super) sys::ncclComm_t);

// SAFETY: the pointer is an opaque NCCL handle that NCCL lets any thread use, one call at a
// time. It is only ever read through `Shared::comm`'s mutex guard, held for the whole call, so
// moving the guarded value between threads cannot race.
unsafe impl Send for Handle {}

/// One enqueued collective the watchdog watches.
pub(super) struct Pending {
    /// Recorded on the rank's stream right after the collective was enqueued.
    pub(super) event: Arc<CudaEvent>,
    /// When it must have completed.
    pub(super) deadline: Instant,
    pub(super) op: &'static str,
}

pub(super) struct Shared {
    pub(super) nccl: &'static Nccl,
    pub(super) gpu: Arc<Gpu>,
    pub(super) timeout: Duration,
    comm: Mutex<Handle>,
    failed: AtomicBool,
    failure: Mutex<Option<String>>,
    pub(super) pending: Mutex<VecDeque<Pending>>,
    /// Wakes the watchdog when work arrives or the communicator closes.
    pub(super) wake: Condvar,
    pub(super) stop: AtomicBool,
}

/// `m.lock()`, recovering the data of a poisoned lock (this module's code keeps it consistent).
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    pub(super) fn new(nccl: &'static Nccl, gpu: Arc<Gpu>, timeout: Duration, comm: sys::ncclComm_t) -> Shared {
        Shared {
            nccl,
            gpu,
            timeout,
            comm: Mutex::new(Handle(comm)),
            failed: AtomicBool::new(false),
            failure: Mutex::new(None),
            pending: Mutex::new(VecDeque::new()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        }
    }

    /// The handle, locked for one NCCL call.
    pub(super) fn handle(&self) -> MutexGuard<'_, Handle> {
        lock(&self.comm)
    }

    pub(super) fn has_failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    /// The error a call on a failed communicator returns.
    pub(super) fn poisoned(&self, op: &str) -> CommError {
        let reason = lock(&self.failure).clone().unwrap_or_else(|| "the communicator was closed".into());
        CommError::Poisoned { op: op.into(), reason }
    }

    /// `Ok` unless the communicator has failed.
    pub(super) fn check_usable(&self, op: &str) -> crate::Result<()> {
        if self.has_failed() { Err(self.poisoned(op)) } else { Ok(()) }
    }

    /// Records why the communicator failed (the first reason wins), aborts it (`ncclCommAbort`:
    /// peers' pending operations fail instead of hanging), and returns the error to report.
    pub(super) fn fail(&self, h: &mut Handle, op: &'static str, message: String) -> CommError {
        if !self.failed.swap(true, Ordering::SeqCst) {
            *lock(&self.failure) = Some(format!("{op}: {message}"));
        }
        abort_handle(self.nccl, h);
        lock(&self.pending).clear();
        CommError::Nccl { op, message }
    }

    /// After a call returned `ncclInProgress` (a non-blocking communicator), polls
    /// `ncclCommGetAsyncError` until the operation is enqueued (`ncclSuccess`), failing the
    /// communicator on an error or at `deadline`.
    pub(super) fn settle(&self, h: &mut Handle, op: &'static str, deadline: Instant) -> crate::Result<()> {
        loop {
            let state = self.async_state(h, op)?;
            if state == ncclResult_t::ncclSuccess {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let e = self.fail(
                    h,
                    op,
                    format!("still in progress after {:?} (a peer is missing or stuck)", self.timeout),
                );
                return Err(e);
            }
            std::thread::yield_now();
        }
    }

    /// `ncclCommGetAsyncError`: `Success` or `InProgress`; any error fails the communicator.
    pub(super) fn async_state(&self, h: &mut Handle, op: &'static str) -> crate::Result<ncclResult_t::Type> {
        if h.0.is_null() {
            return Err(self.poisoned(op));
        }
        let mut state: ncclResult_t::Type = ncclResult_t::ncclSuccess;
        // SAFETY: `h.0` is this communicator's live handle (non-null, guarded); `state` is a
        // valid out-pointer for the call.
        let r = unsafe { self.nccl.lib().ncclCommGetAsyncError(h.0, &mut state) };
        if r != ncclResult_t::ncclSuccess {
            let message = self.nccl.describe(r, h.0);
            return Err(self.fail(h, op, message));
        }
        if state != ncclResult_t::ncclSuccess && state != ncclResult_t::ncclInProgress {
            let message = self.nccl.describe(state, h.0);
            return Err(self.fail(h, op, message));
        }
        Ok(state)
    }
}

/// `ncclCommAbort` on a live handle, which then becomes null (abort frees it).
pub(super) fn abort_handle(nccl: &Nccl, h: &mut Handle) {
    if !h.0.is_null() {
        // SAFETY: `h.0` is a communicator NCCL returned and that was neither aborted nor destroyed
        // (both set it to null, under the same lock the caller holds); abort is valid in any
        // state and frees the communicator, so the pointer is forgotten right after.
        unsafe { nccl.lib().ncclCommAbort(h.0) };
        h.0 = std::ptr::null_mut();
    }
}
