//! Random checkpoints in Hugging Face's layout, for tests and benchmarks: a `config.json` in the
//! transformers 4 or 5 form, the weights over one or more safetensors files with
//! `model.safetensors.index.json`, exactly as `save_pretrained` lays them out. Weights are
//! seeded normal samples scaled by `1/sqrt(fan_in)` (activations stay of order one through any
//! depth), norms near one.

use serde_json::{Value, json};
use std::path::Path;
use tp_core::{DType, Device, NormStyle, Tensor};
use tp_models::{Architecture, ModelConfig, ModelError, Result};

/// The shape of a synthetic model.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticModel {
    /// Family (decides the biases and the `architectures` entry).
    pub architecture: Architecture,
    /// `vocab_size`.
    pub vocab_size: usize,
    /// `hidden_size`.
    pub hidden_size: usize,
    /// `intermediate_size`.
    pub intermediate_size: usize,
    /// `num_hidden_layers`.
    pub num_hidden_layers: usize,
    /// `num_attention_heads`.
    pub num_attention_heads: usize,
    /// `num_key_value_heads`.
    pub num_key_value_heads: usize,
    /// `head_dim`, written to the config only when `Some`.
    pub head_dim: Option<usize>,
    /// `tie_word_embeddings` (then no `lm_head.weight` is written).
    pub tie_word_embeddings: bool,
    /// Llama's `attention_bias`.
    pub attention_bias: bool,
    /// `rope_theta`.
    pub rope_theta: f64,
    /// A `rope_scaling` object (transformers 4 form, e.g. llama3's), if any.
    pub rope_scaling: Option<Value>,
    /// `max_position_embeddings`.
    pub max_position_embeddings: usize,
    /// `eos_token_id`.
    pub eos_token_id: Option<i64>,
    /// Mistral's `sliding_window`.
    pub sliding_window: Option<usize>,
    /// Write `rope_parameters` (transformers 5) instead of `rope_theta` / `rope_scaling`.
    pub transformers_v5: bool,
    /// Dtype of the stored weights.
    pub dtype: DType,
    /// Number of safetensors files (1: `model.safetensors`; more: an index).
    pub files: usize,
    /// Seed of every tensor.
    pub seed: u64,
    /// Further `config.json` keys (a JSON object), merged last: a family's own fields
    /// (`layer_types`, `query_pre_attn_scalar`, `final_logit_softcapping`, ...).
    pub extra: Option<Value>,
}

impl SyntheticModel {
    /// TinyLlama-1.1B's shapes (hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 KV heads,
    /// vocab 32000), stored in `dtype` over several files.
    pub fn tinyllama(dtype: DType) -> SyntheticModel {
        SyntheticModel {
            architecture: Architecture::Llama,
            vocab_size: 32000,
            hidden_size: 2048,
            intermediate_size: 5632,
            num_hidden_layers: 22,
            num_attention_heads: 32,
            num_key_value_heads: 4,
            head_dim: None,
            tie_word_embeddings: false,
            attention_bias: false,
            rope_theta: 10_000.0,
            rope_scaling: None,
            max_position_embeddings: 2048,
            eos_token_id: Some(2),
            sliding_window: None,
            transformers_v5: false,
            dtype,
            files: 4,
            seed: 1,
            extra: None,
        }
    }

    /// A tiny Llama with uneven heads and vocabulary, for tests.
    pub fn tiny() -> SyntheticModel {
        SyntheticModel {
            vocab_size: 1001,
            hidden_size: 48,
            intermediate_size: 77,
            num_hidden_layers: 3,
            num_attention_heads: 12,
            num_key_value_heads: 12,
            max_position_embeddings: 64,
            dtype: DType::F32,
            files: 2,
            ..Self::tinyllama(DType::F32)
        }
    }

    /// The `config.json` object.
    pub fn config_json(&self) -> Value {
        let arch = (self.architecture.class_name(), self.architecture.model_type());
        let dtype = match self.dtype {
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            _ => "float32",
        };
        let mut c = json!({
            "architectures": [arch.0],
            "model_type": arch.1,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": 0.02,
            "use_cache": true,
            "bos_token_id": 1,
            "eos_token_id": self.eos_token_id,
        });
        let Some(obj) = c.as_object_mut() else { return c };
        if let Some(d) = self.head_dim {
            obj.insert("head_dim".into(), json!(d));
        }
        let arch = self.architecture;
        obj.insert(arch.activation_key().into(), json!(arch.default_activation()));
        if arch.reads_attention_bias() {
            obj.insert("attention_bias".into(), json!(self.attention_bias));
        }
        if arch.reads_mlp_bias() {
            obj.insert("mlp_bias".into(), json!(false));
        }
        if arch.reads_sliding_window() {
            obj.insert("sliding_window".into(), json!(self.sliding_window));
        }
        if arch.sliding_window_needs_opt_in() && self.sliding_window.is_some() {
            obj.insert("use_sliding_window".into(), json!(true));
            obj.insert("max_window_layers".into(), json!(0));
        }
        if self.transformers_v5 {
            let mut p = json!({"rope_type": "default", "rope_theta": self.rope_theta});
            if let (Some(Value::Object(s)), Some(po)) = (&self.rope_scaling, p.as_object_mut()) {
                po.extend(s.iter().map(|(k, v)| (k.clone(), v.clone())));
            }
            obj.insert("rope_parameters".into(), p);
            obj.insert("dtype".into(), json!(dtype));
        } else {
            obj.insert("rope_theta".into(), json!(self.rope_theta));
            obj.insert("rope_scaling".into(), self.rope_scaling.clone().unwrap_or(Value::Null));
            obj.insert("torch_dtype".into(), json!(dtype));
        }
        if let Some(Value::Object(extra)) = &self.extra {
            obj.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        c
    }

    /// The validated config of [`config_json`](Self::config_json).
    pub fn config(&self) -> Result<ModelConfig> {
        match self.config_json() {
            Value::Object(map) => ModelConfig::from_json(&map),
            _ => Err(ModelError::Request("internal: the synthetic config is not an object".into())),
        }
    }

    /// Every tensor's name and shape, in Hugging Face's order (what the architecture table
    /// implies for this config).
    pub fn tensor_shapes(&self) -> Result<Vec<(String, Vec<usize>)>> {
        Ok(tp_models::expected_tensors(&self.config()?).0)
    }

    /// The seeded tensor `name` of `dims`.
    pub fn tensor(&self, index: usize, name: &str, dims: &[usize]) -> Result<Tensor> {
        let seed = self.seed.wrapping_mul(1_000_003).wrapping_add(index as u64);
        let cpu = Device::Cpu;
        let t = if name.ends_with("norm.weight") {
            // Gemma's norms multiply by (1 + w): weights near 0 there, near 1 elsewhere.
            let one = if self.architecture.norm_style() == NormStyle::OnePlusWeight { 0.0 } else { 1.0 };
            let mut rng = tp_core::rng::SplitMix64::new(seed);
            Tensor::from_fn_f64(dims, self.dtype, &cpu, |_| one + 0.1 * rng.uniform(-1.0, 1.0))?
        } else if name.ends_with(".bias") {
            let mut rng = tp_core::rng::SplitMix64::new(seed);
            Tensor::from_fn_f64(dims, self.dtype, &cpu, |_| 0.1 * rng.normal())?
        } else if dims.len() == 1 {
            // Vectors of logits (gpt-oss's attention sinks), of the scores' order.
            let mut rng = tp_core::rng::SplitMix64::new(seed);
            Tensor::from_fn_f64(dims, self.dtype, &cpu, |_| rng.normal())?
        } else {
            let scale = if name == "model.embed_tokens.weight" { 1.0 } else { 1.0 / (dims[1] as f64).sqrt() };
            let mut rng = tp_core::rng::SplitMix64::new(seed);
            Tensor::from_fn_f64(dims, self.dtype, &cpu, |_| scale * rng.normal())?
        };
        Ok(t)
    }

    /// Writes `config.json`, `generation_config.json` and the weights into `dir` (created if
    /// needed).
    pub fn write(&self, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        let io = |e: std::io::Error| ModelError::ConfigFile { path: dir.display().to_string(), why: e.to_string() };
        std::fs::create_dir_all(dir).map_err(io)?;
        let pretty = |v: &Value| serde_json::to_string_pretty(v).unwrap_or_default();
        std::fs::write(dir.join("config.json"), pretty(&self.config_json())).map_err(io)?;
        let gen_config = json!({"bos_token_id": 1, "eos_token_id": self.eos_token_id, "do_sample": false});
        std::fs::write(dir.join("generation_config.json"), pretty(&gen_config)).map_err(io)?;
        let shapes = self.tensor_shapes()?;
        let files = self.files.clamp(1, shapes.len());
        let per = shapes.len().div_ceil(files);
        let mut weight_map = serde_json::Map::new();
        for (f, chunk) in shapes.chunks(per).enumerate() {
            let file = if files == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{:05}.safetensors", f + 1, files)
            };
            let tensors = chunk
                .iter()
                .enumerate()
                .map(|(i, (name, dims))| Ok((name.clone(), self.tensor(f * per + i, name, dims)?)))
                .collect::<Result<Vec<_>>>()?;
            let refs: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
            tp_layers::save(dir.join(&file), &refs)?;
            for (name, _) in chunk {
                weight_map.insert(name.clone(), json!(file));
            }
        }
        if files > 1 {
            let index = json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
            std::fs::write(dir.join("model.safetensors.index.json"), pretty(&index)).map_err(io)?;
        }
        Ok(())
    }
}
