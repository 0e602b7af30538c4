//! [`ParallelAttention`]: grouped-query self-attention split by heads, with a KV cache.
//!
//! With query heads split whole over ranks (balanced; each rank holding the KV heads its query
//! heads use, replicated where ranks share one: [`QkvLayout`]), rank `r` holding query heads
//! `Q_r`:
//!
//! 1. `[q_r | k_r | v_r] = x [Wq_r; Wk_r; Wv_r]^T (+ b)`: one column-parallel GEMM, local.
//! 2. Optional q/k RMSNorm ([`QkNorm`]): per head over `head_dim` (Qwen3, Gemma 3; local), or
//!    over the full q and k width (OLMo 2). The full-width norm needs each token's sum of
//!    squares over every rank's features: each rank sums its q features and the k features of
//!    the KV heads it owns (a replicated KV head counts once, [`QkvLayout::kv_owned`]), and one
//!    all-reduce of `2T` floats completes both statistics; nothing else moves.
//! 3. RoPE on `q_r` and `k_r` at the tokens' absolute positions; `k_r, v_r` appended to this
//!    rank's cache (its KV heads only).
//! 4. Causal attention of `q_r` over the cache (scaled by `1/sqrt(head_dim)` or the
//!    architecture's own factor, within a sliding window where the layer has one, with the
//!    rank's heads' attention-sink logits where the layer has them, gpt-oss's `sinks: [heads]`):
//!    each rank's heads are independent, local.
//! 5. `y = Σ_r o_r Wo[:, cols(Q_r)]^T + b_o`: the output projection is row-parallel over the
//!    input features of the rank's own query heads, `cols(Q_r) = [q_start·D, (q_start+q_len)·D)`,
//!    which follow the head split (uneven heads included), then one all-reduce; the bias once.
//!
//! Communication: one all-reduce of `[T, H]` per forward (plus `2T` floats for a full-width
//! q/k norm).
//!
//! [`ParallelAttention::forward_batch`] runs the same steps over a flat batch of several
//! sequences' tokens ([`TokenBatch`]) with a paged cache ([`PagedKvCache`]): one q/k/v GEMM
//! over all `T` tokens, RoPE at each token's own position, keys and values written at the
//! tokens' slots, paged attention of each sequence over its own blocks, and one all-reduce for
//! the whole batch.

use crate::batch::TokenBatch;
use crate::error::{LayerError, Result};
use crate::kv_cache::KvCache;
use crate::linear::Linear;
use crate::loader::Loader;
use crate::norm::RmsNorm;
use crate::paged_cache::PagedKvCache;
use crate::parts::Projections;
use crate::qkv::{AttentionHeads, QkvLayout, QkvParallel};
use crate::row::RowParallel;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tp_comm::{DeviceGroup, ReduceOp};
use tp_core::{AttentionSpec, DType, Device, KvQuant, NormStyle, PagedAttentionSpec, RotaryEmbedding, Tensor};

/// Over which features a q/k norm normalises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNormSpan {
    /// Each head's `head_dim` features (Qwen3, Gemma 3): weights `[head_dim]`.
    PerHead,
    /// All `heads · head_dim` features of q (and of k) per token (OLMo 2): weights
    /// `[heads · head_dim]`, split across ranks with the heads.
    FullWidth,
}

/// An RMSNorm on the queries and keys before RoPE.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QkNorm {
    /// Per head or over the full width.
    pub span: QkNormSpan,
    /// How the weight applies.
    pub style: NormStyle,
    /// Epsilon under the square root.
    pub eps: f64,
}

/// What an attention layer needs besides its weights.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionConfig {
    /// Heads and head size.
    pub heads: AttentionHeads,
    /// Rotary embedding over the first `rope.head_dim() <= heads.head_dim` features of each
    /// head (fewer: partial rotary, the rest pass through).
    pub rope: RotaryEmbedding,
    /// Each token sees at most this many most recent positions (Mistral, Gemma's local layers).
    pub sliding_window: Option<usize>,
    /// Factor on `q·k` (`None`: `1/sqrt(head_dim)`; Gemma: `query_pre_attn_scalar^-1/2`).
    pub scale: Option<f64>,
    /// A q/k RMSNorm, if the architecture has one.
    pub qk_norm: Option<QkNorm>,
    /// Whether each query head has a learned attention-sink logit (gpt-oss).
    pub sinks: bool,
}

impl AttentionConfig {
    /// Plain attention: `heads`, `rope`, no window, the default scale, no q/k norm, no sinks.
    pub fn new(heads: AttentionHeads, rope: RotaryEmbedding) -> AttentionConfig {
        AttentionConfig { heads, rope, sliding_window: None, scale: None, qk_norm: None, sinks: false }
    }
}

/// The checkpoint names of an attention block's tensors, relative to its prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionNames {
    /// q, k, v: Hugging Face's `q_proj`, `k_proj`, `v_proj`, or Phi-3's fused `qkv_proj`.
    pub qkv: Projections<3>,
    /// The output projection, `o_proj`.
    pub o: &'static str,
    /// The q and k norms (`q_norm`, `k_norm`), read when the config has a q/k norm.
    pub q_norm: &'static str,
    /// See `q_norm`.
    pub k_norm: &'static str,
    /// The sink logits `[heads]` (`sinks`), read when the config has sinks.
    pub sinks: &'static str,
}

impl Default for AttentionNames {
    fn default() -> Self {
        AttentionNames { qkv: Projections::default(), o: "o_proj", q_norm: "q_norm", k_norm: "k_norm", sinks: "sinks" }
    }
}

/// Rank `r`'s q and k norm weights.
#[derive(Debug, Clone)]
struct QkNorms {
    q: RmsNorm,
    k: RmsNorm,
    span: QkNormSpan,
}

/// Rank `r`'s part of a self-attention layer, with the group it runs on.
#[derive(Debug, Clone)]
pub struct ParallelAttention {
    qkv: QkvParallel,
    o_proj: RowParallel,
    qk_norm: Option<QkNorms>,
    config: AttentionConfig,
    scale: f32,
    /// This rank's query heads' sink logits `[q_len]` (the model's dtype) and their gradient,
    /// where the config has sinks.
    sinks: Option<(Tensor, crate::Grad)>,
    /// Identifies the layer to the KV caches it binds (clones share it).
    id: u64,
}

fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl ParallelAttention {
    /// Packs the q/k/v and output projections' host weights once
    /// ([`Linear::pack_host`](crate::Linear::pack_host)).
    pub fn pack_host(&mut self) -> Result<()> {
        self.qkv.pack_host()?;
        self.o_proj.pack_host()
    }

    /// Assembles a layer from its projections (and q/k norm weights when the config has a q/k
    /// norm: `[head_dim]` per head, or this rank's slice of the full width); `o_proj` must hold
    /// the input features of the query heads `qkv` holds.
    pub fn new(
        qkv: QkvParallel,
        o_proj: RowParallel,
        qk_norm: Option<(RmsNorm, RmsNorm)>,
        config: AttentionConfig,
    ) -> Result<ParallelAttention> {
        let l = *qkv.layout();
        let h = config.heads;
        if (l.num_heads, l.num_kv_heads, l.head_dim) != (h.num_heads, h.num_kv_heads, h.head_dim)
            || config.rope.head_dim() > h.head_dim
        {
            return Err(LayerError::Config(format!("attention layout {l:?} and config {config:?} disagree")));
        }
        let s = o_proj.shard();
        let cols = l.o_proj_columns();
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
        let scale = match config.scale {
            Some(s) if s.is_finite() && s > 0.0 && (s as f32).is_finite() && s as f32 > 0.0 => s as f32,
            Some(s) => return Err(LayerError::Config(format!("attention scale must be positive, got {s}"))),
            None => 1.0 / (h.head_dim as f32).sqrt(),
        };
        let qk_norm = match (config.qk_norm, qk_norm) {
            (None, None) => None,
            (Some(n), Some((q, k))) => {
                let (wq, wk) = match n.span {
                    QkNormSpan::PerHead => (l.head_dim, l.head_dim),
                    QkNormSpan::FullWidth => (l.q_len * l.head_dim, l.kv_len * l.head_dim),
                };
                if q.weight().dims() != [wq] || k.weight().dims() != [wk] {
                    return Err(LayerError::Config(format!(
                        "q/k norm weights {:?} / {:?}; this rank needs [{wq}] / [{wk}]",
                        q.weight().dims(),
                        k.weight().dims()
                    )));
                }
                Some(QkNorms { q, k, span: n.span })
            }
            _ => {
                return Err(LayerError::Config(
                    "q/k norm weights must be given exactly when the config has one".into(),
                ));
            }
        };
        Ok(ParallelAttention { qkv, o_proj, qk_norm, config, scale, sinks: None, id: next_id() })
    }

    /// Sets the sink logits from the model's full `[heads]` vector (any float dtype): this rank
    /// keeps its query heads' entries, in the layer's dtype (after [`new`](Self::new) or
    /// [`from_full`](Self::from_full); [`load`](Self::load) reads them itself).
    ///
    /// Errors: a config without sinks, a vector of another length, a non-finite logit.
    pub fn set_sinks(&mut self, full: &Tensor) -> Result<()> {
        let l = *self.layout();
        if !self.config.sinks || full.dims() != [l.num_heads] {
            return Err(LayerError::Config(format!(
                "attention sinks must be [{}] (one per head) on a layer configured with sinks, got {:?}",
                l.num_heads,
                full.dims()
            )));
        }
        let v = full.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.to_vec::<f32>()?;
        if v.iter().any(|x| !x.is_finite()) {
            return Err(LayerError::Config("attention sinks must be finite".into()));
        }
        let mine = full.narrow(0, l.q_start, l.q_len)?.to_dtype(self.dtype())?.to_device(&Device::Cpu)?;
        self.sinks = Some((mine, crate::Grad::default()));
        Ok(())
    }

    /// This rank's query heads' sink logits in f32, if the layer has them.
    pub fn sinks(&self) -> Result<Option<Arc<[f32]>>> {
        match &self.sinks {
            None => Ok(None),
            Some((w, _)) => Ok(Some(w.to_dtype(DType::F32)?.to_vec::<f32>()?.into())),
        }
    }

    /// `group`'s rank's part of full `q, k, v, o` projections (`o: [H, heads·D]`) and, with a
    /// q/k norm, of its full weights.
    pub fn from_full(
        [q, k, v, o]: [&Linear; 4],
        qk_norm: Option<(&Tensor, &Tensor)>,
        config: AttentionConfig,
        group: &DeviceGroup,
    ) -> Result<ParallelAttention> {
        let h = config.heads;
        let layout = QkvLayout::new(h.num_heads, h.num_kv_heads, h.head_dim, group.rank(), group.world_size())?;
        let dev = group.device();
        let moved = |l: &Linear| l.to(l.dtype(), &dev);
        let qkv = QkvParallel::from_full(&moved(q)?, &moved(k)?, &moved(v)?, layout)?;
        let o_proj = RowParallel::from_full_columns(o.weight()?, o.bias(), layout.o_proj_columns(), group)?;
        let norms = match (config.qk_norm, qk_norm) {
            (Some(n), Some((wq, wk))) => {
                let (wq, wk) = (wq.to_device(&dev)?, wk.to_device(&dev)?);
                let (wq, wk) = match n.span {
                    QkNormSpan::PerHead => (wq, wk),
                    QkNormSpan::FullWidth => {
                        let d = h.head_dim;
                        (
                            wq.narrow(0, layout.q_start * d, layout.q_len * d)?,
                            wk.narrow(0, layout.kv_start * d, layout.kv_len * d)?,
                        )
                    }
                };
                Some((RmsNorm::with_style(wq, n.eps, n.style)?, RmsNorm::with_style(wk, n.eps, n.style)?))
            }
            _ => None,
        };
        Self::new(qkv, o_proj, norms, config)
    }

    /// Loads the projections (and q/k norms) named by `names` under the loader's prefix, each
    /// rank reading only its heads' rows of q/k/v, its heads' columns of o and its slice of a
    /// full-width norm.
    pub fn load(ld: &Loader<'_>, config: &AttentionConfig, names: AttentionNames) -> Result<ParallelAttention> {
        let qkv = QkvParallel::load(ld, config.heads, names.qkv)?;
        let l = *qkv.layout();
        let hidden = qkv.local().in_features();
        ld.expect(&format!("{}.weight", names.o), &[hidden, l.num_heads * l.head_dim])?;
        let o_proj = RowParallel::load_columns(&ld.pp(names.o), l.o_proj_columns())?;
        let norms = match config.qk_norm {
            None => None,
            Some(n) => {
                let (qn, kn) = (ld.pp(names.q_norm), ld.pp(names.k_norm));
                let d = l.head_dim;
                Some(match n.span {
                    QkNormSpan::PerHead => {
                        qn.expect("weight", &[d])?;
                        kn.expect("weight", &[d])?;
                        (RmsNorm::load(&qn, n.eps, n.style)?, RmsNorm::load(&kn, n.eps, n.style)?)
                    }
                    QkNormSpan::FullWidth => {
                        qn.expect("weight", &[l.num_heads * d])?;
                        kn.expect("weight", &[l.num_kv_heads * d])?;
                        (
                            RmsNorm::load_slice(&qn, (l.q_start * d, l.q_len * d), n.eps, n.style)?,
                            RmsNorm::load_slice(&kn, (l.kv_start * d, l.kv_len * d), n.eps, n.style)?,
                        )
                    }
                })
            }
        };
        let mut a = Self::new(qkv, o_proj, norms, config.clone())?;
        if config.sinks {
            ld.expect(names.sinks, &[l.num_heads])?;
            a.set_sinks(&ld.full(names.sinks)?)?;
        }
        Ok(a)
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
    /// The group the layer runs on.
    pub fn group(&self) -> &DeviceGroup {
        self.o_proj.group()
    }
    /// The parameters' dtype.
    pub fn dtype(&self) -> DType {
        self.qkv.local().dtype()
    }
    /// Where the parameters live.
    pub fn device(&self) -> Device {
        self.qkv.local().device()
    }

    /// An empty cache for this layer on this rank: `capacity` positions of its KV heads.
    pub fn new_cache(&self, capacity: usize) -> Result<KvCache> {
        let l = self.layout();
        let mut cache = KvCache::new(capacity, l.kv_len, l.head_dim, self.dtype(), &self.device())?;
        cache.bind(self.id, (l.kv_len, l.head_dim), self.dtype(), self.device())?;
        Ok(cache)
    }

    /// Self-attention of `x: [T, H]`, the next `T` tokens of the sequence whose first
    /// `cache.len()` positions the cache holds (so token `t` sits at position
    /// `cache.len() + t`); appends their keys and values (growing the cache when it is full);
    /// returns `[T, H]` on every rank.
    ///
    /// Errors: [`LayerError::CacheMismatch`] for a cache of another layer or shape, allocation
    /// failures when the cache must grow (nothing is written), collective failures.
    pub fn forward(&self, x: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        let l = *self.layout();
        cache.bind(self.id, (l.kv_len, l.head_dim), self.dtype(), self.device())?;
        let &[t, _] = x.dims() else {
            return Err(LayerError::Config(format!("attention input must be [tokens, hidden], got {:?}", x.dims())));
        };
        let positions: Vec<usize> = (cache.len()..cache.len() + t).collect();
        let (q, k, v) = self.qkv.forward(x)?;
        let (q, k) = self.qk_normed(q, k, t)?;
        let q = q.reshape(&[t, l.q_len, l.head_dim])?.rope(&positions, &self.config.rope)?;
        let k = k.reshape(&[t, l.kv_len, l.head_dim])?.rope(&positions, &self.config.rope)?;
        let v = v.reshape(&[t, l.kv_len, l.head_dim])?;
        cache.append(&k, &v)?;
        let spec = AttentionSpec {
            kv_len: cache.len(),
            scale: self.scale,
            sliding_window: self.config.sliding_window,
            kv_groups: Some(l.kv_groups()),
            sinks: self.sinks()?,
        };
        let (kc, vc) = cache.buffers();
        let o = q.attention(kc, vc, &spec)?.reshape(&[t, l.q_len * l.head_dim])?;
        self.o_proj.forward(&o)
    }

    /// An empty paged cache for this layer on this rank: `num_blocks` blocks of `block_size`
    /// positions of its KV heads, in the layer's dtype or (`quant`) in 8 bits on the host,
    /// bound to the layer.
    pub fn new_paged_cache(
        &self,
        num_blocks: usize,
        block_size: usize,
        quant: Option<KvQuant>,
    ) -> Result<PagedKvCache> {
        let l = self.layout();
        let (kv, d, dtype, device) = (l.kv_len, l.head_dim, self.dtype(), self.device());
        let mut cache = match quant {
            None => PagedKvCache::new(num_blocks, block_size, kv, d, dtype, &device)?,
            Some(q) => PagedKvCache::new_quantized(num_blocks, block_size, kv, d, q, dtype, &device)?,
        };
        cache.bind(self.id, (l.kv_len, l.head_dim), self.dtype(), self.device())?;
        Ok(cache)
    }

    /// Self-attention of `x: [T, H]`, the rows of `batch` (each sequence's next tokens after
    /// its cached context): writes their keys and values at the batch's slots of `cache`, then
    /// each row attends over its own sequence's blocks. Returns `[T, H]` on every rank, with
    /// one all-reduce for the whole batch.
    ///
    /// Errors: [`LayerError::CacheMismatch`] for a cache of another layer, shape or block
    /// size; `x` not `[T, H]`; block tables naming blocks past the cache; collective failures.
    pub fn forward_batch(&self, x: &Tensor, batch: &TokenBatch, cache: &mut PagedKvCache) -> Result<Tensor> {
        let l = *self.layout();
        cache.bind(self.id, (l.kv_len, l.head_dim), self.dtype(), self.device())?;
        if cache.block_size() != batch.block_size() {
            return Err(LayerError::CacheMismatch(format!(
                "the batch's block tables count blocks of {} positions, the cache's blocks hold {}",
                batch.block_size(),
                cache.block_size()
            )));
        }
        let blocks = cache.num_blocks();
        if let Some((i, b)) = batch
            .seqs()
            .iter()
            .enumerate()
            .find_map(|(i, s)| s.blocks.iter().find(|&&b| b as usize >= blocks).map(|b| (i, b)))
        {
            return Err(LayerError::CacheMismatch(format!(
                "sequence {i} of the batch names block {b}, past the cache's {blocks} blocks"
            )));
        }
        let t = batch.num_tokens();
        if x.ndim() != 2 || x.dims()[0] != t {
            return Err(LayerError::Config(format!(
                "attention input must be [{t} tokens of the batch, hidden], got {:?}",
                x.dims()
            )));
        }
        let (q, k, v) = self.qkv.forward(x)?;
        let (q, k) = self.qk_normed(q, k, t)?;
        let q = batch.rope(&q.reshape(&[t, l.q_len, l.head_dim])?, &self.config.rope)?;
        let k = batch.rope(&k.reshape(&[t, l.kv_len, l.head_dim])?, &self.config.rope)?;
        let v = v.reshape(&[t, l.kv_len, l.head_dim])?;
        cache.write(&k, &v, batch.slots())?;
        let spec = PagedAttentionSpec {
            scale: self.scale,
            sliding_window: self.config.sliding_window,
            kv_groups: Some(l.kv_groups()),
            sinks: self.sinks()?,
        };
        let (kc, vc) = cache.buffers();
        let o = q.paged_attention_kv(kc, vc, &batch.paged_seqs(), &spec)?.reshape(&[t, l.q_len * l.head_dim])?;
        self.o_proj.forward(&o)
    }

    /// `q: [T, q_len·D]`, `k: [T, kv_len·D]` after the q/k norm, if any.
    fn qk_normed(&self, q: Tensor, k: Tensor, t: usize) -> Result<(Tensor, Tensor)> {
        let (q, k, _) = self.qk_normed_stats(q, k, t)?;
        Ok((q, k))
    }
}

/// q and k after the q/k norm, and a full-width norm's summed statistics `(Σq², Σk²)`.
type NormedQk = (Tensor, Tensor, Option<(Tensor, Tensor)>);

/// What [`ParallelAttention::backward`] needs of a training forward.
#[derive(Debug, Clone)]
pub struct AttentionSaved {
    x: Tensor,
    /// `q_r`, `k_r` before the q/k norm, and a full-width norm's summed statistics.
    q: Tensor,
    k: Tensor,
    stats: Option<(Tensor, Tensor)>,
    /// After RoPE: `[T, q_len, D]`, `[T, kv_len, D]`; and `v: [T, kv_len, D]`.
    q_rot: Tensor,
    k_rot: Tensor,
    v: Tensor,
    /// Attention's output `[T, q_len·D]`, the input of `o_proj`.
    o: Tensor,
    batch: crate::SeqBatch,
}

/// Training: a forward over a batch of whole sequences, and its backward.
///
/// The input `x: [T, H]` holds the sequences' tokens one after the other (`lens` of them each,
/// each sequence from position 0, attending only within itself: no padding is ever computed;
/// RoPE turns each sequence with the frequencies of its own length, [`crate::SeqBatch`]'s rule, so a
/// LongRoPE row gets the factors it would get alone). The backward runs the forward's steps in reverse: the output projection's (row-parallel,
/// local), attention's per sequence ([`Tensor::attention_backward`], scores recomputed, never
/// stored), RoPE's (the transposed rotation), the q/k norm's (for a full-width norm the ranks
/// all-reduce each token's `Σ g·x` over q and over k, `2T` floats, as the forward did its sums
/// of squares), and the q/k/v projection's (one all-reduce of `dX`). A KV head that other
/// ranks hold too gets only this rank's query heads' share here; see [`QkvParallel::params`].
impl ParallelAttention {
    /// Self-attention of the sequences of `batch`, keeping what the backward needs. `x` is
    /// this rank's rows of `[T, H]` (all of them, or its sequence shard under sequence
    /// parallelism, all-gathered first); the output comes back in the same rows (all-reduced,
    /// or reduce-scattered to the shard).
    pub fn forward_train(&self, x: &Tensor, batch: &crate::SeqBatch) -> Result<(Tensor, AttentionSaved)> {
        let l = *self.layout();
        let d = l.head_dim;
        let group = self.group();
        let t = batch.tokens();
        let rows = batch.shard(group)?.len();
        if x.ndim() != 2 || x.dims()[0] != rows {
            return Err(LayerError::Config(format!(
                "attention input must be [{rows} tokens of the batch on this rank, hidden], got {:?}",
                x.dims()
            )));
        }
        let x_full = batch.gather(x, group)?;
        let (q, k, v) = self.qkv.forward(&x_full)?;
        let (qn, kn, stats) = self.qk_normed_stats(q.clone(), k.clone(), t)?;
        // Each sequence with its own length's frequencies (LongRoPE, dynamic NTK).
        let q_rot = batch.rope(&qn.reshape(&[t, l.q_len, d])?, &self.config.rope)?;
        let k_rot = batch.rope(&kn.reshape(&[t, l.kv_len, d])?, &self.config.rope)?;
        let v = v.reshape(&[t, l.kv_len, d])?;
        let mut outs = Vec::with_capacity(batch.lens().len());
        let mut start = 0;
        let sinks = self.sinks()?;
        for &n in batch.lens().iter().filter(|&&n| n > 0) {
            let spec = self.train_spec(n, sinks.clone());
            let part = |t: &Tensor| t.narrow(0, start, n);
            outs.push(part(&q_rot)?.attention(&part(&k_rot)?, &part(&v)?, &spec)?);
            start += n;
        }
        let o = Tensor::cat(&outs, 0)?.reshape(&[t, l.q_len * d])?;
        let y = self.o_proj.add_bias(batch.reduce(&self.o_proj.forward_partial(&o)?, group)?)?;
        let saved = AttentionSaved { x: x.clone(), q, k, stats, q_rot, k_rot, v, o, batch: batch.clone() };
        Ok((y, saved))
    }

    /// `dx` (f32, this rank's rows as the forward's input) from `dy` (the output's rows),
    /// accumulating the gradients of the projections and q/k norms.
    pub fn backward(&mut self, saved: AttentionSaved, dy: &Tensor) -> Result<Tensor> {
        let l = *self.layout();
        let d = l.head_dim;
        let t = saved.batch.tokens();
        let group = self.o_proj.group().clone();
        let dy = saved.batch.gather(dy, &group)?;
        let d_o = self.o_proj.backward(&saved.o, &dy)?.reshape(&[t, l.q_len, d])?;
        let (mut dq, mut dk, mut dv) = (Vec::new(), Vec::new(), Vec::new());
        let mut start = 0;
        let sinks = self.sinks()?;
        let mut dsinks = vec![0f32; l.q_len];
        for &n in saved.batch.lens().iter().filter(|&&n| n > 0) {
            let part = |t: &Tensor| t.narrow(0, start, n);
            let (a, b, c, ds) = part(&saved.q_rot)?.attention_backward_sinks(
                &part(&saved.k_rot)?,
                &part(&saved.v)?,
                &part(&d_o)?,
                &self.train_spec(n, sinks.clone()),
            )?;
            dq.push(a);
            dk.push(b);
            dv.push(c);
            dsinks.iter_mut().zip(ds).for_each(|(a, b)| *a += b);
            start += n;
        }
        if let Some((_, grad)) = &mut self.sinks {
            grad.add(&Tensor::from_vec(dsinks, &[l.q_len], &Device::Cpu)?)?;
        }
        let (rope, batch) = (&self.config.rope, &saved.batch);
        let dq = batch.rope_backward(&Tensor::cat(&dq, 0)?, rope)?.reshape(&[t, l.q_len * d])?;
        let dk = batch.rope_backward(&Tensor::cat(&dk, 0)?, rope)?.reshape(&[t, l.kv_len * d])?;
        let dv = Tensor::cat(&dv, 0)?.reshape(&[t, l.kv_len * d])?;
        let (dq, dk) = self.qk_norm_backward(&saved, dq, dk, t)?;
        let dqkv = Tensor::cat(&[dq, dk, dv], 1)?;
        let x_full = saved.batch.gather(&saved.x, &group)?; // gathered again, not kept
        self.qkv.backward(&x_full, &dqkv, &group, Some(&saved.batch))
    }

    /// The layer's parameters under `prefix` (named by `names`): q/k/v and o as their layers
    /// place them; a per-head q/k norm replicated with partial gradients (each rank's heads
    /// contribute), a full-width one by this rank's slice (its KV heads' part placed as the
    /// k rows are).
    pub fn params<'a>(
        &'a mut self,
        prefix: &str,
        names: AttentionNames,
        f: &mut dyn FnMut(crate::Param<'a>),
    ) -> Result<()> {
        use crate::parts::join;
        let l = *self.layout();
        let d = l.head_dim;
        self.qkv.params(prefix, names.qkv, f)?;
        self.o_proj.params(&join(prefix, names.o), f)?;
        if let Some((value, grad)) = &mut self.sinks {
            let p = crate::Placement::block(join(prefix, names.sinks), &[l.num_heads], 0, (0, l.q_start, l.q_len));
            f(crate::Param { value, grad, placements: vec![p] });
        }
        let Some(n) = &mut self.qk_norm else { return Ok(()) };
        let (qname, kname) =
            (join(prefix, &format!("{}.weight", names.q_norm)), join(prefix, &format!("{}.weight", names.k_norm)));
        match n.span {
            QkNormSpan::PerHead => {
                n.q.param(vec![crate::Placement::replicated(qname, &[d], l.rank, true)], f);
                n.k.param(vec![crate::Placement::replicated(kname, &[d], l.rank, true)], f);
            }
            QkNormSpan::FullWidth => {
                let q = crate::Placement::block(qname, &[l.num_heads * d], 0, (0, l.q_start * d, l.q_len * d));
                n.q.param(vec![q], f);
                let kp = l
                    .kv_sharing()
                    .into_iter()
                    .enumerate()
                    .map(|(j, (owned, partial))| crate::Placement {
                        name: kname.clone(),
                        full_dims: vec![l.num_kv_heads * d],
                        dim: 0,
                        local_start: j * d,
                        full_start: (l.kv_start + j) * d,
                        len: d,
                        owned,
                        partial,
                    })
                    .collect();
                n.k.param(kp, f);
            }
        }
        Ok(())
    }

    /// Attention of one whole sequence of `n` tokens (no cache before it).
    fn train_spec(&self, n: usize, sinks: Option<Arc<[f32]>>) -> AttentionSpec {
        AttentionSpec {
            kv_len: n,
            scale: self.scale,
            sliding_window: self.config.sliding_window,
            kv_groups: Some(self.layout().kv_groups()),
            sinks,
        }
    }

    /// [`qk_normed`](Self::qk_normed), also returning a full-width norm's summed statistics.
    fn qk_normed_stats(&self, q: Tensor, k: Tensor, t: usize) -> Result<NormedQk> {
        let Some(n) = &self.qk_norm else { return Ok((q, k, None)) };
        let l = *self.layout();
        let d = l.head_dim;
        match n.span {
            QkNormSpan::PerHead => {
                let q = n.q.forward(&q.reshape(&[t, l.q_len, d])?)?.reshape(&[t, l.q_len * d])?;
                let k = n.k.forward(&k.reshape(&[t, l.kv_len, d])?)?.reshape(&[t, l.kv_len * d])?;
                Ok((q, k, None))
            }
            QkNormSpan::FullWidth => {
                // Each token's sum of squares over the rank's q features and its owned KV
                // heads' k features, [2, T] in f32, summed over the ranks in one all-reduce.
                let owned = l.kv_owned();
                let ss_q = q.sum_squares()?;
                let ss_k = if owned.is_empty() {
                    Tensor::zeros(&[t], DType::F32, &q.device())?
                } else {
                    k.narrow(1, owned.start * d, owned.len() * d)?.sum_squares()?
                };
                let stats = Tensor::cat(&[ss_q.reshape(&[1, t])?, ss_k.reshape(&[1, t])?], 0)?;
                let stats = self.group().all_reduce(&stats, ReduceOp::Sum)?;
                let (sq, sk) = (stats.narrow(0, 0, 1)?.reshape(&[t])?, stats.narrow(0, 1, 1)?.reshape(&[t])?);
                let q = n.q.forward_with_sum_squares(&q, &sq, l.num_heads * d)?;
                let k = n.k.forward_with_sum_squares(&k, &sk, l.num_kv_heads * d)?;
                Ok((q, k, Some((sq, sk))))
            }
        }
    }

    /// The q/k norm's backward: `(dq, dk)` before the norm from their gradients after it.
    fn qk_norm_backward(
        &mut self,
        saved: &AttentionSaved,
        dq: Tensor,
        dk: Tensor,
        t: usize,
    ) -> Result<(Tensor, Tensor)> {
        let l = *self.layout();
        let d = l.head_dim;
        let group = self.o_proj.group().clone();
        let Some(n) = &mut self.qk_norm else { return Ok((dq, dk)) };
        match (n.span, &saved.stats) {
            (QkNormSpan::PerHead, _) => {
                let dq = n.q.backward(&saved.q.reshape(&[t, l.q_len, d])?, &dq.reshape(&[t, l.q_len, d])?)?;
                let dk = n.k.backward(&saved.k.reshape(&[t, l.kv_len, d])?, &dk.reshape(&[t, l.kv_len, d])?)?;
                Ok((dq.reshape(&[t, l.q_len * d])?, dk.reshape(&[t, l.kv_len * d])?))
            }
            (QkNormSpan::FullWidth, Some((sq, sk))) => {
                // Σ g·x over every feature: this rank's q features and all its KV heads' k
                // features (a shared head's gradient here is this rank's share, so the sum over
                // the ranks is the whole).
                let dots = Tensor::cat(
                    &[n.q.grad_dot(&saved.q, &dq)?.reshape(&[1, t])?, n.k.grad_dot(&saved.k, &dk)?.reshape(&[1, t])?],
                    0,
                )?;
                let dots =
                    group.all_reduce(&dots.to_device(&group.device())?, ReduceOp::Sum)?.to_device(&Device::Cpu)?;
                let (dot_q, dot_k) = (dots.narrow(0, 0, 1)?.reshape(&[t])?, dots.narrow(0, 1, 1)?.reshape(&[t])?);
                let dq = n.q.backward_split(&saved.q, &dq, sq, l.num_heads * d, &dot_q)?;
                let nk = l.num_kv_heads * d;
                let dk = n.k.backward_split(&saved.k, &dk, sk, nk, &dot_k)?;
                // A KV head other ranks hold too: its `dx = r·g - x·r³·dot/n` has a share
                // `r·g` per rank (linear in this rank's g) but the one `x·r³·dot/n` term, from
                // the ranks' total dot, must enter the all-reduced dX once: on the rank owning
                // the head. The other copies take it back out.
                let not_owned = l.kv_owned().start;
                if not_owned == 0 {
                    return Ok((dq, dk));
                }
                let mut dk = dk.to_dtype(DType::F32)?;
                let (x, ss, dot) = (saved.k.to_dtype(DType::F32)?, sk.to_f64_vec()?, dot_k.to_f64_vec()?);
                let (x, width) = (x.as_slice::<f32>()?, l.kv_len * d);
                let eps = n.k.eps() as f32;
                let g = dk.as_mut_slice::<f32>()?;
                for row in 0..t {
                    let rstd = 1.0 / ((ss[row] as f32) / nk as f32 + eps).sqrt();
                    let c = rstd * rstd * rstd * dot[row] as f32 / nk as f32;
                    for i in row * width..row * width + not_owned * d {
                        g[i] += x[i] * c;
                    }
                }
                Ok((dq, dk))
            }
            (QkNormSpan::FullWidth, None) => {
                Err(LayerError::Config("a full-width q/k norm saved no statistics".into()))
            }
        }
    }
}
