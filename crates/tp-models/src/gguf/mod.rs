//! Models from GGUF files (llama.cpp's format): the config from the file's metadata, and every
//! Hugging Face tensor name mapped to the GGUF tensor that holds it.
//!
//! * `config`: the metadata translated into the `config.json` fields the Hugging Face
//!   original has (`{arch}.embedding_length` is `hidden_size`, ...) plus each family's extras
//!   (`extras`: Gemma 3's sliding layers and local rope base, Phi-3's LongRoPE factors and
//!   partial rotary, ...), then validated by the same reader as a `config.json`
//!   ([`ModelConfig::from_json`]), so a GGUF model and its Hugging Face original build the same
//!   model.
//! * `names`: each Hugging Face tensor's llama.cpp name, with what llama.cpp changed in it:
//!   the rotary row order of Llama's Q and K ([`tp_layers::RowOrder::Rotary`]), the `1 + w` of
//!   Gemma's norms (read back with a shift of `-1`).
//!
//! A file holding a tensor the model has no place for is refused rather than run without it.

mod config;
mod extras;
mod names;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tp_gguf::GgufFile;
use tp_layers::GgufTensor;
use tp_layers::tp_core::DType;

pub(crate) use names::tensor_map;

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
    /// The open file (shared with the checkpoints that read its tensors).
    pub file: Arc<GgufFile>,
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
    /// Opens `path` (a `.gguf` file) and reads its config; a tensor the model has no place for
    /// is an error naming it.
    pub fn open(path: &Path) -> Result<GgufModel> {
        let file = GgufFile::open(path).map_err(|e| file_err(path, e))?;
        let arch = get_str(&file, path, "general.architecture")?
            .ok_or_else(|| meta_err(path, "general.architecture", "is missing"))?
            .to_string();
        let (spec, map) = config::config_json(&Meta { file: &file, path, arch: &arch })?;
        let config = ModelConfig::from_json(&map)?;
        names::check_all_mapped(&file, path, spec, &tensor_map(&config, &arch))?;
        Ok(GgufModel { path: path.to_path_buf(), file: Arc::new(file), arch, config })
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

/// One file's metadata, read with the file named in every error; `u64`, `f32`, ... read
/// `{arch}.{key}`.
pub(crate) struct Meta<'a> {
    pub file: &'a GgufFile,
    pub path: &'a Path,
    /// `general.architecture`.
    pub arch: &'a str,
}

impl Meta<'_> {
    /// `{arch}.{k}`.
    pub fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }
    /// An error about `{arch}.{k}`.
    pub fn err(&self, k: &str, why: impl std::fmt::Display) -> ModelError {
        meta_err(self.path, &self.key(k), why)
    }
    /// An error about the file.
    pub fn file_err(&self, why: impl std::fmt::Display) -> ModelError {
        file_err(self.path, why)
    }
    pub fn u64(&self, k: &str) -> Result<Option<u64>> {
        get_u64(self.file, self.path, &self.key(k))
    }
    /// `{arch}.{k}`, which must be present.
    pub fn need(&self, k: &str) -> Result<u64> {
        self.u64(k)?.ok_or_else(|| self.err(k, "is missing"))
    }
    pub fn f32(&self, k: &str) -> Result<Option<f32>> {
        get_f32(self.file, self.path, &self.key(k))
    }
    /// The f32 at `{arch}.{k}` as the shortest decimal that rounds to it: the value the
    /// Hugging Face config held when it was a short decimal (`1e-5`, not `9.99999974e-6`).
    pub fn decimal(&self, k: &str) -> Result<Option<f64>> {
        Ok(self.f32(k)?.map(|x| x.to_string().parse().unwrap_or(f64::from(x))))
    }
    pub fn str(&self, k: &str) -> Result<Option<&str>> {
        get_str(self.file, self.path, &self.key(k))
    }
    /// A key outside the architecture's (`tokenizer.ggml.eos_token_id`).
    pub fn global_u64(&self, key: &str) -> Result<Option<u64>> {
        get_u64(self.file, self.path, key)
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
