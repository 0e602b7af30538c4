//! [`SeqBatch`]: how a training micro-batch's tokens are laid out, and the collectives that
//! move them between the two regions of a tensor-parallel block.
//!
//! The batch is whole sequences packed one after the other (`lens`, `T` tokens in all), each
//! from position 0 and attending only within itself. Without sequence parallelism every rank
//! holds all `T` rows everywhere. With it (Megatron-LM's `sequence_parallel`), the norms and
//! residuals run on sequence shards: rank `r` holds rows `[t_r, t_{r+1})` (the balanced split of
//! `T`, uneven where `T` does not divide); the regions between them are joined by
//!
//! * `g` before a column-parallel layer: all-gather the shards into `[T, H]` (backward:
//!   reduce-scatter of `dX`, instead of the all-reduce);
//! * `ḡ` after a row-parallel layer: reduce-scatter the partial sums into shards (instead of
//!   the all-reduce; backward: all-gather of `dY`).
//!
//! The same bytes move as with the all-reduces (an all-reduce is a reduce-scatter plus an
//! all-gather), but the activations outside attention and the MLP take `1/N` of the memory.
//! Norm weights then see only their rank's rows, so their gradients are partial sums over the
//! group (Megatron-LM #1446's bug when they are not summed).

use crate::error::Result;
use tp_comm::{DeviceGroup, ReduceOp};
use tp_core::{RotaryEmbedding, Tensor, TensorShard};

/// The token layout of a training micro-batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqBatch {
    lens: Vec<usize>,
    tokens: usize,
    sequence_parallel: bool,
}

impl SeqBatch {
    /// Sequences of `lens` tokens, with or without sequence parallelism.
    pub fn new(lens: &[usize], sequence_parallel: bool) -> SeqBatch {
        SeqBatch { lens: lens.to_vec(), tokens: lens.iter().sum(), sequence_parallel }
    }
    /// Tokens per sequence.
    pub fn lens(&self) -> &[usize] {
        &self.lens
    }
    /// All tokens, `T`.
    pub fn tokens(&self) -> usize {
        self.tokens
    }
    /// Whether norms and residuals run on sequence shards.
    pub fn sequence_parallel(&self) -> bool {
        self.sequence_parallel
    }
    /// This rank's rows of the `T` tokens: all of them, or its sequence shard.
    pub fn shard(&self, group: &DeviceGroup) -> Result<TensorShard> {
        if self.sequence_parallel {
            Ok(TensorShard::new(0, self.tokens, group.rank(), group.world_size())?)
        } else {
            Ok(TensorShard::new(0, self.tokens, 0, 1)?)
        }
    }

    /// `g`: the full `[T, H]` from this rank's rows (the identity without sequence parallelism).
    pub fn gather(&self, x: &Tensor, group: &DeviceGroup) -> Result<Tensor> {
        if !self.sequence_parallel || group.world_size() == 1 {
            return Ok(x.clone());
        }
        Ok(group.all_gather_balanced(x, 0, self.tokens)?)
    }

    /// `ḡ`: the sum over the ranks of partial `[T, H]` results, this rank's rows of it (the
    /// all-reduce without sequence parallelism).
    pub fn reduce(&self, partial: &Tensor, group: &DeviceGroup) -> Result<Tensor> {
        if group.world_size() == 1 {
            return Ok(partial.clone());
        }
        if self.sequence_parallel {
            Ok(group.reduce_scatter(partial, 0, ReduceOp::Sum)?)
        } else {
            Ok(group.all_reduce(partial, ReduceOp::Sum)?)
        }
    }

    /// This rank's rows of a full `[T, ..]` tensor that every rank holds (the tensor itself
    /// without sequence parallelism).
    pub fn local(&self, full: &Tensor, group: &DeviceGroup) -> Result<Tensor> {
        if !self.sequence_parallel {
            return Ok(full.clone());
        }
        let s = self.shard(group)?;
        Ok(full.narrow(0, s.start(), s.len())?)
    }
}

/// Rotary embeddings over a batch's sequences. Each sequence turns from position 0 with the
/// frequencies of its own length where they depend on it (LongRoPE's short or long factors,
/// dynamic NTK scaling), as it would alone in transformers, so a row's result never depends on
/// the rows beside it in the micro-batch; one call covers the batch when every sequence has the
/// same frequencies.
impl SeqBatch {
    /// Each token's position in its sequence (`0..n` per sequence, one after the other).
    pub fn positions(&self) -> Vec<usize> {
        self.lens.iter().flat_map(|&n| 0..n).collect()
    }

    /// RoPE on `x: [T, heads, D]` (every token of the batch).
    pub(crate) fn rope(&self, x: &Tensor, rope: &RotaryEmbedding) -> Result<Tensor> {
        self.per_frequencies(x, rope, |part, positions| part.rope(positions, rope))
    }

    /// The transposed rotation of [`rope`](Self::rope) on `dy: [T, heads, D]` (f32 out).
    pub(crate) fn rope_backward(&self, dy: &Tensor, rope: &RotaryEmbedding) -> Result<Tensor> {
        self.per_frequencies(dy, rope, |part, positions| part.rope_backward(positions, rope))
    }

    /// `f(x, positions)` over the whole batch when every sequence's frequencies are those of
    /// the longest, else per sequence (each with its positions `0..n`), joined in row order.
    fn per_frequencies(
        &self,
        x: &Tensor,
        rope: &RotaryEmbedding,
        f: impl Fn(&Tensor, &[usize]) -> tp_core::Result<Tensor>,
    ) -> Result<Tensor> {
        let longest = rope.inv_freq_for(self.lens.iter().copied().max().unwrap_or(0));
        if self.lens.iter().all(|&n| n == 0 || *rope.inv_freq_for(n) == *longest) {
            return Ok(f(x, &self.positions())?);
        }
        let (mut parts, mut start) = (Vec::with_capacity(self.lens.len()), 0);
        for &n in self.lens.iter().filter(|&&n| n > 0) {
            let positions: Vec<usize> = (0..n).collect();
            parts.push(f(&x.narrow(0, start, n)?, &positions)?);
            start += n;
        }
        Ok(Tensor::cat(&parts, 0)?)
    }
}
