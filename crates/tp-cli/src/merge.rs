//! `tp merge BASE ADAPTER OUT`: a Hugging Face folder with a LoRA adapter merged into its
//! weights (PEFT's `merge_and_unload`), loadable by transformers and `tp serve` as a plain model.

use crate::error::CliError;
use std::path::{Path, PathBuf};
use tp_models::adapter::{merge, read_adapter};

/// `tp merge BASE ADAPTER OUT`.
#[derive(Debug, Clone, clap::Args)]
pub struct MergeArgs {
    /// The base model: a Hugging Face folder.
    pub base: PathBuf,
    /// The PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`).
    pub adapter: PathBuf,
    /// Where the merged folder goes (absent, or an empty folder).
    pub out: PathBuf,
}

/// Largest file copied from the base folder besides its weights.
const MAX_COPY_BYTES: u64 = 1 << 30;

fn io(path: &Path, e: impl std::fmt::Display) -> CliError {
    CliError::Io(format!("{}: {e}", path.display()))
}

/// Runs `tp merge`: the merged weights into `OUT/model.safetensors`, every other regular file of
/// the base folder (config, tokenizer, generation config) copied.
pub fn merge_command(a: MergeArgs) -> Result<(), CliError> {
    let model = |e: tp_models::ModelError| CliError::Model(e.to_string());
    if tp_models::gguf::find_gguf(&a.base).map_err(model)?.is_some() {
        return Err(CliError::Args(format!(
            "{}: merging into a GGUF file is not supported yet; merge into the Hugging Face folder it came from",
            a.base.display()
        )));
    }
    match std::fs::read_dir(&a.out).map(|mut entries| entries.next().is_some()) {
        Ok(true) => {
            return Err(CliError::Args(format!("{}: exists and is not empty; pick another folder", a.out.display())));
        }
        Ok(false) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(&a.out, e)),
    }
    let config = tp_models::ModelConfig::from_dir(&a.base).map_err(model)?;
    let adapter = read_adapter(&a.adapter, config.num_hidden_layers).map_err(model)?;
    let base = tp_layers::Checkpoint::open(&a.base).map_err(|e| CliError::Model(e.to_string()))?;
    let merged = merge(&base, &adapter).map_err(model)?;
    std::fs::create_dir_all(&a.out).map_err(|e| io(&a.out, e))?;
    let named: Vec<(&str, &tp_core::Tensor)> = merged.iter().map(|(n, t)| (n.as_str(), t)).collect();
    tp_layers::save(a.out.join("model.safetensors"), &named).map_err(|e| CliError::Io(e.to_string()))?;
    for entry in std::fs::read_dir(&a.base).map_err(|e| io(&a.base, e))? {
        let path = entry.map_err(|e| io(&a.base, e))?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
        let weights = name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json");
        match std::fs::metadata(&path) {
            Ok(m) if m.is_file() && !weights && m.len() <= MAX_COPY_BYTES => {
                std::fs::copy(&path, a.out.join(&name)).map_err(|e| io(&path, e))?;
            }
            _ => {}
        }
    }
    eprintln!(
        "merged {} adapted modules (r {}, alpha {}) into {}",
        adapter.modules().len(),
        adapter.settings.r,
        adapter.settings.alpha,
        a.out.join("model.safetensors").display()
    );
    Ok(())
}
