//! [`TensorShard`]: which slice of which dimension a rank holds, under one split policy.
//!
//! # Policy: balanced, larger shards first
//! A dimension of length `L` split over `W` ranks gives `L = q·W + r` (`0 <= r < W`). Ranks
//! `0..r` hold `q + 1` elements and ranks `r..W` hold `q`; rank `i` starts at `i·q + min(i, r)`.
//! Shard lengths differ by at most one, every element is held by exactly one rank, and when
//! `W` divides `L` this is Megatron-LM's and vLLM's even split. When `L < W`, the last ranks
//! hold empty shards. Every crate of tp uses this policy (`TensorShard::new`) for every split
//! it chooses. A split that must follow another one is the one exception, built with
//! [`TensorShard::with_range`]: attention's output projection takes the features of the query
//! heads the rank holds (heads are split by this policy, features follow them).

use crate::{Error, Result, Tensor};

/// The slice `start..start + len` of dimension `dim` that rank `rank` of `world_size` holds, out
/// of a global length `global_len`, under the balanced policy of this module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TensorShard {
    dim: usize,
    rank: usize,
    world_size: usize,
    global_len: usize,
    start: usize,
    len: usize,
}

impl TensorShard {
    /// Rank `rank`'s shard of a dimension `dim` of length `global_len` over `world_size` ranks.
    ///
    /// Errors: [`Error::ZeroWorldSize`], [`Error::RankOutOfRange`].
    pub fn new(dim: usize, global_len: usize, rank: usize, world_size: usize) -> Result<Self> {
        const OP: &str = "TensorShard::new";
        if world_size == 0 {
            return Err(Error::ZeroWorldSize { op: OP });
        }
        if rank >= world_size {
            return Err(Error::RankOutOfRange { op: OP, rank, world_size });
        }
        let (q, r) = (global_len / world_size, global_len % world_size);
        let start = rank * q + rank.min(r);
        let len = q + usize::from(rank < r);
        Ok(TensorShard { dim, rank, world_size, global_len, start, len })
    }

    /// Rank `rank`'s shard when it holds the given range `start..start + len` of a dimension of
    /// `global_len`, whatever the policy would give (a split that follows another, such as the
    /// head-aligned input features of attention's output projection).
    ///
    /// Errors: [`Error::ZeroWorldSize`], [`Error::RankOutOfRange`], [`Error::ShardMismatch`] if
    /// the range does not lie inside the dimension.
    pub fn with_range(
        dim: usize,
        global_len: usize,
        rank: usize,
        world_size: usize,
        start: usize,
        len: usize,
    ) -> Result<Self> {
        const OP: &str = "TensorShard::with_range";
        Self::new(dim, global_len, rank, world_size)?; // rank and world checks
        if start.checked_add(len).is_none_or(|end| end > global_len) {
            return Err(Error::ShardMismatch {
                op: OP,
                why: format!("range {start}..{start}+{len} exceeds the dimension's length {global_len}"),
            });
        }
        Ok(TensorShard { dim, rank, world_size, global_len, start, len })
    }

    /// Whether this shard is the balanced policy's for its rank (false for a
    /// [`with_range`](Self::with_range) shard that differs from it).
    pub fn is_balanced(&self) -> bool {
        Self::new(self.dim, self.global_len, self.rank, self.world_size).is_ok_and(|b| b == *self)
    }

    /// The shards of every rank, in rank order.
    pub fn for_all_ranks(dim: usize, global_len: usize, world_size: usize) -> Result<Vec<Self>> {
        if world_size == 0 {
            return Err(Error::ZeroWorldSize { op: "TensorShard::for_all_ranks" });
        }
        (0..world_size).map(|rank| Self::new(dim, global_len, rank, world_size)).collect()
    }

    /// The sharded dimension.
    pub fn dim(&self) -> usize {
        self.dim
    }
    /// The rank holding this shard.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Number of ranks the dimension is split over.
    pub fn world_size(&self) -> usize {
        self.world_size
    }
    /// Length of the whole, unsharded dimension.
    pub fn global_len(&self) -> usize {
        self.global_len
    }
    /// First global index this rank holds.
    pub fn start(&self) -> usize {
        self.start
    }
    /// Number of indices this rank holds (may be 0 when `global_len < world_size`).
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether this rank holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// One past the last global index this rank holds.
    pub fn end(&self) -> usize {
        self.start + self.len
    }

    /// This rank's slice of the full tensor `full`: `full.narrow(dim, start, len)`.
    ///
    /// Errors: [`Error::DimOutOfRange`], or [`Error::ShardMismatch`] if `full`'s dimension `dim`
    /// is not `global_len` long.
    pub fn shard(&self, full: &Tensor) -> Result<Tensor> {
        let size = full.shape().dim("TensorShard::shard", self.dim)?;
        if size != self.global_len {
            return Err(Error::ShardMismatch {
                op: "TensorShard::shard",
                why: format!(
                    "tensor {:?} has length {size} in dim {}, but the shard splits a length of {}",
                    full.dims(),
                    self.dim,
                    self.global_len
                ),
            });
        }
        full.narrow(self.dim, self.start, self.len)
    }

    /// Splits `full` along `dim` into `world_size` shards, in rank order.
    pub fn shard_all(full: &Tensor, dim: usize, world_size: usize) -> Result<Vec<Tensor>> {
        let len = full.shape().dim("TensorShard::shard_all", dim)?;
        Self::for_all_ranks(dim, len, world_size)?.iter().map(|s| s.shard(full)).collect()
    }

    /// Joins the shards of every rank (`parts[r]` is rank `r`'s) back into the full tensor: the
    /// exact inverse of [`shard_all`](Self::shard_all).
    ///
    /// Errors: [`Error::ZeroWorldSize`] for no parts, [`Error::ShardMismatch`] if the parts'
    /// lengths along `dim` are not the policy's split of their sum (wrong order, a missing or
    /// extra part), and `cat`'s errors for parts that disagree in dtype or other dims.
    pub fn unshard(parts: &[Tensor], dim: usize) -> Result<Tensor> {
        const OP: &str = "TensorShard::unshard";
        if parts.is_empty() {
            return Err(Error::ZeroWorldSize { op: OP });
        }
        let lens = parts.iter().map(|p| p.shape().dim(OP, dim)).collect::<Result<Vec<_>>>()?;
        let total = lens
            .iter()
            .try_fold(0usize, |a, &l| a.checked_add(l))
            .ok_or_else(|| Error::ShardMismatch { op: OP, why: "shard lengths overflow when summed".into() })?;
        let expected = Self::for_all_ranks(dim, total, parts.len())?;
        if let Some((r, s)) = expected.iter().enumerate().find(|(r, s)| s.len != lens[*r]) {
            return Err(Error::ShardMismatch {
                op: OP,
                why: format!(
                    "rank {r} has length {} in dim {dim}, but splitting {total} over {} ranks gives it {}",
                    lens[r],
                    parts.len(),
                    s.len
                ),
            });
        }
        Tensor::cat(parts, dim)
    }
}
