//! [`DecoderLayer`]: one Llama / Qwen2 / Mistral block.
//!
//! `h = x + attn(input_layernorm(x))`, `y = h + mlp(post_attention_layernorm(h))`: the norms and
//! residual adds are replicated (every rank holds `x` whole); attention and the MLP are split by
//! heads and by intermediate features, one all-reduce each. Hugging Face names:
//! `{prefix}.input_layernorm`, `{prefix}.self_attn.{q,k,v,o}_proj`,
//! `{prefix}.post_attention_layernorm`, `{prefix}.mlp.{gate,up,down}_proj`.

use crate::attention::{AttentionConfig, ParallelAttention};
use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::kv_cache::KvCache;
use crate::mlp::ParallelMlp;
use crate::norm::RmsNorm;
use crate::options::LoadOptions;
use tp_comm::DeviceGroup;
use tp_core::Tensor;

/// What a decoder layer needs besides its weights.
#[derive(Debug, Clone, PartialEq)]
pub struct DecoderConfig {
    /// The attention block's configuration.
    pub attention: AttentionConfig,
    /// `rms_norm_eps` of both norms.
    pub rms_norm_eps: f64,
}

/// Rank `r`'s part of one decoder block.
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: ParallelAttention,
    post_attention_layernorm: RmsNorm,
    mlp: ParallelMlp,
}

impl DecoderLayer {
    /// Assembles a block from its parts.
    pub fn new(
        input_layernorm: RmsNorm,
        self_attn: ParallelAttention,
        post_attention_layernorm: RmsNorm,
        mlp: ParallelMlp,
    ) -> DecoderLayer {
        DecoderLayer { input_layernorm, self_attn, post_attention_layernorm, mlp }
    }

    /// Loads block `prefix` (e.g. `model.layers.3`), each rank reading only its shards.
    pub fn load(
        ckpt: &Checkpoint,
        prefix: &str,
        config: &DecoderConfig,
        group: &DeviceGroup,
        opts: &LoadOptions,
    ) -> Result<DecoderLayer> {
        let eps = config.rms_norm_eps;
        Ok(DecoderLayer {
            input_layernorm: RmsNorm::load(ckpt, &format!("{prefix}.input_layernorm"), eps, group, opts)?,
            self_attn: ParallelAttention::load(ckpt, &format!("{prefix}.self_attn"), &config.attention, group, opts)?,
            post_attention_layernorm: RmsNorm::load(
                ckpt,
                &format!("{prefix}.post_attention_layernorm"),
                eps,
                group,
                opts,
            )?,
            mlp: ParallelMlp::load(ckpt, &format!("{prefix}.mlp"), group, opts)?,
        })
    }

    /// The attention block.
    pub fn self_attn(&self) -> &ParallelAttention {
        &self.self_attn
    }
    /// The MLP block.
    pub fn mlp(&self) -> &ParallelMlp {
        &self.mlp
    }

    /// An empty KV cache for this block's attention.
    pub fn new_cache(&self, capacity: usize) -> Result<KvCache> {
        self.self_attn.new_cache(capacity)
    }

    /// The block on `x: [T, H]` (the next `T` tokens after the cache's), every rank returning
    /// the full `[T, H]`. Two all-reduces.
    pub fn forward(&self, x: &Tensor, cache: &mut KvCache, group: &DeviceGroup) -> Result<Tensor> {
        let mut h = self.self_attn.forward(&self.input_layernorm.forward(x)?, cache, group)?;
        h.add_assign(x)?; // h = x + attn (addition commutes bit for bit)
        let mut y = self.mlp.forward(&self.post_attention_layernorm.forward(&h)?, group)?;
        y.add_assign(&h)?;
        Ok(y)
    }
}
