//! The batched forward of [`ParallelCausalLm`]: one step of several sequences as one flat token
//! batch over paged KV caches (one per layer, owned by the caller), for continuous batching.
//!
//! The embedding runs over all `T` tokens (one all-reduce), every block over the whole batch
//! (two all-reduces per layer), then only the rows that need logits go through the final norm
//! (row-wise, so the same as norming everything) and the LM head, which returns this rank's
//! columns of the vocabulary without gathering them: the sampler works on the shards.
//!
//! Batch invariance on the host (f32): attention, norms and the embedding compute each row on
//! its own, so a row's logits depend on the rest of the batch only through the linear layers,
//! where tp-cpu takes a GEMV kernel for up to 8 rows and a packed GEMM above, which round
//! differently. A sequence's logits are bitwise the same alone and in a batch when every step
//! (and the logits' row count) falls on the same side of that threshold in both runs.

use super::ParallelCausalLm;
use crate::error::{ModelError, Result};
use tp_core::{Device, KvQuant, Tensor};
use tp_layers::{PagedKvCache, TokenBatch};

impl ParallelCausalLm {
    /// Bytes one block of `block_size` positions costs on this rank, keys and values of every
    /// layer, stored in the model dtype or (`quant`) in 8 bits.
    ///
    /// Errors: a `head_dim` that `quant` cannot hold (`q8_0`: not a multiple of 32).
    pub fn kv_bytes_per_block(&self, block_size: usize, quant: Option<KvQuant>) -> Result<usize> {
        let d = self.config.head_dim;
        let per_layer =
            PagedKvCache::block_bytes(block_size, self.kv_heads, d, self.dtype, quant).ok_or_else(|| {
                ModelError::Unsupported {
                    field: "head_dim".into(),
                    value: d.to_string(),
                    why: format!("a {} KV cache needs head_dim a multiple of 32", quant.map_or("dense", KvQuant::name)),
                }
            })?;
        Ok(per_layer.saturating_mul(self.layers.len()))
    }

    /// One paged cache per layer, `num_blocks` blocks of `block_size` positions each, on this
    /// rank's device in the model dtype, or (`quant`) in 8 bits on the host.
    ///
    /// Errors: a zero size, a `head_dim` that `quant` cannot hold, an 8-bit cache asked of a
    /// GPU model, or memory that cannot be had (said in bytes).
    pub fn new_paged_caches(
        &self,
        num_blocks: usize,
        block_size: usize,
        quant: Option<KvQuant>,
    ) -> Result<Vec<PagedKvCache>> {
        self.layers.iter().map(|l| Ok(l.new_paged_cache(num_blocks, block_size, quant)?)).collect()
    }

    /// Which columns of the vocabulary this rank's logits hold: `(start, len)` of
    /// `config().vocab_size`.
    /// (The whole vocabulary's `(0, 0)` on a pipeline stage without the LM head.)
    pub fn vocab_shard(&self) -> (usize, usize) {
        self.head.as_ref().map_or((0, 0), |(_, h)| (h.shard().start(), h.shard().len()))
    }

    /// Runs the flat batch `ids` (`batch.num_tokens()` ids, sequence after sequence) through the
    /// model, writing every token's keys and values at its slot of `caches` (one per layer), and
    /// returns this rank's columns of the logits `[rows.len(), V_r]` of the flat rows `rows`
    /// (usually the last token of each sequence that samples), in the model dtype on the
    /// group's device, not gathered ([`vocab_shard`](Self::vocab_shard) says which columns).
    ///
    /// Errors: ids that do not match the batch, ids outside the vocabulary, a row past the
    /// batch, caches not one per layer or of another layer or shape, positions past
    /// `max_position_embeddings`; layer and collective errors.
    pub fn forward_batch(
        &self,
        ids: &[i64],
        batch: &TokenBatch,
        caches: &mut [PagedKvCache],
        rows: &[usize],
    ) -> Result<Tensor> {
        match self.forward_batch_stage(ids, None, batch, caches, rows)? {
            StageOutput::Logits(l) => Ok(l),
            StageOutput::Hidden(_) => Err(self.missing("a batched forward's logits", "the LM head")),
        }
    }

    /// [`forward_batch`](Self::forward_batch) of one pipeline stage: from the token ids on the
    /// first stage (`input` `None`), else from the previous stage's hidden states `input`
    /// (`[T, H]`); through this stage's blocks (their keys and values written into `caches`,
    /// one per block of this stage); to the logits of `rows` on the last stage, else to the
    /// hidden states for the next.
    ///
    /// Errors: as [`forward_batch`](Self::forward_batch); `input` given to the first stage,
    /// missing elsewhere, or of another shape.
    pub fn forward_batch_stage(
        &self,
        ids: &[i64],
        input: Option<Tensor>,
        batch: &TokenBatch,
        caches: &mut [PagedKvCache],
        rows: &[usize],
    ) -> Result<StageOutput> {
        let t = batch.num_tokens();
        if ids.len() != t {
            return Err(ModelError::Request(format!("{} token ids given for a batch of {t} tokens", ids.len())));
        }
        if caches.len() != self.layers.len() {
            return Err(ModelError::Request(format!(
                "{} paged caches given for {} layers",
                caches.len(),
                self.layers.len()
            )));
        }
        if let Some(r) = rows.iter().find(|&&r| r >= t) {
            return Err(ModelError::Request(format!("logits asked for row {r} of a batch of {t} tokens")));
        }
        let limit = self.config.max_position_embeddings;
        if let Some(s) = batch.seqs().iter().find(|s| s.context + s.tokens > limit) {
            return Err(ModelError::Request(format!(
                "a sequence reaches {} positions, past max_position_embeddings ({limit})",
                s.context + s.tokens
            )));
        }
        let mut x = match (&self.embed, input) {
            (Some(embed), None) => embed.forward(&Tensor::from_vec(ids.to_vec(), &[t], &Device::Cpu)?)?,
            (None, Some(x)) if x.dims() == [t, self.config.hidden_size] => x,
            (None, Some(x)) => {
                return Err(ModelError::Request(format!(
                    "stage input of shape {:?}, expected [{t}, {}]",
                    x.dims(),
                    self.config.hidden_size
                )));
            }
            (Some(_), Some(_)) => {
                return Err(ModelError::Request("the first pipeline stage takes token ids, not hidden states".into()));
            }
            (None, None) => return Err(self.missing("a batched forward from token ids", "the embedding")),
        };
        for (layer, cache) in self.layers.iter().zip(caches.iter_mut()) {
            x = layer.forward_batch(&x, batch, cache)?;
        }
        let Some((norm, lm_head)) = &self.head else { return Ok(StageOutput::Hidden(x)) };
        if rows.is_empty() {
            return Ok(StageOutput::Logits(Tensor::zeros(&[0, lm_head.shard().len()], self.dtype, &x.device())?));
        }
        let h = norm.forward(&pick_rows(&x, rows)?)?;
        Ok(StageOutput::Logits(lm_head.forward_local(&h)?))
    }
}

/// What one pipeline stage's batched forward gives.
#[derive(Debug)]
pub enum StageOutput {
    /// The hidden states `[T, H]` for the next stage.
    Hidden(Tensor),
    /// The last stage's logits, this rank's vocabulary columns.
    Logits(Tensor),
}

/// Rows `rows` of `x: [T, H]`, in that order: runs of consecutive rows narrowed and joined (the
/// whole tensor itself when `rows` is `0..T`).
fn pick_rows(x: &Tensor, rows: &[usize]) -> Result<Tensor> {
    let t = x.dims()[0];
    if rows.len() == t && rows.iter().enumerate().all(|(i, &r)| i == r) {
        return Ok(x.clone());
    }
    let mut parts = Vec::new();
    let mut i = 0;
    while i < rows.len() {
        let mut n = 1;
        while i + n < rows.len() && rows[i + n] == rows[i] + n {
            n += 1;
        }
        parts.push(x.narrow(0, rows[i], n)?);
        i += n;
    }
    Ok(Tensor::cat(&parts, 0)?)
}
