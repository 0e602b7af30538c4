//! [`Work`]: a collective that has been issued and may still be running, so that a caller can
//! overlap it with other work and wait for it later (the `async_op=True` handles of
//! `torch.distributed`).
//!
//! Every wait has the group's deadline; a failed or timed-out collective, or a group aborted
//! from another thread while the wait is pending, turns into an error, never a hang.

use crate::Result;
use tp_core::Tensor;

/// The part of a pending collective that a backend implements.
pub(crate) trait PendingWork: Send {
    /// Whether the result is ready, without blocking.
    fn is_done(&mut self) -> bool;
    /// Blocks until the result is ready (or the deadline passes, or the group fails).
    fn wait(self: Box<Self>) -> Result<Tensor>;
}

/// A collective in flight. [`Work::wait`] returns its result.
#[must_use = "a collective's result (or error) arrives through wait()"]
pub struct Work {
    inner: Inner,
}

enum Inner {
    Done(Result<Tensor>),
    Pending(Box<dyn PendingWork>),
}

impl std::fmt::Debug for Work {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            Inner::Done(Ok(t)) => write!(f, "Work(done: {t:?})"),
            Inner::Done(Err(e)) => write!(f, "Work(failed: {e})"),
            Inner::Pending(_) => f.write_str("Work(pending)"),
        }
    }
}

impl Work {
    /// Work that has already finished with `result`.
    pub fn done(result: Result<Tensor>) -> Work {
        Work { inner: Inner::Done(result) }
    }

    pub(crate) fn pending(p: Box<dyn PendingWork>) -> Work {
        Work { inner: Inner::Pending(p) }
    }

    /// This work with `f` applied to its result when it is waited for (an error passes through
    /// untouched). Dropping the returned work drops this one, unwaited.
    pub(crate) fn map(self, f: impl FnOnce(Tensor) -> Result<Tensor> + Send + 'static) -> Work {
        match self.inner {
            Inner::Done(r) => Work::done(r.and_then(f)),
            Inner::Pending(inner) => Work::pending(Box::new(Mapped { inner, f })),
        }
    }

    /// Whether [`wait`](Self::wait) would return without blocking.
    pub fn is_completed(&mut self) -> bool {
        match &mut self.inner {
            Inner::Done(_) => true,
            Inner::Pending(p) => p.is_done(),
        }
    }

    /// The collective's result, once it has completed on this rank; an error when it failed,
    /// when the group was aborted, or when the group's deadline passed first.
    pub fn wait(self) -> Result<Tensor> {
        match self.inner {
            Inner::Done(r) => r,
            Inner::Pending(p) => p.wait(),
        }
    }
}

/// Pending work whose result goes through `f` ([`Work::map`]).
struct Mapped<F> {
    inner: Box<dyn PendingWork>,
    f: F,
}

impl<F: FnOnce(Tensor) -> Result<Tensor> + Send> PendingWork for Mapped<F> {
    fn is_done(&mut self) -> bool {
        self.inner.is_done()
    }

    fn wait(self: Box<Self>) -> Result<Tensor> {
        let Mapped { inner, f } = *self;
        f(inner.wait()?)
    }
}
