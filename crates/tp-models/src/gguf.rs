//! Models from GGUF files (llama.cpp's format): the config from the file's metadata, and every
//! Hugging Face tensor name mapped to the GGUF tensor that holds it.
//!
//! The metadata is translated into the `config.json` fields transformers' own GGUF loader
//! derives (`{arch}.embedding_length` is `hidden_size`, `{arch}.attention.head_count_kv` is
//! `num_key_value_heads`, ...), then validated by the same reader as a `config.json`
//! ([`ModelConfig::from_json`]), so a GGUF model and its Hugging Face original build the same
//! model. Tied embeddings are a file without `output.weight`. llama.cpp's `llama` architecture
//! (Llama, Mistral and their fine-tunes) stores Q and K rows in its rotary layout; they are
//! read back in Hugging Face's order ([`tp_layers::RowOrder::Rotary`]).

use crate::arch::Architecture;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use serde_json::{Map, Value, json};
use std::path::{Path, PathBuf};
use tp_gguf::GgufFile;
use tp_layers::tp_core::DType;
use tp_layers::{GgufTensor, RowOrder};

/// The GGUF architectures tp reads, and the family each is.
const ARCHS: &[(&str, Architecture)] =
    &[("llama", Architecture::Llama), ("qwen2", Architecture::Qwen2), ("qwen3", Architecture::Qwen3)];

/// Hugging Face's tensor names within a layer, and llama.cpp's.
const LAYER_NAMES: &[(&str, &str)] = &[
    ("input_layernorm", "attn_norm"),
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("self_attn.q_norm", "attn_q_norm"),
    ("self_attn.k_norm", "attn_k_norm"),
    ("post_attention_layernorm", "ffn_norm"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
];

/// The GGUF file `path` names, if it names one: a file ending in `.gguf`, or a folder with no
/// `config.json` holding exactly one (more than one is an error naming them).
pub fn find_gguf(path: &Path) -> Result<Option<PathBuf>> {
    let is_gguf = |p: &Path| p.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    if !path.is_dir() {
        return Ok(is_gguf(path).then(|| path.to_path_buf()));
    }
    if path.join("config.json").exists() {
        return Ok(None);
    }
    let read = std::fs::read_dir(path).map_err(|e| file_err(path, format!("cannot list: {e}")))?;
    let mut found: Vec<PathBuf> = read.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| is_gguf(p)).collect();
    found.sort();
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        n => Err(file_err(
            path,
            format!(
                "holds {n} GGUF files ({}); name the one to run",
                found.iter().filter_map(|p| p.file_name()).map(|f| f.to_string_lossy()).collect::<Vec<_>>().join(", ")
            ),
        )),
    }
}

fn file_err(path: &Path, why: impl std::fmt::Display) -> ModelError {
    ModelError::ConfigFile { path: tp_layers::quote_text(&path.display().to_string()), why: why.to_string() }
}

fn meta_err(path: &Path, key: &str, why: impl std::fmt::Display) -> ModelError {
    file_err(path, format!("metadata {key}: {why}"))
}

/// A GGUF model: its file, architecture and validated config.
pub struct GgufModel {
    /// Where the file is.
    pub path: PathBuf,
    /// The open file.
    pub file: GgufFile,
    /// `general.architecture`.
    pub arch: String,
    /// The config its metadata implies.
    pub config: ModelConfig,
}

impl std::fmt::Debug for GgufModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GgufModel({}, {})", self.path.display(), self.arch)
    }
}

impl GgufModel {
    /// Opens `path` (a `.gguf` file) and reads its config.
    pub fn open(path: &Path) -> Result<GgufModel> {
        let file = GgufFile::open(path).map_err(|e| file_err(path, e))?;
        let arch = get_str(&file, path, "general.architecture")?
            .ok_or_else(|| meta_err(path, "general.architecture", "is missing"))?
            .to_string();
        let config = ModelConfig::from_json(&config_json(&file, path, &arch)?)?;
        Ok(GgufModel { path: path.to_path_buf(), file, arch, config })
    }

    /// Every tensor of the model under its Hugging Face name, mapped to the GGUF tensor that
    /// holds it.
    pub fn tensors(&self) -> Vec<GgufTensor> {
        tensor_map(&self.config, &self.arch)
    }

    /// The dtype the file's token embedding is stored in, as tp reads it (block types as f32).
    pub fn embedding_dtype(&self) -> DType {
        match self.file.tensor("token_embd.weight").map(|t| t.ggml_type.0) {
            Some(1) => DType::F16,
            Some(30) => DType::BF16,
            _ => DType::F32,
        }
    }
}

fn get_str<'a>(file: &'a GgufFile, path: &Path, key: &str) -> Result<Option<&'a str>> {
    file.get_str(key).map_err(|e| meta_err(path, key, e))
}
fn get_u64(file: &GgufFile, path: &Path, key: &str) -> Result<Option<u64>> {
    file.get_u64(key).map_err(|e| meta_err(path, key, e))
}
fn get_f32(file: &GgufFile, path: &Path, key: &str) -> Result<Option<f32>> {
    file.get_f32(key).map_err(|e| meta_err(path, key, e))
}

/// The `config.json` object the metadata of `file` (architecture `arch`) implies.
fn config_json(file: &GgufFile, path: &Path, arch: &str) -> Result<Map<String, Value>> {
    let family = ARCHS.iter().find(|(a, _)| *a == arch).map(|(_, f)| *f).ok_or_else(|| {
        meta_err(
            path,
            "general.architecture",
            format!(
                "{} is not one tp reads from GGUF (it reads {})",
                tp_layers::quote_text(arch),
                ARCHS.iter().map(|(a, _)| *a).collect::<Vec<_>>().join(", ")
            ),
        )
    })?;
    let key = |k: &str| format!("{arch}.{k}");
    let need =
        |k: &str| -> Result<u64> { get_u64(file, path, &key(k))?.ok_or_else(|| meta_err(path, &key(k), "is missing")) };
    let hidden = need("embedding_length")?;
    let heads = need("attention.head_count")?;
    let mut c = json!({
        "architectures": [family.class_name()],
        "model_type": family.model_type(),
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length")?,
        "num_hidden_layers": need("block_count")?,
        "num_attention_heads": heads,
        "num_key_value_heads": get_u64(file, path, &key("attention.head_count_kv"))?.unwrap_or(heads),
        "max_position_embeddings": need("context_length")?,
        "rms_norm_eps": get_f32(file, path, &key("attention.layer_norm_rms_epsilon"))?.map_or(1e-6, f64::from),
        "rope_theta": get_f32(file, path, &key("rope.freq_base"))?.map_or(10_000.0, f64::from),
        "tie_word_embeddings": file.tensor("output.weight").is_none(),
        "hidden_act": "silu",
    });
    let obj = c.as_object_mut().ok_or_else(|| file_err(path, "internal: config is not an object"))?;
    if let Some(d) = get_u64(file, path, &key("attention.key_length"))? {
        obj.insert("head_dim".into(), json!(d));
    }
    let vocab = match get_u64(file, path, &key("vocab_size"))? {
        Some(v) => v,
        None => {
            match file.get_str_array("tokenizer.ggml.tokens").map_err(|e| meta_err(path, "tokenizer.ggml.tokens", e))? {
                Some(t) => t.len() as u64,
                None => file.tensor("token_embd.weight").and_then(|t| t.dims.get(1).copied()).ok_or_else(|| {
                    meta_err(path, &key("vocab_size"), "is missing, as are the tokens and token_embd.weight")
                })?,
            }
        }
    };
    obj.insert("vocab_size".into(), json!(vocab));
    if let Some(kind) = get_str(file, path, &key("rope.scaling.type"))?
        && kind != "none"
    {
        let mut s = json!({"rope_type": kind});
        if let Some(f) = get_f32(file, path, &key("rope.scaling.factor"))? {
            s["factor"] = json!(f64::from(f));
        }
        if let Some(n) = get_u64(file, path, &key("rope.scaling.original_context_length"))? {
            s["original_max_position_embeddings"] = json!(n);
        }
        obj.insert("rope_scaling".into(), s);
    }
    if file.tensor("rope_freqs.weight").is_some() {
        return Err(meta_err(
            path,
            "rope_freqs.weight",
            "per-frequency rotary factors (Llama 3.1's rope scaling as a tensor) are not read yet",
        ));
    }
    if family == Architecture::Llama {
        obj.insert("attention_bias".into(), json!(file.tensor("blk.0.attn_q.bias").is_some()));
        obj.insert("mlp_bias".into(), json!(false));
    }
    if family == Architecture::Qwen3 {
        obj.insert("attention_bias".into(), json!(file.tensor("blk.0.attn_q.bias").is_some()));
    }
    if let Some(eos) = get_u64(file, path, "tokenizer.ggml.eos_token_id")? {
        obj.insert("eos_token_id".into(), json!(eos));
    }
    if let Some(bos) = get_u64(file, path, "tokenizer.ggml.bos_token_id")? {
        obj.insert("bos_token_id".into(), json!(bos));
    }
    Ok(c.as_object().cloned().unwrap_or_default())
}

/// Every tensor `c` implies, Hugging Face name to GGUF name (`arch`: the file's architecture).
pub(crate) fn tensor_map(c: &ModelConfig, arch: &str) -> Vec<GgufTensor> {
    let (want, _) = crate::tensors::expected_tensors(c);
    let rotary = arch == "llama";
    want.into_iter()
        .filter_map(|(name, _)| {
            let (gguf_name, rows) = gguf_name(&name, c, rotary)?;
            Some(GgufTensor { name, gguf_name, rows, shift: 0.0 })
        })
        .collect()
}

/// llama.cpp's name for Hugging Face tensor `name`, and how its rows are stored.
fn gguf_name(name: &str, c: &ModelConfig, rotary: bool) -> Option<(String, RowOrder)> {
    let top = match name {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(t) = top {
        return Some((t.to_string(), RowOrder::Stored));
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, param) = rest.rsplit_once('.')?;
    let (_, g) = LAYER_NAMES.iter().find(|(hf, _)| *hf == module)?;
    let rows = match module {
        "self_attn.q_proj" if rotary => RowOrder::Rotary { heads: c.num_attention_heads },
        "self_attn.k_proj" if rotary => RowOrder::Rotary { heads: c.num_key_value_heads },
        _ => RowOrder::Stored,
    };
    Some((format!("blk.{layer}.{g}.{param}"), rows))
}

impl GgufModel {
    /// `tokenizer.chat_template`, if the file has one.
    pub fn chat_template(&self) -> Result<Option<String>> {
        Ok(get_str(&self.file, &self.path, "tokenizer.chat_template")?.map(str::to_string))
    }

    /// The text of special token `key` (`tokenizer.ggml.bos_token_id`, ...), if the file names
    /// one within its tokens: what a chat template reads as `bos_token`.
    pub fn special_token(&self, key: &str) -> Result<Option<String>> {
        let Some(id) = get_u64(&self.file, &self.path, key)? else { return Ok(None) };
        let tokens = self.file.get_str_array("tokenizer.ggml.tokens").map_err(|e| meta_err(&self.path, key, e))?;
        Ok(tokens.and_then(|t| usize::try_from(id).ok().and_then(|i| t.get(i))).cloned())
    }

    /// The tokenizer metadata (`tokenizer.ggml.*`), each field read with its type checked.
    #[cfg(feature = "tokenizers")]
    pub fn vocab(&self) -> Result<crate::gguf_tokenizer::GgufVocab> {
        let (f, p) = (&self.file, self.path.as_path());
        fn err<'a>(p: &'a Path, key: &'a str) -> impl Fn(tp_gguf::GgufError) -> ModelError + 'a {
            move |e| meta_err(p, key, e)
        }
        let id = |key: &str| -> Result<Option<u32>> { f.get_u32(key).map_err(err(p, key)) };
        let flag = |key: &str| -> Result<Option<bool>> { f.get_bool(key).map_err(err(p, key)) };
        let model = get_str(f, p, "tokenizer.ggml.model")?
            .ok_or_else(|| meta_err(p, "tokenizer.ggml.model", "is missing: the file carries no tokenizer"))?;
        let tokens = f
            .get_str_array("tokenizer.ggml.tokens")
            .map_err(err(p, "tokenizer.ggml.tokens"))?
            .ok_or_else(|| meta_err(p, "tokenizer.ggml.tokens", "is missing"))?;
        Ok(crate::gguf_tokenizer::GgufVocab {
            model: model.to_string(),
            pre: get_str(f, p, "tokenizer.ggml.pre")?.map(str::to_string),
            tokens: tokens.to_vec(),
            scores: f
                .get_f32_array("tokenizer.ggml.scores")
                .map_err(err(p, "tokenizer.ggml.scores"))?
                .map(<[f32]>::to_vec),
            token_types: f
                .get_i32_array("tokenizer.ggml.token_type")
                .map_err(err(p, "tokenizer.ggml.token_type"))?
                .map(<[i32]>::to_vec),
            merges: f
                .get_str_array("tokenizer.ggml.merges")
                .map_err(err(p, "tokenizer.ggml.merges"))?
                .map(<[String]>::to_vec),
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?,
            unk: id("tokenizer.ggml.unknown_token_id")?,
            pad: id("tokenizer.ggml.padding_token_id")?,
            add_bos: flag("tokenizer.ggml.add_bos_token")?,
            add_eos: flag("tokenizer.ggml.add_eos_token")?,
            add_space_prefix: flag("tokenizer.ggml.add_space_prefix")?,
            architecture: Some(self.arch.clone()),
        })
    }

    /// The file's tokenizer, built as transformers builds it ([`crate::gguf_tokenizer`]).
    #[cfg(feature = "tokenizers")]
    pub fn tokenizer(&self) -> Result<tokenizers::Tokenizer> {
        crate::gguf_tokenizer::tokenizer_from_gguf(&self.vocab()?)
    }
}
