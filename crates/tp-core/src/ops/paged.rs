//! Paged attention over a block-table KV cache, and writes into its slots (the engine's flat
//! token batches: chunked prefills and decodes of many sequences in one call).
//!
//! PLACEHOLDER on the `cuda-work` branch: the types and method signatures of the shared spec
//! (section A), with only the CUDA path (`paged_cuda.rs`). The branch that writes the host
//! kernels replaces this whole file with the full version (checks and host path); keep the
//! types' fields identical.

use crate::{Error, KvGroups, Result, Tensor};

/// One sequence of a flat token batch, for paged attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedSeq<'a> {
    /// First row of q (and of the output) belonging to this sequence.
    pub q_start: usize,
    /// Its rows: the last `q_len` of its `kv_len` positions (query `t` at position
    /// `kv_len - q_len + t`).
    pub q_len: usize,
    /// Positions valid in its blocks (context before this step + `q_len`).
    pub kv_len: usize,
    /// Block table: position `p` lives in block `blocks[p / block_size]`, row `p % block_size`.
    pub blocks: &'a [u32],
}

/// Score scale, window and head grouping of [`Tensor::paged_attention`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PagedAttentionSpec {
    /// Factor on `q·k`.
    pub scale: f32,
    /// At most this many most recent positions per query, its own included; `None`: all.
    pub sliding_window: Option<usize>,
    /// Which KV head each query head uses; `None`: `Hkv` divides `Hq`, head `h` uses
    /// `h / (Hq / Hkv)`.
    pub kv_groups: Option<KvGroups>,
}

impl Tensor {
    /// q: `[T, Hq, D]`; `k_cache, v_cache: [num_blocks, block_size, Hkv, D]`; causal (and
    /// windowed) attention of every sequence's rows over its own blocks; returns `[T, Hq, D]` in
    /// q's dtype (f32 accumulation). Rows of q not covered by any sequence are an error.
    pub fn paged_attention(
        &self,
        k_cache: &Tensor,
        v_cache: &Tensor,
        seqs: &[PagedSeq<'_>],
        spec: &PagedAttentionSpec,
    ) -> Result<Tensor> {
        if !self.device().is_cuda() {
            return Err(Error::UnsupportedDevice { op: "paged_attention", device: self.device() });
        }
        super::paged_cuda::paged_attention_cuda(self, k_cache, v_cache, seqs, spec)
    }

    /// `self`: a cache `[num_blocks, block_size, H, D]`; writes `src: [T, H, D]` row `t` to flat
    /// slot `slots[t]` (slot = block * block_size + offset). Checks bounds and dtypes.
    pub fn write_slots(&mut self, src: &Tensor, slots: &[usize]) -> Result<()> {
        if !self.device().is_cuda() {
            return Err(Error::UnsupportedDevice { op: "write_slots", device: self.device() });
        }
        super::paged_cuda::write_slots_cuda(self, src, slots)
    }
}
