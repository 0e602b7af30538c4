//! [`RowParallel`]: a linear layer split by input features.
//!
//! `Y = X A^T + b` with `A: [out, in]` split by columns, `A = [A_0, .., A_{p-1}]`, and the input
//! split to match, `X = [X_0, .., X_{p-1}]` (balanced `TensorShard` on `in`). Rank `r` holds
//! `A_r` and computes the partial product `X_r A_r^T`; an all-reduce sums the partials,
//! `Y = Σ_r X_r A_r^T`, and the full bias `b` is added once, after the reduction.

use crate::checkpoint::Checkpoint;
use crate::error::{LayerError, Result};
use tp_comm::{DeviceGroup, ReduceOp};
use tp_core::{DType, Device, Tensor, TensorShard};

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
    /// `[out, in]` weight; `shard.dim()` must be 1; `bias` is the full `[out]` bias.
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

    /// Rank `rank`'s columns of `{prefix}.weight` (only those bytes are read) and the full
    /// `{prefix}.bias` if present. `out_features` is checked when given.
    pub fn load(
        ckpt: &Checkpoint,
        prefix: &str,
        out_features: Option<usize>,
        rank: usize,
        world_size: usize,
        dtype: Option<DType>,
        device: &Device,
    ) -> Result<RowParallel> {
        let name = format!("{prefix}.weight");
        let (_, dims) = ckpt.info(&name)?;
        let [out, inp] = dims[..] else {
            return Err(LayerError::WrongShape { name, found: dims, expected: vec![out_features.unwrap_or(0), 0] });
        };
        if let Some(want) = out_features
            && want != out
        {
            return Err(LayerError::WrongShape { name, found: dims, expected: vec![want, inp] });
        }
        let shard = TensorShard::new(1, inp, rank, world_size)?;
        let weight = ckpt.load_shard(&name, &shard, dtype, device)?.0;
        let bias_name = format!("{prefix}.bias");
        let bias = if ckpt.contains(&bias_name) {
            ckpt.expect(&bias_name, &[out], None)?;
            Some(ckpt.load(&bias_name, dtype, device)?)
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
        crate::column::check_group(&self.shard, group)?;
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
        let shard = TensorShard::new(last, self.shard.global_len(), self.shard.rank(), self.shard.world_size())?;
        self.forward(&shard.shard(x)?, group)
    }
}
