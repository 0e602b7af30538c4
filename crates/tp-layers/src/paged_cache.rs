//! [`PagedKvCache`]: one attention layer's keys and values on one rank, in fixed-size blocks
//! that many sequences share.
//!
//! Keys and values are `[num_blocks, block_size, kv_heads_r, head_dim]` each, in the layer's
//! dtype on its device, or in 8 bits on the host ([`KvQuant`]: FP8 E4M3 or llama.cpp's Q8_0,
//! quantized as they are written and widened as attention reads them), allocated once. Which
//! blocks hold which sequence's positions is the caller's business (a block table per sequence,
//! [`TokenBatch`](crate::TokenBatch)); a step
//! writes its tokens' keys and values at their slots and attends through the tables. Like
//! [`KvCache`](crate::KvCache), the cache is bound to the layer that first uses it, so it
//! cannot silently serve another one.

use crate::error::{LayerError, Result};
use tp_core::{DType, Device, KvBuffer, KvQuant, QuantKvBuffer, Tensor};

/// Paged keys and values of one attention layer on one rank.
#[derive(Debug, Clone)]
pub struct PagedKvCache {
    store: Store,
    /// `[num_blocks, block_size, kv_heads, head_dim]`.
    dims: [usize; 4],
    /// The dtype of the layer's keys and values (what an 8-bit cache is written from).
    dtype: DType,
    device: Device,
    /// The layer (`ParallelAttention::id`) this cache serves, once bound.
    owner: Option<u64>,
}

/// The keys and values.
#[derive(Debug, Clone)]
enum Store {
    Dense(Tensor, Tensor),
    Quant(QuantKvBuffer, QuantKvBuffer),
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
        Ok(PagedKvCache { store: Store::Dense(k, v), dims, dtype, device: *device, owner: None })
    }

    /// A zeroed cache of the same geometry as [`new`](Self::new) whose keys and values are
    /// stored in 8 bits (`quant`) on the host and written from a layer of `dtype`: about half
    /// the bytes of a 16-bit cache, a quarter of an `f32` one.
    ///
    /// Errors: [`LayerError::Config`] for a zero size, a `head_dim` the format cannot hold
    /// (`q8_0`: not a multiple of 32) or a device other than the host;
    /// [`LayerError::CacheAlloc`] when the memory cannot be had.
    pub fn new_quantized(
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        quant: KvQuant,
        dtype: DType,
        device: &Device,
    ) -> Result<PagedKvCache> {
        if *device != Device::Cpu {
            return Err(LayerError::Config(format!(
                "a {quant} KV cache lives in host memory; the layer runs on {device} (use --kv-cache-dtype auto there)"
            )));
        }
        let positions = num_blocks.saturating_mul(block_size);
        if positions == 0 || kv_heads == 0 || head_dim == 0 || quant.row_bytes(head_dim).is_none() {
            return Err(LayerError::Config(format!(
                "a {quant} paged KV cache needs blocks, positions per block and heads > 0{}, got {num_blocks} x {block_size} x {kv_heads} x {head_dim}",
                if quant == KvQuant::Q8_0 { " and head_dim a multiple of 32" } else { " and head_dim > 0" }
            )));
        }
        let dims = [num_blocks, block_size, kv_heads, head_dim];
        let alloc_err = |e: tp_core::Error| LayerError::CacheAlloc {
            positions,
            bytes: 2usize
                .saturating_mul(quant.row_bytes(head_dim).unwrap_or(0))
                .saturating_mul(kv_heads)
                .saturating_mul(positions),
            why: e.to_string(),
        };
        let k = QuantKvBuffer::zeros(quant, dims).map_err(alloc_err)?;
        let v = QuantKvBuffer::zeros(quant, dims).map_err(alloc_err)?;
        Ok(PagedKvCache { store: Store::Quant(k, v), dims, dtype, device: Device::Cpu, owner: None })
    }

    /// Bytes of keys and values one block holds when stored in `dtype`, or in 8 bits as
    /// `quant` says (`None` when `quant` cannot hold a row of `head_dim`).
    pub fn block_bytes(
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: DType,
        quant: Option<KvQuant>,
    ) -> Option<usize> {
        let row = match quant {
            None => head_dim.checked_mul(dtype.size_in_bytes())?,
            Some(q) => q.row_bytes(head_dim)?,
        };
        row.checked_mul(kv_heads)?.checked_mul(block_size)?.checked_mul(2)
    }

    /// Blocks in the cache.
    pub fn num_blocks(&self) -> usize {
        self.dims[0]
    }
    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.dims[1]
    }
    /// `(kv_heads, head_dim)` of each position.
    pub fn head_shape(&self) -> (usize, usize) {
        (self.dims[2], self.dims[3])
    }
    /// Bytes of keys and values one block holds.
    pub fn bytes_per_block(&self) -> usize {
        let (h, d) = self.head_shape();
        Self::block_bytes(self.block_size(), h, d, self.dtype, self.quant()).unwrap_or(usize::MAX)
    }
    /// The dtype of the layer's keys and values (an 8-bit cache is written from it and read
    /// back into it).
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// The 8-bit format of the keys and values, or `None` when they are held in [`dtype`](Self::dtype).
    pub fn quant(&self) -> Option<KvQuant> {
        match &self.store {
            Store::Dense(..) => None,
            Store::Quant(k, _) => Some(k.quant()),
        }
    }
    /// Where the keys and values live.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The key and value buffers, `[num_blocks, block_size, kv_heads, head_dim]` each, as paged
    /// attention reads them.
    pub fn buffers(&self) -> (KvBuffer<'_>, KvBuffer<'_>) {
        match &self.store {
            Store::Dense(k, v) => (KvBuffer::Dense(k), KvBuffer::Dense(v)),
            Store::Quant(k, v) => (k.as_kv(), v.as_kv()),
        }
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
        match &mut self.store {
            Store::Dense(kc, vc) => {
                kc.write_slots(k, slots)?;
                vc.write_slots(v, slots)?;
            }
            Store::Quant(kc, vc) => {
                // Both checks before either write, so a bad value source writes nothing.
                if k.dtype() != self.dtype || v.dtype() != self.dtype {
                    return Err(LayerError::CacheMismatch(format!(
                        "the cache is written from {}, got keys of {} and values of {}",
                        self.dtype,
                        k.dtype(),
                        v.dtype()
                    )));
                }
                kc.write_slots(k, slots)?;
                vc.write_slots(v, slots)?;
            }
        }
        Ok(())
    }
}
