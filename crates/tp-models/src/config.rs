//! [`ModelConfig`]: a Hugging Face `config.json` for a Llama-family causal LM, validated.
//!
//! Both forms real checkpoints use are read: transformers 4 (`rope_theta` plus an optional
//! `rope_scaling` object whose kind is `rope_type`, or `type` in older files) and transformers 5
//! (`rope_parameters` holding `rope_type`, `rope_theta` and the scaling parameters). Fields that
//! are absent take the defaults of the family's transformers config class (the architecture
//! table, [`crate::arch`]). Every missing required field, wrong type, impossible value, size
//! that overflows and unsupported kind is a typed [`ModelError`] naming the field; values from
//! the file are shown escaped and cut to [`SHOWN_CHARS`](crate::fields::SHOWN_CHARS) characters.

use crate::arch::{self, Architecture, Biases, Windows};
use crate::error::{ModelError, Result};
use crate::fields::{Fields, shown, shown_value};
use crate::moe_config::{MoeSettings, moe_settings};
use crate::rope_config::{RopeFamily, rope, rope_params};
use serde_json::{Map, Value};
use std::path::Path;
use tp_core::{Activation, NormStyle, RopeScaling};
use tp_layers::QkNormSpan;

/// Largest `config.json` or `generation_config.json` read (real ones are a few KiB; Gemma's
/// and Qwen's carry long lists, well under 1 MiB).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;
/// Largest `head_dim` accepted.
pub const MAX_HEAD_DIM: usize = 1 << 16;
/// Most layers a model may have (the largest released models have under 200).
pub const MAX_LAYERS: usize = 1 << 16;

/// Whether a layer attends to every earlier position or within a sliding window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerType {
    /// Full causal attention (`full_attention`).
    Full,
    /// Causal attention within the config's `sliding_window` (`sliding_attention`).
    Sliding,
}

/// A validated model configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// The model family.
    pub architecture: Architecture,
    /// `vocab_size`.
    pub vocab_size: usize,
    /// `hidden_size`.
    pub hidden_size: usize,
    /// `intermediate_size` of the MLP.
    pub intermediate_size: usize,
    /// `num_hidden_layers`.
    pub num_hidden_layers: usize,
    /// `num_attention_heads`.
    pub num_attention_heads: usize,
    /// `num_key_value_heads` (defaults to the attention heads: multi-head attention).
    pub num_key_value_heads: usize,
    /// `head_dim` (defaults to the family's: `hidden_size / num_attention_heads`, 128 for
    /// Qwen3, 256 for Gemma 3).
    pub head_dim: usize,
    /// Features of each head that rotate: `head_dim`, or `int(head_dim · partial_rotary_factor)`
    /// (Phi-4-mini: 0.75), the rest passing through RoPE unchanged.
    pub rotary_dim: usize,
    /// `rms_norm_eps`.
    pub rms_norm_eps: f64,
    /// `rope_theta` (or `rope_parameters.rope_theta`; Gemma 3: of its full-attention layers).
    pub rope_theta: f64,
    /// The rotary scaling (`rope_scaling` / `rope_parameters`).
    pub rope_scaling: RopeScaling,
    /// Gemma 3's sliding layers' own rotary base and scaling (`rope_local_base_freq`, or
    /// `rope_parameters.sliding_attention`); `None`: they use the global one.
    pub local_rope: Option<(f64, RopeScaling)>,
    /// `max_position_embeddings`: the longest sequence the model accepts.
    pub max_position_embeddings: usize,
    /// `tie_word_embeddings`: the LM head is the embedding table (no `lm_head.weight`).
    pub tie_word_embeddings: bool,
    /// Biases on the q/k/v projections (Qwen2 always; others with `attention_bias`).
    pub qkv_bias: bool,
    /// A bias on the output projection (`attention_bias`, where the family reads it).
    pub o_bias: bool,
    /// Biases in the MLP (Llama with `mlp_bias`).
    pub mlp_bias: bool,
    /// The sliding window of the layers that have one (`None`: no layer has one).
    pub sliding_window: Option<usize>,
    /// Per layer: full attention or within `sliding_window`.
    pub layer_types: Vec<LayerType>,
    /// The MLP's gate activation (`hidden_act` / `hidden_activation`).
    pub hidden_act: Activation,
    /// How every RMSNorm applies its weight.
    pub norm_style: NormStyle,
    /// A q/k RMSNorm, per head or over the full width, if the family has one.
    pub qk_norm: Option<QkNormSpan>,
    /// Factor on attention scores (`None`: `1/sqrt(head_dim)`; Gemma:
    /// `query_pre_attn_scalar^-1/2`).
    pub attention_scale: Option<f64>,
    /// Factor on looked-up embeddings (Gemma: `sqrt(hidden_size)`).
    pub embedding_scale: Option<f64>,
    /// `final_logit_softcapping` (Gemma), if set.
    pub final_logit_softcapping: Option<f64>,
    /// End-of-sequence ids (`eos_token_id`, one or several; `generation_config.json` wins).
    pub eos_token_ids: Vec<i64>,
    /// The experts of a mixture-of-experts family (which layers have them, how they route).
    pub moe: Option<MoeSettings>,
    /// The embedding row of `pad_token_id` (a negative id counts from the end, as torch's
    /// `padding_idx`): transformers builds the table as `nn.Embedding(V, H, padding_idx)`, so
    /// training never writes a lookup gradient into that row.
    pub pad_token_id: Option<usize>,
}

/// The JSON object in `path`: a regular file of at most [`MAX_CONFIG_BYTES`].
pub(crate) fn read_json(path: &Path) -> Result<Map<String, Value>> {
    let file_err = |why: String| ModelError::ConfigFile { path: shown(&path.display().to_string()), why };
    let text = tp_layers::read_text_file(path, MAX_CONFIG_BYTES).map_err(|e| match e {
        tp_layers::LayerError::Checkpoint { why, .. } => file_err(why),
        e => file_err(e.to_string()),
    })?;
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(file_err("is not a JSON object".into())),
        Err(e) => Err(file_err(format!("invalid JSON: {e}"))),
    }
}

/// `eos_token_id` as a list: an integer, a list of integers, or null/absent (none).
fn eos_ids(f: &Fields<'_>) -> Result<Vec<i64>> {
    let bad =
        |v: &Value| f.bad("eos_token_id", format!("must be an integer or a list of integers, got {}", shown_value(v)));
    match f.get("eos_token_id") {
        None => Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().map(|v| v.as_i64().ok_or_else(|| bad(v))).collect(),
        Some(v) => Ok(vec![v.as_i64().ok_or_else(|| bad(v))?]),
    }
}

/// `pad_token_id` as the embedding row it names: null is none, absent the config class's
/// `default` (where it lies in the vocabulary), a negative id counts from the end (torch's
/// `padding_idx`), and an id outside `-V..V` is refused, as `nn.Embedding` refuses it when
/// transformers builds the model.
fn pad_row(f: &Fields<'_>, vocab: usize, default: Option<usize>) -> Result<Option<usize>> {
    if !f.map.contains_key("pad_token_id") {
        return Ok(default.filter(|&d| d < vocab));
    }
    let Some(v) = f.get("pad_token_id") else { return Ok(None) };
    let bad = |why: String| f.bad("pad_token_id", why);
    let id = v.as_i64().ok_or_else(|| bad(format!("must be an integer or null, got {}", shown_value(v))))?;
    let row = if id < 0 { i64::try_from(vocab).ok().and_then(|v| v.checked_add(id)) } else { Some(id) };
    row.and_then(|r| usize::try_from(r).ok())
        .filter(|&r| r < vocab)
        .map(Some)
        .ok_or_else(|| bad(format!("({id}) must lie within the vocabulary of {vocab} ids")))
}

/// The family named by `architectures[0]`, else by `model_type`.
fn architecture(f: &Fields<'_>) -> Result<Architecture> {
    let name = match f.get("architectures") {
        Some(Value::Array(names)) => names
            .first()
            .and_then(Value::as_str)
            .ok_or_else(|| f.bad("architectures", "must be a non-empty list of names"))?,
        Some(v) => return Err(f.bad("architectures", format!("must be a list of names, got {}", shown_value(v)))),
        None => match f.string("model_type")? {
            Some(t) => t,
            None => return Err(f.bad("architectures", "is missing (and so is model_type)")),
        },
    };
    Architecture::from_name(name)
        .ok_or_else(|| ModelError::UnknownArchitecture { name: shown(name), supported: Architecture::supported() })
}

/// `a * b` (elements of a `[a, b]` tensor), checked against overflow and tp's tensor size
/// limit, naming the fields.
fn product(f: &Fields<'_>, (a, an): (usize, &str), (b, bn): (usize, &str)) -> Result<usize> {
    match tp_core::Shape::new(&[a, b]) {
        Ok(s) => Ok(s.numel()),
        Err(_) => Err(f.bad(an, format!("({a}) times {bn} ({b}) is too large for a tensor"))),
    }
}

impl ModelConfig {
    /// Reads `dir/config.json` (and `dir/generation_config.json` for the end-of-sequence ids, as
    /// transformers' `generate` does, when present). Both are read once, as regular files of
    /// at most [`MAX_CONFIG_BYTES`].
    ///
    /// `dir` may instead be a GGUF file, or a folder holding one and no `config.json`: the
    /// config then comes from the file's metadata ([`crate::gguf`]).
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<ModelConfig> {
        crate::ModelSource::open(dir)?.config()
    }

    /// [`from_dir`](Self::from_dir) of a Hugging Face folder.
    pub(crate) fn from_folder(dir: &Path) -> Result<ModelConfig> {
        let mut config = Self::from_json(&read_json(&dir.join("config.json"))?)?;
        let gen_path = dir.join("generation_config.json");
        if std::fs::symlink_metadata(&gen_path).is_ok() {
            let gen_map = read_json(&gen_path)?;
            let gen_fields = Fields { map: &gen_map, prefix: "generation_config.json: ".into() };
            if gen_fields.get("eos_token_id").is_some() {
                config.eos_token_ids = eos_ids(&gen_fields)?;
            }
        }
        Ok(config)
    }

    /// Parses and validates a `config.json` object.
    pub fn from_json(map: &Map<String, Value>) -> Result<ModelConfig> {
        let f = Fields { map, prefix: String::new() };
        let architecture = architecture(&f)?;
        let spec = architecture.spec();
        let act_name = spec.act_keys.iter().map(|k| f.string(k)).find_map(|r| r.transpose()).transpose()?;
        let act_name = act_name.unwrap_or(spec.act_default);
        let hidden_act = arch::activation(act_name).ok_or_else(|| ModelError::Unsupported {
            field: spec.act_keys[0].into(),
            value: shown(&format!("{act_name:?}")),
            why: "tp's gated MLPs take silu or gelu_pytorch_tanh".into(),
        })?;
        let hidden_size = f.count("hidden_size", None)?;
        let num_attention_heads = f.count("num_attention_heads", None)?;
        let num_key_value_heads =
            f.count("num_key_value_heads", Some(spec.num_key_value_heads.unwrap_or(num_attention_heads)))?;
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(f.bad(
                "num_key_value_heads",
                format!("({num_key_value_heads}) must divide num_attention_heads ({num_attention_heads})"),
            ));
        }
        let head_dim = match (f.get("head_dim"), spec.head_dim) {
            (Some(_), _) => f.count("head_dim", None)?,
            (None, Some(d)) => d,
            (None, None) if hidden_size % num_attention_heads == 0 => hidden_size / num_attention_heads,
            (None, None) => {
                return Err(f.bad(
                    "head_dim",
                    format!(
                        "is absent and hidden_size ({hidden_size}) is not a multiple of num_attention_heads \
                         ({num_attention_heads})"
                    ),
                ));
            }
        };
        if head_dim % 2 != 0 || head_dim > MAX_HEAD_DIM {
            return Err(f.bad("head_dim", format!("({head_dim}) must be even and at most {MAX_HEAD_DIM}")));
        }
        let vocab_size = f.count("vocab_size", None)?;
        let intermediate_size = f.count("intermediate_size", None)?;
        let num_hidden_layers = f.count("num_hidden_layers", None)?;
        if num_hidden_layers > MAX_LAYERS {
            return Err(f.bad("num_hidden_layers", format!("({num_hidden_layers}) exceeds {MAX_LAYERS}")));
        }
        product(&f, (num_attention_heads, "num_attention_heads"), (head_dim, "head_dim"))?;
        product(&f, (vocab_size, "vocab_size"), (hidden_size, "hidden_size"))?;
        product(&f, (intermediate_size, "intermediate_size"), (hidden_size.saturating_mul(2), "2 x hidden_size"))?;
        let max_position_embeddings = f.count("max_position_embeddings", Some(spec.max_position_embeddings))?;
        let ((rope_theta, rope_scaling), local_rope) = if spec.gemma {
            gemma_rope(&f, spec.rope_theta, max_position_embeddings)?
        } else {
            let family = RopeFamily {
                original_max_position_embeddings: spec.original_max_position_embeddings,
                longrope_aliases: spec.longrope_aliases,
            };
            match spec.default_rope {
                // The class's own parameters when the config names none (gpt-oss's YaRN).
                Some(default) if f.get("rope_parameters").is_none() && f.get("rope_scaling").is_none() => {
                    let mut with = map.clone();
                    let params: Value = serde_json::from_str(default).map_err(|e| ModelError::Unsupported {
                        field: "rope_parameters".into(),
                        value: default.into(),
                        why: e.to_string(),
                    })?;
                    with.insert("rope_parameters".into(), params);
                    let g = Fields { map: &with, prefix: String::new() };
                    (rope(&g, spec.rope_theta, max_position_embeddings, family)?, None)
                }
                _ => (rope(&f, spec.rope_theta, max_position_embeddings, family)?, None),
            }
        };
        let rotary_dim = rotary_dim(&f, head_dim, spec.partial_rotary)?;
        // The rotary parameters must fit the rotated features (longrope's lists: one factor per
        // pair).
        let rope_key = if f.get("rope_parameters").is_some() { "rope_parameters" } else { "rope_scaling" };
        for (theta, scaling) in
            std::iter::once((rope_theta, &rope_scaling)).chain(local_rope.iter().map(|(t, s)| (*t, s)))
        {
            tp_core::RotaryEmbedding::new(rotary_dim, theta, scaling.clone())
                .map_err(|e| f.bad(rope_key, e.to_string()))?;
        }
        let rms_norm_eps = f.number("rms_norm_eps", Some(spec.rms_norm_eps))?;
        if !(0.0..=1.0).contains(&rms_norm_eps) {
            return Err(f.bad("rms_norm_eps", format!("must lie in [0, 1], got {rms_norm_eps}")));
        }
        let (qkv_bias, o_bias, mlp_bias) = match spec.biases {
            Biases::None => (false, false, false),
            Biases::Qkv => (true, false, false),
            Biases::QkvKey => (f.flag("qkv_bias", true)?, false, false),
            Biases::Attention | Biases::AttentionOn => {
                let a = f.flag("attention_bias", spec.biases == Biases::AttentionOn)?;
                (a, a, false)
            }
            Biases::AttentionAndMlp => {
                let a = f.flag("attention_bias", false)?;
                (a, a, f.flag("mlp_bias", false)?)
            }
        };
        let (sliding_window, layer_types) = windows(&f, spec.windows, num_hidden_layers)?;
        let moe = spec.moe.as_ref().map(|rule| moe_settings(&f, rule, num_hidden_layers, hidden_size)).transpose()?;
        if spec.arch == Architecture::Olmoe
            && let Some(v) = f.get("clip_qkv")
        {
            return Err(unsupported("clip_qkv", &shown_value(v), "tp does not clamp q, k and v"));
        }
        let (mut attention_scale, mut embedding_scale, mut final_logit_softcapping) = (None, None, None);
        if spec.gemma {
            if f.flag("use_bidirectional_attention", false)? {
                return Err(unsupported("use_bidirectional_attention", "true", "tp's attention is causal"));
            }
            // `attn_logit_softcapping` is read and ignored: transformers' and vLLM's Gemma 3
            // attention do not cap the scores whatever the config says (Gemma 2's did).
            if let Some(v) = f.get("attn_logit_softcapping")
                && !v.is_null()
                && !v.is_number()
            {
                return Err(f.bad("attn_logit_softcapping", "must be a number or null"));
            }
            attention_scale = Some(f.number("query_pre_attn_scalar", Some(256.0))?.powf(-0.5));
            // The scale is applied in f32: it must be a positive f32 too.
            if !attention_scale.is_some_and(|s| (s as f32).is_finite() && s as f32 > 0.0) {
                return Err(f.bad("query_pre_attn_scalar", "must be positive"));
            }
            embedding_scale = Some((hidden_size as f64).sqrt());
            final_logit_softcapping = match f.get("final_logit_softcapping") {
                None => None,
                Some(_) => Some(f.positive("final_logit_softcapping", None)?),
            };
        }
        Ok(ModelConfig {
            architecture,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rotary_dim,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            local_rope,
            max_position_embeddings,
            tie_word_embeddings: f.flag("tie_word_embeddings", spec.tie_word_embeddings)?,
            qkv_bias,
            o_bias,
            mlp_bias,
            sliding_window,
            layer_types,
            hidden_act,
            norm_style: spec.norm_style,
            qk_norm: spec.qk_norm,
            attention_scale,
            embedding_scale,
            final_logit_softcapping,
            eos_token_ids: eos_ids(&f)?,
            pad_token_id: pad_row(&f, vocab_size, spec.pad_token_id)?,
            moe,
        })
    }

    /// Layer `i`'s sliding window, if it has one.
    pub fn window_of(&self, layer: usize) -> Option<usize> {
        match self.layer_types.get(layer) {
            Some(LayerType::Sliding) => self.sliding_window,
            _ => None,
        }
    }
}

/// The rotated features of each head: `int(head_dim · partial_rotary_factor)` (the factor at the
/// top level or in `rope_parameters`, default 1), where the family rotates part of a head.
fn rotary_dim(f: &Fields<'_>, head_dim: usize, partial_allowed: bool) -> Result<usize> {
    let nested = match f.get("rope_parameters") {
        Some(Value::Object(p)) if p.get("partial_rotary_factor").is_some_and(|v| !v.is_null()) => {
            Some(Fields { map: p, prefix: "rope_parameters.".into() })
        }
        _ => None,
    };
    let (fields, factor) = match &nested {
        Some(p) => (p, p.number("partial_rotary_factor", None)?),
        None => (f, f.number("partial_rotary_factor", Some(1.0))?),
    };
    if factor == 1.0 {
        return Ok(head_dim);
    }
    if !partial_allowed {
        return Err(unsupported(
            &fields.name("partial_rotary_factor"),
            &factor.to_string(),
            "this family's rotary embeddings cover the whole head",
        ));
    }
    let dim = (head_dim as f64 * factor) as usize; // Python's int(): truncation
    if !(factor > 0.0 && factor < 1.0) || dim == 0 || dim % 2 != 0 {
        return Err(fields.bad(
            "partial_rotary_factor",
            format!("({factor}) must rotate an even, positive number of the {head_dim} features of a head"),
        ));
    }
    Ok(dim)
}

fn unsupported(field: &str, value: &str, why: &str) -> ModelError {
    ModelError::Unsupported { field: field.into(), value: value.into(), why: why.into() }
}

/// `(sliding_window, layer types)` by the family's rule.
fn windows(f: &Fields<'_>, rule: Windows, layers: usize) -> Result<(Option<usize>, Vec<LayerType>)> {
    let window = |default: Option<usize>| -> Result<Option<usize>> {
        match f.map.get("sliding_window") {
            None => Ok(default),
            Some(Value::Null) => Ok(None),
            Some(_) => Ok(Some(f.count("sliding_window", None)?)),
        }
    };
    let all = |w: Option<usize>| vec![if w.is_some() { LayerType::Sliding } else { LayerType::Full }; layers];
    let (w, types) = match rule {
        Windows::Never => (None, all(None)),
        Windows::Every { default } => {
            let w = window(default)?;
            (w, all(w))
        }
        Windows::Qwen => {
            let w = if f.flag("use_sliding_window", false)? { window(Some(4096))? } else { None };
            let from = max_window_layers(f)?;
            let default: Vec<LayerType> = (0..layers)
                .map(|i| if w.is_some() && i >= from { LayerType::Sliding } else { LayerType::Full })
                .collect();
            (w, layer_types(f, layers, default)?)
        }
        Windows::OptInEvery => {
            let w = if f.flag("use_sliding_window", false)? { window(Some(4096))? } else { None };
            (w, all(w))
        }
        Windows::Qwen2Moe => {
            let w = if f.flag("use_sliding_window", false)? { window(Some(4096))? } else { None };
            let below = max_window_layers(f)?;
            let default = (0..layers)
                .map(|i| if w.is_some() && i % 2 == 0 && i < below { LayerType::Sliding } else { LayerType::Full })
                .collect();
            (w, layer_types(f, layers, default)?)
        }
        Windows::GptOss => {
            let w = window(Some(128))?;
            let default = (0..layers).map(|i| if i % 2 == 0 { LayerType::Sliding } else { LayerType::Full }).collect();
            (w, layer_types(f, layers, default)?)
        }
        Windows::Gemma => {
            let w = window(Some(4096))?;
            let pattern = f.count("sliding_window_pattern", Some(6))?;
            let default = (0..layers)
                .map(|i| if (i + 1) % pattern != 0 { LayerType::Sliding } else { LayerType::Full })
                .collect();
            (w, layer_types(f, layers, default)?)
        }
    };
    if w.is_none() && types.contains(&LayerType::Sliding) {
        return Err(f.bad("sliding_window", "is null but layer_types names sliding_attention layers"));
    }
    Ok((w, types))
}

/// `max_window_layers` (default 28; 0 is valid).
fn max_window_layers(f: &Fields<'_>) -> Result<usize> {
    match f.get("max_window_layers") {
        None => Ok(28),
        Some(v) => v.as_u64().and_then(|v| usize::try_from(v).ok()).ok_or_else(|| {
            f.bad("max_window_layers", format!("must be a non-negative integer, got {}", shown_value(v)))
        }),
    }
}

/// `layer_types` when present (one `full_attention` / `sliding_attention` per layer), else
/// `default`.
fn layer_types(f: &Fields<'_>, layers: usize, default: Vec<LayerType>) -> Result<Vec<LayerType>> {
    let Some(v) = f.get("layer_types") else { return Ok(default) };
    let items = v.as_array().filter(|a| a.len() == layers).ok_or_else(|| {
        f.bad("layer_types", format!("must list one type per layer ({layers}), got {}", shown_value(v)))
    })?;
    items
        .iter()
        .map(|t| match t.as_str() {
            Some("full_attention") => Ok(LayerType::Full),
            Some("sliding_attention") => Ok(LayerType::Sliding),
            _ => Err(f.bad(
                "layer_types",
                format!("entries are full_attention or sliding_attention, got {}", shown_value(t)),
            )),
        })
        .collect()
}

/// A rotary base and its scaling.
type ThetaScaling = (f64, RopeScaling);

/// Gemma 3's two rotary embeddings: `((global theta, global scaling), Some(local))`. transformers
/// 5 writes `rope_parameters: {"full_attention": {..}, "sliding_attention": {..}}`; transformers
/// 4 `rope_theta` (global, default 1e6), `rope_scaling` (global only) and
/// `rope_local_base_freq` (local, default 1e4, no scaling).
fn gemma_rope(
    f: &Fields<'_>,
    global_default: f64,
    max_position_embeddings: usize,
) -> Result<(ThetaScaling, Option<ThetaScaling>)> {
    // The bases when the parameters do not name one: `rope_theta` (global) and
    // `rope_local_base_freq` (local), else 1e6 and 1e4 (Gemma3TextConfig's standardisation).
    let global_theta = f.positive("rope_theta", Some(global_default))?;
    let local_theta = f.positive("rope_local_base_freq", Some(10_000.0))?;
    let family = RopeFamily::default();
    match f.get("rope_parameters") {
        Some(Value::Object(p)) if p.contains_key("full_attention") || p.contains_key("sliding_attention") => {
            let part = |key: &str, default: f64| -> Result<(f64, RopeScaling)> {
                match p.get(key) {
                    None | Some(Value::Null) => Ok((default, RopeScaling::Default)),
                    Some(Value::Object(o)) => {
                        let pf = Fields { map: o, prefix: format!("rope_parameters.{key}.") };
                        let theta = pf.positive("rope_theta", Some(default))?;
                        rope_params(f, &pf, Some(theta), default, max_position_embeddings, family)
                    }
                    Some(v) => Err(
                        f.bad(&format!("rope_parameters.{key}"), format!("must be an object, got {}", shown_value(v)))
                    ),
                }
            };
            Ok((part("full_attention", global_theta)?, Some(part("sliding_attention", local_theta)?)))
        }
        // A flat `rope_parameters` is not per layer type: Gemma3TextConfig replaces it with
        // default rope on both kinds of layer, and so does tp.
        Some(Value::Object(_)) => Ok(((global_theta, RopeScaling::Default), Some((local_theta, RopeScaling::Default)))),
        Some(v) => Err(f.bad("rope_parameters", format!("must be an object, got {}", shown_value(v)))),
        // transformers 4: `rope_scaling` scales the global layers only.
        None => {
            Ok((rope(f, global_default, max_position_embeddings, family)?, Some((local_theta, RopeScaling::Default))))
        }
    }
}
