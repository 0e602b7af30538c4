//! Typed reading of a JSON object's fields (`config.json`, `generation_config.json` and their
//! nested objects), naming the field in every error, and how a value from the file is shown in
//! one: escaped and cut to [`SHOWN_CHARS`] characters.

use crate::error::{ModelError, Result};
use serde_json::{Map, Value};

/// Longest value shown in an error, in characters.
pub const SHOWN_CHARS: usize = 200;

/// `s` with its control characters escaped (`\u{1b}`, `\n`, ...) and cut to [`SHOWN_CHARS`]
/// characters.
pub(crate) fn shown(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars().take(SHOWN_CHARS) {
        if c.is_control() {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    if s.chars().nth(SHOWN_CHARS).is_some() {
        out.push_str(&format!("… ({} bytes)", s.len()));
    }
    out
}

/// A JSON value as it is shown in an error: its JSON text (strings quoted, control characters
/// escaped), cut.
pub(crate) fn shown_value(v: &Value) -> String {
    shown(&v.to_string())
}

/// Typed access to one JSON object's fields, naming the field in every error.
pub(crate) struct Fields<'a> {
    pub(crate) map: &'a Map<String, Value>,
    pub(crate) prefix: String,
}

impl Fields<'_> {
    pub(crate) fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// The field, treating JSON `null` as absent.
    pub(crate) fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    pub(crate) fn bad(&self, key: &str, why: impl Into<String>) -> ModelError {
        ModelError::ConfigField { field: self.name(key), why: why.into() }
    }

    /// A positive integer field (or `default` when absent and a default exists).
    pub(crate) fn count(&self, key: &str, default: Option<usize>) -> Result<usize> {
        match self.get(key) {
            None => default.ok_or_else(|| self.bad(key, "is missing")),
            Some(v) => {
                let bad = || self.bad(key, format!("must be a positive integer, got {}", shown_value(v)));
                match v.as_u64().map(usize::try_from) {
                    Some(Ok(n)) if n > 0 => Ok(n),
                    _ => Err(bad()),
                }
            }
        }
    }

    /// A finite number field.
    pub(crate) fn number(&self, key: &str, default: Option<f64>) -> Result<f64> {
        match self.get(key) {
            None => default.ok_or_else(|| self.bad(key, "is missing")),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() => Ok(x),
                _ => Err(self.bad(key, format!("must be a finite number, got {}", shown_value(v)))),
            },
        }
    }

    /// A finite, positive number field.
    pub(crate) fn positive(&self, key: &str, default: Option<f64>) -> Result<f64> {
        let v = self.number(key, default)?;
        if v > 0.0 { Ok(v) } else { Err(self.bad(key, format!("must be positive, got {v}"))) }
    }

    pub(crate) fn flag(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => {
                v.as_bool().ok_or_else(|| self.bad(key, format!("must be true or false, got {}", shown_value(v))))
            }
        }
    }

    pub(crate) fn string(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => {
                v.as_str().map(Some).ok_or_else(|| self.bad(key, format!("must be a string, got {}", shown_value(v))))
            }
        }
    }
}
