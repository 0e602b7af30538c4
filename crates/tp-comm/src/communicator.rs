//! The [`Communicator`] trait: the collectives every backend provides.
//!
//! Semantics follow `torch.distributed` / NCCL. Every rank of the group must call the same
//! collectives in the same order; a rank that calls another one, or passes incompatible tensors,
//! makes every rank return [`CommError::Mismatch`](crate::CommError::Mismatch). Every call has a
//! deadline.
//!
//! On a GPU backend the calls are stream-ordered: they return once the collective is enqueued,
//! and its output is valid for later work on the rank's stream (reading it on the host waits for
//! it). A collective that fails or passes its deadline after that makes the next call, or
//! [`Work::wait`], return the error. The `_async` forms return a [`Work`] handle to wait on.

use crate::{CommError, Result, Work};
use tp_core::Tensor;

/// How `all_reduce` and `reduce_scatter` combine the ranks' tensors, element by element.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum over ranks.
    Sum,
    /// Maximum over ranks.
    Max,
    /// Minimum over ranks.
    Min,
    /// Arithmetic mean over ranks (the sum divided by the world size).
    Avg,
}

/// One message of a batch of point-to-point operations
/// ([`Communicator::send_recv_async`], `torch.distributed.batch_isend_irecv`'s `P2POp`).
#[derive(Debug, Clone, Copy)]
pub enum P2p<'a> {
    /// Send `x` to rank `peer`, as [`Communicator::send_async`].
    Send {
        /// The tensor sent.
        x: &'a Tensor,
        /// The receiving rank.
        peer: usize,
    },
    /// Receive the next `dims` tensor of `dtype` from rank `peer`, as
    /// [`Communicator::recv_async`].
    Recv {
        /// The dims the sender must send.
        dims: &'a [usize],
        /// The dtype the sender must send.
        dtype: tp_core::DType,
        /// The sending rank.
        peer: usize,
    },
}

/// A group of `world_size` ranks, seen from one of them.
pub trait Communicator: Send + Sync {
    /// This rank, in `0..world_size`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn world_size(&self) -> usize;

    /// Every rank's `x`, concatenated in rank order along `dim`. The ranks' lengths along `dim`
    /// may differ (uneven shards are gathered exactly); all other dims, the dtype must agree.
    /// Rank `r`'s block lands at the sum of the lengths of ranks `0..r`.
    fn all_gather(&self, x: &Tensor, dim: usize) -> Result<Tensor>;

    /// The element-wise reduction of every rank's `x` (same shape and dtype on all ranks); every
    /// rank receives the same result.
    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor>;

    /// The reduction of every rank's `x`, of which this rank receives its `TensorShard` (balanced
    /// policy) along `dim`.
    fn reduce_scatter(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor>;

    /// Rank `root`'s `x`, on every rank. Every rank passes a tensor of the same shape and dtype;
    /// the non-root ranks' contents are ignored.
    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor>;

    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;

    /// Fails the group: every rank's pending and later collectives return an error carrying
    /// `reason` (NCCL: `ncclCommAbort`). For a rank whose own work failed, so that its peers
    /// do not wait for it until their deadline.
    fn abort(&self, reason: &str);

    /// [`all_gather`](Self::all_gather) when every rank's length along `dim` is known to the
    /// caller (`lengths[r]` for rank `r`, the same list on every rank): backends that would
    /// otherwise exchange the lengths first (NCCL: a tiny collective read back to the host) skip
    /// that. This rank's own entry is checked.
    fn all_gather_sized(&self, x: &Tensor, dim: usize, lengths: &[usize]) -> Result<Tensor> {
        let len = x.shape().dim("all_gather", dim).map_err(crate::error::tensor_err("all_gather"))?;
        if lengths.len() != self.world_size() || lengths.get(self.rank()) != Some(&len) {
            return Err(CommError::Mismatch {
                op: "all_gather".into(),
                why: format!("rank {} has length {len} but was told lengths {lengths:?}", self.rank()),
            });
        }
        self.all_gather(x, dim)
    }

    /// All-to-all with variable counts (`torch.distributed.all_to_all_single` with split
    /// sizes): `x`'s rows go out in consecutive chunks of `send_counts[j]` rows to rank `j`;
    /// returns the rows this rank received, in rank order, and how many came from each rank.
    /// Receivers need not know the counts beforehand (they are exchanged first). A
    /// `send_counts` of the wrong length, or not summing to `x`'s rows, is
    /// [`CommError::Mismatch`]. See `all_to_all.rs` for how it moves the rows.
    fn all_to_all(&self, x: &Tensor, send_counts: &[usize]) -> Result<(Tensor, Vec<usize>)> {
        crate::all_to_all::all_to_all(self, x, send_counts)
    }

    /// [`all_reduce`](Self::all_reduce), issued without waiting for it: the result comes from
    /// [`Work::wait`], so the caller can do other work meanwhile. Backends without real overlap
    /// return finished work.
    fn all_reduce_async(&self, x: &Tensor, op: ReduceOp) -> Result<Work> {
        Ok(Work::done(self.all_reduce(x, op)))
    }

    /// [`all_gather`](Self::all_gather), issued without waiting for it (see
    /// [`all_reduce_async`](Self::all_reduce_async)).
    fn all_gather_async(&self, x: &Tensor, dim: usize) -> Result<Work> {
        Ok(Work::done(self.all_gather(x, dim)))
    }

    /// Point-to-point (`torch.distributed.isend` / `ncclSend`): posts `x` for rank `dst` of
    /// this group and returns without waiting for it to be received; [`Work::wait`] returns `x`
    /// itself (a clone sharing its storage) once `dst` has received it.
    ///
    /// * Matching: messages from one rank to another are matched in order: the `k`-th send from
    ///   `a` to `b` is the `k`-th receive at `b` from `a`, whatever the order of the waits.
    ///   Point-to-point traffic does not take part in the collectives' matching: a rank may
    ///   have sends and receives in flight across collectives.
    /// * Shapes: a receiver that expected other dims or another dtype makes both sides' waits
    ///   return an error naming both shapes ([`CommError::Mismatch`] on the thread backend and
    ///   at an NCCL receiver; see below for an NCCL sender), never a hang.
    /// * Deadlines: every wait has the group's deadline, counted from the call: a peer that
    ///   never receives (or, for [`recv_async`](Self::recv_async), never sends) is a
    ///   [`CommError::Timeout`] naming it on the thread backend, an aborted communicator on
    ///   NCCL. A failed or aborted group fails pending sends and receives at once.
    /// * Peers: `dst` must be another rank of the group: this rank is a
    ///   [`CommError::Mismatch`], a rank past the group [`CommError::RankOutOfRange`], at the
    ///   call.
    ///
    /// Backends. [`LocalGroup`](crate::LocalGroup) hands over a reference-counted clone (no
    /// copy; a CUDA tensor stays on its GPU) and the send completes once the receive is
    /// posted. [`NcclComm`](crate::nccl::NcclComm) sends a small header (dtype and dims) then
    /// the payload in one NCCL group on the rank's stream; a receiver that finds the header
    /// wrong aborts its communicator, and the sender's wait fails at the latest at its
    /// deadline (NCCL does not tell peers about an abort). On NCCL every operation of a rank
    /// runs in order on its one stream, so two ranks that both send to each other before
    /// receiving would wait for each other until the deadline on messages past NCCL's buffers:
    /// post such exchanges together with [`send_recv_async`](Self::send_recv_async). Backends
    /// without point-to-point return [`CommError::Limit`].
    fn send_async(&self, x: &Tensor, dst: usize) -> Result<Work> {
        let _ = (x, dst);
        Err(CommError::Limit { op: "send", why: "this backend has no point-to-point messages".into() })
    }

    /// Point-to-point (`irecv` / `ncclRecv`): posts the receive of the next tensor from rank
    /// `src`, which must be a `dims` tensor of `dtype`; [`Work::wait`] returns it (see
    /// [`send_async`](Self::send_async) for matching, shape checks, deadlines and peers). On
    /// the thread backend the tensor is where the sender had it;
    /// [`DeviceGroup::recv_async`](crate::DeviceGroup::recv_async) moves it to its own device.
    /// Dropping the work unwaited does not cancel the receive: its message is still taken.
    /// On NCCL the header and the payload are received in one group and the header is checked
    /// at the wait.
    fn recv_async(&self, dims: &[usize], dtype: tp_core::DType, src: usize) -> Result<Work> {
        let _ = (dims, dtype, src);
        Err(CommError::Limit { op: "recv", why: "this backend has no point-to-point messages".into() })
    }

    /// Several point-to-point operations posted together, one [`Work`] per operation in the
    /// order given (`torch.distributed.batch_isend_irecv`). Matching, shapes, deadlines and
    /// peers are those of [`send_async`](Self::send_async) and
    /// [`recv_async`](Self::recv_async). This is how two ranks that both send to each other
    /// before receiving (1F1B's neighbours) must post on NCCL, where every operation of a rank
    /// runs in order on one stream: there the whole batch is one NCCL group, so the sends and
    /// receives progress together. The thread and MPI backends post each operation in turn,
    /// which never blocks. An error at one operation's call (a bad peer, a tensor on another
    /// device) leaves the ones before it posted; their works are dropped unwaited.
    fn send_recv_async(&self, ops: &[P2p<'_>]) -> Result<Vec<Work>> {
        ops.iter()
            .map(|op| match *op {
                P2p::Send { x, peer } => self.send_async(x, peer),
                P2p::Recv { dims, dtype, peer } => self.recv_async(dims, dtype, peer),
            })
            .collect()
    }

    /// [`all_reduce`](Self::all_reduce) into `x` itself (host tensors are overwritten in place).
    fn all_reduce_into(&self, x: &mut Tensor, op: ReduceOp) -> Result<()> {
        let reduced = self.all_reduce(x, op)?;
        x.copy_from(&reduced).map_err(crate::error::tensor_err("all_reduce_into"))
    }

    /// [`all_gather`](Self::all_gather) into `out`, which must already have the gathered shape.
    fn all_gather_into(&self, x: &Tensor, dim: usize, out: &mut Tensor) -> Result<()> {
        let gathered = self.all_gather(x, dim)?;
        out.copy_from(&gathered).map_err(crate::error::tensor_err("all_gather_into"))
    }
}
