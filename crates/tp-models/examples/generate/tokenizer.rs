//! `--prompt TEXT` through the model folder's `tokenizer.json`, or a GGUF file's own tokenizer
//! (`tokenizer.ggml.*`) when the model is one (the `tokenizers` crate, behind tp-models'
//! `tokenizers` feature: it adds about 85 crates to the build).

use std::path::Path;

/// Encodes `text` with `dir/tokenizer.json` (special tokens added, as transformers does).
#[cfg(feature = "tokenizers")]
pub fn encode(dir: &Path, text: &str) -> Result<Vec<i64>, String> {
    let t = load(dir)?;
    let enc = t.encode(text, true).map_err(|e| format!("tokenizer: cannot encode the prompt: {e}"))?;
    Ok(enc.get_ids().iter().map(|&i| i64::from(i)).collect())
}

/// Decodes `ids` with `dir/tokenizer.json`, if the folder has one.
#[cfg(feature = "tokenizers")]
pub fn decode(dir: &Path, ids: &[i64]) -> Option<String> {
    let t = load(dir).ok()?;
    let ids: Vec<u32> = ids.iter().filter_map(|&i| u32::try_from(i).ok()).collect();
    t.decode(&ids, true).ok()
}

/// Largest `tokenizer.json` read (Gemma's, among the largest on the Hub, is about 33 MB).
#[cfg(feature = "tokenizers")]
const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// `dir/tokenizer.json`, read as every file from a model folder is: only a regular file (a pipe
/// or a device is an error at once, never a blocked open) of at most `MAX_TOKENIZER_BYTES`.
#[cfg(feature = "tokenizers")]
fn load(dir: &Path) -> Result<tokenizers::Tokenizer, String> {
    if let Some(gguf) = tp_models::gguf::find_gguf(dir).map_err(|e| e.to_string())? {
        let model = tp_models::gguf::GgufModel::open(&gguf).map_err(|e| e.to_string())?;
        return model.tokenizer().map_err(|e| e.to_string());
    }
    let path = dir.join("tokenizer.json");
    if std::fs::symlink_metadata(&path).is_err() {
        return Err(format!("--prompt needs {}, which does not exist (use --prompt-ids)", path.display()));
    }
    let text = tp_layers::read_text_file(&path, MAX_TOKENIZER_BYTES).map_err(|e| match e {
        tp_layers::LayerError::Checkpoint { path, why } => format!("{path}: {why}"),
        e => e.to_string(),
    })?;
    text.parse::<tokenizers::Tokenizer>().map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(not(feature = "tokenizers"))]
pub fn encode(_dir: &Path, _text: &str) -> Result<Vec<i64>, String> {
    Err("--prompt needs tokenizer support: rebuild with `--features tp-models/tokenizers` (or pass --prompt-ids)"
        .into())
}

#[cfg(not(feature = "tokenizers"))]
pub fn decode(_dir: &Path, _ids: &[i64]) -> Option<String> {
    None
}
