//! [`RowParallel`]: a linear layer split by input features.
//!
//! `Y = X A^T + b` with `A: [out, in]` split by columns, `A = [A_0, .., A_{p-1}]`, and the input
//! split to match, `X = [X_0, .., X_{p-1}]` (balanced `TensorShard` on `in`). Rank `r` holds
//! `A_r` and computes the partial product `X_r A_r^T`; an all-reduce sums the partials,
//! `Y = Σ_r X_r A_r^T`, and the full bias `b` is added once, after the reduction.
//!
//! The column blocks need not be the balanced ones: any partition of `in` into per-rank ranges
//! gives the same sum. Attention's output projection uses that: rank `r`'s block is the features
//! of the query heads it holds ([`RowParallel::load_columns`]), uneven heads included.

use crate::checkpoint::Checkpoint;
use crate::error::{LayerError, Result};
use crate::options::LoadOptions;
use tp_comm::{DeviceGroup, ReduceOp};
use tp_core::{Tensor, TensorShard};

/// Rank `shard.rank()`'s part of a row-parallel linear layer.
#[derive(Debug, Clone)]
pub struct RowParallel {
    /// `A_r: [out, in_r]`.
    weight: Tensor,
    /// The full `b: [out]` (every rank holds it; it is added after the all-reduce).
    bias: Option<Tensor>,
    shard: TensorShard,
}

impl RowParallel {
    /// Wraps a local shard: `weight` holds columns `shard.start()..shard.end()` of the full
    /// `[out, in]` weight (the balanced shard, or any range built with
    /// `TensorShard::with_range`); `shard.dim()` must be 1; `bias` is the full `[out]` bias.
    pub fn new(weight: Tensor, bias: Option<Tensor>, shard: TensorShard) -> Result<RowParallel> {
        let &[out, in_r] = weight.dims() else {
            return Err(LayerError::Config(format!("RowParallel weight must be [out, in_r], got {:?}", weight.dims())));
        };
        if shard.dim() != 1 || shard.len() != in_r {
            return Err(LayerError::Config(format!(
                "RowParallel shard must split dim 1 with {in_r} columns, got dim {} with {}",
                shard.dim(),
                shard.len()
            )));
        }
        if let Some(b) = &bias
            && (b.dims() != [out] || b.dtype() != weight.dtype() || b.device() != weight.device())
        {
            return Err(LayerError::Config(format!(
                "RowParallel bias must be [{out}] like the weight, got {:?}",
                b.dims()
            )));
        }
        Ok(RowParallel { weight, bias, shard })
    }

    /// Rank `rank`'s shard of a full `[out, in]` weight (and the full bias).
    pub fn from_full(weight: &Tensor, bias: Option<&Tensor>, rank: usize, world_size: usize) -> Result<RowParallel> {
        let in_features = weight.shape().dim("RowParallel", 1)?;
        let shard = TensorShard::new(1, in_features, rank, world_size)?;
        Self::new(shard.shard(weight)?, bias.cloned(), shard)
    }

    /// Rank `rank`'s columns `cols` of a full `[out, in]` weight (and the full bias): the
    /// [`load_columns`](Self::load_columns) split, from tensors in memory.
    pub fn from_full_columns(
        weight: &Tensor,
        bias: Option<&Tensor>,
        cols: std::ops::Range<usize>,
        rank: usize,
        world_size: usize,
    ) -> Result<RowParallel> {
        let in_features = weight.shape().dim("RowParallel", 1)?;
        let len = cols.end.saturating_sub(cols.start);
        let shard = TensorShard::with_range(1, in_features, rank, world_size, cols.start, len)?;
        Self::new(shard.shard(weight)?, bias.cloned(), shard)
    }

    /// This rank's balanced columns of `{prefix}.weight` (only those bytes are read) and the
    /// full `{prefix}.bias` if present; rank, world size and device come from `group`.
    pub fn load(ckpt: &Checkpoint, prefix: &str, group: &DeviceGroup, opts: &LoadOptions) -> Result<RowParallel> {
        let (_, inp) = weight_dims(ckpt, prefix)?;
        let shard = TensorShard::new(1, inp, group.rank(), group.world_size())?;
        Self::load_shard(ckpt, prefix, shard, group, opts)
    }

    /// Like [`load`](Self::load), but this rank holds input features `cols` (any range, not
    /// necessarily the balanced one): the split must follow the layer before it, as attention's
    /// output projection follows the query heads a rank holds.
    pub fn load_columns(
        ckpt: &Checkpoint,
        prefix: &str,
        cols: std::ops::Range<usize>,
        group: &DeviceGroup,
        opts: &LoadOptions,
    ) -> Result<RowParallel> {
        let (_, inp) = weight_dims(ckpt, prefix)?;
        let len = cols.end.saturating_sub(cols.start);
        let shard = TensorShard::with_range(1, inp, group.rank(), group.world_size(), cols.start, len)?;
        Self::load_shard(ckpt, prefix, shard, group, opts)
    }

    fn load_shard(
        ckpt: &Checkpoint,
        prefix: &str,
        shard: TensorShard,
        group: &DeviceGroup,
        opts: &LoadOptions,
    ) -> Result<RowParallel> {
        let (name, device) = (format!("{prefix}.weight"), group.device());
        let (out, _) = weight_dims(ckpt, prefix)?;
        let weight = ckpt.load_shard(&name, &shard, opts.dtype, &device)?.0;
        let bias_name = format!("{prefix}.bias");
        let bias = if ckpt.contains(&bias_name) {
            ckpt.expect(&bias_name, &[out], None)?;
            Some(ckpt.load(&bias_name, opts.dtype, &device)?)
        } else {
            None
        };
        Self::new(weight, bias, shard)
    }

    /// Which columns of the full weight (input features) this rank holds.
    pub fn shard(&self) -> &TensorShard {
        &self.shard
    }
    /// `A_r`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
    /// The full bias.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// `X_r A_r^T`: this rank's partial product, before any communication.
    pub fn forward_partial(&self, x_local: &Tensor) -> Result<Tensor> {
        Ok(x_local.matmul_t(&self.weight)?)
    }

    /// `Y = Σ_r X_r A_r^T + b` from this rank's input block `x_local: [.., in_r]`.
    pub fn forward(&self, x_local: &Tensor, group: &DeviceGroup) -> Result<Tensor> {
        crate::column::check_group(&self.shard, self.weight.device(), group)?;
        let partial = self.forward_partial(x_local)?;
        let y = group.all_reduce(&partial, ReduceOp::Sum)?;
        Ok(match &self.bias {
            Some(b) => y.add_row(b)?,
            None => y,
        })
    }

    /// [`forward`](Self::forward) from the full input `x: [.., in]`: this rank takes its block.
    pub fn forward_split(&self, x: &Tensor, group: &DeviceGroup) -> Result<Tensor> {
        let last = x.ndim().checked_sub(1).ok_or_else(|| LayerError::Config("input must have a feature dim".into()))?;
        let s = &self.shard;
        let shard = TensorShard::with_range(last, s.global_len(), s.rank(), s.world_size(), s.start(), s.len())?;
        self.forward(&shard.shard(x)?, group)
    }
}

/// `(out, in)` of the 2-D tensor `{prefix}.weight`.
fn weight_dims(ckpt: &Checkpoint, prefix: &str) -> Result<(usize, usize)> {
    let name = format!("{prefix}.weight");
    match ckpt.param_info(&name)?.1[..] {
        [out, inp] => Ok((out, inp)),
        ref dims => Err(LayerError::Config(format!(
            "checkpoint tensor {name:?} has shape {dims:?}; a 2-D [out, in] weight was expected"
        ))),
    }
}
