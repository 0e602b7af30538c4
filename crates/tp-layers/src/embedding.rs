//! [`VocabParallelEmbedding`]: the token embedding split over the vocabulary.
//!
//! The table `E: [V, H]` is split by rows with the balanced policy: rank `r` holds
//! `E_r = E[v_r .. v_{r+1}]` (uneven `V` exact). A lookup of ids `t` is
//! `E[t] = Σ_r mask_r(t) ⊙ E_r[t - v_r]`: each rank gathers the rows of the ids it holds and
//! zeros for the others (`tp_core::Tensor::embedding`), and one all-reduce (sum) over the group
//! completes it. The sum adds one row to zeros, so the result equals the unsharded lookup bit
//! for bit. Megatron-LM's `VocabParallelEmbedding`.

use crate::column::check_placement;
use crate::error::{LayerError, Result};
use crate::loader::Loader;
use tp_comm::{DeviceGroup, ReduceOp};
use tp_core::{Tensor, TensorShard};

/// Rank `shard.rank()`'s rows of a vocab-parallel embedding table.
#[derive(Debug, Clone)]
pub struct VocabParallelEmbedding {
    /// `E_r: [V_r, H]`.
    table: Tensor,
    /// Rows `v_r .. v_{r+1}` of the `V`-row table (dim 0).
    shard: TensorShard,
    /// A factor on every looked-up row (Gemma's `sqrt(H)`), if any.
    scale: Option<f32>,
    /// The full table's row that lookups never train (torch's `padding_idx`), if any.
    padding_idx: Option<usize>,
    group: DeviceGroup,
    /// fp32 gradient of `E_r` (training).
    grad: crate::Grad,
}

impl VocabParallelEmbedding {
    /// Wraps a local table holding rows `shard.start()..shard.end()` (dim 0) of the full one,
    /// for `group`'s rank.
    pub fn new(table: Tensor, shard: TensorShard, group: &DeviceGroup) -> Result<VocabParallelEmbedding> {
        if table.ndim() != 2 || shard.dim() != 0 || table.dims()[0] != shard.len() {
            return Err(LayerError::Config(format!(
                "embedding table {:?} does not hold the {} rows of its shard",
                table.dims(),
                shard.len()
            )));
        }
        check_placement(&shard, table.device(), group)?;
        Ok(VocabParallelEmbedding {
            table,
            shard,
            scale: None,
            padding_idx: None,
            group: group.clone(),
            grad: crate::Grad::default(),
        })
    }

    /// `group`'s rank's rows of a full `[V, H]` table (moved to the group's device).
    pub fn from_full(table: &Tensor, group: &DeviceGroup) -> Result<VocabParallelEmbedding> {
        let rows = table.shape().dim("VocabParallelEmbedding", 0)?;
        let shard = TensorShard::new(0, rows, group.rank(), group.world_size())?;
        Self::new(shard.shard(table)?.to_device(&group.device())?, shard, group)
    }

    /// This rank's rows of `weight` under the loader's prefix (e.g. `model.embed_tokens`),
    /// reading only them.
    pub fn load(ld: &Loader<'_>) -> Result<VocabParallelEmbedding> {
        let (rows, _) = ld.dims2("weight")?;
        let shard = TensorShard::new(0, rows, ld.rank(), ld.world_size())?;
        Self::new(ld.rows("weight", shard.start(), shard.len())?, shard, ld.group())
    }

    /// The same table with every looked-up row multiplied by `scale` (rounded to the table's
    /// dtype first, as Gemma's `embed_scale.to(dtype)`): `round(E[t] · round(scale))`.
    pub fn with_scale(mut self, scale: f32) -> VocabParallelEmbedding {
        self.scale = Some(scale);
        self
    }

    /// The same table with row `id` of the full table as torch's `padding_idx`: the lookup
    /// still reads it, but its backward adds nothing to that row (transformers builds every
    /// model's table as `nn.Embedding(V, H, padding_idx=config.pad_token_id)`). `None`, or a row
    /// past the vocabulary, trains every row.
    pub fn with_padding_idx(mut self, id: Option<usize>) -> VocabParallelEmbedding {
        self.padding_idx = id.filter(|&i| i < self.vocab_size());
        self
    }

    /// The row lookups never train, if any.
    pub fn padding_idx(&self) -> Option<usize> {
        self.padding_idx
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
    /// host before anything runs), collective failures.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let group = &self.group;
        check_ids(ids, self.vocab_size())?;
        let local = self.table.embedding(&group.to_local(ids)?, self.shard.start())?;
        let rows = if group.world_size() == 1 { local } else { group.all_reduce(&local, ReduceOp::Sum)? };
        Ok(match self.scale {
            Some(s) => rows.scale(s)?,
            None => rows,
        })
    }

    /// The group the layer runs on.
    pub fn group(&self) -> &DeviceGroup {
        &self.group
    }
}

/// Training: the lookup's gradient is a scatter-add into the rows this rank holds,
/// `dE_r[t - v_r] += s · dy[t]` for every id `t` in `[v_r, v_{r+1})` other than the padding
/// row (`s` the scale rounded to the table's dtype, or 1); no communication (every rank has the
/// whole `dy`). The padding row's gradient is what other uses add ([`add_grad`]: a tied LM
/// head's share), as torch's `padding_idx` leaves it.
///
/// [`add_grad`]: VocabParallelEmbedding::add_grad
impl VocabParallelEmbedding {
    /// Training: the lookup of `batch`'s `ids: [T]` into this rank's rows of the output (all
    /// `T`, all-reduced; or its sequence shard, reduce-scattered).
    pub fn forward_train(&self, ids: &Tensor, batch: &crate::SeqBatch) -> Result<Tensor> {
        if !batch.sequence_parallel() {
            return self.forward(ids);
        }
        check_ids(ids, self.vocab_size())?;
        let local = self.table.embedding(&self.group.to_local(ids)?, self.shard.start())?;
        let rows = batch.reduce(&local, &self.group)?;
        Ok(match self.scale {
            Some(s) => rows.scale(s)?,
            None => rows,
        })
    }

    /// Accumulates `dE_r` from the forward's `ids: [T]` and the output gradient `dy` (this
    /// rank's rows of `batch`, all-gathered first under sequence parallelism).
    /// Nothing with the base frozen ([`crate::lora::frozen_base`]).
    pub fn backward(&mut self, ids: &Tensor, dy: &Tensor, batch: &crate::SeqBatch) -> Result<()> {
        if crate::lora::base_frozen() {
            return Ok(());
        }
        let dy = batch.gather(dy, &self.group)?;
        let dy = &dy;
        let ids = self.trained_ids(&ids.to_device(&tp_core::Device::Cpu)?)?;
        let mut g = dy.embedding_backward(&ids, self.shard.len(), self.shard.start())?;
        if let Some(s) = self.scale {
            let rounded =
                Tensor::from_vec(vec![s], &[1], &tp_core::Device::Cpu)?.to_dtype(self.table.dtype())?.to_f64_vec()?[0];
            g = g.scale(rounded as f32)?;
        }
        self.grad.add(&g)
    }

    /// `ids` (on the host) with the padding row's id replaced by `-1`, which no rank holds:
    /// the scatter-add then skips it. The same tensor when no id is the padding row.
    fn trained_ids(&self, ids: &Tensor) -> Result<Tensor> {
        let Some(pad) = self.padding_idx.and_then(|p| i64::try_from(p).ok()) else { return Ok(ids.clone()) };
        let mut values = ids.to_i64_vec()?;
        if !values.contains(&pad) {
            return Ok(ids.clone());
        }
        values.iter_mut().filter(|v| **v == pad).for_each(|v| *v = -1);
        Ok(Tensor::from_vec(values, ids.dims(), &tp_core::Device::Cpu)?)
    }

    /// Adds `g: [V_r, H]` to the table's gradient: the LM head's share when it is tied to
    /// this table (one parameter, the sum of both uses).
    pub fn add_grad(&mut self, g: &Tensor) -> Result<()> {
        self.grad.add(g)
    }

    /// The table as the parameter `{prefix}.weight`: rows `shard` of the full `[V, H]`.
    pub fn params<'a>(&'a mut self, prefix: &str, f: &mut dyn FnMut(crate::Param<'a>)) {
        let (s, h) = (self.shard, self.hidden_size());
        let p = crate::Placement::block(
            crate::parts::join(prefix, "weight"),
            &[s.global_len(), h],
            0,
            (0, s.start(), s.len()),
        );
        f(crate::Param { value: &mut self.table, grad: &mut self.grad, placements: vec![p] });
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
