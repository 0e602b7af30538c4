//! Structured outputs: OpenAI's `response_format` (`json_object`, `json_schema`) and vLLM's
//! `structured_outputs` (`json`, `regex`, `choice`, `grammar` in Lark, `json_object`), enforced
//! with llguidance.
//!
//! A request's constraint is compiled once (a schema llguidance cannot compile is a 400 naming
//! the keyword) and each choice gets its own matcher. The engine asks the matcher for the ids
//! allowed next while the step's forward pass runs, on rank 0, and every rank applies its own
//! columns of that mask, so sampling stays exact and vocab-parallel; ids past the tokenizer's
//! vocabulary are never allowed. A constrained answer that finished (`stop`) always parses and
//! validates; only `max_tokens` (`length`) cuts one short.

mod vocab;

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::reasoning::ReasoningParser;
use llguidance::api::{GrammarWithLexer, TopLevelGrammar};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use std::sync::Arc;
use std::time::Instant;
use tp_engine::api::TokenConstraint;

/// What a request constrains its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum Spec {
    /// JSON valid under this schema (`{"type": "object"}` for `json_object`).
    Json(Value),
    /// Text matching this regular expression (Rust's syntax), whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// Text of this Lark grammar (llguidance's dialect).
    Lark(String),
}

/// A constraint as the request gave it: the spec and the field that carried it (for errors).
#[derive(Debug, Clone, PartialEq)]
pub struct Constraint {
    /// What to enforce.
    pub spec: Spec,
    /// `response_format` or `structured_outputs`.
    pub field: &'static str,
}

/// The compiler of constraints for the served model's tokenizer, built once at start-up.
pub struct Grammars {
    factory: Result<ParserFactory, String>,
}

impl Grammars {
    /// The compiler for a tokenizer (its `tokenizer.json` value) over a model of `vocab_size`
    /// ids ending with `eos`. A tokenizer llguidance cannot read leaves structured outputs off
    /// (requests asking for them get a 400 saying why); nothing else is affected.
    pub fn new(tokenizer_json: &Value, vocab_size: usize, eos: &[i64]) -> Grammars {
        let built = std::panic::catch_unwind(|| {
            let env = vocab::tok_env(tokenizer_json, vocab_size, eos)?;
            let mut f = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
            f.quiet();
            Ok(f)
        });
        let factory = built.unwrap_or_else(|_| Err("reading the tokenizer's tokens failed".into()));
        if let Err(e) = &factory {
            tracing::warn!("structured outputs are unavailable: {e}");
        }
        Grammars { factory }
    }

    /// Compiles `c` into a matcher at its start; with a `reasoning` format the constraint
    /// applies once the reasoning ends (`</think>`), the reasoning itself free. Errors are 400s
    /// naming `c.field`: a schema with a keyword llguidance does not implement, an
    /// unsatisfiable schema, a bad regex or grammar.
    pub fn compile(&self, c: &Constraint, reasoning: Option<ReasoningParser>) -> Result<Matcher, ApiError> {
        let factory = self.factory.as_ref().map_err(|e| {
            ApiError::invalid(c.field, format!("structured outputs are unavailable for this model's tokenizer: {e}"))
        })?;
        let mut answer = match &c.spec {
            Spec::Json(schema) => GrammarWithLexer::from_json_schema(schema.clone()),
            Spec::Regex(rx) => GrammarWithLexer::from_regex(rx),
            Spec::Choice(list) => GrammarWithLexer::from_regex(&choice_regex(list)),
            Spec::Lark(g) => GrammarWithLexer::from_lark(g.clone()),
        };
        // Free text up to and including `</think>`, then the constraint.
        let think = "think[suffix=\"</think>\"]: /(?s:.*)/";
        let start = match reasoning {
            None => None,
            Some(ReasoningParser::DeepSeekR1) => Some(format!("start: \"<think>\"? think @answer\n{think}")),
            Some(ReasoningParser::Qwen3) => Some(format!("start: \"<think>\" think @answer | @answer\n{think}")),
            // gpt-oss's harmony headers are special tokens: the constraint holds from the first
            // token (no analysis message), and header-less text is read as the answer.
            Some(ReasoningParser::GptOss) => None,
        };
        let grammar = match start {
            None => TopLevelGrammar::from_grammar(answer),
            Some(start) => {
                answer.name = Some("answer".into());
                let mut main = GrammarWithLexer::from_lark(start);
                main.name = Some("main".into());
                TopLevelGrammar { grammars: vec![main, answer], max_tokens: None }
            }
        };
        let compiled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| factory.create_parser(grammar)))
            .map_err(|_| ApiError::invalid(c.field, format!("`{}`: the constraint could not be compiled", c.field)))?;
        let parser = compiled.map_err(|e| ApiError::invalid(c.field, format!("`{}`: {e}", c.field)))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(ApiError::invalid(c.field, format!("`{}`: {e}", c.field)));
        }
        Ok(matcher)
    }
}

/// A regex matching exactly one of `list` (each escaped).
fn choice_regex(list: &[String]) -> String {
    let escaped: Vec<String> = list
        .iter()
        .map(|s| {
            s.chars()
                .map(|ch| {
                    if ch.is_ascii() && !ch.is_ascii_alphanumeric() {
                        format!("\\x{:02x}", ch as u32)
                    } else {
                        ch.to_string()
                    }
                })
                .collect()
        })
        .collect();
    format!("({})", escaped.join("|"))
}

/// One choice's constraint, as the engine drives it: llguidance's matcher and where its mask
/// time is recorded.
pub struct GrammarConstraint {
    matcher: Matcher,
    metrics: Arc<Metrics>,
}

impl GrammarConstraint {
    /// Drives `matcher`, recording each mask's time in `metrics`.
    pub fn new(matcher: Matcher, metrics: Arc<Metrics>) -> GrammarConstraint {
        GrammarConstraint { matcher, metrics }
    }
}

impl TokenConstraint for GrammarConstraint {
    fn fill_mask(&mut self, mask: &mut [u64]) -> Result<(), String> {
        let started = Instant::now();
        let allowed = self.matcher.compute_mask().map_err(|e| e.to_string())?;
        // llguidance's words are 32 bits wide; two make one of the engine's.
        for (i, &w) in allowed.as_slice().iter().enumerate() {
            if let Some(m) = mask.get_mut(i / 2) {
                *m |= u64::from(w) << (32 * (i % 2));
            }
        }
        self.metrics.observe_mask(started.elapsed().as_secs_f64());
        Ok(())
    }

    fn advance(&mut self, token: i64) -> Result<(), String> {
        let t = u32::try_from(token).map_err(|_| format!("token {token} is not an id"))?;
        self.matcher.consume_token(t).map_err(|e| e.to_string())
    }

    fn is_finished(&self) -> bool {
        self.matcher.is_stopped() && !self.matcher.is_error()
    }
}

/// Reads the request's `response_format` and vLLM's `structured_outputs` (at most one of them
/// may constrain). `None`: free text.
pub fn parse(body: &serde_json::Map<String, Value>) -> Result<Option<Constraint>, ApiError> {
    let rf = match body.get("response_format").filter(|v| !v.is_null()) {
        None => None,
        Some(v) => response_format(v)?,
    };
    let so = match body.get("structured_outputs").filter(|v| !v.is_null()) {
        None => None,
        Some(v) => structured_outputs(v)?,
    };
    match (rf, so) {
        (Some(_), Some(_)) => Err(ApiError::invalid(
            "structured_outputs",
            "`structured_outputs` and a constraining `response_format` cannot be given together",
        )),
        (a, b) => Ok(a.or(b)),
    }
}

fn bad(field: &'static str, what: impl Into<String>) -> ApiError {
    ApiError::invalid(field, format!("`{field}`: {}", what.into()))
}

/// OpenAI's `response_format`.
fn response_format(v: &Value) -> Result<Option<Constraint>, ApiError> {
    const F: &str = "response_format";
    let o = v.as_object().ok_or_else(|| bad(F, "must be an object with a `type`"))?;
    let json = |schema: Value| Ok(Some(Constraint { spec: Spec::Json(schema), field: F }));
    match o.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => json(serde_json::json!({"type": "object"})),
        Some("json_schema") => {
            let js = o
                .get("json_schema")
                .and_then(Value::as_object)
                .ok_or_else(|| bad(F, "`json_schema` must be an object with `name` and `schema`"))?;
            match js.get("name") {
                Some(Value::String(n)) if !n.is_empty() && n.len() <= 64 => {}
                _ => return Err(bad(F, "`json_schema.name` must be a string of 1 to 64 characters")),
            }
            if js.get("strict").is_some_and(|s| !s.is_boolean() && !s.is_null()) {
                return Err(bad(F, "`json_schema.strict` must be true or false"));
            }
            match js.get("schema") {
                None | Some(Value::Null) => json(serde_json::json!({})),
                Some(s @ (Value::Object(_) | Value::Bool(_))) => json(s.clone()),
                Some(_) => Err(bad(F, "`json_schema.schema` must be a JSON schema object")),
            }
        }
        Some(t) => Err(bad(F, format!("unknown type `{t}` (expected text, json_object or json_schema)"))),
        None => Err(bad(F, "`type` must be a string")),
    }
}

/// vLLM's `structured_outputs`: exactly one of `json`, `regex`, `choice`, `grammar`,
/// `json_object`.
fn structured_outputs(v: &Value) -> Result<Option<Constraint>, ApiError> {
    const F: &str = "structured_outputs";
    let o = v.as_object().ok_or_else(|| bad(F, "must be an object"))?;
    let mut found = Vec::new();
    let compact = match o.get("disable_any_whitespace") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad(F, "`disable_any_whitespace` must be true or false")),
    };
    for (k, val) in o {
        if val.is_null() || val == &Value::Bool(false) {
            continue;
        }
        let spec = match k.as_str() {
            "json" => match val {
                Value::String(s) => {
                    Spec::Json(serde_json::from_str(s).map_err(|e| bad(F, format!("`json` is not valid JSON: {e}")))?)
                }
                Value::Object(_) | Value::Bool(true) => Spec::Json(val.clone()),
                _ => return Err(bad(F, "`json` must be a JSON schema")),
            },
            "json_object" => Spec::Json(serde_json::json!({"type": "object"})),
            "regex" => Spec::Regex(val.as_str().ok_or_else(|| bad(F, "`regex` must be a string"))?.to_string()),
            "grammar" => Spec::Lark(val.as_str().ok_or_else(|| bad(F, "`grammar` must be a string"))?.to_string()),
            "choice" => {
                let list = val
                    .as_array()
                    .filter(|a| !a.is_empty())
                    .ok_or_else(|| bad(F, "`choice` must be a non-empty list of strings"))?;
                Spec::Choice(
                    list.iter()
                        .map(|c| {
                            c.as_str().map(str::to_string).ok_or_else(|| bad(F, "`choice` must be a list of strings"))
                        })
                        .collect::<Result<_, _>>()?,
                )
            }
            "disable_any_whitespace" => continue,
            other => {
                return Err(bad(
                    F,
                    format!("unknown key `{other}` (expected json, regex, choice, grammar or json_object)"),
                ));
            }
        };
        found.push(spec);
    }
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop().map(|spec| {
            let spec = match spec {
                // llguidance's own option: JSON with no whitespace between tokens.
                Spec::Json(Value::Object(mut schema)) if compact => {
                    schema.insert("x-guidance".into(), serde_json::json!({"whitespace_flexible": false}));
                    Spec::Json(Value::Object(schema))
                }
                other => other,
            };
            Constraint { spec, field: F }
        })),
        _ => Err(bad(F, "give exactly one of json, regex, choice, grammar and json_object")),
    }
}
