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

use crate::column::check_placement;
use crate::error::{LayerError, Result};
use crate::loader::Loader;
use crate::weight::Weight;
use std::ops::Range;
use tp_comm::{DeviceGroup, ReduceOp};
use tp_core::{Tensor, TensorShard};

/// Rank `r`'s part of a row-parallel linear layer, with the group it runs on.
#[derive(Debug, Clone)]
pub struct RowParallel {
    /// `A_r: [out, in_r]` (packed for the host GEMM once [`pack_host`](Self::pack_host) ran).
    weight: Weight,
    /// The full `b: [out]` (every rank holds it; it is added after the all-reduce).
    bias: Option<Tensor>,
    /// fp32 gradients of `A_r` and `b` (training).
    grad_weight: crate::Grad,
    grad_bias: crate::Grad,
    /// A LoRA adapter on the layer, if any ([`crate::lora`]).
    lora: Option<Box<crate::lora::Lora>>,
    shard: TensorShard,
    group: DeviceGroup,
}

impl RowParallel {
    /// Wraps a local shard for `group`'s rank: `weight` holds columns
    /// `shard.start()..shard.end()` of the full `[out, in]` weight (the balanced shard, or any
    /// range built with `TensorShard::with_range`); `shard.dim()` must be 1; `bias` is the full
    /// `[out]` bias.
    pub fn new(
        weight: impl Into<Weight>,
        bias: Option<Tensor>,
        shard: TensorShard,
        group: &DeviceGroup,
    ) -> Result<RowParallel> {
        let weight = weight.into();
        let (out, in_r) = weight.check_2d("RowParallel")?;
        if shard.dim() != 1 || shard.len() != in_r {
            return Err(LayerError::Config(format!(
                "RowParallel shard must split dim 1 with {in_r} columns, got dim {} with {}",
                shard.dim(),
                shard.len()
            )));
        }
        if let Some(b) = &bias {
            crate::linear::check_bias(b, out, &weight, "RowParallel")?;
        }
        check_placement(&shard, weight.device(), group)?;
        Ok(RowParallel {
            weight,
            bias,
            grad_weight: crate::Grad::default(),
            grad_bias: crate::Grad::default(),
            lora: None,
            shard,
            group: group.clone(),
        })
    }

    /// `group`'s rank's balanced columns of a full `[out, in]` weight (and the full bias),
    /// moved to the group's device.
    pub fn from_full(weight: &Tensor, bias: Option<&Tensor>, group: &DeviceGroup) -> Result<RowParallel> {
        let in_features = weight.shape().dim("RowParallel", 1)?;
        let shard = TensorShard::new(1, in_features, group.rank(), group.world_size())?;
        Self::from_full_shard(weight, bias, shard, group)
    }

    /// `group`'s rank's columns `cols` of a full `[out, in]` weight (and the full bias): the
    /// [`load_columns`](Self::load_columns) split, from tensors in memory.
    pub fn from_full_columns(
        weight: &Tensor,
        bias: Option<&Tensor>,
        cols: Range<usize>,
        group: &DeviceGroup,
    ) -> Result<RowParallel> {
        let in_features = weight.shape().dim("RowParallel", 1)?;
        let len = cols.end.saturating_sub(cols.start);
        let shard = TensorShard::with_range(1, in_features, group.rank(), group.world_size(), cols.start, len)?;
        Self::from_full_shard(weight, bias, shard, group)
    }

    fn from_full_shard(
        weight: &Tensor,
        bias: Option<&Tensor>,
        shard: TensorShard,
        group: &DeviceGroup,
    ) -> Result<RowParallel> {
        let device = group.device();
        let bias = bias.map(|b| b.to_device(&device)).transpose()?;
        Self::new(shard.shard(weight)?.to_device(&device)?, bias, shard, group)
    }

    /// This rank's balanced columns of `weight` (only those bytes are read) and the full `bias`
    /// if present, under the loader's prefix.
    pub fn load(ld: &Loader<'_>) -> Result<RowParallel> {
        let (_, inp) = ld.dims2("weight")?;
        let shard = TensorShard::new(1, inp, ld.rank(), ld.world_size())?;
        Self::load_shard(ld, shard)
    }

    /// Like [`load`](Self::load), but this rank holds input features `cols` (any range, not
    /// necessarily the balanced one): the split must follow the layer before it, as attention's
    /// output projection follows the query heads a rank holds.
    pub fn load_columns(ld: &Loader<'_>, cols: Range<usize>) -> Result<RowParallel> {
        let (_, inp) = ld.dims2("weight")?;
        let len = cols.end.saturating_sub(cols.start);
        let shard = TensorShard::with_range(1, inp, ld.rank(), ld.world_size(), cols.start, len)?;
        Self::load_shard(ld, shard)
    }

    fn load_shard(ld: &Loader<'_>, shard: TensorShard) -> Result<RowParallel> {
        let (out, _) = ld.dims2("weight")?;
        let weight = ld.linear_columns("weight", shard.start(), shard.len())?;
        let bias = if ld.contains("bias") {
            ld.expect("bias", &[out])?;
            Some(ld.full("bias")?)
        } else {
            None
        };
        Self::new(weight, bias, shard, ld.group())
    }

    /// Which columns of the full weight (input features) this rank holds.
    pub fn shard(&self) -> &TensorShard {
        &self.shard
    }
    /// `A_r` as a tensor; an error for quantized blocks ([`Weight::dense`]).
    pub fn weight(&self) -> Result<&Tensor> {
        self.weight.dense()
    }
    /// `A_r`, however it is held.
    pub fn weights(&self) -> &Weight {
        &self.weight
    }
    /// The full bias.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }
    /// The group the layer runs on.
    pub fn group(&self) -> &DeviceGroup {
        &self.group
    }

    /// `X_r A_r^T`: this rank's partial product, before any communication; with a LoRA
    /// adapter, plus its partial `s · (X_r LA_r^T) LB^T`, which the same reduction completes.
    pub fn forward_partial(&self, x_local: &Tensor) -> Result<Tensor> {
        let y = self.weight.matmul_t(x_local)?;
        match &self.lora {
            Some(l) => l.forward(x_local, y),
            None => Ok(y),
        }
    }

    /// The layer's LoRA adapter, if any.
    pub fn lora(&self) -> Option<&crate::lora::Lora> {
        self.lora.as_deref()
    }

    /// Packs the weight once into the host GEMM's panels (host weights only; a no-op on a GPU
    /// or when already packed), so that products of many rows (prefill, batched decode) stop
    /// repacking it: the same numbers, bitwise, for as much memory again as the weight.
    pub fn pack_host(&mut self) -> Result<()> {
        self.weight.pack_host()
    }

    /// `Y = Σ_r X_r A_r^T + b` from this rank's input block `x_local: [.., in_r]`.
    pub fn forward(&self, x_local: &Tensor) -> Result<Tensor> {
        let partial = self.forward_partial(x_local)?;
        let y = self.group.all_reduce(&partial, ReduceOp::Sum)?;
        Ok(match &self.bias {
            Some(b) => y.add_row(b)?,
            None => y,
        })
    }

    /// [`forward`](Self::forward) from the full input `x: [.., in]`: this rank takes its block.
    pub fn forward_split(&self, x: &Tensor) -> Result<Tensor> {
        let last = x.ndim().checked_sub(1).ok_or_else(|| LayerError::Config("input must have a feature dim".into()))?;
        let s = &self.shard;
        let shard = TensorShard::with_range(last, s.global_len(), s.rank(), s.world_size(), s.start(), s.len())?;
        self.forward(&shard.shard(x)?)
    }
}

/// Training.
///
/// With `Y = Σ_r X_r A_r^T + b` and `dY` the same on every rank: `dX_r = dY A_r` (this rank's
/// input columns, no communication: Megatron's reduce-from-region backward is the identity),
/// `dA_r += dY^T X_r`, and the bias, added once after the reduction, gets the full
/// `db += Σ_t dY[t]` on every rank (identical, so counted once).
impl RowParallel {
    /// The bias added to reduced outputs `y` (`y` itself when the layer has none).
    pub fn add_bias(&self, y: Tensor) -> Result<Tensor> {
        Ok(match &self.bias {
            Some(b) => y.add_row(b)?,
            None => y,
        })
    }

    /// `dX_r: [T, in_r]` (f32) from `dy: [T, out]`, accumulating `dA_r` and `db`; `x_local` is
    /// the forward's input block.
    /// With a LoRA adapter, its `dA_r`, `dB` (partial) and `dX_r` share too.
    pub fn backward(&mut self, x_local: &Tensor, dy: &Tensor) -> Result<Tensor> {
        let mut dx = self.weight.input_grad(dy)?;
        if let Some(l) = &mut self.lora {
            dx = l.input_grad(dy, dx)?;
            l.accumulate(x_local, dy)?;
        }
        self.grad_weight.add_weight_grad(x_local, dy)?;
        if self.bias.is_some() {
            self.grad_bias.add_bias_grad(dy)?;
        }
        Ok(dx)
    }

    /// `A_r` and `b` as parameters `{prefix}.weight` (columns `shard` of the full `[out, in]`)
    /// and `{prefix}.bias` (replicated). With the base frozen ([`crate::lora::frozen_base`]),
    /// the layer's LoRA adapter instead (attached first inside [`crate::lora::attaching`]).
    pub fn params<'a>(&'a mut self, prefix: &str, f: &mut dyn FnMut(crate::Param<'a>)) -> Result<()> {
        let s = self.shard;
        let out = self.weight.out_features();
        let w = crate::Placement::block(
            crate::parts::join(prefix, "weight"),
            &[out, s.global_len()],
            1,
            (0, s.start(), s.len()),
        );
        let local = (out, s.len());
        if crate::lora::visit(&mut self.lora, std::slice::from_ref(&w), local, &self.weight.device(), f)? {
            return Ok(());
        }
        f(crate::Param { value: self.weight.dense_mut()?, grad: &mut self.grad_weight, placements: vec![w] });
        if let Some(b) = &mut self.bias {
            // The bias is whole on every rank that holds the layer, and owned by one of them: rank
            // 0, or the one rank holding every input feature (an expert held whole under expert
            // parallelism, which the other ranks do not hold at all).
            let owner = if s.len() == s.global_len() { 0 } else { self.group.rank() };
            let p = crate::Placement::replicated(crate::parts::join(prefix, "bias"), &[out], owner, false);
            f(crate::Param { value: b, grad: &mut self.grad_bias, placements: vec![p] });
        }
        Ok(())
    }
}
