//! [`ModelSource`]: a model's files found and opened once, then shared by everything that
//! reads them (the config, the tokenizer and chat template, every rank's weights).

use crate::config::ModelConfig;
use crate::error::Result;
use crate::gguf::{GgufModel, find_gguf};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where a model comes from: a Hugging Face folder (its files read as each part needs them), or
/// a GGUF file opened once (mapped, its header parsed and checked, its config read and every
/// tensor matched to a place) and shared by reference: clones share the one open file.
#[derive(Debug, Clone)]
pub enum ModelSource {
    /// A folder with `config.json` and safetensors.
    Folder(PathBuf),
    /// An open GGUF file.
    Gguf(Arc<GgufModel>),
}

impl ModelSource {
    /// Opens what `path` names: a GGUF file, or a folder holding one and no `config.json`
    /// (opened here, once), else a Hugging Face folder.
    ///
    /// Errors: a folder with several GGUF files, and every error of [`GgufModel::open`].
    pub fn open(path: impl AsRef<Path>) -> Result<ModelSource> {
        let path = path.as_ref();
        Ok(match find_gguf(path)? {
            Some(file) => ModelSource::Gguf(Arc::new(GgufModel::open(&file)?)),
            None => ModelSource::Folder(path.to_path_buf()),
        })
    }

    /// The folder, or the GGUF file.
    pub fn path(&self) -> &Path {
        match self {
            ModelSource::Folder(p) => p,
            ModelSource::Gguf(m) => &m.path,
        }
    }

    /// The model's config: read from the folder's `config.json` (and `generation_config.json`),
    /// or the one the GGUF file's metadata gave when it was opened.
    ///
    /// Errors: those of [`ModelConfig::from_dir`] for a folder.
    pub fn config(&self) -> Result<ModelConfig> {
        match self {
            ModelSource::Folder(dir) => ModelConfig::from_folder(dir),
            ModelSource::Gguf(m) => Ok(m.config.clone()),
        }
    }

    /// The open GGUF file, for a GGUF model.
    pub fn gguf(&self) -> Option<&GgufModel> {
        match self {
            ModelSource::Folder(_) => None,
            ModelSource::Gguf(m) => Some(m),
        }
    }
}
