//! One decoder block of a model, built from the architecture table and the config: which rope
//! (Gemma 3's sliding layers have their own base), which window, which norms and q/k norm, an
//! MLP or a mixture of experts, and the family's tensor names.

use crate::config::ModelConfig;
use crate::error::Result;
use tp_core::{RotaryEmbedding, RouterKind};
use tp_layers::{AttentionConfig, AttentionHeads, Block, DecoderConfig, DecoderLayer, Loader, MoeConfig, QkNorm};

/// What layer `i` of the model needs besides its weights.
pub(crate) fn decoder_config(c: &ModelConfig, i: usize, expert_parallel: bool) -> Result<DecoderConfig> {
    let window = c.window_of(i);
    let (theta, scaling) = match (window, c.local_rope.clone()) {
        (Some(_), Some(local)) => local,
        _ => (c.rope_theta, c.rope_scaling.clone()),
    };
    let heads =
        AttentionHeads { num_heads: c.num_attention_heads, num_kv_heads: c.num_key_value_heads, head_dim: c.head_dim };
    let attention = AttentionConfig {
        heads,
        rope: RotaryEmbedding::new(c.rotary_dim, theta, scaling)?,
        sliding_window: window,
        scale: c.attention_scale,
        qk_norm: c.qk_norm.map(|span| QkNorm { span, style: c.norm_style, eps: c.rms_norm_eps }),
        sinks: c.architecture.spec().sinks,
    };
    let moe = c.moe.as_ref().filter(|m| m.is_sparse(i)).map(|m| MoeConfig {
        num_experts: m.num_experts,
        top_k: m.top_k,
        router: RouterKind::SoftmaxTopK { renormalize: m.norm_topk_prob },
        weights_in_dtype: m.weights_in_dtype,
        activation: m.activation.unwrap_or(c.hidden_act),
        expert_parallel,
    });
    Ok(DecoderConfig {
        attention,
        rms_norm_eps: c.rms_norm_eps,
        norm_style: c.norm_style,
        activation: c.hidden_act,
        moe,
    })
}

/// Layer `i` under the loader's prefix (`model.layers.i`), this rank's shards only (an MoE
/// layer's experts whole on ranks under `expert_parallel`).
pub(crate) fn decoder_layer(
    ld: &Loader<'_>,
    c: &ModelConfig,
    i: usize,
    expert_parallel: bool,
) -> Result<Box<dyn Block>> {
    let names = c.architecture.spec().names;
    Ok(Box::new(DecoderLayer::load(ld, &decoder_config(c, i, expert_parallel)?, &names)?))
}
