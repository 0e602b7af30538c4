//! [`DecoderLayer`]: one decoder block of a Llama-family model, and the [`Block`] trait a model
//! is a list of.
//!
//! A block is attention and a gated MLP, each with a residual connection, and up to four
//! replicated RMSNorms around them ([`BlockNorms`]):
//!
//! `h = x + attn_out(attn(attn_in(x)))`, `y = h + mlp_out(mlp(mlp_in(h)))`
//!
//! where an absent norm is the identity. Llama, Qwen2/3, Mistral and Phi-3 normalise the
//! inputs (`attn_in` = `input_layernorm`, `mlp_in` = `post_attention_layernorm`); OLMo 2 the
//! outputs (`attn_out` = `post_attention_layernorm`, `mlp_out` = `post_feedforward_layernorm`);
//! Gemma 3 both ("sandwich": `input_layernorm`, `post_attention_layernorm`,
//! `pre_feedforward_layernorm`, `post_feedforward_layernorm`). The norms and residual adds are
//! replicated (every rank holds `x` whole); attention and the MLP are split by heads and by
//! intermediate features, one all-reduce each.

use crate::attention::{AttentionConfig, AttentionNames, ParallelAttention};
use crate::batch::TokenBatch;
use crate::error::Result;
use crate::kv_cache::KvCache;
use crate::loader::Loader;
use crate::mlp::{MlpNames, ParallelMlp};
use crate::moe::{MoeConfig, MoeNames, ParallelMoe};
use crate::norm::RmsNorm;
use crate::paged_cache::PagedKvCache;
use tp_core::{Activation, KvQuant, NormStyle, Tensor};

/// A block of a model: a forward over the hidden states of the next tokens of a sequence, with
/// that sequence's cache. Implemented by [`DecoderLayer`]; a model is a list of blocks.
pub trait Block: std::fmt::Debug + Send + Sync {
    /// `x: [T, H]`, the next `T` tokens after the cache's, to `[T, H]` (every rank the same).
    fn forward(&self, x: &Tensor, cache: &mut KvCache) -> Result<Tensor>;
    /// An empty cache for this block on this rank, holding `capacity` positions at first.
    fn new_cache(&self, capacity: usize) -> Result<KvCache>;
    /// Packs the block's host weights once for the host GEMM (see
    /// [`Linear::pack_host`](crate::Linear::pack_host)); a no-op on a GPU.
    fn pack_host(&mut self) -> Result<()>;
    /// `x: [T, H]`, the rows of a flat batch of several sequences' next tokens, to `[T, H]`
    /// (every rank the same), their keys and values written into the paged `cache`.
    fn forward_batch(&self, x: &Tensor, batch: &TokenBatch, cache: &mut PagedKvCache) -> Result<Tensor>;
    /// An empty paged cache for this block on this rank: `num_blocks` blocks of `block_size`
    /// positions, in the block's dtype or (`quant`) in 8 bits on the host.
    fn new_paged_cache(&self, num_blocks: usize, block_size: usize, quant: Option<KvQuant>) -> Result<PagedKvCache>;

    /// Training: the forward of `batch`'s whole sequences (packed one after the other, each
    /// from position 0) from this rank's rows `x` of them (all, or its sequence shard),
    /// keeping what [`backward`](Block::backward) needs. No cache is read or written.
    fn forward_train(&self, x: &Tensor, batch: &crate::SeqBatch) -> Result<(Tensor, BlockSaved)>;
    /// Training: `dx` (f32, every rank the same) from `dy`, accumulating the gradients of the
    /// block's parameters.
    fn backward(&mut self, saved: BlockSaved, dy: &Tensor) -> Result<Tensor>;
    /// Training: what this block's mixture of experts routed in the forward that kept `saved`
    /// (`None` for a dense block).
    fn router_stats<'s>(&self, _saved: &'s BlockSaved) -> Option<&'s crate::RouterStats> {
        None
    }
    /// Training: sets the load-balancing loss's gradient on this block's router probabilities
    /// (`[T · E]`), which its backward adds (a no-op for a dense block).
    fn set_router_prob_grad(&self, _saved: &mut BlockSaved, _grad: std::sync::Arc<Vec<f32>>) {}
    /// The block's trainable parameters under `prefix` (`model.layers.N`), named by `names`;
    /// under `sequence_parallel` the replicated norms' gradients are partial (each rank's rows).
    fn params<'a>(
        &'a mut self,
        prefix: &str,
        names: &DecoderNames,
        sequence_parallel: bool,
        f: &mut dyn FnMut(crate::Param<'a>),
    ) -> Result<()>;
}

/// What a block's backward needs of its training forward (opaque; each block kind keeps its
/// own).
#[derive(Debug)]
pub struct BlockSaved(Box<dyn std::any::Any + Send>);

/// The names of a block's norms under its prefix; `None` where the block has no such norm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockNorms {
    /// Before attention.
    pub attn_in: Option<&'static str>,
    /// After attention, before the residual add.
    pub attn_out: Option<&'static str>,
    /// Before the MLP.
    pub mlp_in: Option<&'static str>,
    /// After the MLP, before the residual add.
    pub mlp_out: Option<&'static str>,
}

impl BlockNorms {
    /// Llama's pre-norm block: `input_layernorm`, `post_attention_layernorm` (before the MLP).
    pub const PRE: BlockNorms = BlockNorms {
        attn_in: Some("input_layernorm"),
        attn_out: None,
        mlp_in: Some("post_attention_layernorm"),
        mlp_out: None,
    };
}

/// What a decoder layer needs besides its weights.
#[derive(Debug, Clone, PartialEq)]
pub struct DecoderConfig {
    /// The attention block's configuration.
    pub attention: AttentionConfig,
    /// `rms_norm_eps` of the block's norms.
    pub rms_norm_eps: f64,
    /// How the block's norms apply their weights.
    pub norm_style: NormStyle,
    /// The MLP's gate activation.
    pub activation: Activation,
    /// A mixture of experts in place of the MLP, if this layer has one.
    pub moe: Option<MoeConfig>,
}

/// The checkpoint names of a block's parts, relative to its prefix (`model.layers.N`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecoderNames {
    /// The attention block's prefix (`self_attn`).
    pub attn: &'static str,
    /// Its tensors.
    pub attn_names: AttentionNames,
    /// The MLP's prefix (`mlp`).
    pub mlp: &'static str,
    /// Its tensors.
    pub mlp_names: MlpNames,
    /// A mixture-of-experts layer's prefixes (the first the checkpoint has: Mixtral's
    /// `block_sparse_moe`, or `mlp` as transformers 5 renames it) and tensors.
    pub moe: Option<(&'static [&'static str], MoeNames)>,
    /// The norms.
    pub norms: BlockNorms,
}

impl Default for DecoderNames {
    fn default() -> Self {
        DecoderNames {
            attn: "self_attn",
            attn_names: AttentionNames::default(),
            mlp: "mlp",
            mlp_names: MlpNames::default(),
            moe: None,
            norms: BlockNorms::PRE,
        }
    }
}

/// A block's feed-forward part: a gated MLP, or a mixture of experts.
// One per layer, held in place: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum FeedForward {
    /// A gated MLP.
    Dense(ParallelMlp),
    /// A mixture of experts.
    Moe(ParallelMoe),
}

impl FeedForward {
    /// `[T, H]` to `[T, H]`, every rank the same (one all-reduce).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            FeedForward::Dense(m) => m.forward(x),
            FeedForward::Moe(m) => m.forward(x),
        }
    }

    fn pack_host(&mut self) -> Result<()> {
        match self {
            FeedForward::Dense(m) => m.pack_host(),
            FeedForward::Moe(m) => m.pack_host(),
        }
    }

    /// Training forward (see [`ParallelMlp::forward_train`], [`ParallelMoe::forward_train`]).
    fn forward_train(&self, x: &Tensor, batch: &crate::SeqBatch) -> Result<(Tensor, FeedForwardSaved)> {
        match self {
            FeedForward::Dense(m) => m.forward_train(x, batch).map(|(y, s)| (y, FeedForwardSaved::Dense(s))),
            FeedForward::Moe(m) => m.forward_train(x, batch).map(|(y, s)| (y, FeedForwardSaved::Moe(s))),
        }
    }

    fn backward(&mut self, saved: FeedForwardSaved, dy: &Tensor) -> Result<Tensor> {
        match (self, saved) {
            (FeedForward::Dense(m), FeedForwardSaved::Dense(s)) => m.backward(s, dy),
            (FeedForward::Moe(m), FeedForwardSaved::Moe(s)) => m.backward(s, dy),
            _ => Err(crate::LayerError::Config("a feed-forward backward got another kind's saved state".into())),
        }
    }

    fn params<'a>(&'a mut self, prefix: &str, names: &DecoderNames, f: &mut dyn FnMut(crate::Param<'a>)) -> Result<()> {
        use crate::parts::join;
        match self {
            FeedForward::Dense(m) => m.params(&join(prefix, names.mlp), names.mlp_names, f),
            FeedForward::Moe(m) => {
                let Some((prefixes, moe_names)) = names.moe else {
                    return Err(crate::LayerError::Config(format!(
                        "{prefix}: experts in a family without expert names"
                    )));
                };
                m.params(&join(prefix, prefixes[0]), moe_names, f)
            }
        }
    }
}

/// A feed-forward part's training forward, kept for its backward.
// One per block, boxed inside `BlockSaved`: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum FeedForwardSaved {
    Dense(crate::MlpSaved),
    Moe(crate::MoeSaved),
}

/// Rank `r`'s part of one decoder block.
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    attn_in: Option<RmsNorm>,
    self_attn: ParallelAttention,
    attn_out: Option<RmsNorm>,
    mlp_in: Option<RmsNorm>,
    mlp: FeedForward,
    mlp_out: Option<RmsNorm>,
}

impl DecoderLayer {
    /// Assembles Llama's pre-norm block from its parts.
    pub fn new(
        input_layernorm: RmsNorm,
        self_attn: ParallelAttention,
        post_attention_layernorm: RmsNorm,
        mlp: ParallelMlp,
    ) -> DecoderLayer {
        Self::with_norms(self_attn, mlp, [Some(input_layernorm), None, Some(post_attention_layernorm), None])
    }

    /// Assembles a block with any of the four norms ([`BlockNorms`] order).
    pub fn with_norms(
        self_attn: ParallelAttention,
        mlp: ParallelMlp,
        [attn_in, attn_out, mlp_in, mlp_out]: [Option<RmsNorm>; 4],
    ) -> DecoderLayer {
        DecoderLayer { attn_in, self_attn, attn_out, mlp_in, mlp: FeedForward::Dense(mlp), mlp_out }
    }

    /// Loads the block under the loader's prefix (e.g. `model.layers.3`), each rank reading
    /// only its shards.
    pub fn load(ld: &Loader<'_>, config: &DecoderConfig, names: &DecoderNames) -> Result<DecoderLayer> {
        let norm = |name: Option<&str>| -> Result<Option<RmsNorm>> {
            name.map(|n| RmsNorm::load(&ld.pp(n), config.rms_norm_eps, config.norm_style)).transpose()
        };
        let n = names.norms;
        let mlp = match (config.moe, names.moe) {
            (None, _) => FeedForward::Dense(ParallelMlp::load(&ld.pp(names.mlp), names.mlp_names, config.activation)?),
            (Some(moe), Some((prefixes, moe_names))) => {
                let router = format!("{}.weight", moe_names.router);
                let prefix = prefixes.iter().find(|p| ld.pp(p).contains(&router)).or(prefixes.first());
                FeedForward::Moe(ParallelMoe::load(&ld.pp(prefix.unwrap_or(&names.mlp)), moe, moe_names)?)
            }
            (Some(_), None) => {
                return Err(crate::LayerError::Config(format!(
                    "{}: a mixture-of-experts layer in a family without expert names",
                    ld.prefix()
                )));
            }
        };
        Ok(DecoderLayer {
            attn_in: norm(n.attn_in)?,
            self_attn: ParallelAttention::load(&ld.pp(names.attn), &config.attention, names.attn_names)?,
            attn_out: norm(n.attn_out)?,
            mlp_in: norm(n.mlp_in)?,
            mlp,
            mlp_out: norm(n.mlp_out)?,
        })
    }

    /// The attention block.
    pub fn self_attn(&self) -> &ParallelAttention {
        &self.self_attn
    }
    /// The feed-forward block (an MLP or a mixture of experts).
    pub fn feed_forward(&self) -> &FeedForward {
        &self.mlp
    }
}

/// `x` through the norm `n`, or `x` itself where the block has no such norm (a tensor clone
/// shares its elements, so passing one costs nothing).
fn norm(n: &Option<RmsNorm>, x: Tensor) -> Result<Tensor> {
    match n {
        Some(n) => n.forward(&x),
        None => Ok(x),
    }
}

impl DecoderLayer {
    /// The block around an attention `attn` (of the normed input): norms, residuals, the MLP.
    fn run(&self, x: &Tensor, attn: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
        let mut h = norm(&self.attn_out, attn(&norm(&self.attn_in, x.clone())?)?)?;
        h.add_assign(x)?; // h = x + attn (addition commutes bit for bit)
        let mut y = norm(&self.mlp_out, self.mlp.forward(&norm(&self.mlp_in, h.clone())?)?)?;
        y.add_assign(&h)?;
        Ok(y)
    }
}

impl Block for DecoderLayer {
    /// Two all-reduces (attention's and the MLP's).
    fn forward(&self, x: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        self.run(x, |a| self.self_attn.forward(a, cache))
    }

    fn new_cache(&self, capacity: usize) -> Result<KvCache> {
        self.self_attn.new_cache(capacity)
    }

    fn pack_host(&mut self) -> Result<()> {
        self.self_attn.pack_host()?;
        self.mlp.pack_host()
    }

    /// Two all-reduces for the whole batch (attention's and the MLP's).
    fn forward_batch(&self, x: &Tensor, batch: &TokenBatch, cache: &mut PagedKvCache) -> Result<Tensor> {
        self.run(x, |a| self.self_attn.forward_batch(a, batch, cache))
    }

    fn new_paged_cache(&self, num_blocks: usize, block_size: usize, quant: Option<KvQuant>) -> Result<PagedKvCache> {
        self.self_attn.new_paged_cache(num_blocks, block_size, quant)
    }

    /// Two all-reduces (three with a full-width q/k norm), as the forward.
    fn forward_train(&self, x: &Tensor, batch: &crate::SeqBatch) -> Result<(Tensor, BlockSaved)> {
        let a_in = norm(&self.attn_in, x.clone())?;
        let (a_raw, attn) = self.self_attn.forward_train(&a_in, batch)?;
        let mut h = norm(&self.attn_out, a_raw.clone())?;
        h.add_assign(x)?;
        let m_in = norm(&self.mlp_in, h.clone())?;
        let (m_raw, mlp) = self.mlp.forward_train(&m_in, batch)?;
        let mut y = norm(&self.mlp_out, m_raw.clone())?;
        y.add_assign(&h)?;
        let saved = DecoderSaved { x: x.clone(), attn, a_raw, h, mlp, m_raw };
        Ok((y, BlockSaved(Box::new(saved))))
    }

    /// `h = x + attn_out(attn(attn_in(x)))`, `y = h + mlp_out(mlp(mlp_in(h)))`, backwards:
    /// `dh = dy + mlp_in'(mlp'(mlp_out'(dy)))`, `dx = dh + attn_in'(attn'(attn_out'(dh)))`
    /// (each primed step the backward of that part, an absent norm the identity).
    fn backward(&mut self, saved: BlockSaved, dy: &Tensor) -> Result<Tensor> {
        let s = *saved.0.downcast::<DecoderSaved>().map_err(|_| {
            crate::LayerError::Config("a decoder layer's backward got another block's saved state".into())
        })?;
        let dy = dy.to_dtype(tp_core::DType::F32)?;
        let d_mraw = norm_backward(&mut self.mlp_out, &s.m_raw, &dy)?;
        let d_min = self.mlp.backward(s.mlp, &d_mraw)?;
        let mut dh = norm_backward(&mut self.mlp_in, &s.h, &d_min)?;
        dh.add_assign(&dy)?;
        let d_araw = norm_backward(&mut self.attn_out, &s.a_raw, &dh)?;
        let d_ain = self.self_attn.backward(s.attn, &d_araw)?;
        let mut dx = norm_backward(&mut self.attn_in, &s.x, &d_ain)?;
        dx.add_assign(&dh)?;
        Ok(dx)
    }

    fn router_stats<'s>(&self, saved: &'s BlockSaved) -> Option<&'s crate::RouterStats> {
        match &saved.0.downcast_ref::<DecoderSaved>()?.mlp {
            FeedForwardSaved::Moe(m) => Some(m.router_stats()),
            FeedForwardSaved::Dense(_) => None,
        }
    }

    fn set_router_prob_grad(&self, saved: &mut BlockSaved, grad: std::sync::Arc<Vec<f32>>) {
        if let Some(DecoderSaved { mlp: FeedForwardSaved::Moe(m), .. }) = saved.0.downcast_mut::<DecoderSaved>() {
            m.set_prob_grad(grad);
        }
    }

    fn params<'a>(
        &'a mut self,
        prefix: &str,
        names: &DecoderNames,
        sequence_parallel: bool,
        f: &mut dyn FnMut(crate::Param<'a>),
    ) -> Result<()> {
        use crate::parts::join;
        let rank = self.self_attn.group().rank();
        let n = names.norms;
        for (norm, name) in [
            (&mut self.attn_in, n.attn_in),
            (&mut self.attn_out, n.attn_out),
            (&mut self.mlp_in, n.mlp_in),
            (&mut self.mlp_out, n.mlp_out),
        ] {
            if let (Some(norm), Some(name)) = (norm.as_mut(), name) {
                let h = norm.weight().numel();
                norm.param(
                    vec![crate::Placement::replicated(
                        join(prefix, &format!("{name}.weight")),
                        &[h],
                        rank,
                        sequence_parallel,
                    )],
                    f,
                );
            }
        }
        self.self_attn.params(&join(prefix, names.attn), names.attn_names, f)?;
        self.mlp.params(prefix, names, f)
    }
}

/// A decoder layer's training forward, kept for its backward.
#[derive(Debug)]
struct DecoderSaved {
    x: Tensor,
    attn: crate::AttentionSaved,
    a_raw: Tensor,
    h: Tensor,
    mlp: FeedForwardSaved,
    m_raw: Tensor,
}

/// The backward of `norm` at input `x` (the identity where the block has no such norm).
fn norm_backward(n: &mut Option<RmsNorm>, x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    match n {
        Some(n) => n.backward(x, dy),
        None => Ok(dy.clone()),
    }
}
