//! The `config.json` a GGUF file's metadata implies: the keys transformers' GGUF loader maps
//! (`{arch}.embedding_length` is `hidden_size`, `{arch}.attention.head_count_kv` is
//! `num_key_value_heads`, ...), with llama.cpp's meaning where the two differ (`head_dim` is
//! `attention.key_length`, else `embedding_length / head_count`; `rope.dimension_count` below
//! `head_dim` is a partial rotary embedding), then each family's extras (`extras`).
//! Floats, stored as f32, read back as the shortest decimal that rounds to them. Tied embeddings
//! are a file without `output.weight`; biases are the files' `blk.0` biases.

use super::Meta;
use crate::arch::Architecture;
use crate::error::Result;
use serde_json::{Map, Value, json};

/// One GGUF architecture tp reads.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GgufArch {
    /// `general.architecture`.
    pub name: &'static str,
    /// The family it builds.
    pub family: Architecture,
    /// llama.cpp stores the rows of Q and K in its rotary layout (its converter permutes them
    /// for `llama` only).
    pub rotary_qk: bool,
    /// Tensors llama.cpp stores that tp reads into the config rather than as weights.
    pub config_tensors: &'static [&'static str],
}

const fn arch(name: &'static str, family: Architecture) -> GgufArch {
    GgufArch { name, family, rotary_qk: false, config_tensors: &[] }
}

/// The GGUF architectures tp reads.
pub(crate) const ARCHS: &[GgufArch] = &[
    GgufArch { rotary_qk: true, ..arch("llama", Architecture::Llama) },
    arch("qwen2", Architecture::Qwen2),
    arch("qwen3", Architecture::Qwen3),
    arch("gemma3", Architecture::Gemma3),
    GgufArch {
        config_tensors: &[super::extras::ROPE_FACTORS_LONG, super::extras::ROPE_FACTORS_SHORT],
        ..arch("phi3", Architecture::Phi3)
    },
    arch("olmo2", Architecture::Olmo2),
    arch("qwen2moe", Architecture::Qwen2Moe),
    arch("qwen3moe", Architecture::Qwen3Moe),
    arch("olmoe", Architecture::Olmoe),
    arch("gpt-oss", Architecture::GptOss),
];

/// `llama` with experts (`llama.expert_count`): llama.cpp writes Mixtral so.
const MIXTRAL: GgufArch = GgufArch { rotary_qk: true, ..arch("llama", Architecture::Mixtral) };

/// The entry of `general.architecture` `name`, if tp reads it.
pub(crate) fn gguf_arch(name: &str) -> Option<&'static GgufArch> {
    ARCHS.iter().find(|a| a.name == name)
}

/// The sizes every family's extras may need.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    pub hidden: u64,
    pub heads: u64,
    pub layers: u64,
    pub head_dim: u64,
    pub max_positions: u64,
}

/// The architecture's entry and the `config.json` object the metadata of `m` implies.
pub(crate) fn config_json(m: &Meta<'_>) -> Result<(&'static GgufArch, Map<String, Value>)> {
    let spec = gguf_arch(m.arch).ok_or_else(|| {
        super::meta_err(
            m.path,
            "general.architecture",
            format!(
                "{} is not one tp reads from GGUF (it reads {})",
                tp_layers::quote_text(m.arch),
                ARCHS.iter().map(|a| a.name).collect::<Vec<_>>().join(", ")
            ),
        )
    })?;
    let spec = if spec.family == Architecture::Llama && m.u64("expert_count")?.is_some_and(|e| e > 0) {
        &MIXTRAL
    } else {
        spec
    };
    let family = spec.family;
    let (hidden, heads, layers) =
        (m.need("embedding_length")?, m.need("attention.head_count")?, m.need("block_count")?);
    if layers > crate::config::MAX_LAYERS as u64 {
        return Err(m.err("block_count", format!("({layers}) exceeds {}", crate::config::MAX_LAYERS)));
    }
    // llama.cpp's head size: attention.key_length, else embedding_length / head_count (whatever
    // default the family's config class has).
    let head_dim = match m.u64("attention.key_length")? {
        Some(d) => d,
        None if heads > 0 && hidden % heads == 0 => hidden / heads,
        None => {
            return Err(m.err(
                "attention.key_length",
                format!("is missing and embedding_length ({hidden}) is not a multiple of head_count ({heads})"),
            ));
        }
    };
    let dims = Dims { hidden, heads, layers, head_dim, max_positions: m.need("context_length")? };
    let mut c = Map::new();
    let mut set = |k: &str, v: Value| {
        c.insert(k.to_string(), v);
    };
    set("architectures", json!([family.class_name()]));
    set("model_type", json!(family.model_type()));
    set("hidden_size", json!(hidden));
    set("intermediate_size", json!(m.need("feed_forward_length")?));
    set("num_hidden_layers", json!(layers));
    set("num_attention_heads", json!(heads));
    set("num_key_value_heads", json!(m.u64("attention.head_count_kv")?.unwrap_or(heads)));
    set("head_dim", json!(head_dim));
    set("max_position_embeddings", json!(dims.max_positions));
    set("rms_norm_eps", json!(m.decimal("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6)));
    set("rope_theta", json!(m.decimal("rope.freq_base")?.unwrap_or(10_000.0)));
    set("tie_word_embeddings", json!(m.file.tensor("output.weight").is_none()));
    set(family.activation_key(), json!(family.default_activation()));
    let vocab = vocab_size(m)?;
    set("vocab_size", json!(vocab));
    if let Some(f) = partial_rotary_factor(m, family, head_dim)? {
        set("partial_rotary_factor", json!(f));
    }
    if let Some(kind) = m.str("rope.scaling.type")?
        && kind != "none"
    {
        let mut s = json!({"rope_type": kind});
        if let Some(f) = m.decimal("rope.scaling.factor")? {
            s["factor"] = json!(f);
        }
        if let Some(n) = m.u64("rope.scaling.original_context_length")? {
            s["original_max_position_embeddings"] = json!(n);
        }
        set("rope_scaling", s);
    }
    if m.file.tensor("rope_freqs.weight").is_some() {
        return Err(super::meta_err(
            m.path,
            "rope_freqs.weight",
            "per-frequency rotary factors (Llama 3.1's rope scaling as a tensor) are not read yet",
        ));
    }
    let has = |t: &str| m.file.tensor(t).is_some();
    if family.reads_attention_bias() {
        set("attention_bias", json!(has("blk.0.attn_q.bias") || has("blk.0.attn_qkv.bias")));
    }
    if family.reads_mlp_bias() {
        set("mlp_bias", json!(has("blk.0.ffn_down.bias")));
    }
    if let Some(eos) = m.global_u64("tokenizer.ggml.eos_token_id")? {
        set("eos_token_id", json!(eos));
    }
    if let Some(bos) = m.global_u64("tokenizer.ggml.bos_token_id")? {
        set("bos_token_id", json!(bos));
    }
    // transformers reads the padding token as the config's `pad_token_id` (the embedding's
    // `padding_idx`); one outside the vocabulary is left out, as llama.cpp ignores a bad
    // special id.
    if let Some(pad) = m.global_u64("tokenizer.ggml.padding_token_id")?.filter(|&p| p < vocab) {
        set("pad_token_id", json!(pad));
    }
    super::extras::family_extras(m, family, dims, &mut c)?;
    moe_keys(m, family, &mut c)?;
    Ok((spec, c))
}

/// A mixture of experts' keys: `expert_count` and `expert_used_count`, the experts' width
/// (`expert_feed_forward_length`; Mixtral's and OLMoE's `feed_forward_length` is already it), the
/// shared expert's (`expert_shared_feed_forward_length`), and the renormalisation of the top-k
/// weights llama.cpp applies per architecture (Qwen3-MoE: yes; Qwen2-MoE, OLMoE: no; Mixtral
/// always).
fn moe_keys(m: &Meta<'_>, family: Architecture, c: &mut Map<String, Value>) -> Result<()> {
    let (experts_key, renorm, own_width, shared) = match family {
        Architecture::Mixtral => ("num_local_experts", None, false, false),
        Architecture::Qwen3Moe => ("num_experts", Some(true), true, false),
        Architecture::Qwen2Moe => ("num_experts", Some(false), true, true),
        Architecture::Olmoe => ("num_experts", Some(false), false, false),
        Architecture::GptOss => ("num_local_experts", None, false, false),
        _ => return Ok(()),
    };
    c.insert(experts_key.into(), json!(m.need("expert_count")?));
    c.insert("num_experts_per_tok".into(), json!(m.need("expert_used_count")?));
    if own_width {
        c.insert("moe_intermediate_size".into(), json!(m.need("expert_feed_forward_length")?));
    }
    if family == Architecture::GptOss
        && let Some(w) = m.u64("expert_feed_forward_length")?
    {
        // gpt-oss's experts are `intermediate_size` wide (its converter writes both keys).
        c.insert("intermediate_size".into(), json!(w));
    }
    if shared {
        c.insert("shared_expert_intermediate_size".into(), json!(m.need("expert_shared_feed_forward_length")?));
        // Qwen2-MoE's q/k/v biases are `qkv_bias` (default true): the file says.
        c.insert("qkv_bias".into(), json!(m.file.tensor("blk.0.attn_q.bias").is_some()));
    }
    if let Some(r) = renorm {
        c.insert("norm_topk_prob".into(), json!(r));
    }
    Ok(())
}

/// `{arch}.vocab_size`, else the number of tokens, else the embedding's rows.
fn vocab_size(m: &Meta<'_>) -> Result<u64> {
    if let Some(v) = m.u64("vocab_size")? {
        return Ok(v);
    }
    let tokens = m
        .file
        .get_str_array("tokenizer.ggml.tokens")
        .map_err(|e| super::meta_err(m.path, "tokenizer.ggml.tokens", e))?;
    match tokens {
        Some(t) => Ok(t.len() as u64),
        None => m
            .file
            .tensor("token_embd.weight")
            .and_then(|t| t.dims.get(1).copied())
            .ok_or_else(|| m.err("vocab_size", "is missing, as are the tokens and token_embd.weight")),
    }
}

/// The `partial_rotary_factor` that makes tp rotate the `rope.dimension_count` features of
/// each head llama.cpp rotates, when that is fewer than `head_dim` (Phi-4-mini: 96 of 128).
///
/// tp's config reader rotates `int(head_dim · factor)` features, Python's truncation; the
/// factor given is `(n + 1/2) / head_dim`, halfway between `n` and `n + 1` features, so the
/// truncation lands on `n` whatever the rounding of the division (`n / head_dim` itself would
/// give `n - 1` for some sizes).
fn partial_rotary_factor(m: &Meta<'_>, family: Architecture, head_dim: u64) -> Result<Option<f64>> {
    let Some(n) = m.u64("rope.dimension_count")? else { return Ok(None) };
    if n == head_dim {
        return Ok(None);
    }
    if n == 0 || n > head_dim || n % 2 != 0 {
        return Err(m.err(
            "rope.dimension_count",
            format!("({n}) must be an even, positive number of features, at most head_dim ({head_dim})"),
        ));
    }
    if !family.spec().partial_rotary {
        return Err(m.err(
            "rope.dimension_count",
            format!(
                "({n}) rotates part of each head of {head_dim} features; a {} model rotates all of them",
                family.class_name()
            ),
        ));
    }
    Ok(Some((n as f64 + 0.5) / head_dim as f64))
}
