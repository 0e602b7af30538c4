//! [`PagedKvCache`]: one attention layer's keys and values on one rank, in fixed-size blocks
//! that many sequences share.
//!
//! Keys and values are `[num_blocks, block_size, kv_heads_r, head_dim]` each, in the layer's
//! dtype on its device, allocated once. Which blocks hold which sequence's positions is the
//! caller's business (a block table per sequence, [`TokenBatch`](crate::TokenBatch)); a step
//! writes its tokens' keys and values at their slots and attends through the tables. Like
//! [`KvCache`](crate::KvCache), the cache is bound to the layer that first uses it, so it
//! cannot silently serve another one.

use crate::error::{LayerError, Result};
use tp_core::{DType, Device, Tensor};

/// Paged keys and values of one attention layer on one rank.
#[derive(Debug, Clone)]
pub struct PagedKvCache {
    k: Tensor,
    v: Tensor,
    /// The layer (`ParallelAttention::id`) this cache serves, once bound.
    owner: Option<u64>,
}

impl PagedKvCache {
    /// A zeroed cache of `num_blocks` blocks of `block_size` positions of `kv_heads` heads of
    /// `head_dim`.
    ///
    /// Errors: [`LayerError::Config`] for a zero size, [`LayerError::CacheAlloc`] when the
    /// memory cannot be had.
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<PagedKvCache> {
        if num_blocks == 0 || block_size == 0 || kv_heads == 0 || head_dim == 0 {
            return Err(LayerError::Config(format!(
                "a paged KV cache needs blocks, positions per block, heads and head_dim > 0, got {num_blocks} x {block_size} x {kv_heads} x {head_dim}"
            )));
        }
        let dims = [num_blocks, block_size, kv_heads, head_dim];
        let alloc_err = |e: tp_core::Error| LayerError::CacheAlloc {
            positions: num_blocks.saturating_mul(block_size),
            bytes: 2usize
                .saturating_mul(dtype.size_in_bytes())
                .saturating_mul(kv_heads * head_dim)
                .saturating_mul(num_blocks.saturating_mul(block_size)),
            why: e.to_string(),
        };
        let k = Tensor::zeros(&dims, dtype, device).map_err(alloc_err)?;
        let v = Tensor::zeros(&dims, dtype, device).map_err(alloc_err)?;
        Ok(PagedKvCache { k, v, owner: None })
    }

    /// Blocks in the cache.
    pub fn num_blocks(&self) -> usize {
        self.k.dims()[0]
    }
    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.k.dims()[1]
    }
    /// `(kv_heads, head_dim)` of each position.
    pub fn head_shape(&self) -> (usize, usize) {
        (self.k.dims()[2], self.k.dims()[3])
    }
    /// Bytes of keys and values one block holds.
    pub fn bytes_per_block(&self) -> usize {
        let (h, d) = self.head_shape();
        2 * self.block_size() * h * d * self.dtype().size_in_bytes()
    }
    /// The dtype of the keys and values.
    pub fn dtype(&self) -> DType {
        self.k.dtype()
    }
    /// Where the keys and values live.
    pub fn device(&self) -> Device {
        self.k.device()
    }

    /// The key and value buffers, `[num_blocks, block_size, kv_heads, head_dim]` each.
    pub fn buffers(&self) -> (&Tensor, &Tensor) {
        (&self.k, &self.v)
    }

    /// Checks that this cache can serve layer `owner` with heads `(kv_heads, head_dim)` of
    /// `dtype` on `device`, and binds it to the layer if it is unbound.
    pub(crate) fn bind(&mut self, owner: u64, heads: (usize, usize), dtype: DType, device: Device) -> Result<()> {
        if self.head_shape() != heads || self.dtype() != dtype || self.device() != device {
            return Err(LayerError::CacheMismatch(format!(
                "the paged cache holds {:?} heads x head_dim of {} on {}, the layer has {heads:?} of {dtype} on {device}",
                self.head_shape(),
                self.dtype(),
                self.device()
            )));
        }
        match self.owner {
            Some(o) if o != owner => {
                Err(LayerError::CacheMismatch("the paged cache belongs to another attention layer".into()))
            }
            _ => {
                self.owner = Some(owner);
                Ok(())
            }
        }
    }

    /// Writes `k, v: [T, kv_heads, head_dim]` row `t` at flat slot `slots[t]`.
    ///
    /// Errors: shapes that differ, slots past the cache or repeated (nothing written).
    pub(crate) fn write(&mut self, k: &Tensor, v: &Tensor, slots: &[usize]) -> Result<()> {
        if k.dims() != v.dims() {
            return Err(LayerError::CacheMismatch(format!("keys {:?} and values {:?} differ", k.dims(), v.dims())));
        }
        self.k.write_slots(k, slots)?;
        self.v.write_slots(v, slots)?;
        Ok(())
    }
}
