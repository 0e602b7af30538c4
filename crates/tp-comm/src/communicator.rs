//! The [`Communicator`] trait: the collectives every backend provides.
//!
//! Semantics follow `torch.distributed` / NCCL. Every rank of the group must call the same
//! collectives in the same order; a rank that calls another one, or passes incompatible tensors,
//! makes every rank return [`CommError::Mismatch`](crate::CommError::Mismatch). Every call has a
//! deadline.

use crate::Result;
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
