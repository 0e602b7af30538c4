//! The mixture-of-experts fields of a `config.json` ([`MoeSettings`]), read by the family's
//! rules in the architecture table ([`crate::arch::MoeRule`]): the expert count
//! (`num_experts` or `num_local_experts`), `num_experts_per_tok`, the experts' intermediate
//! size, `norm_topk_prob`, Qwen2-MoE's shared expert, Qwen's `decoder_sparse_step` and
//! `mlp_only_layers`, and `router_aux_loss_coef`.

use crate::arch::MoeRule;
use crate::error::Result;
use crate::fields::{Fields, shown_value};
use serde_json::Value;

/// A mixture-of-experts model's experts, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeSettings {
    /// Routed experts per MoE layer `E`.
    pub num_experts: usize,
    /// Experts per token `k` (`num_experts_per_tok`).
    pub top_k: usize,
    /// Whether the top `k` weights are divided by their sum.
    pub norm_topk_prob: bool,
    /// Whether the weights are cast to the model's dtype before scaling the experts (all but
    /// Mixtral).
    pub weights_in_dtype: bool,
    /// Each expert's intermediate features.
    pub expert_intermediate_size: usize,
    /// The shared expert's intermediate features (Qwen2-MoE), if the model has one.
    pub shared_expert_intermediate_size: Option<usize>,
    /// Per layer, whether it is a mixture of experts (else a dense MLP of
    /// `intermediate_size`).
    pub sparse_layers: Vec<bool>,
    /// The load-balancing loss's coefficient (`router_aux_loss_coef`).
    pub router_aux_loss_coef: f64,
    /// Whether training adds the load-balancing loss (`output_router_logits`, default false:
    /// transformers adds it only then).
    pub output_router_logits: bool,
    /// Mixtral's `router_jitter_noise`: random scaling of a training forward's inputs (0: none).
    pub router_jitter_noise: f64,
    /// The experts' activation where the family fixes its own (gpt-oss's clamped SwiGLU with
    /// `swiglu_alpha`, default 1.702, and `swiglu_limit`, default 7); else the config's
    /// `hidden_act`.
    pub activation: Option<tp_core::Activation>,
}

impl MoeSettings {
    /// Whether layer `i` is a mixture of experts.
    pub fn is_sparse(&self, layer: usize) -> bool {
        self.sparse_layers.get(layer).copied().unwrap_or(false)
    }
}

/// The settings `f` gives under `rule` for a model of `layers` layers and `hidden` features.
pub(crate) fn moe_settings(f: &Fields<'_>, rule: &MoeRule, layers: usize, hidden: usize) -> Result<MoeSettings> {
    let experts_key = rule.experts_keys.iter().copied().find(|k| f.get(k).is_some()).unwrap_or(rule.experts_keys[0]);
    let num_experts = match f.get(experts_key) {
        None => rule.experts_default,
        Some(v) => v
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| f.bad(experts_key, format!("must be a non-negative integer, got {}", shown_value(v))))?,
    };
    // Qwen's classes take 0 experts as a dense model; the others need experts.
    if num_experts == 0 && !rule.sparse_step {
        return Err(f.bad(experts_key, "must be at least 1"));
    }
    let top_k = f.count("num_experts_per_tok", Some(rule.top_k_default))?;
    if num_experts > 0 && top_k > num_experts {
        return Err(
            f.bad("num_experts_per_tok", format!("({top_k}) exceeds the {num_experts} experts ({experts_key})"))
        );
    }
    let expert_intermediate_size = f.count(rule.expert_size_key, Some(rule.expert_size_default))?;
    for (n, key) in [(num_experts, experts_key), (expert_intermediate_size, rule.expert_size_key)] {
        if n.checked_mul(2).and_then(|v| v.checked_mul(hidden)).is_none_or(|v| tp_core::Shape::new(&[v]).is_err()) {
            return Err(f.bad(key, format!("({n}) is too large for the experts' tensors")));
        }
    }
    let norm_topk_prob = match rule.norm_topk_prob {
        None => true,
        Some(default) => f.flag("norm_topk_prob", default)?,
    };
    let shared_expert_intermediate_size = match rule.shared_expert_default {
        None => None,
        Some(d) => Some(f.count("shared_expert_intermediate_size", Some(d))?),
    };
    let sparse_layers = if rule.sparse_step {
        let step = f.count("decoder_sparse_step", Some(1))?;
        let dense = mlp_only_layers(f)?;
        (0..layers).map(|i| num_experts > 0 && !dense.contains(&i) && (i + 1) % step == 0).collect()
    } else {
        vec![true; layers]
    };
    let router_aux_loss_coef = f.number("router_aux_loss_coef", Some(rule.aux_loss_coef_default))?;
    let output_router_logits = f.flag("output_router_logits", false)?;
    let router_jitter_noise = f.number("router_jitter_noise", Some(0.0))?;
    let activation = if rule.clamped_swiglu {
        let alpha = f.positive("swiglu_alpha", Some(1.702))?;
        let limit = f.positive("swiglu_limit", Some(7.0))?;
        for (v, key) in [(alpha, "swiglu_alpha"), (limit, "swiglu_limit")] {
            if !(v as f32).is_finite() {
                return Err(f.bad(key, format!("({v}) must be a finite f32")));
            }
        }
        Some(tp_core::Activation::ClampedSwiglu { alpha: alpha as f32, limit: limit as f32 })
    } else {
        None
    };
    Ok(MoeSettings {
        num_experts,
        top_k,
        norm_topk_prob,
        weights_in_dtype: rule.weights_in_dtype,
        expert_intermediate_size,
        shared_expert_intermediate_size,
        sparse_layers,
        router_aux_loss_coef,
        output_router_logits,
        router_jitter_noise,
        activation,
    })
}

/// `mlp_only_layers`: a list of layer indices (null or absent: none).
fn mlp_only_layers(f: &Fields<'_>) -> Result<Vec<usize>> {
    let Some(v) = f.get("mlp_only_layers") else { return Ok(Vec::new()) };
    let bad = || f.bad("mlp_only_layers", format!("must be a list of layer indices, got {}", shown_value(v)));
    let Value::Array(items) = v else { return Err(bad()) };
    items.iter().map(|i| i.as_u64().and_then(|i| usize::try_from(i).ok()).ok_or_else(bad)).collect()
}
