//! `--prompt TEXT` through the model folder's `tokenizer.json` (the `tokenizers` crate, behind
//! tp-models' `tokenizers` feature: it adds about 85 crates to the build).

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

#[cfg(feature = "tokenizers")]
fn load(dir: &Path) -> Result<tokenizers::Tokenizer, String> {
    let path = dir.join("tokenizer.json");
    if !path.is_file() {
        return Err(format!("--prompt needs {}, which does not exist (use --prompt-ids)", path.display()));
    }
    tokenizers::Tokenizer::from_file(&path).map_err(|e| format!("{}: {e}", path.display()))
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
