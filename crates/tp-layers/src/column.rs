//! [`ColumnParallel`]: a linear layer split by output features.
//!
//! `Y = X A^T + b` with `A: [out, in]` split by rows, `A = [A_0; ..; A_{p-1}]` and
//! `b = [b_0, .., b_{p-1}]` (the balanced `TensorShard` policy on `out`). Rank `r` holds `A_r`
//! and `b_r` and computes `Y_r = X A_r^T + b_r`, with no communication; the outputs are the
//! column blocks of `Y = [Y_0, .., Y_{p-1}]`, joined, when needed, by an all-gather along the
//! last dim (uneven blocks exact).

use crate::error::{LayerError, Result};
use crate::linear::Linear;
use crate::loader::Loader;
use tp_comm::DeviceGroup;
use tp_core::{Tensor, TensorShard};

/// Rank `r`'s part of a column-parallel linear layer, with the group it runs on.
#[derive(Debug, Clone)]
pub struct ColumnParallel {
    linear: Linear,
    shard: TensorShard,
    group: DeviceGroup,
}

impl ColumnParallel {
    /// Packs the local weight once into the host GEMM's panels (host weights only; a no-op on a GPU
    /// or when already packed), so that products of many rows (prefill, batched decode) stop
    /// repacking it: the same numbers, bitwise, for as much memory again as the weight.
    pub fn pack_host(&mut self) -> Result<()> {
        self.linear.pack_host()
    }

    /// Wraps a local shard for `group`'s rank: `linear` holds rows `shard.start()..shard.end()`
    /// of the full weight (and those entries of the bias); `shard` splits dim 0 over the group.
    pub fn new(linear: Linear, shard: TensorShard, group: &DeviceGroup) -> Result<ColumnParallel> {
        if shard.dim() != 0 || linear.out_features() != shard.len() {
            return Err(LayerError::Config(format!(
                "ColumnParallel shard must split dim 0 with {} rows, got dim {} with {}",
                linear.out_features(),
                shard.dim(),
                shard.len()
            )));
        }
        check_placement(&shard, linear.device(), group)?;
        Ok(ColumnParallel { linear, shard, group: group.clone() })
    }

    /// `group`'s rank's shard of a full layer (moved to the group's device).
    pub fn from_full(full: &Linear, group: &DeviceGroup) -> Result<ColumnParallel> {
        let shard = TensorShard::new(0, full.out_features(), group.rank(), group.world_size())?;
        let weight = shard.shard(full.weight()?)?.to_device(&group.device())?;
        let bias = full.bias().map(|b| shard.shard(b)?.to_device(&group.device())).transpose()?;
        Self::new(Linear::new(weight, bias)?, shard, group)
    }

    /// This rank's rows of `weight` (`[out, in]`) and of `bias` when the checkpoint has it,
    /// under the loader's prefix (`Loader::pp("q_proj")`).
    pub fn load(ld: &Loader<'_>) -> Result<ColumnParallel> {
        let (out, _) = ld.dims2("weight")?;
        let shard = TensorShard::new(0, out, ld.rank(), ld.world_size())?;
        let weight = ld.linear_rows("weight", shard.start(), shard.len())?;
        let bias = if ld.contains("bias") {
            ld.expect("bias", &[out])?;
            Some(ld.rows("bias", shard.start(), shard.len())?)
        } else {
            None
        };
        Self::new(Linear::new(weight, bias)?, shard, ld.group())
    }

    /// Which rows of the full weight (output features) this rank holds.
    pub fn shard(&self) -> &TensorShard {
        &self.shard
    }
    /// The local layer (`A_r`, `b_r`).
    pub fn local(&self) -> &Linear {
        &self.linear
    }
    /// The group the layer runs on.
    pub fn group(&self) -> &DeviceGroup {
        &self.group
    }

    /// `Y_r = X A_r^T + b_r`: this rank's block of output columns. No communication.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.linear.forward(x)
    }

    /// The full `Y`: the local block, then an all-gather of every rank's block along the last
    /// dim.
    pub fn forward_gathered(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.forward(x)?;
        Ok(self.group.all_gather_balanced(&y, y.ndim() - 1, self.shard.global_len())?)
    }
}

/// Training.
///
/// `dX = Σ_r dY_r A_r`: each rank's product is partial (its output columns only), so the
/// ranks all-reduce it (Megatron's copy-to-region backward); the all-reduce is issued before
/// the weight gradient `dA_r += dY_r^T X` (and `db_r += Σ_t dY_r[t]`) is computed, so the two
/// overlap where the backend overlaps.
impl ColumnParallel {
    /// `dX: [T, in]` (f32, every rank the same) from this rank's output gradient
    /// `dy_r: [T, out_r]`, accumulating `dA_r`, `db_r`; `x` is the forward's input.
    pub fn backward(&mut self, x: &Tensor, dy_r: &Tensor) -> Result<Tensor> {
        column_backward(&mut self.linear, &self.group, x, dy_r, None)
    }

    /// The local weight and bias as parameters `{prefix}.weight` / `{prefix}.bias`: rows
    /// `shard` of the full tensors.
    pub fn params<'a>(&'a mut self, prefix: &str, f: &mut dyn FnMut(crate::Param<'a>)) -> Result<()> {
        let s = self.shard;
        let (full, width) = (s.global_len(), self.linear.in_features());
        let block = (0, s.start(), s.len());
        let w = crate::Placement::block(crate::parts::join(prefix, "weight"), &[full, width], 0, block);
        let b = crate::Placement::block(crate::parts::join(prefix, "bias"), &[full], 0, block);
        self.linear.params(vec![w], vec![b], f)
    }
}

/// The backward of a column-parallel `linear` on `group`: the all-reduce of `dX` issued, the
/// weight gradient computed, then the all-reduce waited for. Under sequence parallelism
/// (`batch`), `dX` is reduce-scattered to this rank's rows instead.
pub(crate) fn column_backward(
    linear: &mut Linear,
    group: &DeviceGroup,
    x: &Tensor,
    dy: &Tensor,
    batch: Option<&crate::SeqBatch>,
) -> Result<Tensor> {
    let partial = linear.input_grad(dy)?;
    if group.world_size() == 1 {
        linear.accumulate_grads(x, dy)?;
        return Ok(partial);
    }
    if let Some(b) = batch.filter(|b| b.sequence_parallel()) {
        linear.accumulate_grads(x, dy)?;
        return b.reduce(&partial, group);
    }
    let work = group.all_reduce_async(&partial, tp_comm::ReduceOp::Sum)?;
    let grads = linear.accumulate_grads(x, dy);
    let dx = work.wait()?;
    grads?;
    Ok(dx)
}

/// Checks, once when a layer is built, that a shard of `shard`'s rank and world size with
/// parameters on `device` belongs to `group`.
pub(crate) fn check_placement(shard: &TensorShard, device: tp_core::Device, group: &DeviceGroup) -> Result<()> {
    if group.rank() != shard.rank() || group.world_size() != shard.world_size() || group.device() != device {
        return Err(LayerError::Config(format!(
            "a shard of rank {} of {} on {device} cannot run on rank {} of {} on {}",
            shard.rank(),
            shard.world_size(),
            group.rank(),
            group.world_size(),
            group.device()
        )));
    }
    Ok(())
}
