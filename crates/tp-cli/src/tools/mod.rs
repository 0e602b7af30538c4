//! Tool calling: the request's `tools`, `tool_choice` and `parallel_tool_calls`, the grammars
//! that enforce `"required"` and a named function ([`forced`]: in the model's own call format
//! where it is known, else vLLM's JSON form), and the parsers that find calls in free output
//! ([`parse`]: Hermes/Qwen `<tool_call>{...}</tool_call>`, Llama 3 JSON, Mistral
//! `[TOOL_CALLS]`), chosen from the chat template or `--tool-call-parser`.

pub(crate) mod call;
pub mod forced;
pub mod stream;

pub use call::Call;

use crate::error::ApiError;
use crate::template::python_json;
use serde_json::{Map, Value, json};

/// One function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    /// Its name (`[A-Za-z0-9_-]{1,64}`).
    pub name: String,
    /// The JSON schema of its arguments (`{"type": "object", "properties": {}}` when absent).
    pub parameters: Value,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    /// Never call: output is content (the tools still reach the template, as vLLM does).
    None,
    /// The model decides; calls are parsed out of its output.
    Auto,
    /// At least one call, enforced.
    Required,
    /// Exactly one call of this function, enforced.
    Named(String),
}

/// A chat request's tools.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    /// The tools as the request gave them (what the template gets).
    pub raw: Value,
    /// Each tool's name and parameters.
    pub list: Vec<Tool>,
    /// What the model must do with them.
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (default true): false allows one call at most (a forced choice
    /// writes exactly one; free output keeps its first, as vLLM does).
    pub parallel: bool,
}

/// How the model writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolParser {
    /// Hermes and Qwen: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
    Hermes,
    /// Llama 3.1+: a JSON object `{"name": ..., "parameters": {...}}` (after `<|python_tag|>`),
    /// several separated by `;`.
    Llama3Json,
    /// Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`, or `[TOOL_CALLS]name[ARGS]{...}`.
    Mistral,
    /// gpt-oss (OpenAI's harmony): a `commentary` message `to=functions.NAME` whose body is the
    /// arguments, ended by `<|call|>` (`harmony.rs`).
    Harmony,
}

impl ToolParser {
    /// vLLM's name for `--tool-call-parser`.
    pub fn from_name(name: &str) -> Option<ToolParser> {
        match name {
            "hermes" | "qwen" | "qwen2_5" => Some(ToolParser::Hermes),
            "llama3_json" | "llama4_json" => Some(ToolParser::Llama3Json),
            "mistral" => Some(ToolParser::Mistral),
            "openai" => Some(ToolParser::Harmony),
            _ => None,
        }
    }

    /// The parser a chat template's own text implies, if any.
    pub fn from_template(source: &str) -> Option<ToolParser> {
        if is_harmony_template(source) {
            Some(ToolParser::Harmony)
        } else if source.contains("<tool_call>") {
            Some(ToolParser::Hermes)
        } else if source.contains("[TOOL_CALLS]") {
            Some(ToolParser::Mistral)
        } else if source.contains("<|python_tag|>") || (source.contains("ipython") && source.contains("parameters")) {
            Some(ToolParser::Llama3Json)
        } else {
            None
        }
    }

    /// The text that opens a call in this format (what streaming holds back on).
    pub fn marker(self) -> &'static str {
        match self {
            ToolParser::Hermes => "<tool_call>",
            ToolParser::Llama3Json => "{",
            ToolParser::Mistral => "[TOOL_CALLS]",
            ToolParser::Harmony => "<|channel|>",
        }
    }

    /// The syntax a forced call is written in: the parser's own, or vLLM's JSON where its
    /// format is made of special tokens a grammar of text cannot force (harmony's headers).
    pub fn forced_syntax(self) -> forced::CallSyntax {
        match self {
            ToolParser::Harmony => forced::CallSyntax::Vllm,
            p => forced::CallSyntax::Parser(p),
        }
    }
}

/// Whether a chat template writes OpenAI's harmony format (gpt-oss's): its output is then read
/// by `harmony.rs` (reasoning, content and calls), as vLLM reads gpt-oss's.
pub fn is_harmony_template(source: &str) -> bool {
    source.contains("<|channel|>") && source.contains("<|message|>")
}

/// The output of one choice, split: content (if any) and calls.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Parsed {
    /// Text outside the calls (`None` when there is none).
    pub content: Option<String>,
    /// The calls, in order.
    pub calls: Vec<Call>,
}

fn bad_tools(what: impl Into<String>) -> ApiError {
    ApiError::invalid("tools", format!("`tools`: {}", what.into()))
}

/// Reads `tools` and `tool_choice` (`None` when the request has no tools and no choice).
pub fn parse_request(body: &Map<String, Value>) -> Result<Option<Tools>, ApiError> {
    let raw = body.get("tools").filter(|v| !v.is_null());
    let choice = body.get("tool_choice").filter(|v| !v.is_null());
    let list = match raw {
        None => Vec::new(),
        Some(Value::Array(a)) => a.iter().enumerate().map(|(i, t)| tool(i, t)).collect::<Result<Vec<_>, _>>()?,
        Some(_) => return Err(bad_tools("must be a list of {\"type\": \"function\", \"function\": {...}}")),
    };
    for (i, t) in list.iter().enumerate() {
        if list[..i].iter().any(|u| u.name == t.name) {
            return Err(bad_tools(format!("two tools are named `{}`", t.name)));
        }
    }
    let choice = match choice {
        None if list.is_empty() => ToolChoice::None,
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("`tool_choice` `{other}` is not none, auto, required or a named function"),
                ));
            }
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| o.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tool_choice",
                        "a named `tool_choice` is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            ToolChoice::Named(name.to_string())
        }
        Some(_) => return Err(ApiError::invalid("tool_choice", "`tool_choice` must be a string or an object")),
    };
    match &choice {
        ToolChoice::Required if list.is_empty() => {
            return Err(ApiError::invalid("tool_choice", "`tool_choice` \"required\" needs `tools`"));
        }
        ToolChoice::Named(n) if !list.iter().any(|t| &t.name == n) => {
            return Err(ApiError::invalid(
                "tool_choice",
                format!("`tool_choice` names `{n}`, which is not in `tools`"),
            ));
        }
        _ => {}
    }
    let parallel = match body.get("parallel_tool_calls") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid("parallel_tool_calls", "`parallel_tool_calls` must be true or false"));
        }
    };
    if raw.is_none() && choice == ToolChoice::None {
        return Ok(None);
    }
    Ok(Some(Tools { raw: raw.cloned().unwrap_or(Value::Array(Vec::new())), list, choice, parallel }))
}

/// One entry of `tools`.
fn tool(i: usize, t: &Value) -> Result<Tool, ApiError> {
    let at = |what: &str| bad_tools(format!("tools[{i}]: {what}"));
    if t.get("type").and_then(Value::as_str) != Some("function") {
        return Err(at("`type` must be \"function\""));
    }
    let f = t.get("function").and_then(Value::as_object).ok_or_else(|| at("`function` must be an object"))?;
    let name = f.get("name").and_then(Value::as_str).ok_or_else(|| at("`function.name` must be a string"))?;
    if name.is_empty() || name.len() > 64 || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return Err(at("`function.name` must be 1 to 64 of a-z, A-Z, 0-9, _ and -"));
    }
    if f.get("description").is_some_and(|d| !d.is_string() && !d.is_null()) {
        return Err(at("`function.description` must be a string"));
    }
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => return Err(at("`function.parameters` must be a JSON schema object")),
    };
    Ok(Tool { name: name.to_string(), parameters })
}

/// A `{"name", <args key>}` object as a call.
fn call_of(v: &Value, keys: &[&str]) -> Option<Call> {
    let name = v.get("name")?.as_str()?.to_string();
    let args = keys.iter().find_map(|k| v.get(*k)).cloned().unwrap_or_else(|| json!({}));
    let arguments = match args {
        Value::String(s) => s,
        other => python_json(&other, None),
    };
    Some(Call { name, arguments })
}

/// The calls in free output written in `parser`'s format. Output that holds no well-formed
/// call is all content.
pub fn parse(parser: ToolParser, text: &str) -> Parsed {
    let all_content = || Parsed { content: (!text.is_empty()).then(|| text.to_string()), calls: Vec::new() };
    match parser {
        ToolParser::Harmony => {
            let h = crate::harmony::parse(text, true);
            Parsed { content: (!h.content.is_empty()).then_some(h.content), calls: h.calls }
        }
        ToolParser::Hermes => {
            let Some(first) = text.find("<tool_call>") else { return all_content() };
            let mut calls = Vec::new();
            let mut rest = &text[first..];
            while let Some(start) = rest.find("<tool_call>") {
                let body = &rest[start + "<tool_call>".len()..];
                let (inner, after) = match body.find("</tool_call>") {
                    Some(end) => (&body[..end], &body[end + "</tool_call>".len()..]),
                    None => (body, ""),
                };
                let Some(call) = serde_json::from_str::<Value>(inner.trim())
                    .ok()
                    .and_then(|v| call_of(&v, &["arguments", "parameters"]))
                else {
                    return all_content();
                };
                calls.push(call);
                rest = after;
            }
            let content = &text[..first];
            Parsed { content: (!content.is_empty()).then(|| content.to_string()), calls }
        }
        ToolParser::Llama3Json => {
            let body = text.trim_start().strip_prefix("<|python_tag|>").unwrap_or(text.trim_start());
            if !body.starts_with('{') {
                return all_content();
            }
            // One or more objects, separated by `;` (and whitespace).
            let mut calls = Vec::new();
            let mut rest = body;
            while !rest.is_empty() {
                let mut items = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
                let Some(Ok(v)) = items.next() else { return all_content() };
                let Some(call) = call_of(&v, &["parameters", "arguments"]) else { return all_content() };
                calls.push(call);
                rest = rest[items.byte_offset()..].trim_start();
                rest = rest.strip_prefix(';').unwrap_or(rest).trim_start();
            }
            Parsed { content: None, calls }
        }
        ToolParser::Mistral => {
            let Some(at) = text.find("[TOOL_CALLS]") else { return all_content() };
            let body = text[at + "[TOOL_CALLS]".len()..].trim();
            let content = &text[..at];
            let content = (!content.trim().is_empty()).then(|| content.to_string());
            if let Ok(Value::Array(list)) = serde_json::from_str::<Value>(body) {
                if let Some(calls) =
                    list.iter().map(|c| call_of(c, &["arguments", "parameters"])).collect::<Option<Vec<_>>>()
                {
                    return Parsed { content, calls };
                }
                return all_content();
            }
            // The v11 form: name[ARGS]{...}, repeated after further [TOOL_CALLS].
            let mut calls = Vec::new();
            for part in body.split("[TOOL_CALLS]") {
                let Some((name, args)) = part.split_once("[ARGS]") else { return all_content() };
                let Ok(args) = serde_json::from_str::<Value>(args.trim()) else { return all_content() };
                calls.push(Call { name: name.trim().to_string(), arguments: python_json(&args, None) });
            }
            Parsed { content, calls }
        }
    }
}

/// A fresh tool-call id (`chatcmpl-tool-` and 32 hex digits, as vLLM makes them).
pub fn call_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let mut rng = tp_core::rng::SplitMix64::new(nanos ^ n.rotate_left(32) ^ u64::from(std::process::id()));
    format!("chatcmpl-tool-{:016x}{:016x}", rng.next_u64(), rng.next_u64())
}

/// `message.tool_calls` of `calls`, each with a fresh id.
pub fn tool_calls_json(calls: &[Call]) -> Value {
    calls
        .iter()
        .map(|c| json!({"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hermes_calls_and_content() {
        let p = parse(
            ToolParser::Hermes,
            "Let me check.\n<tool_call>\n{\"name\": \"get\", \"arguments\": {\"city\": \"Oslo\", \"n\": [1,2]}}\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
        );
        assert_eq!(p.content.as_deref(), Some("Let me check.\n"));
        assert_eq!(
            p.calls,
            vec![
                Call { name: "get".into(), arguments: "{\"city\": \"Oslo\", \"n\": [1, 2]}".into() },
                Call { name: "f".into(), arguments: "{}".into() }
            ]
        );
        // Unterminated last call (cut by a stop id): still a call, as vLLM reads it.
        assert_eq!(parse(ToolParser::Hermes, "<tool_call>{\"name\": \"g\", \"arguments\": {\"a\": 1}}").calls.len(), 1);
        // Not JSON: all content.
        let bad = parse(ToolParser::Hermes, "x <tool_call>{oops</tool_call>");
        assert_eq!((bad.content.as_deref(), bad.calls.len()), (Some("x <tool_call>{oops</tool_call>"), 0));
        assert_eq!(parse(ToolParser::Hermes, "plain").content.as_deref(), Some("plain"));
    }

    #[test]
    fn llama3_and_mistral_forms() {
        let l = parse(ToolParser::Llama3Json, "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"x\": \"é\"}}");
        assert_eq!(l.calls, vec![Call { name: "f".into(), arguments: "{\"x\": \"é\"}".into() }]);
        assert_eq!(
            parse(
                ToolParser::Llama3Json,
                "{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {}}"
            )
            .calls
            .len(),
            2
        );
        assert_eq!(parse(ToolParser::Llama3Json, "Hello {there}").calls.len(), 0);
        let m = parse(
            ToolParser::Mistral,
            "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": 1}}, {\"name\": \"g\", \"arguments\": {}}]",
        );
        assert_eq!(m.calls.len(), 2);
        assert_eq!(m.content, None);
        let v11 = parse(ToolParser::Mistral, "[TOOL_CALLS]get[ARGS]{\"q\": true}");
        assert_eq!(v11.calls, vec![Call { name: "get".into(), arguments: "{\"q\": true}".into() }]);
    }

    #[test]
    fn requests_are_checked() {
        let t = |v: Value| parse_request(v.as_object().unwrap());
        let f = json!([{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]);
        assert_eq!(t(json!({"tools": f})).unwrap().unwrap().choice, ToolChoice::Auto);
        assert_eq!(t(json!({})).unwrap(), None);
        let named =
            t(json!({"tools": f, "tool_choice": {"type": "function", "function": {"name": "get"}}})).unwrap().unwrap();
        assert_eq!((named.choice, named.parallel), (ToolChoice::Named("get".into()), true));
        assert!(!t(json!({"tools": f, "parallel_tool_calls": false})).unwrap().unwrap().parallel);
        for (body, param) in [
            (json!({"tools": {}}), "tools"),
            (json!({"tools": [{"type": "function"}]}), "tools"),
            (json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}), "tools"),
            (json!({"tools": [{"type": "function", "function": {"name": "a", "parameters": 3}}]}), "tools"),
            (json!({"tools": [f[0], f[0]]}), "tools"),
            (json!({"tools": f, "tool_choice": "maybe"}), "tool_choice"),
            (json!({"tools": f, "tool_choice": {"type": "function", "function": {"name": "nope"}}}), "tool_choice"),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (json!({"tools": f, "parallel_tool_calls": "no"}), "parallel_tool_calls"),
        ] {
            assert_eq!(t(body.clone()).unwrap_err().param.as_deref(), Some(param), "{body}");
        }
    }
}
