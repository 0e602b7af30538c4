//! [`ParallelLmHead`]: the output projection split over the vocabulary, with a greedy argmax
//! that never gathers the logits.
//!
//! `logits = h W^T` with `W: [V, H]` split by rows like the embedding (balanced, uneven `V`
//! exact): rank `r` computes `L_r = h W_r^T`, the columns `v_r .. v_{r+1}` of the logits, with
//! no communication. [`ParallelLmHead::logits`] all-gathers them into `[.., V]` (exact).
//! [`ParallelLmHead::argmax`] instead takes each rank's local `(max, index)` per row and
//! all-gathers only those (`2 × world` numbers per token): the global argmax is the best of the
//! local ones, the lowest index winning ties (the lowest rank holds the lowest indices), NaN
//! beating numbers, as `torch.argmax` over the full logits. With tied embeddings
//! (`tie_word_embeddings`), `W` is the embedding table and the rank reuses its shard.
//!
//! Gemma's final-logit soft-capping, `L ← c · tanh(L / c)` rounded after each of the three
//! operations as PyTorch does, is element-wise and monotonic: each rank caps its own columns
//! before anything leaves it, so gathered logits and the argmax both see capped values.

use crate::column::check_placement;
use crate::embedding::VocabParallelEmbedding;
use crate::error::{LayerError, Result};
use crate::loader::Loader;
use crate::weight::Weight;
use tp_comm::DeviceGroup;
use tp_core::{Device, Tensor, TensorShard};

/// Rank `shard.rank()`'s rows of a vocab-parallel LM head.
#[derive(Debug, Clone)]
pub struct ParallelLmHead {
    /// `W_r: [V_r, H]` (packed for the host GEMM once [`pack_host`](Self::pack_host) ran).
    weight: Weight,
    shard: TensorShard,
    /// Final-logit soft-capping `c`, if any.
    softcap: Option<f32>,
    group: DeviceGroup,
    /// fp32 gradient of `W_r` (training; [`loss_backward`](Self::loss_backward) adds to it).
    pub(crate) grad: crate::Grad,
}

impl ParallelLmHead {
    /// Wraps a local weight holding rows `shard.start()..shard.end()` of the full `[V, H]`.
    pub fn new(weight: impl Into<Weight>, shard: TensorShard, group: &DeviceGroup) -> Result<ParallelLmHead> {
        let weight = weight.into();
        let (rows, _) = weight.check_2d("LM head")?;
        if shard.dim() != 0 || rows != shard.len() {
            return Err(LayerError::Config(format!(
                "LM head weight of {rows} rows does not hold the {} rows of its shard",
                shard.len()
            )));
        }
        check_placement(&shard, weight.device(), group)?;
        Ok(ParallelLmHead { weight, shard, softcap: None, group: group.clone(), grad: crate::Grad::default() })
    }

    /// `group`'s rank's rows of a full `[V, H]` weight (moved to the group's device).
    pub fn from_full(weight: &Tensor, group: &DeviceGroup) -> Result<ParallelLmHead> {
        let rows = weight.shape().dim("ParallelLmHead", 0)?;
        let shard = TensorShard::new(0, rows, group.rank(), group.world_size())?;
        Self::new(shard.shard(weight)?.to_device(&group.device())?, shard, group)
    }

    /// This rank's rows of `weight` under the loader's prefix (e.g. `lm_head`).
    pub fn load(ld: &Loader<'_>) -> Result<ParallelLmHead> {
        let (rows, _) = ld.dims2("weight")?;
        let shard = TensorShard::new(0, rows, ld.rank(), ld.world_size())?;
        Self::new(ld.linear_rows("weight", shard.start(), shard.len())?, shard, ld.group())
    }

    /// The head of a model with tied embeddings: the embedding's own shard (shared, not copied),
    /// so in the embedding's dtype, on its device, and with no soft-capping (add it with
    /// [`with_softcap`](Self::with_softcap)). To compute the logits in another dtype, use
    /// [`tied_as`](Self::tied_as).
    pub fn tied(embedding: &VocabParallelEmbedding) -> ParallelLmHead {
        ParallelLmHead {
            weight: embedding.table().clone().into(),
            shard: *embedding.shard(),
            softcap: None,
            group: embedding.group().clone(),
            grad: crate::Grad::default(),
        }
    }

    /// The head of a model with tied embeddings, its weight the embedding's shard converted to
    /// `dtype` (a copy when the dtype differs; shared when it is the same, as [`tied`](Self::tied)).
    /// A tied head is the table itself: training it updates the embedding, so a copy in
    /// another dtype is for inference.
    pub fn tied_as(embedding: &VocabParallelEmbedding, dtype: tp_core::DType) -> Result<ParallelLmHead> {
        let mut head = Self::tied(embedding);
        if embedding.table().dtype() != dtype {
            head.weight = embedding.table().to_dtype(dtype)?.into();
        }
        Ok(head)
    }

    /// The dtype of the logits (the weight's; f32 for quantized blocks).
    pub fn dtype(&self) -> tp_core::DType {
        self.weight.dtype().unwrap_or(tp_core::DType::F32)
    }

    /// The same head with final-logit soft-capping at `cap` (> 0, finite).
    pub fn with_softcap(mut self, cap: f32) -> Result<ParallelLmHead> {
        if !(cap.is_finite() && cap > 0.0) {
            return Err(LayerError::Config(format!("final logit soft-capping must be positive, got {cap}")));
        }
        self.softcap = Some(cap);
        Ok(self)
    }

    /// Vocabulary size `V`.
    pub fn vocab_size(&self) -> usize {
        self.shard.global_len()
    }
    /// Which rows (vocabulary entries) this rank holds.
    pub fn shard(&self) -> &TensorShard {
        &self.shard
    }
    /// The dense weight, writable, and its gradient (training).
    pub(crate) fn weight_and_grad(&mut self) -> Result<(&mut Tensor, &mut crate::Grad)> {
        Ok((self.weight.dense_mut()?, &mut self.grad))
    }
    /// The final-logit soft-capping, if any.
    pub fn softcap(&self) -> Option<f32> {
        self.softcap
    }
    /// `W_r`, however it is held.
    pub fn weights(&self) -> &Weight {
        &self.weight
    }
    /// `W_r` as a tensor; an error for quantized blocks ([`Weight::dense`]).
    pub fn weight(&self) -> Result<&Tensor> {
        self.weight.dense()
    }

    /// Packs the weight once into the host GEMM's panels (host weights only; a no-op on a GPU
    /// or when already packed), so that products of many rows (prefill, batched decode) stop
    /// repacking it: the same numbers, bitwise, for as much memory again as the weight.
    pub fn pack_host(&mut self) -> Result<()> {
        self.weight.pack_host()
    }

    /// `L_r = h W_r^T: [.., V_r]` (soft-capped where the head caps), this rank's columns of
    /// the logits. No communication.
    pub fn forward_local(&self, h: &Tensor) -> Result<Tensor> {
        let l = self.weight.matmul_t(h)?;
        Ok(match self.softcap {
            Some(c) => l.softcap(c)?,
            None => l,
        })
    }

    /// The group the layer runs on.
    pub fn group(&self) -> &DeviceGroup {
        &self.group
    }

    /// The full logits `[.., V]` on every rank (an all-gather along the last dim).
    pub fn logits(&self, h: &Tensor) -> Result<Tensor> {
        let group = &self.group;
        let local = self.forward_local(h)?;
        if group.world_size() == 1 {
            return Ok(local);
        }
        Ok(group.all_gather_balanced(&local, local.ndim() - 1, self.shard.global_len())?)
    }

    /// The greedy next token of every row of `h: [.., H]`: an `i64` host tensor of the leading
    /// dims, identical on every rank, equal to `argmax` over the full logits, computed from the
    /// ranks' local maxima without gathering the logits.
    pub fn argmax(&self, h: &Tensor) -> Result<Tensor> {
        let group = &self.group;
        let local = self.forward_local(h)?;
        let lead = &local.dims()[..local.ndim() - 1];
        let rows: usize = lead.iter().product();
        let (vals, idx) = if self.shard.is_empty() {
            // No vocabulary here: a value every real one beats, at an index past every real one.
            let vals = Tensor::from_vec(vec![f32::NEG_INFINITY; rows], lead, &Device::Cpu)?;
            (vals, Tensor::from_vec(vec![i64::MAX; rows], lead, &Device::Cpu)?)
        } else {
            local.max_with_index()?
        };
        let (vals, idx) = (vals.to_device(&Device::Cpu)?, idx.to_device(&Device::Cpu)?);
        let offset = self.shard.start() as i64;
        let idx: Vec<i64> = idx.to_i64_vec()?.into_iter().map(|i| if i == i64::MAX { i } else { i + offset }).collect();
        if group.world_size() == 1 {
            return Ok(Tensor::from_vec(idx, lead, &Device::Cpu)?);
        }
        // [1, rows] per rank, gathered to [world, rows] on the group's device.
        let to_group = |t: Tensor| -> Result<Tensor> { Ok(group.to_local(&t.reshape(&[1, rows])?)?) };
        let ones = vec![1; group.world_size()];
        let all_vals = group.all_gather_sized(&to_group(vals)?, 0, &ones)?.to_f64_vec()?;
        let idx = to_group(Tensor::from_vec(idx, &[rows], &Device::Cpu)?)?;
        let all_idx = group.all_gather_sized(&idx, 0, &ones)?.to_i64_vec()?;
        let best: Vec<i64> = (0..rows)
            .map(|row| {
                let mut best = (all_vals[row], all_idx[row]);
                for r in 1..group.world_size() {
                    let cand = (all_vals[r * rows + row], all_idx[r * rows + row]);
                    if better(cand, best) {
                        best = cand;
                    }
                }
                best.1
            })
            .collect();
        Ok(Tensor::from_vec(best, lead, &Device::Cpu)?)
    }
}

/// Whether candidate `a` beats `b` as `(value, global index)`: NaN first, then the larger
/// value, then the lower index.
fn better(a: (f64, i64), b: (f64, i64)) -> bool {
    match (a.0.is_nan(), b.0.is_nan()) {
        (true, false) => true,
        (false, true) => false,
        (true, true) => a.1 < b.1,
        (false, false) => a.0 > b.0 || (a.0 == b.0 && a.1 < b.1),
    }
}
