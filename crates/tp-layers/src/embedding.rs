//! [`VocabParallelEmbedding`]: the token embedding split over the vocabulary.
//!
//! The table `E: [V, H]` is split by rows with the balanced policy: rank `r` holds
//! `E_r = E[v_r .. v_{r+1}]` (uneven `V` exact). A lookup of ids `t` is
//! `E[t] = Σ_r mask_r(t) ⊙ E_r[t - v_r]`: each rank gathers the rows of the ids it holds and
//! zeros for the others (`tp_core::Tensor::embedding`), and one all-reduce (sum) over the group
//! completes it. The sum adds one row to zeros, so the result equals the unsharded lookup bit
//! for bit. Megatron-LM's `VocabParallelEmbedding`.

use crate::checkpoint::Checkpoint;
use crate::column::{check_group, load_rows};
use crate::error::{LayerError, Result};
use crate::options::LoadOptions;
use tp_comm::{DeviceGroup, ReduceOp};
use tp_core::{Tensor, TensorShard};

/// Rank `shard.rank()`'s rows of a vocab-parallel embedding table.
#[derive(Debug, Clone)]
pub struct VocabParallelEmbedding {
    /// `E_r: [V_r, H]`.
    table: Tensor,
    /// Rows `v_r .. v_{r+1}` of the `V`-row table (dim 0).
    shard: TensorShard,
}

impl VocabParallelEmbedding {
    /// Wraps a local table holding rows `shard.start()..shard.end()` (dim 0) of the full one.
    pub fn new(table: Tensor, shard: TensorShard) -> Result<VocabParallelEmbedding> {
        if table.ndim() != 2 || shard.dim() != 0 || table.dims()[0] != shard.len() {
            return Err(LayerError::Config(format!(
                "embedding table {:?} does not hold the {} rows of its shard",
                table.dims(),
                shard.len()
            )));
        }
        Ok(VocabParallelEmbedding { table, shard })
    }

    /// Rank `rank`'s rows of a full `[V, H]` table.
    pub fn from_full(table: &Tensor, rank: usize, world_size: usize) -> Result<VocabParallelEmbedding> {
        let shard = TensorShard::new(0, table.shape().dim("VocabParallelEmbedding", 0)?, rank, world_size)?;
        Self::new(shard.shard(table)?, shard)
    }

    /// This rank's rows of `{prefix}.weight` (e.g. `model.embed_tokens`), reading only them.
    pub fn load(
        ckpt: &Checkpoint,
        prefix: &str,
        group: &DeviceGroup,
        opts: &LoadOptions,
    ) -> Result<VocabParallelEmbedding> {
        let (table, shard) = load_rows(ckpt, &format!("{prefix}.weight"), group, opts)?;
        Self::new(table, shard)
    }

    /// The full vocabulary size `V`.
    pub fn vocab_size(&self) -> usize {
        self.shard.global_len()
    }
    /// The embedding width `H`.
    pub fn hidden_size(&self) -> usize {
        self.table.dims()[1]
    }
    /// Which rows this rank holds.
    pub fn shard(&self) -> &TensorShard {
        &self.shard
    }
    /// `E_r`.
    pub fn table(&self) -> &Tensor {
        &self.table
    }

    /// `E[ids]: [.., H]` on every rank, for integer `ids` of any shape (host or device), each
    /// in `0..V`: the masked local gather, then one all-reduce.
    ///
    /// Errors: `TokenOutOfRange` naming the first id outside the vocabulary (checked on the
    /// host before anything runs), group mismatches, collective failures.
    pub fn forward(&self, ids: &Tensor, group: &DeviceGroup) -> Result<Tensor> {
        check_group(&self.shard, self.table.device(), group)?;
        check_ids(ids, self.vocab_size())?;
        let local = self.table.embedding(&group.to_local(ids)?, self.shard.start())?;
        if group.world_size() == 1 {
            return Ok(local);
        }
        Ok(group.all_reduce(&local, ReduceOp::Sum)?)
    }
}

/// `TokenOutOfRange` for the first id of `ids` outside `0..vocab`.
pub(crate) fn check_ids(ids: &Tensor, vocab: usize) -> Result<()> {
    let values = ids.to_i64_vec()?;
    if let Some((position, &id)) =
        values.iter().enumerate().find(|(_, id)| usize::try_from(**id).map_or(true, |i| i >= vocab))
    {
        return Err(LayerError::Tensor(tp_core::Error::TokenOutOfRange { op: "embedding", id, position, vocab }));
    }
    Ok(())
}
