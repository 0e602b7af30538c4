//! The second half of a [`LocalGroup`] collective: waiting for its exchange, checking that every
//! rank made the same call, and computing this rank's result; blocking or through a [`Work`].

use super::*;

/// What a rank makes of a completed exchange: each collective's second half.
#[derive(Debug, Clone, Copy)]
pub(super) enum Finish {
    Gather { dim: usize },
    Reduce { op: ReduceOp },
    ReduceScatter { dim: usize, op: ReduceOp },
    Broadcast { root: usize },
}

impl Member {
    /// Issues a collective: the deposit, with the call's description for the agreement check.
    fn issue(&self, op: &'static str, call: String, x: &Tensor) -> Result<u64> {
        self.deposit(op, call, x.clone())
    }

    /// Waits for exchange `ticket`, checks every rank made the same call, and computes this
    /// rank's result on `device`.
    fn finish(&self, op: &'static str, ticket: u64, deadline: Instant, how: Finish, device: Device) -> Result<Tensor> {
        let round = self.await_round(op, ticket, deadline)?;
        let all = &round.deposits;
        if let Some((r, d)) = all.iter().enumerate().find(|(_, d)| d.call != all[0].call) {
            return Err(CommError::Mismatch {
                op: op.into(),
                why: format!("rank 0 called {} but rank {r} called {}", all[0].call, d.call),
            });
        }
        match how {
            Finish::Gather { dim } => {
                let parts = all.iter().map(|d| Self::on(op, &d.tensor, device)).collect::<Result<Vec<_>>>()?;
                Tensor::cat(&parts, dim).map_err(|e| CommError::Mismatch { op: op.into(), why: e.to_string() })
            }
            Finish::Reduce { op: red } => Self::on(op, &self.reduced(op, &round, red)?, device),
            Finish::ReduceScatter { dim, op: red } => {
                let reduced = self.reduced(op, &round, red)?;
                let len = reduced.shape().dim(op, dim).map_err(tensor_err(op))?;
                let shard = TensorShard::new(dim, len, self.rank, self.shared.world).map_err(tensor_err(op))?;
                Self::on(op, &shard.shard(&reduced).map_err(tensor_err(op))?, device)
            }
            Finish::Broadcast { root } => Self::on(op, &all[root].tensor, device),
        }
    }

    /// The blocking form: issue, then finish.
    pub(super) fn run(&self, op: &'static str, call: String, x: &Tensor, how: Finish) -> Result<Tensor> {
        let deadline = Deadline::after(self.shared.timeout).instant();
        let ticket = self.issue(op, call, x)?;
        self.finish(op, ticket, deadline, how, x.device())
    }

    /// The asynchronous form: issue now, finish in [`Work::wait`].
    pub(super) fn run_async(&self, op: &'static str, call: String, x: &Tensor, how: Finish) -> Result<Work> {
        let deadline = Deadline::after(self.shared.timeout).instant();
        let ticket = self.issue(op, call, x)?;
        let pending = LocalWork { m: self.clone(), op, ticket: Some(ticket), deadline, how, device: x.device() };
        Ok(Work::pending(Box::new(pending)))
    }
}

/// A LocalGroup collective issued and not yet waited for.
pub(super) struct LocalWork {
    m: Member,
    op: &'static str,
    /// `None` once waited for (so `Drop` knows the claim on the exchange was used).
    ticket: Option<u64>,
    deadline: Instant,
    how: Finish,
    device: Device,
}

impl PendingWork for LocalWork {
    fn is_done(&mut self) -> bool {
        let sh = &self.m.shared;
        self.ticket.is_none_or(|t| sh.completed.load(Ordering::Acquire) > t) || sh.poisoned.load(Ordering::Acquire)
    }

    fn wait(mut self: Box<Self>) -> Result<Tensor> {
        let ticket = self
            .ticket
            .take()
            .ok_or_else(|| CommError::Mismatch { op: self.op.into(), why: "work waited for twice".into() })?;
        self.m.finish(self.op, ticket, self.deadline, self.how, self.device)
    }
}

impl Drop for LocalWork {
    /// Work dropped without a wait still counts as taken, so its exchange can be freed.
    fn drop(&mut self) {
        if let Some(t) = self.ticket.take() {
            self.m.release(t);
        }
    }
}
