//! [`TokenBatch`]: the tokens of one step of several sequences, run as one flat batch over a
//! paged KV cache.
//!
//! Sequence `i` feeds `tokens` new tokens at positions `context .. context + tokens` (its first
//! `context` positions are in the cache already: earlier steps or shared prefix blocks) and
//! owns the block table `blocks`, position `p` living in block `blocks[p / block_size]`, row
//! `p % block_size`. The batch's rows are the sequences' tokens one sequence after the other;
//! each row has a position and a flat cache slot (`block · block_size + offset`) where its key
//! and value are written. The same batch is built on every rank.

use crate::error::{LayerError, Result};
use std::ops::Range;
use tp_core::{PagedSeq, RotaryEmbedding, Tensor};

/// One sequence of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchSeq {
    /// Tokens fed this step (at least 1).
    pub tokens: usize,
    /// Positions already in the cache.
    pub context: usize,
    /// Block table covering at least `context + tokens` positions.
    pub blocks: Vec<u32>,
}

/// The sequences of one step's flat token batch, with each token's position and cache slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBatch {
    seqs: Vec<BatchSeq>,
    block_size: usize,
    /// First row of each sequence (and the total rows at the end).
    starts: Vec<usize>,
    positions: Vec<usize>,
    slots: Vec<usize>,
    /// Each sequence's length for length-dependent rotary frequencies (LongRoPE, dynamic NTK):
    /// `context + tokens` unless [`with_rope_lens`](Self::with_rope_lens) says more.
    rope_lens: Vec<usize>,
}

impl TokenBatch {
    /// The batch of `seqs` over a cache of blocks of `block_size` positions.
    ///
    /// Errors ([`LayerError::Config`], naming the sequence): a zero block size, a sequence
    /// feeding no token, a block table too short for `context + tokens` positions, sizes that
    /// overflow, or no sequence at all.
    pub fn new(seqs: Vec<BatchSeq>, block_size: usize) -> Result<TokenBatch> {
        let err = |why: String| LayerError::Config(format!("token batch: {why}"));
        if block_size == 0 {
            return Err(err("the block size must be at least 1".into()));
        }
        if seqs.is_empty() {
            return Err(err("no sequences (a step runs at least one token)".into()));
        }
        let (mut starts, mut positions, mut slots) = (vec![0], Vec::new(), Vec::new());
        for (i, s) in seqs.iter().enumerate() {
            let end = s.context.checked_add(s.tokens).filter(|_| s.tokens > 0);
            let Some(end) = end else {
                return Err(err(format!(
                    "sequence {i} feeds {} tokens after {} (need 1 or more)",
                    s.tokens, s.context
                )));
            };
            if s.blocks.len() < end.div_ceil(block_size) {
                return Err(err(format!(
                    "sequence {i}: {} blocks of {block_size} cannot hold its {end} positions",
                    s.blocks.len()
                )));
            }
            for p in s.context..end {
                let slot = (s.blocks[p / block_size] as usize)
                    .checked_mul(block_size)
                    .and_then(|b| b.checked_add(p % block_size));
                let Some(slot) = slot else {
                    return Err(err(format!("sequence {i}: block {} is past any cache", s.blocks[p / block_size])));
                };
                positions.push(p);
                slots.push(slot);
            }
            starts.push(positions.len());
        }
        let rope_lens = seqs.iter().map(|s| s.context + s.tokens).collect();
        Ok(TokenBatch { seqs, block_size, starts, positions, slots, rope_lens })
    }

    /// Sets each sequence's length for length-dependent rotary frequencies to its whole known
    /// length (`lens[i]`, at least `context + tokens`): a prompt prefilled in chunks then turns
    /// with the frequencies of its full length in every chunk, as transformers' one-call prefill
    /// does. Shorter or missing entries keep `context + tokens`.
    pub fn with_rope_lens(mut self, lens: &[usize]) -> TokenBatch {
        for (r, &l) in self.rope_lens.iter_mut().zip(lens) {
            *r = (*r).max(l);
        }
        self
    }

    /// The sequences, in row order.
    pub fn seqs(&self) -> &[BatchSeq] {
        &self.seqs
    }
    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    /// Rows of the batch (tokens fed, all sequences).
    pub fn num_tokens(&self) -> usize {
        self.positions.len()
    }
    /// Each row's position in its sequence.
    pub fn positions(&self) -> &[usize] {
        &self.positions
    }
    /// Each row's flat cache slot.
    pub fn slots(&self) -> &[usize] {
        &self.slots
    }
    /// The rows of sequence `i` (empty past the last sequence).
    pub fn rows(&self, i: usize) -> Range<usize> {
        match (self.starts.get(i), self.starts.get(i + 1)) {
            (Some(&a), Some(&b)) => a..b,
            _ => 0..0,
        }
    }
    /// The last row of every sequence (the one whose logits pick its next token).
    pub fn last_rows(&self) -> Vec<usize> {
        self.starts[1..].iter().map(|&e| e - 1).collect()
    }

    /// The sequences as paged attention takes them.
    pub fn paged_seqs(&self) -> Vec<PagedSeq<'_>> {
        self.seqs
            .iter()
            .enumerate()
            .map(|(i, s)| PagedSeq {
                q_start: self.starts[i],
                q_len: s.tokens,
                kv_len: s.context + s.tokens,
                blocks: &s.blocks,
            })
            .collect()
    }

    /// RoPE on `x: [T, H, D]`, each row at its position. Where the frequencies depend on the
    /// sequence's length (dynamic NTK scaling, LongRoPE), each sequence turns with those of its
    /// own length (see [`with_rope_lens`](Self::with_rope_lens)), as it would alone; otherwise
    /// the whole batch in one call.
    pub(crate) fn rope(&self, x: &Tensor, rope: &RotaryEmbedding) -> Result<Tensor> {
        let batch_len = self.rope_lens.iter().copied().max().unwrap_or(0);
        let shared = rope.inv_freq_for(batch_len);
        let same = self.rope_lens.iter().all(|&l| *rope.inv_freq_for(l) == *shared);
        if same {
            return Ok(x.rope_with_len(&self.positions, rope, batch_len)?);
        }
        let parts = (0..self.seqs.len())
            .map(|i| {
                let r = self.rows(i);
                Ok(x.narrow(0, r.start, r.len())?.rope_with_len(&self.positions[r], rope, self.rope_lens[i])?)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&parts, 0)?)
    }
}
