//! [`KvCache`]: the keys and values one attention layer has seen, on one rank.
//!
//! A rank's cache holds only its KV heads (`kv_len` of them, replicated heads included where
//! `kv_heads < world`): keys and values `[capacity, kv_heads_r, head_dim]` in the layer's dtype
//! on its device, of which the first `len` positions are filled. Appending writes in place; a
//! prefill appends `T` positions, a decode step one. The cache grows as a sequence needs it
//! (doubling, at most to a limit the model sets: its `max_position_embeddings`), so nothing is
//! allocated for positions a request never reaches. The cache is bound to the layer that first
//! uses it, so it cannot silently serve another one.

use crate::error::{LayerError, Result};
use tp_core::{DType, Device, Tensor};

/// Keys and values of one attention layer on one rank, with a fixed capacity.
#[derive(Debug, Clone)]
pub struct KvCache {
    k: Tensor,
    v: Tensor,
    len: usize,
    /// The layer (`ParallelAttention::id`) this cache serves, once bound.
    owner: Option<u64>,
    /// Positions it may grow to.
    limit: usize,
}

impl KvCache {
    /// An empty cache for `capacity` positions of `kv_heads` heads of `head_dim`.
    ///
    /// Errors: `Config` for a zero head count or size, tensor errors for impossible sizes.
    pub fn new(capacity: usize, kv_heads: usize, head_dim: usize, dtype: DType, device: &Device) -> Result<KvCache> {
        if kv_heads == 0 || head_dim == 0 {
            return Err(LayerError::Config(format!(
                "KV cache needs heads and head_dim > 0, got {kv_heads} x {head_dim}"
            )));
        }
        let dims = [capacity, kv_heads, head_dim];
        let (k, v) = (Tensor::zeros(&dims, dtype, device)?, Tensor::zeros(&dims, dtype, device)?);
        Ok(KvCache { k, v, len: 0, owner: None, limit: capacity })
    }

    /// The same cache allowed to grow to `limit` positions (at least its capacity).
    pub fn with_limit(mut self, limit: usize) -> KvCache {
        self.limit = limit.max(self.capacity());
        self
    }

    /// Positions the cache may grow to.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes of keys and values per position.
    pub fn bytes_per_position(&self) -> usize {
        let (h, d) = self.head_shape();
        2 * h * d * self.dtype().size_in_bytes()
    }

    /// Makes room for `len` positions, keeping the filled ones: the capacity doubles (at least
    /// to `len`, at most to the limit).
    ///
    /// Errors: [`LayerError::CacheFull`] past the limit, [`LayerError::CacheAlloc`] when the
    /// memory cannot be had; either way the cache is unchanged.
    pub fn reserve(&mut self, len: usize) -> Result<()> {
        if len <= self.capacity() {
            return Ok(());
        }
        if len > self.limit {
            return Err(LayerError::CacheFull { capacity: self.limit, len: self.len, adding: len - self.len });
        }
        let capacity = self.capacity().saturating_mul(2).clamp(len, self.limit);
        let (h, d) = self.head_shape();
        let dims = [capacity, h, d];
        let alloc_err = |e: tp_core::Error| LayerError::CacheAlloc {
            positions: capacity,
            bytes: capacity.saturating_mul(self.bytes_per_position()),
            why: e.to_string(),
        };
        let grown = |old: &Tensor| -> Result<Tensor> {
            let mut t = Tensor::zeros(&dims, self.dtype(), &self.device()).map_err(alloc_err)?;
            if self.len > 0 {
                t.slice_set(&old.narrow(0, 0, self.len)?, 0, 0)?;
            }
            Ok(t)
        };
        let (k, v) = (grown(&self.k)?, grown(&self.v)?);
        (self.k, self.v) = (k, v);
        Ok(())
    }

    /// Positions it can hold.
    pub fn capacity(&self) -> usize {
        self.k.dims()[0]
    }
    /// Positions filled.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether no position is filled.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// `(kv_heads, head_dim)` of each position.
    pub fn head_shape(&self) -> (usize, usize) {
        (self.k.dims()[1], self.k.dims()[2])
    }
    /// The dtype of the keys and values.
    pub fn dtype(&self) -> DType {
        self.k.dtype()
    }
    /// Where the keys and values live.
    pub fn device(&self) -> Device {
        self.k.device()
    }

    /// Forgets every position (the capacity and the layer binding stay).
    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// The key and value buffers, `[capacity, kv_heads, head_dim]` each; the first
    /// [`len`](Self::len) positions are valid.
    pub fn buffers(&self) -> (&Tensor, &Tensor) {
        (&self.k, &self.v)
    }

    /// Checks that this cache can serve layer `owner` with heads `(kv_heads, head_dim)` of
    /// `dtype` on `device`, and binds it to the layer if it is unbound.
    pub(crate) fn bind(&mut self, owner: u64, heads: (usize, usize), dtype: DType, device: Device) -> Result<()> {
        if self.head_shape() != heads || self.dtype() != dtype || self.device() != device {
            return Err(LayerError::CacheMismatch(format!(
                "the cache holds {:?} heads x head_dim of {} on {}, the layer has {heads:?} of {dtype} on {device}",
                self.head_shape(),
                self.dtype(),
                self.device()
            )));
        }
        match self.owner {
            Some(o) if o != owner => {
                Err(LayerError::CacheMismatch("the cache belongs to another attention layer".into()))
            }
            _ => {
                self.owner = Some(owner);
                Ok(())
            }
        }
    }

    /// Appends `k, v: [T, kv_heads, head_dim]` at positions `len..len + T`.
    ///
    /// Errors: [`LayerError::CacheFull`] past the limit, [`LayerError::CacheAlloc`] when the
    /// cache cannot grow (nothing is written), shape errors.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let t = k.shape().dim("KvCache::append", 0)?;
        if k.dims() != v.dims() {
            return Err(LayerError::CacheMismatch(format!("keys {:?} and values {:?} differ", k.dims(), v.dims())));
        }
        self.reserve(self.len.saturating_add(t))?;
        self.k.slice_set(k, 0, self.len)?;
        self.v.slice_set(v, 0, self.len)?;
        self.len += t;
        Ok(())
    }
}
