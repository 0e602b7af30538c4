//! [`MergedColumnParallel`]: several column-parallel projections of the same input in one GEMM.
//!
//! For projections `A^(0), .., A^(k-1)` (e.g. an MLP's gate and up), rank `r` holds its balanced
//! row shard of each and stacks them, `[A^(0)_r; ..; A^(k-1)_r]`, so one GEMM gives
//! `[Y^(0)_r | .. | Y^(k-1)_r]`. No communication.

use crate::checkpoint::Checkpoint;
use crate::column::load_rows;
use crate::error::{LayerError, Result};
use crate::linear::Linear;
use crate::options::LoadOptions;
use tp_comm::DeviceGroup;
use tp_core::{Tensor, TensorShard};

/// Rank `r`'s stacked shards of several column-parallel projections.
#[derive(Debug, Clone)]
pub struct MergedColumnParallel {
    linear: Linear,
    shards: Vec<TensorShard>,
}

impl MergedColumnParallel {
    /// Wraps a local stacked layer whose row blocks are `shards` (each over dim 0 of its part).
    pub fn new(linear: Linear, shards: Vec<TensorShard>) -> Result<MergedColumnParallel> {
        let rows: usize = shards.iter().map(|s| s.len()).sum();
        if shards.is_empty() || rows != linear.out_features() || shards.iter().any(|s| s.dim() != 0) {
            return Err(LayerError::Config(format!(
                "merged layer has {} rows but its dim-0 shards cover {rows}",
                linear.out_features()
            )));
        }
        Ok(MergedColumnParallel { linear, shards })
    }

    /// Rank `rank`'s stacked shards of full layers `parts` (same input size, dtype, device).
    pub fn from_full(parts: &[&Linear], rank: usize, world_size: usize) -> Result<MergedColumnParallel> {
        let mut weights = Vec::new();
        let mut biases = Vec::new();
        let mut shards = Vec::new();
        for p in parts {
            let s = TensorShard::new(0, p.out_features(), rank, world_size)?;
            weights.push(s.shard(p.weight())?);
            biases.push(p.bias().map(|b| s.shard(b)).transpose()?);
            shards.push(s);
        }
        let bias = if biases.iter().all(Option::is_some) {
            Some(Tensor::cat(&biases.into_iter().flatten().collect::<Vec<_>>(), 0)?)
        } else if biases.iter().all(Option::is_none) {
            None
        } else {
            return Err(LayerError::Config("merged parts must all have a bias or all have none".into()));
        };
        Self::new(Linear::new(Tensor::cat(&weights, 0)?, bias)?, shards)
    }

    /// Loads `{prefix}.weight` of each prefix (and `.bias` when every part has one), reading only
    /// this rank's rows of each; rank, world size and device come from `group`. The parts must
    /// share their input size.
    pub fn load(
        ckpt: &Checkpoint,
        prefixes: &[&str],
        group: &DeviceGroup,
        opts: &LoadOptions,
    ) -> Result<MergedColumnParallel> {
        let mut weights = Vec::new();
        let mut shards = Vec::new();
        for p in prefixes {
            let (w, s) = load_rows(ckpt, &format!("{p}.weight"), group, opts)?;
            if let Some(first) = weights.first().map(|w: &Tensor| w.dims()[1])
                && first != w.dims()[1]
            {
                return Err(LayerError::Config(format!(
                    "{prefixes:?} do not share an input size ({first} vs {} in {p})",
                    w.dims()[1]
                )));
            }
            weights.push(w);
            shards.push(s);
        }
        let has_bias: Vec<bool> = prefixes.iter().map(|p| ckpt.contains(&format!("{p}.bias"))).collect();
        let bias = if has_bias.iter().all(|&b| b) {
            let parts = prefixes
                .iter()
                .zip(&shards)
                .map(|(p, s)| Ok(ckpt.load_shard(&format!("{p}.bias"), s, opts.dtype, &group.device())?.0))
                .collect::<Result<Vec<_>>>()?;
            Some(Tensor::cat(&parts, 0)?)
        } else if has_bias.iter().any(|&b| b) {
            return Err(LayerError::Config(format!("some of {prefixes:?} have a bias and some do not")));
        } else {
            None
        };
        Self::new(Linear::new(Tensor::cat(&weights, 0)?, bias)?, shards)
    }

    /// Each part's shard, in order.
    pub fn shards(&self) -> &[TensorShard] {
        &self.shards
    }
    /// The local stacked layer.
    pub fn local(&self) -> &Linear {
        &self.linear
    }

    /// `[Y^(0)_r | .. | Y^(k-1)_r]` in one GEMM.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.linear.forward(x)
    }

    /// Splits a local output into the parts' blocks.
    pub fn split(&self, y: &Tensor) -> Result<Vec<Tensor>> {
        let last = y.ndim().saturating_sub(1);
        let mut start = 0;
        self.shards
            .iter()
            .map(|s| {
                let t = y.narrow(last, start, s.len())?;
                start += s.len();
                Ok(t)
            })
            .collect()
    }

    /// Every part's full output `Y^(i)`, each all-gathered along the last dim.
    pub fn forward_gathered(&self, x: &Tensor, group: &DeviceGroup) -> Result<Vec<Tensor>> {
        crate::column::check_group(&self.shards[0], self.linear.device(), group)?;
        let y = self.forward(x)?;
        let parts = self.split(&y)?;
        parts
            .iter()
            .zip(&self.shards)
            .map(|(p, s)| Ok(group.all_gather_balanced(p, p.ndim() - 1, s.global_len())?))
            .collect()
    }
}
