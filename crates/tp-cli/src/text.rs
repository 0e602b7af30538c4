//! The model folder's text side: `tokenizer.json` (the `tokenizers` crate) and the chat
//! template (`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`, a string or a
//! list of named templates, the one named `default` or the first). A GGUF model without a
//! `tokenizer.json` beside it takes both from the file (`tokenizer.ggml.*`, built as
//! transformers builds it, and `tokenizer.chat_template`).

use crate::error::CliError;
use crate::template::ChatTemplate;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// Largest `tokenizer.json` read (Gemma's, among the largest on the Hub, is about 33 MB).
const MAX_TOKENIZER_BYTES: u64 = 256 << 20;
/// Largest `tokenizer_config.json` or `chat_template.jinja` read.
const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// The tokenizer and chat template of the served model.
pub struct TextModel {
    tokenizer: tokenizers::Tokenizer,
    template: Option<ChatTemplate>,
    /// The special tokens a template is rendered with (kept for `--chat-template`).
    specials: BTreeMap<String, String>,
}

impl TextModel {
    /// The text side of a model already opened: a GGUF file's own tokenizer and template (read
    /// from the open file), unless a `tokenizer.json` lies beside it; else the folder's files.
    pub fn from_source(source: &tp_models::ModelSource) -> Result<TextModel, CliError> {
        if let Some(model) = source.gguf() {
            let beside = model.path.parent().map(|p| p.join("tokenizer.json"));
            if !beside.as_ref().is_some_and(|t| t.exists()) {
                return Self::from_gguf(model);
            }
        }
        let dir = source.path();
        let dir = if dir.is_dir() { dir } else { dir.parent().unwrap_or(Path::new(".")) };
        let tok_text = read_text(&dir.join("tokenizer.json"), MAX_TOKENIZER_BYTES)?
            .ok_or_else(|| CliError::Model(format!("{}: no tokenizer.json in the model folder", dir.display())))?;
        let tokenizer = tok_text
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| CliError::Model(format!("{}: {e}", dir.join("tokenizer.json").display())))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let config: Value = match read_text(&cfg_path, MAX_CONFIG_BYTES)? {
            Some(t) => serde_json::from_str(&t).map_err(|e| CliError::Model(format!("{}: {e}", cfg_path.display())))?,
            None => Value::Null,
        };
        let source = match read_text(&dir.join("chat_template.jinja"), MAX_CONFIG_BYTES)? {
            Some(t) => Some(t),
            None => {
                template_from_config(&config).map_err(|e| CliError::Model(format!("{}: {e}", cfg_path.display())))?
            }
        };
        let specials = special_tokens(&config);
        let template = match source {
            Some(s) => Some(ChatTemplate::new(s, specials.clone()).map_err(CliError::Model)?),
            None => None,
        };
        Ok(TextModel { tokenizer, template, specials })
    }

    /// The tokenizer and chat template a GGUF file carries.
    fn from_gguf(model: &tp_models::gguf::GgufModel) -> Result<TextModel, CliError> {
        let model_err = |e: tp_models::ModelError| CliError::Model(e.to_string());
        let tokenizer = model.tokenizer().map_err(model_err)?;
        let mut specials = BTreeMap::new();
        for (name, key) in
            [("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")]
        {
            if let Some(t) = model.special_token(&format!("tokenizer.ggml.{key}_token_id")).map_err(model_err)? {
                specials.insert(name.to_string(), t);
            }
        }
        let template = match model.chat_template().map_err(model_err)? {
            Some(s) => Some(ChatTemplate::new(s, specials.clone()).map_err(CliError::Model)?),
            None => None,
        };
        Ok(TextModel { tokenizer, template, specials })
    }

    /// Ids of `text`; `special` adds the tokenizer's own special tokens (BOS), as a plain
    /// completion prompt is encoded; chat prompts already hold them.
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<i64>, String> {
        let enc = self.tokenizer.encode(text, special).map_err(|e| format!("the tokenizer failed: {e}"))?;
        Ok(enc.get_ids().iter().map(|&i| i64::from(i)).collect())
    }

    /// Text of `ids`, special tokens left out. Ids outside `u32` decode to nothing.
    pub fn decode(&self, ids: &[i64]) -> String {
        let ids: Vec<u32> = ids.iter().filter_map(|&i| u32::try_from(i).ok()).collect();
        self.tokenizer.decode(&ids, true).unwrap_or_default()
    }

    /// Text of `ids` with special tokens kept (as `/detokenize` answers).
    pub fn decode_with_specials(&self, ids: &[i64]) -> String {
        let ids: Vec<u32> = ids.iter().filter_map(|&i| u32::try_from(i).ok()).collect();
        self.tokenizer.decode(&ids, false).unwrap_or_default()
    }

    /// A token's entry in the vocabulary (`Ġworld`, not ` world`), as transformers'
    /// `convert_ids_to_tokens` gives it; empty for an id the tokenizer lacks.
    pub fn token_piece(&self, id: i64) -> String {
        u32::try_from(id).ok().and_then(|id| self.tokenizer.id_to_token(id)).unwrap_or_default()
    }

    /// One token's own text (special tokens included), for logprobs.
    pub fn token_text(&self, id: i64) -> String {
        let Ok(id) = u32::try_from(id) else { return String::new() };
        self.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    /// The tokenizer as its `tokenizer.json` value (for structured outputs); `Null` if it
    /// cannot be written out.
    pub fn tokenizer_json(&self) -> Value {
        self.tokenizer.to_string(false).ok().and_then(|s| serde_json::from_str(&s).ok()).unwrap_or(Value::Null)
    }

    /// Replaces the chat template with the one in `path` (`--chat-template`), keeping the
    /// special tokens the model's own was given.
    pub fn replace_template(&mut self, path: &Path) -> Result<(), CliError> {
        let source = read_text(path, MAX_CONFIG_BYTES)?
            .ok_or_else(|| CliError::Args(format!("--chat-template: {}: no such file", path.display())))?;
        let specials = self.template.as_ref().map(|t| t.specials().clone()).unwrap_or_else(|| self.specials.clone());
        self.template = Some(
            ChatTemplate::new(source, specials)
                .map_err(|e| CliError::Args(format!("--chat-template: {}: {e}", path.display())))?,
        );
        Ok(())
    }

    /// The chat template, if the model has one.
    pub fn template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }
}

/// Reads a regular file of at most `limit` bytes; `None` if it does not exist.
fn read_text(path: &Path, limit: u64) -> Result<Option<String>, CliError> {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(CliError::Model(format!("{}: {e}", path.display()))),
    };
    if !meta.is_file() {
        return Err(CliError::Model(format!("{}: not a regular file", path.display())));
    }
    if meta.len() > limit {
        return Err(CliError::Model(format!("{}: {} bytes, over the limit of {limit}", path.display(), meta.len())));
    }
    std::fs::read_to_string(path).map(Some).map_err(|e| CliError::Model(format!("{}: {e}", path.display())))
}

/// `chat_template` of a tokenizer config: a string, or a list of `{name, template}` (the one
/// named `default`, else the first).
fn template_from_config(config: &Value) -> Result<Option<String>, String> {
    match config.get("chat_template") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(list)) => {
            let named = |want: Option<&str>| {
                list.iter().find(|t| want.is_none_or(|w| t.get("name").and_then(Value::as_str) == Some(w)))
            };
            let entry = named(Some("default")).or_else(|| named(None));
            match entry.and_then(|t| t.get("template")).and_then(Value::as_str) {
                Some(s) => Ok(Some(s.to_string())),
                None => Err("chat_template is a list without a {name, template} entry".into()),
            }
        }
        Some(_) => Err("chat_template is neither a string nor a list of named templates".into()),
    }
}

/// The special tokens transformers passes to templates (`bos_token`, `eos_token`, `unk_token`,
/// `pad_token`), each a string or an added-token object with `content`.
fn special_tokens(config: &Value) -> BTreeMap<String, String> {
    ["bos_token", "eos_token", "unk_token", "pad_token"]
        .into_iter()
        .filter_map(|k| {
            let v = config.get(k)?;
            let s = v.as_str().or_else(|| v.get("content").and_then(Value::as_str))?;
            Some((k.to_string(), s.to_string()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn template_forms() {
        assert_eq!(template_from_config(&json!({"chat_template": "a"})).unwrap().as_deref(), Some("a"));
        let list =
            json!({"chat_template": [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]});
        assert_eq!(template_from_config(&list).unwrap().as_deref(), Some("d"));
        let first = json!({"chat_template": [{"name": "rag", "template": "r"}]});
        assert_eq!(template_from_config(&first).unwrap().as_deref(), Some("r"));
        assert_eq!(template_from_config(&json!({})).unwrap(), None);
        assert!(template_from_config(&json!({"chat_template": 3})).is_err());
        assert!(template_from_config(&json!({"chat_template": [{"name": "x"}]})).is_err());
    }

    #[test]
    fn special_token_forms() {
        let cfg = json!({"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": false}, "pad_token": null});
        let got = special_tokens(&cfg);
        assert_eq!(got.get("bos_token").map(String::as_str), Some("<s>"));
        assert_eq!(got.get("eos_token").map(String::as_str), Some("</s>"));
        assert!(!got.contains_key("pad_token"));
    }
}
