//! [`ParallelAttention`]: grouped-query self-attention split by heads, with a KV cache.
//!
//! With query heads split whole over ranks (balanced; each rank holding the KV heads its query
//! heads use, replicated where ranks share one: [`QkvLayout`]), rank `r` holding query heads
//! `Q_r`:
//!
//! 1. `[q_r | k_r | v_r] = x [Wq_r; Wk_r; Wv_r]^T (+ b)`: one column-parallel GEMM, local.
//! 2. RoPE on `q_r` and `k_r` at the tokens' absolute positions; `k_r, v_r` appended to this
//!    rank's cache (its KV heads only).
//! 3. Causal attention of `q_r` over the cache: each rank's heads are independent, local.
//! 4. `y = Σ_r o_r Wo[:, cols(Q_r)]^T + b_o`: the output projection is row-parallel over the
//!    input features of the rank's own query heads, `cols(Q_r) = [q_start·D, (q_start+q_len)·D)`,
//!    which follow the head split (uneven heads included), then one all-reduce; the bias once.
//!
//! Communication: one all-reduce of `[T, H]` per forward.

use crate::checkpoint::Checkpoint;
use crate::error::{LayerError, Result};
use crate::kv_cache::KvCache;
use crate::linear::Linear;
use crate::options::LoadOptions;
use crate::qkv::{AttentionHeads, QkvLayout, QkvParallel};
use crate::row::RowParallel;
use std::sync::atomic::{AtomicU64, Ordering};
use tp_comm::DeviceGroup;
use tp_core::{AttentionSpec, RotaryEmbedding, Tensor};

/// What an attention layer needs besides its weights.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionConfig {
    /// Heads and head size.
    pub heads: AttentionHeads,
    /// Rotary embedding (its head size must be `heads.head_dim`).
    pub rope: RotaryEmbedding,
    /// Mistral's sliding window: each token sees at most this many most recent positions.
    pub sliding_window: Option<usize>,
}

/// Rank `r`'s part of a self-attention layer.
#[derive(Debug, Clone)]
pub struct ParallelAttention {
    qkv: QkvParallel,
    o_proj: RowParallel,
    config: AttentionConfig,
    scale: f32,
    /// Identifies the layer to the KV caches it binds (clones share it).
    id: u64,
}

fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl ParallelAttention {
    /// Assembles a layer from its projections; `o_proj` must hold the input features of the
    /// query heads `qkv` holds.
    pub fn new(qkv: QkvParallel, o_proj: RowParallel, config: AttentionConfig) -> Result<ParallelAttention> {
        let l = *qkv.layout();
        let h = config.heads;
        if (l.num_heads, l.num_kv_heads, l.head_dim) != (h.num_heads, h.num_kv_heads, h.head_dim)
            || config.rope.head_dim() != h.head_dim
        {
            return Err(LayerError::Config(format!("attention layout {l:?} and config {config:?} disagree")));
        }
        let s = o_proj.shard();
        let cols = l.q_start * l.head_dim..(l.q_start + l.q_len) * l.head_dim;
        if (s.start()..s.end()) != cols
            || s.global_len() != l.num_heads * l.head_dim
            || (s.rank(), s.world_size()) != (l.rank, l.world_size)
        {
            return Err(LayerError::Config(format!(
                "o_proj holds input features {}..{} of {}, but rank {}'s query heads need {cols:?} of {}",
                s.start(),
                s.end(),
                s.global_len(),
                l.rank,
                l.num_heads * l.head_dim
            )));
        }
        if config.sliding_window == Some(0) {
            return Err(LayerError::Config("sliding_window must be at least 1".into()));
        }
        let scale = 1.0 / (h.head_dim as f32).sqrt();
        Ok(ParallelAttention { qkv, o_proj, config, scale, id: next_id() })
    }

    /// Rank `rank`'s part of full `q, k, v, o` projections (`o: [H, heads·D]`).
    pub fn from_full(
        q: &Linear,
        k: &Linear,
        v: &Linear,
        o: &Linear,
        config: AttentionConfig,
        rank: usize,
        world_size: usize,
    ) -> Result<ParallelAttention> {
        let h = config.heads;
        let layout = QkvLayout::new(h.num_heads, h.num_kv_heads, h.head_dim, rank, world_size)?;
        let qkv = QkvParallel::from_full(q, k, v, layout)?;
        let cols = layout.q_start * h.head_dim..(layout.q_start + layout.q_len) * h.head_dim;
        let o_proj = RowParallel::from_full_columns(o.weight(), o.bias(), cols, rank, world_size)?;
        Self::new(qkv, o_proj, config)
    }

    /// Loads `{prefix}.{q,k,v,o}_proj` (Hugging Face names, biases optional), each rank reading
    /// only its heads' rows of q/k/v and its heads' columns of o.
    pub fn load(
        ckpt: &Checkpoint,
        prefix: &str,
        config: &AttentionConfig,
        group: &DeviceGroup,
        opts: &LoadOptions,
    ) -> Result<ParallelAttention> {
        let qkv = QkvParallel::load(ckpt, prefix, config.heads, group, opts)?;
        let l = *qkv.layout();
        let cols = l.q_start * l.head_dim..(l.q_start + l.q_len) * l.head_dim;
        let o_name = format!("{prefix}.o_proj.weight");
        let (_, o_dims) = ckpt.param_info(&o_name)?;
        let hidden = qkv.local().in_features();
        if o_dims != [hidden, l.num_heads * l.head_dim] {
            return Err(LayerError::WrongShape {
                name: o_name,
                found: o_dims,
                expected: vec![hidden, l.num_heads * l.head_dim],
            });
        }
        let o_proj = RowParallel::load_columns(ckpt, &format!("{prefix}.o_proj"), cols, group, opts)?;
        Self::new(qkv, o_proj, config.clone())
    }

    /// Which heads this rank holds.
    pub fn layout(&self) -> &QkvLayout {
        self.qkv.layout()
    }
    /// The configuration.
    pub fn config(&self) -> &AttentionConfig {
        &self.config
    }
    /// The fused q/k/v projection.
    pub fn qkv(&self) -> &QkvParallel {
        &self.qkv
    }
    /// The output projection (this rank's head-aligned columns).
    pub fn o_proj(&self) -> &RowParallel {
        &self.o_proj
    }

    /// An empty cache for this layer on this rank: `capacity` positions of its KV heads.
    pub fn new_cache(&self, capacity: usize) -> Result<KvCache> {
        let lin = self.qkv.local();
        let l = self.layout();
        let mut cache = KvCache::new(capacity, l.kv_len, l.head_dim, lin.dtype(), &lin.device())?;
        cache.bind(self.id, (l.kv_len, l.head_dim), lin.dtype(), lin.device())?;
        Ok(cache)
    }

    /// Self-attention of `x: [T, H]`, the next `T` tokens of the sequence whose first
    /// `cache.len()` positions the cache holds (so token `t` sits at position
    /// `cache.len() + t`); appends their keys and values; returns `[T, H]` on every rank.
    ///
    /// Errors: [`LayerError::CacheFull`] if the tokens do not fit (nothing is written),
    /// [`LayerError::CacheMismatch`] for a cache of another layer or shape, group mismatches.
    pub fn forward(&self, x: &Tensor, cache: &mut KvCache, group: &DeviceGroup) -> Result<Tensor> {
        let l = *self.layout();
        let lin = self.qkv.local();
        crate::column::check_group(self.o_proj.shard(), lin.device(), group)?;
        cache.bind(self.id, (l.kv_len, l.head_dim), lin.dtype(), lin.device())?;
        let &[t, _] = x.dims() else {
            return Err(LayerError::Config(format!("attention input must be [tokens, hidden], got {:?}", x.dims())));
        };
        if cache.len() + t > cache.capacity() {
            return Err(LayerError::CacheFull { capacity: cache.capacity(), len: cache.len(), adding: t });
        }
        let positions: Vec<usize> = (cache.len()..cache.len() + t).collect();
        let (q, k, v) = self.qkv.forward(x)?;
        let q = q.reshape(&[t, l.q_len, l.head_dim])?.rope(&positions, &self.config.rope)?;
        let k = k.reshape(&[t, l.kv_len, l.head_dim])?.rope(&positions, &self.config.rope)?;
        let v = v.reshape(&[t, l.kv_len, l.head_dim])?;
        cache.append(&k, &v)?;
        let spec = AttentionSpec {
            kv_len: cache.len(),
            scale: self.scale,
            sliding_window: self.config.sliding_window,
            kv_groups: Some(l.kv_groups()),
        };
        let (kc, vc) = cache.buffers();
        let o = q.attention(kc, vc, &spec)?.reshape(&[t, l.q_len * l.head_dim])?;
        self.o_proj.forward(&o, group)
    }
}
