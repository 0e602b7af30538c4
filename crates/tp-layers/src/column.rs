//! [`ColumnParallel`]: a linear layer split by output features.
//!
//! `Y = X A^T + b` with `A: [out, in]` split by rows, `A = [A_0; ..; A_{p-1}]` and
//! `b = [b_0, .., b_{p-1}]` (the balanced `TensorShard` policy on `out`). Rank `r` holds `A_r`
//! and `b_r` and computes `Y_r = X A_r^T + b_r`, with no communication; the outputs are the
//! column blocks of `Y = [Y_0, .., Y_{p-1}]`, joined, when needed, by an all-gather along the
//! last dim (uneven blocks exact).

use crate::checkpoint::Checkpoint;
use crate::error::{LayerError, Result};
use crate::linear::Linear;
use crate::options::LoadOptions;
use tp_comm::DeviceGroup;
use tp_core::{Device, Tensor, TensorShard};

/// Rank `shard.rank()`'s part of a column-parallel linear layer.
#[derive(Debug, Clone)]
pub struct ColumnParallel {
    linear: Linear,
    shard: TensorShard,
}

impl ColumnParallel {
    /// Wraps a local shard: `linear` holds rows `shard.start()..shard.end()` of the full weight
    /// (and those entries of the bias). `shard.dim()` must be 0 (output features).
    pub fn new(linear: Linear, shard: TensorShard) -> Result<ColumnParallel> {
        if shard.dim() != 0 || linear.out_features() != shard.len() {
            return Err(LayerError::Config(format!(
                "ColumnParallel shard must split dim 0 with {} rows, got dim {} with {}",
                linear.out_features(),
                shard.dim(),
                shard.len()
            )));
        }
        Ok(ColumnParallel { linear, shard })
    }

    /// Rank `rank`'s shard of a full layer.
    pub fn from_full(full: &Linear, rank: usize, world_size: usize) -> Result<ColumnParallel> {
        let shard = TensorShard::new(0, full.out_features(), rank, world_size)?;
        let weight = shard.shard(full.weight())?;
        let bias = full.bias().map(|b| shard.shard(b)).transpose()?;
        Self::new(Linear::new(weight, bias)?, shard)
    }

    /// This rank's shard of `{prefix}.weight` (`[out, in]`) and `{prefix}.bias` (if the
    /// checkpoint has it), reading only this rank's rows; rank, world size and device come from
    /// `group`.
    pub fn load(ckpt: &Checkpoint, prefix: &str, group: &DeviceGroup, opts: &LoadOptions) -> Result<ColumnParallel> {
        let (weight, shard) = load_rows(ckpt, &format!("{prefix}.weight"), group, opts)?;
        let bias_name = format!("{prefix}.bias");
        let bias = if ckpt.contains(&bias_name) {
            Some(ckpt.load_shard(&bias_name, &shard, opts.dtype, &group.device())?.0)
        } else {
            None
        };
        Self::new(Linear::new(weight, bias)?, shard)
    }

    /// Which rows of the full weight (output features) this rank holds.
    pub fn shard(&self) -> &TensorShard {
        &self.shard
    }
    /// The local layer (`A_r`, `b_r`).
    pub fn local(&self) -> &Linear {
        &self.linear
    }

    /// `Y_r = X A_r^T + b_r`: this rank's block of output columns. No communication.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.linear.forward(x)
    }

    /// The full `Y`: the local block, then an all-gather of every rank's block along the last
    /// dim through `group`.
    pub fn forward_gathered(&self, x: &Tensor, group: &DeviceGroup) -> Result<Tensor> {
        check_group(&self.shard, self.linear.device(), group)?;
        let y = self.forward(x)?;
        Ok(group.all_gather_balanced(&y, y.ndim() - 1, self.shard.global_len())?)
    }
}

/// Checks that a layer built for `shard`'s rank and world size, with parameters on `device`,
/// is used with a matching group.
pub(crate) fn check_group(shard: &TensorShard, device: Device, group: &DeviceGroup) -> Result<()> {
    if group.rank() != shard.rank() || group.world_size() != shard.world_size() || group.device() != device {
        return Err(LayerError::WrongGroup {
            layer_rank: shard.rank(),
            layer_world: shard.world_size(),
            layer_device: device,
            group_rank: group.rank(),
            group_world: group.world_size(),
            group_device: group.device(),
        });
    }
    Ok(())
}

/// This rank's balanced rows of a 2-D `[out, in]` tensor `name`, on the group's device.
pub(crate) fn load_rows(
    ckpt: &Checkpoint,
    name: &str,
    group: &DeviceGroup,
    opts: &LoadOptions,
) -> Result<(Tensor, TensorShard)> {
    let (_, dims) = ckpt.param_info(name)?;
    let [out, _] = dims[..] else {
        return Err(LayerError::Config(format!(
            "checkpoint tensor {name:?} has shape {dims:?}; a 2-D [out, in] weight was expected"
        )));
    };
    let shard = TensorShard::new(0, out, group.rank(), group.world_size())?;
    Ok((ckpt.load_shard(name, &shard, opts.dtype, &group.device())?.0, shard))
}
