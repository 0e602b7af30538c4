//! The architecture table: one entry per model family tp runs, holding everything that family
//! differs in: its Hugging Face class and `model_type`, its tensor names, the defaults its
//! config class gives absent fields, its norm style, activation, q/k norm, biases, sliding-window
//! rule, and Gemma's extras (embedding scale, attention scale, soft-capping, local rope).
//!
//! Adding a family is one [`ArchSpec`] in [`TABLE`] (plus any block op it needs in tp-core and
//! tp-kernels). The config reader ([`crate::ModelConfig`]), the model builder
//! ([`crate::ParallelCausalLm`]) and, through [`Architecture`]'s methods, the synthetic
//! checkpoints of the dev-only tp-testing crate all read this table.

use tp_core::{Activation, NormStyle};
use tp_layers::{AttentionNames, BlockNorms, DecoderNames, MlpNames, MoeNames, Projections, QkNormSpan};

/// The model families tp runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Architecture {
    /// `LlamaForCausalLM` (Llama 2/3, TinyLlama, and many others): optional biases
    /// (`attention_bias`, `mlp_bias`).
    Llama,
    /// `Qwen2ForCausalLM`: biases on q/k/v (not o), none in the MLP.
    Qwen2,
    /// `Qwen3ForCausalLM`: per-head q/k RMSNorm before RoPE; optional `attention_bias`.
    Qwen3,
    /// `MistralForCausalLM`: no biases, an optional sliding window on every layer.
    Mistral,
    /// `Gemma3ForCausalLM` (text): `(1 + w)` RMSNorm, sandwich norms, GeGLU (tanh GELU),
    /// embeddings scaled by `sqrt(hidden)`, `query_pre_attn_scalar`, per-head q/k norm, local
    /// sliding-window layers with their own rope base, optional final-logit soft-capping.
    Gemma3,
    /// `Phi3ForCausalLM` (Phi-3, Phi-3.5, Phi-4-mini): fused `qkv_proj` and `gate_up_proj`,
    /// LongRoPE, partial rotary embeddings.
    Phi3,
    /// `Olmo2ForCausalLM`: RMSNorm over the full q and k width after the projections, and
    /// norms after attention and after the MLP (none before).
    Olmo2,
    /// `MixtralForCausalLM`: Mistral's attention, a mixture of experts (`w1`/`w3`/`w2`) in
    /// every layer, its top-k weights always renormalised and kept in f32.
    Mixtral,
    /// `Qwen2MoeForCausalLM`: Qwen2's attention (`qkv_bias`), experts plus a shared expert
    /// gated by a sigmoid; `decoder_sparse_step` and `mlp_only_layers` pick the MoE layers.
    Qwen2Moe,
    /// `Qwen3MoeForCausalLM`: Qwen3's attention (per-head q/k norm), experts, the same layer
    /// rules as Qwen2-MoE.
    Qwen3Moe,
    /// `OlmoeForCausalLM`: full-width q/k norm, pre-norms, experts in every layer.
    Olmoe,
    /// `GptOssForCausalLM`: attention sinks, biases on q/k/v/o, alternating sliding-window and
    /// full layers, YaRN by default, a router with a bias, and experts with biases and the
    /// clamped SwiGLU in gpt-oss's interleaved fused layout (dense or MXFP4 blocks).
    GptOss,
}

/// A mixture-of-experts family's config rules: its keys and its config class's defaults.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MoeRule {
    /// The expert count's keys, the first present wins (`num_experts`, `num_local_experts`),
    /// and the class default.
    pub experts_keys: &'static [&'static str],
    pub experts_default: usize,
    /// `num_experts_per_tok`'s default.
    pub top_k_default: usize,
    /// The experts' intermediate size: its key (`moe_intermediate_size`, or Mixtral's and
    /// OLMoE's `intermediate_size`) and default.
    pub expert_size_key: &'static str,
    pub expert_size_default: usize,
    /// `norm_topk_prob`'s default; `None`: always renormalised, the key not read (Mixtral).
    pub norm_topk_prob: Option<bool>,
    /// Whether the top-k weights are cast to the model's dtype (all but Mixtral).
    pub weights_in_dtype: bool,
    /// `shared_expert_intermediate_size`'s default where the family has a shared expert.
    pub shared_expert_default: Option<usize>,
    /// Whether `decoder_sparse_step` and `mlp_only_layers` pick the MoE layers (Qwen); else
    /// every layer.
    pub sparse_step: bool,
    /// `router_aux_loss_coef`'s default.
    pub aux_loss_coef_default: f64,
    /// Whether the experts use gpt-oss's clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`)
    /// instead of the config's `hidden_act`.
    pub clamped_swiglu: bool,
}

/// Which projections carry biases, from the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Biases {
    /// None anywhere.
    None,
    /// q, k and v always; o and the MLP never (Qwen2).
    Qkv,
    /// q, k and v as the `qkv_bias` key says (default true); o and the MLP never (Qwen2-MoE).
    QkvKey,
    /// `attention_bias` on q, k, v and o; `mlp_bias` on the MLP (Llama; keys absent: false).
    AttentionAndMlp,
    /// `attention_bias` on q, k, v and o; none in the MLP (Qwen3, Gemma 3, OLMo 2).
    Attention,
    /// The same with `attention_bias` true when absent (gpt-oss).
    AttentionOn,
}

/// Which layers attend within a sliding window, from the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Windows {
    /// Never (`sliding_window` is not read).
    Never,
    /// Every layer, with `sliding_window` (absent: `default`; null: none) (Mistral, Phi-3).
    Every { default: Option<usize> },
    /// Qwen's rule: `sliding_window` (absent: 4096) only when `use_sliding_window`, on the
    /// layers `layer_types` names `sliding_attention` (absent: from `max_window_layers` on).
    Qwen,
    /// Gemma's rule: `sliding_window` (absent: 4096) on the layers `layer_types` names
    /// `sliding_attention` (absent: all but every `sliding_window_pattern`-th, default 6).
    Gemma,
    /// Qwen3-MoE's: `sliding_window` (absent: 4096) on every layer when
    /// `use_sliding_window`, else none.
    OptInEvery,
    /// Qwen2-MoE's: when `use_sliding_window`, `sliding_window` (absent: 4096) on the layers
    /// `layer_types` names (absent: the even-indexed layers below `max_window_layers`, default 28).
    Qwen2Moe,
    /// gpt-oss's: `sliding_window` (absent: 128) on the layers `layer_types` names (absent: the
    /// even-indexed layers).
    GptOss,
}

/// One family's entry in the table.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ArchSpec {
    pub arch: Architecture,
    /// The `architectures[0]` class name in `config.json`.
    pub class: &'static str,
    /// The `model_type`s that name it.
    pub model_types: &'static [&'static str],
    /// Defaults of the config class for absent fields.
    pub max_position_embeddings: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    /// `head_dim` when absent (`None`: `hidden_size / num_attention_heads`).
    pub head_dim: Option<usize>,
    /// `num_key_value_heads` when absent (`None`: `num_attention_heads`).
    pub num_key_value_heads: Option<usize>,
    /// Rope kinds the config class reads as `longrope` (Phi-3's renames `su` and `yarn`).
    pub longrope_aliases: &'static [&'static str],
    /// The config class's own `original_max_position_embeddings`, which wins over the rope
    /// parameters' for longrope (Phi-3: 4096).
    pub original_max_position_embeddings: Option<usize>,
    pub tie_word_embeddings: bool,
    /// The config keys naming the MLP activation, in order of precedence, and its default.
    pub act_keys: &'static [&'static str],
    pub act_default: &'static str,
    pub biases: Biases,
    pub windows: Windows,
    /// How every RMSNorm of the model applies its weight.
    pub norm_style: NormStyle,
    pub qk_norm: Option<QkNormSpan>,
    /// Tensor names of a block under `model.layers.N`.
    pub names: DecoderNames,
    /// Whether `partial_rotary_factor` may rotate only part of each head (Phi-3/4: its
    /// `apply_rotary_pos_emb` passes the rest through; other families' would not).
    pub partial_rotary: bool,
    /// Gemma's extras: `sqrt(hidden)` embedding scale, `query_pre_attn_scalar`,
    /// `final_logit_softcapping`, a local rope base for sliding layers.
    pub gemma: bool,
    /// `pad_token_id`'s default in the config class (Gemma 3: 0, Phi-3: 32000, OLMo 2 and
    /// OLMoE: 1), used when the key is absent and the id lies in the vocabulary.
    pub pad_token_id: Option<usize>,
    /// The mixture-of-experts rules of a family with experts.
    pub moe: Option<MoeRule>,
    /// Whether every attention layer has learned sink logits (gpt-oss's `self_attn.sinks`).
    pub sinks: bool,
    /// The rope parameters the config class sets when the config has none (gpt-oss: YaRN), as
    /// a `rope_parameters` JSON object.
    pub default_rope: Option<&'static str>,
}

const QWEN_MOE: MoeRule = MoeRule {
    experts_keys: &["num_experts", "num_local_experts"],
    experts_default: 128,
    top_k_default: 8,
    expert_size_key: "moe_intermediate_size",
    expert_size_default: 768,
    norm_topk_prob: Some(false),
    weights_in_dtype: true,
    shared_expert_default: None,
    sparse_step: true,
    aux_loss_coef_default: 0.001,
    clamped_swiglu: false,
};

/// Qwen2/3-MoE's and OLMoE's expert names under `mlp`.
const QWEN_MOE_NAMES: Option<(&[&str], MoeNames)> = Some((&["mlp"], MoeNames::QWEN));

const LLAMA_NAMES: DecoderNames = DecoderNames {
    attn: "self_attn",
    attn_names: AttentionNames {
        qkv: Projections::Separate(["q_proj", "k_proj", "v_proj"]),
        o: "o_proj",
        q_norm: "q_norm",
        k_norm: "k_norm",
        sinks: "sinks",
    },
    mlp: "mlp",
    mlp_names: MlpNames { gate_up: Projections::Separate(["gate_proj", "up_proj"]), down: "down_proj" },
    moe: None,
    norms: BlockNorms::PRE,
};

const BASE: ArchSpec = ArchSpec {
    arch: Architecture::Llama,
    class: "LlamaForCausalLM",
    model_types: &["llama"],
    max_position_embeddings: 2048,
    rope_theta: 10_000.0,
    rms_norm_eps: 1e-6,
    head_dim: None,
    num_key_value_heads: None,
    longrope_aliases: &["su"],
    original_max_position_embeddings: None,
    tie_word_embeddings: false,
    act_keys: &["hidden_act"],
    act_default: "silu",
    biases: Biases::AttentionAndMlp,
    windows: Windows::Never,
    norm_style: NormStyle::Weight,
    qk_norm: None,
    names: LLAMA_NAMES,
    partial_rotary: false,
    gemma: false,
    pad_token_id: None,
    moe: None,
    sinks: false,
    default_rope: None,
};

/// Every family tp runs.
pub(crate) const TABLE: [ArchSpec; 12] = [
    BASE,
    ArchSpec {
        arch: Architecture::Qwen2,
        class: "Qwen2ForCausalLM",
        model_types: &["qwen2"],
        max_position_embeddings: 32_768,
        num_key_value_heads: Some(32),
        biases: Biases::Qkv,
        windows: Windows::Qwen,
        ..BASE
    },
    ArchSpec {
        arch: Architecture::Qwen3,
        class: "Qwen3ForCausalLM",
        model_types: &["qwen3"],
        max_position_embeddings: 32_768,
        num_key_value_heads: Some(32),
        head_dim: Some(128),
        biases: Biases::Attention,
        windows: Windows::Qwen,
        qk_norm: Some(QkNormSpan::PerHead),
        ..BASE
    },
    ArchSpec {
        arch: Architecture::Mistral,
        class: "MistralForCausalLM",
        model_types: &["mistral"],
        max_position_embeddings: 4096 * 32,
        num_key_value_heads: Some(8),
        biases: Biases::None,
        windows: Windows::Every { default: Some(4096) },
        ..BASE
    },
    ArchSpec {
        arch: Architecture::Gemma3,
        class: "Gemma3ForCausalLM",
        model_types: &["gemma3_text"],
        max_position_embeddings: 131_072,
        rope_theta: 1_000_000.0,
        head_dim: Some(256),
        num_key_value_heads: Some(4),
        tie_word_embeddings: true,
        // Gemma3MLP reads hidden_activation alone.
        act_keys: &["hidden_activation"],
        act_default: "gelu_pytorch_tanh",
        biases: Biases::Attention,
        windows: Windows::Gemma,
        norm_style: NormStyle::OnePlusWeight,
        qk_norm: Some(QkNormSpan::PerHead),
        names: DecoderNames {
            norms: BlockNorms {
                attn_in: Some("input_layernorm"),
                attn_out: Some("post_attention_layernorm"),
                mlp_in: Some("pre_feedforward_layernorm"),
                mlp_out: Some("post_feedforward_layernorm"),
            },
            ..LLAMA_NAMES
        },
        gemma: true,
        pad_token_id: Some(0),
        ..BASE
    },
    ArchSpec {
        arch: Architecture::Phi3,
        class: "Phi3ForCausalLM",
        model_types: &["phi3"],
        max_position_embeddings: 4096,
        original_max_position_embeddings: Some(4096),
        longrope_aliases: &["su", "yarn"],
        rms_norm_eps: 1e-5,
        biases: Biases::None,
        windows: Windows::Every { default: None },
        names: DecoderNames {
            attn_names: AttentionNames { qkv: Projections::Fused("qkv_proj"), ..LLAMA_NAMES.attn_names },
            mlp_names: MlpNames { gate_up: Projections::Fused("gate_up_proj"), down: "down_proj" },
            ..LLAMA_NAMES
        },
        partial_rotary: true,
        pad_token_id: Some(32_000),
        ..BASE
    },
    ArchSpec {
        arch: Architecture::Olmo2,
        class: "Olmo2ForCausalLM",
        model_types: &["olmo2"],
        max_position_embeddings: 2048,
        rms_norm_eps: 1e-5,
        biases: Biases::Attention,
        norm_style: NormStyle::WeightF32,
        qk_norm: Some(QkNormSpan::FullWidth),
        names: DecoderNames {
            norms: BlockNorms {
                attn_in: None,
                attn_out: Some("post_attention_layernorm"),
                mlp_in: None,
                mlp_out: Some("post_feedforward_layernorm"),
            },
            ..LLAMA_NAMES
        },
        pad_token_id: Some(1),
        ..BASE
    },
    ArchSpec {
        arch: Architecture::Mixtral,
        class: "MixtralForCausalLM",
        model_types: &["mixtral"],
        max_position_embeddings: 4096 * 32,
        rope_theta: 1_000_000.0,
        rms_norm_eps: 1e-5,
        num_key_value_heads: Some(8),
        biases: Biases::None,
        windows: Windows::Every { default: None },
        names: DecoderNames {
            moe: Some((
                &["block_sparse_moe", "mlp"],
                MoeNames {
                    expert: MlpNames { gate_up: Projections::Separate(["w1", "w3"]), down: "w2" },
                    ..MoeNames::QWEN
                },
            )),
            ..LLAMA_NAMES
        },
        moe: Some(MoeRule {
            experts_keys: &["num_local_experts", "num_experts"],
            experts_default: 8,
            top_k_default: 2,
            expert_size_key: "intermediate_size",
            expert_size_default: 14_336,
            norm_topk_prob: None,
            weights_in_dtype: false,
            sparse_step: false,
            ..QWEN_MOE
        }),
        ..BASE
    },
    ArchSpec {
        arch: Architecture::Qwen2Moe,
        class: "Qwen2MoeForCausalLM",
        model_types: &["qwen2_moe"],
        max_position_embeddings: 32_768,
        num_key_value_heads: Some(16),
        biases: Biases::QkvKey,
        windows: Windows::Qwen2Moe,
        names: DecoderNames {
            moe: Some((&["mlp"], MoeNames { shared: Some(("shared_expert", "shared_expert_gate")), ..MoeNames::QWEN })),
            ..LLAMA_NAMES
        },
        moe: Some(MoeRule {
            experts_default: 60,
            top_k_default: 4,
            expert_size_default: 1408,
            shared_expert_default: Some(5632),
            ..QWEN_MOE
        }),
        ..BASE
    },
    ArchSpec {
        arch: Architecture::Qwen3Moe,
        class: "Qwen3MoeForCausalLM",
        model_types: &["qwen3_moe"],
        max_position_embeddings: 32_768,
        num_key_value_heads: Some(4),
        biases: Biases::Attention,
        windows: Windows::OptInEvery,
        qk_norm: Some(QkNormSpan::PerHead),
        names: DecoderNames { moe: QWEN_MOE_NAMES, ..LLAMA_NAMES },
        moe: Some(QWEN_MOE),
        ..BASE
    },
    ArchSpec {
        arch: Architecture::Olmoe,
        class: "OlmoeForCausalLM",
        model_types: &["olmoe"],
        max_position_embeddings: 4096,
        rms_norm_eps: 1e-5,
        biases: Biases::Attention,
        qk_norm: Some(QkNormSpan::FullWidth),
        names: DecoderNames { moe: QWEN_MOE_NAMES, ..LLAMA_NAMES },
        moe: Some(MoeRule {
            experts_default: 64,
            expert_size_key: "intermediate_size",
            expert_size_default: 2048,
            sparse_step: false,
            aux_loss_coef_default: 0.01,
            ..QWEN_MOE
        }),
        pad_token_id: Some(1),
        ..BASE
    },
    ArchSpec {
        arch: Architecture::GptOss,
        class: "GptOssForCausalLM",
        model_types: &["gpt_oss"],
        max_position_embeddings: 131_072,
        rope_theta: 150_000.0,
        rms_norm_eps: 1e-5,
        head_dim: Some(64),
        num_key_value_heads: Some(8),
        biases: Biases::AttentionOn,
        windows: Windows::GptOss,
        // `(self.weight * hidden_states).to(input_dtype)`, as OLMo 2's.
        norm_style: NormStyle::WeightF32,
        names: DecoderNames { moe: Some((&["mlp"], MoeNames::GPT_OSS)), ..LLAMA_NAMES },
        moe: Some(MoeRule {
            experts_keys: &["num_local_experts", "num_experts"],
            experts_default: 128,
            top_k_default: 4,
            expert_size_key: "intermediate_size",
            expert_size_default: 2880,
            // Softmax over the top k logits: the renormalised softmax, whatever the config says.
            norm_topk_prob: None,
            sparse_step: false,
            clamped_swiglu: true,
            ..QWEN_MOE
        }),
        sinks: true,
        default_rope: Some(
            r#"{"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": false, "original_max_position_embeddings": 4096}"#,
        ),
        ..BASE
    },
];

impl Architecture {
    /// The family's table entry.
    pub(crate) fn spec(self) -> &'static ArchSpec {
        TABLE.iter().find(|s| s.arch == self).unwrap_or(&TABLE[0])
    }

    /// The family a `config.json` class name (`architectures[0]`) or `model_type` names.
    pub(crate) fn from_name(name: &str) -> Option<Architecture> {
        TABLE.iter().find(|s| s.class == name || s.model_types.contains(&name)).map(|s| s.arch)
    }

    /// The Hugging Face class name (`LlamaForCausalLM`, ...).
    pub fn class_name(self) -> &'static str {
        self.spec().class
    }

    /// The `model_type` transformers writes for it.
    pub fn model_type(self) -> &'static str {
        self.spec().model_types[0]
    }

    /// The checkpoint names of a block of this family, under `model.layers.N`.
    pub fn decoder_names(self) -> DecoderNames {
        self.spec().names
    }

    /// The `config.json` key naming the MLP activation (`hidden_act`, or Gemma's
    /// `hidden_activation`), the first the config reader looks at.
    pub fn activation_key(self) -> &'static str {
        self.spec().act_keys[0]
    }

    /// The activation name the family's config class defaults to (`silu`, ...).
    pub fn default_activation(self) -> &'static str {
        self.spec().act_default
    }

    /// Whether the config's `attention_bias` key decides the attention biases (false where
    /// the family has none, or always has q/k/v biases as Qwen2).
    pub fn reads_attention_bias(self) -> bool {
        matches!(self.spec().biases, Biases::AttentionAndMlp | Biases::Attention | Biases::AttentionOn)
    }

    /// Whether the config's `mlp_bias` key decides the MLP biases (Llama).
    pub fn reads_mlp_bias(self) -> bool {
        self.spec().biases == Biases::AttentionAndMlp
    }

    /// Whether the config's `sliding_window` key is read at all.
    pub fn reads_sliding_window(self) -> bool {
        self.spec().windows != Windows::Never
    }

    /// Whether a `sliding_window` applies only with `use_sliding_window` (Qwen's rule).
    pub fn sliding_window_needs_opt_in(self) -> bool {
        self.spec().windows == Windows::Qwen
    }

    /// How every RMSNorm of the family applies its weight.
    pub fn norm_style(self) -> NormStyle {
        self.spec().norm_style
    }

    /// Every family, in table order.
    pub fn all() -> impl Iterator<Item = Architecture> {
        TABLE.iter().map(|s| s.arch)
    }

    /// The class names tp runs, for messages.
    pub(crate) fn supported() -> String {
        TABLE.iter().map(|s| s.class).collect::<Vec<_>>().join(", ")
    }
}

/// The activation a config's `hidden_act` names.
pub(crate) fn activation(name: &str) -> Option<Activation> {
    Activation::from_hidden_act(name)
}
