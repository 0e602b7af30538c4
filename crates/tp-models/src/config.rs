//! [`ModelConfig`]: a Hugging Face `config.json` for a Llama-family causal LM, validated.
//!
//! Both forms real checkpoints use are read: transformers 4 (`rope_theta` plus an optional
//! `rope_scaling` object whose kind is `rope_type`, or `type` in older files) and transformers 5
//! (`rope_parameters` holding `rope_type`, `rope_theta` and the scaling parameters). Fields that
//! are absent take transformers' defaults for the architecture; `head_dim` absent (or null) is
//! `hidden_size / num_attention_heads`. Every missing required field, wrong type, impossible
//! value and unsupported kind is a typed [`ModelError`] naming the field.

use crate::error::{ModelError, Result};
use serde_json::{Map, Value};
use std::cell::RefCell;
use std::path::Path;
use tp_core::RopeScaling;

/// The model families tp runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `LlamaForCausalLM` (Llama 2/3, TinyLlama, and many others): optional biases
    /// (`attention_bias`, `mlp_bias`).
    Llama,
    /// `Qwen2ForCausalLM`: biases on q/k/v (not o), none in the MLP.
    Qwen2,
    /// `MistralForCausalLM`: no biases, an optional sliding window.
    Mistral,
}

impl Architecture {
    fn from_name(name: &str) -> Result<Architecture> {
        match name {
            "LlamaForCausalLM" | "llama" => Ok(Architecture::Llama),
            "Qwen2ForCausalLM" | "qwen2" => Ok(Architecture::Qwen2),
            "MistralForCausalLM" | "mistral" => Ok(Architecture::Mistral),
            other => Err(ModelError::UnknownArchitecture { name: other.to_string() }),
        }
    }
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
    /// `head_dim` (defaults to `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// `rms_norm_eps`.
    pub rms_norm_eps: f64,
    /// `rope_theta` (or `rope_parameters.rope_theta`).
    pub rope_theta: f64,
    /// The rotary scaling (`rope_scaling` / `rope_parameters`).
    pub rope_scaling: RopeScaling,
    /// `max_position_embeddings`: the longest sequence the model accepts.
    pub max_position_embeddings: usize,
    /// `tie_word_embeddings`: the LM head is the embedding table (no `lm_head.weight`).
    pub tie_word_embeddings: bool,
    /// Biases on the q/k/v projections (Qwen2 always; Llama with `attention_bias`).
    pub qkv_bias: bool,
    /// A bias on the output projection (Llama with `attention_bias`).
    pub o_bias: bool,
    /// Biases in the MLP (Llama with `mlp_bias`).
    pub mlp_bias: bool,
    /// Mistral's `sliding_window` (`None`: full causal attention; absent in a Mistral config
    /// means transformers' default, 4096).
    pub sliding_window: Option<usize>,
    /// End-of-sequence ids (`eos_token_id`, one or several; `generation_config.json` wins).
    pub eos_token_ids: Vec<i64>,
}

/// Typed access to one JSON object's fields, naming the field in every error.
struct Fields<'a> {
    map: &'a Map<String, Value>,
    prefix: &'static str,
}

impl Fields<'_> {
    fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// The field, treating JSON `null` as absent.
    fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn bad(&self, key: &str, why: impl Into<String>) -> ModelError {
        ModelError::ConfigField { field: self.name(key), why: why.into() }
    }

    /// A positive integer field (or `default` when absent and a default exists).
    fn count(&self, key: &str, default: Option<usize>) -> Result<usize> {
        match self.get(key) {
            None => default.ok_or_else(|| self.bad(key, "is missing")),
            Some(v) => {
                let n = v.as_u64().ok_or_else(|| self.bad(key, format!("must be a positive integer, got {v}")))?;
                match usize::try_from(n) {
                    Ok(n) if n > 0 => Ok(n),
                    _ => Err(self.bad(key, format!("must be a positive integer, got {v}"))),
                }
            }
        }
    }

    /// A finite number field.
    fn number(&self, key: &str, default: Option<f64>) -> Result<f64> {
        match self.get(key) {
            None => default.ok_or_else(|| self.bad(key, "is missing")),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() => Ok(x),
                _ => Err(self.bad(key, format!("must be a finite number, got {v}"))),
            },
        }
    }

    fn flag(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| self.bad(key, format!("must be true or false, got {v}"))),
        }
    }

    fn string(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| self.bad(key, format!("must be a string, got {v}"))),
        }
    }
}

fn read_json(path: &Path) -> Result<Map<String, Value>> {
    let file_err = |why: String| ModelError::ConfigFile { path: path.display().to_string(), why };
    let text = std::fs::read_to_string(path).map_err(|e| file_err(format!("cannot read: {e}")))?;
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(file_err("is not a JSON object".into())),
        Err(e) => Err(file_err(format!("invalid JSON: {e}"))),
    }
}

/// `eos_token_id` as a list: an integer, a list of integers, or null/absent (none).
fn eos_ids(f: &Fields<'_>) -> Result<Vec<i64>> {
    let bad = |v: &Value| f.bad("eos_token_id", format!("must be an integer or a list of integers, got {v}"));
    match f.get("eos_token_id") {
        None => Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().map(|v| v.as_i64().ok_or_else(|| bad(v))).collect(),
        Some(v) => Ok(vec![v.as_i64().ok_or_else(|| bad(v))?]),
    }
}

impl ModelConfig {
    /// Reads `dir/config.json` (and `dir/generation_config.json` for the end-of-sequence ids, as
    /// transformers' `generate` does, when present).
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<ModelConfig> {
        let dir = dir.as_ref();
        let mut config = Self::from_json(&read_json(&dir.join("config.json"))?)?;
        let gen_path = dir.join("generation_config.json");
        if gen_path.is_file() {
            let gen_map = read_json(&gen_path)?;
            let gen_fields = Fields { map: &gen_map, prefix: "generation_config.json: " };
            if gen_fields.get("eos_token_id").is_some() {
                config.eos_token_ids = eos_ids(&gen_fields)?;
            }
        }
        Ok(config)
    }

    /// Parses and validates a `config.json` object.
    pub fn from_json(map: &Map<String, Value>) -> Result<ModelConfig> {
        let f = Fields { map, prefix: "" };
        let architecture = match f.get("architectures") {
            Some(Value::Array(names)) => {
                let name = names
                    .first()
                    .and_then(Value::as_str)
                    .ok_or_else(|| f.bad("architectures", "must be a non-empty list of names"))?;
                Architecture::from_name(name)?
            }
            Some(v) => return Err(f.bad("architectures", format!("must be a list of names, got {v}"))),
            None => match f.string("model_type")? {
                Some(t) => Architecture::from_name(t)?,
                None => return Err(f.bad("architectures", "is missing (and so is model_type)")),
            },
        };
        if let Some(act) = f.string("hidden_act")?.or(f.string("hidden_activation")?)
            && act != "silu"
        {
            return Err(ModelError::Unsupported {
                field: "hidden_act".into(),
                value: format!("{act:?}"),
                why: "the MLP is SwiGLU (silu)".into(),
            });
        }
        let hidden_size = f.count("hidden_size", None)?;
        let num_attention_heads = f.count("num_attention_heads", None)?;
        let num_key_value_heads = f.count("num_key_value_heads", Some(num_attention_heads))?;
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(f.bad(
                "num_key_value_heads",
                format!("({num_key_value_heads}) must divide num_attention_heads ({num_attention_heads})"),
            ));
        }
        let head_dim = match f.get("head_dim") {
            Some(_) => f.count("head_dim", None)?,
            None if hidden_size % num_attention_heads == 0 => hidden_size / num_attention_heads,
            None => {
                return Err(f.bad(
                    "head_dim",
                    format!(
                        "is absent and hidden_size ({hidden_size}) is not a multiple of num_attention_heads \
                         ({num_attention_heads})"
                    ),
                ));
            }
        };
        if head_dim % 2 != 0 {
            return Err(f.bad("head_dim", format!("({head_dim}) must be even for rotary embeddings")));
        }
        let (default_positions, default_theta) = match architecture {
            Architecture::Llama => (2048, 10_000.0),
            Architecture::Qwen2 => (32_768, 10_000.0),
            Architecture::Mistral => (4096 * 32, 10_000.0),
        };
        let max_position_embeddings = f.count("max_position_embeddings", Some(default_positions))?;
        let (rope_theta, rope_scaling) = rope(&f, default_theta, max_position_embeddings)?;
        let rms_norm_eps = f.number("rms_norm_eps", Some(1e-6))?;
        if rms_norm_eps < 0.0 {
            return Err(f.bad("rms_norm_eps", format!("must be >= 0, got {rms_norm_eps}")));
        }
        let (qkv_bias, o_bias, mlp_bias) = match architecture {
            Architecture::Llama => {
                let attn = f.flag("attention_bias", false)?;
                (attn, attn, f.flag("mlp_bias", false)?)
            }
            Architecture::Qwen2 => (true, false, false),
            Architecture::Mistral => (false, false, false),
        };
        let sliding_window = match architecture {
            // transformers' MistralConfig: absent means 4096, null means no window.
            Architecture::Mistral => match map.get("sliding_window") {
                None => Some(4096),
                Some(Value::Null) => None,
                Some(_) => Some(f.count("sliding_window", None)?),
            },
            Architecture::Qwen2 if f.flag("use_sliding_window", false)? => {
                return Err(ModelError::Unsupported {
                    field: "use_sliding_window".into(),
                    value: "true".into(),
                    why: "Qwen2's per-layer sliding window is not implemented".into(),
                });
            }
            _ => None,
        };
        Ok(ModelConfig {
            architecture,
            vocab_size: f.count("vocab_size", None)?,
            hidden_size,
            intermediate_size: f.count("intermediate_size", None)?,
            num_hidden_layers: f.count("num_hidden_layers", None)?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings: f.flag("tie_word_embeddings", false)?,
            qkv_bias,
            o_bias,
            mlp_bias,
            sliding_window,
            eos_token_ids: eos_ids(&f)?,
        })
    }
}

/// `(rope_theta, scaling)` from `rope_parameters` (transformers 5) or `rope_theta` +
/// `rope_scaling` (transformers 4), read as transformers 5 reads either: the kind is `rope_type`
/// (else `type`, else `default`); `linear` and `dynamic` need `factor` (dynamic also the
/// config's `max_position_embeddings`); `yarn` needs the `factor` key (`null`:
/// `max_position_embeddings / original_max_position_embeddings`) and takes the optional
/// `attention_factor`, `beta_fast`, `beta_slow`, `mscale`, `mscale_all_dim` and `truncate`; for
/// `yarn` and `llama3`, a top-level `original_max_position_embeddings` wins over the one in the
/// parameters, and both absent mean `max_position_embeddings` (transformers'
/// `standardize_rope_params`).
fn rope(f: &Fields<'_>, default_theta: f64, max_position_embeddings: usize) -> Result<(f64, RopeScaling)> {
    let (params, theta) = match f.get("rope_parameters") {
        Some(Value::Object(p)) => {
            let pf = Fields { map: p, prefix: "rope_parameters." };
            (Some(pf), None)
        }
        Some(v) => return Err(f.bad("rope_parameters", format!("must be an object, got {v}"))),
        None => match f.get("rope_scaling") {
            Some(Value::Object(p)) => {
                (Some(Fields { map: p, prefix: "rope_scaling." }), Some(f.number("rope_theta", Some(default_theta))?))
            }
            Some(v) => return Err(f.bad("rope_scaling", format!("must be an object or null, got {v}"))),
            None => (None, Some(f.number("rope_theta", Some(default_theta))?)),
        },
    };
    let positive = |theta: f64, fields: &Fields<'_>| {
        if theta > 0.0 { Ok(theta) } else { Err(fields.bad("rope_theta", format!("must be positive, got {theta}"))) }
    };
    let Some(p) = params else {
        return Ok((positive(theta.unwrap_or(default_theta), f)?, RopeScaling::Default));
    };
    let theta = match theta {
        Some(t) => positive(t, f)?,
        None => positive(p.number("rope_theta", Some(f.number("rope_theta", Some(default_theta))?))?, &p)?,
    };
    let kind = match (p.string("rope_type")?, p.string("type")?) {
        (Some(k), _) | (None, Some(k)) => k.to_string(),
        (None, None) => "default".to_string(),
    };
    // What only JSON can say: a yarn factor that is absent (an error) rather than null (the
    // ratio of lengths), truncate as a boolean, and a top-level original length.
    if kind == "yarn" && !p.map.contains_key("factor") {
        return Err(p.bad("factor", "is missing (null: max_position_embeddings / original_max_position_embeddings)"));
    }
    let truncate = if kind == "yarn" { p.flag("truncate", true)? } else { true };
    let top_original = match kind.as_str() {
        "yarn" | "llama3" if f.get("original_max_position_embeddings").is_some() => {
            let v = f.number("original_max_position_embeddings", None)?;
            if v <= 0.0 {
                return Err(f.bad("original_max_position_embeddings", format!("must be positive, got {v}")));
            }
            Some(v)
        }
        _ => None,
    };
    // Which parameters a kind reads, and their bounds, are `RopeScaling::from_kind`'s; a field it
    // asks for that is not a number is noted here and reported first, by its own field name.
    let not_a_number: RefCell<Option<String>> = RefCell::new(None);
    let param = |name: &str| match name {
        "max_position_embeddings" => Some(max_position_embeddings as f64),
        "original_max_position_embeddings" if top_original.is_some() => top_original,
        "truncate" => Some(if truncate { 1.0 } else { 0.0 }),
        _ => {
            let v = p.get(name)?;
            if v.as_f64().is_none() {
                not_a_number.borrow_mut().get_or_insert_with(|| name.to_string());
            }
            v.as_f64()
        }
    };
    let scaling = RopeScaling::from_kind(&kind, param);
    if let Some(name) = not_a_number.into_inner() {
        p.number(&name, None)?; // the error naming the field
    }
    let scaling = scaling.map_err(|e| match e {
        tp_core::Error::UnsupportedRopeScaling { param: Some(name), why, .. } => {
            let fields = if name == "max_position_embeddings" { f } else { &p };
            fields.bad(&name, why)
        }
        e => ModelError::Unsupported { field: p.name("rope_type"), value: format!("{kind:?}"), why: e.to_string() },
    })?;
    Ok((theta, scaling))
}
