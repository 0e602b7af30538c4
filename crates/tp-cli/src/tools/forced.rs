//! Forced tool calls (`tool_choice: "required"` or a named function): the grammar that makes the
//! model write them, and the calls read back from what it wrote.
//!
//! Where the model's format is known (`--tool-call-parser`, or its chat template's), the calls
//! are forced in that format, the one the model was trained to write (as SGLang's structural
//! tags do), and read back by the same parser as `"auto"` output:
//!
//! * Hermes: `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, several separated
//!   by `\n`;
//! * Llama 3 JSON: `{"name": "f", "parameters": {...}}`, several separated by `; `;
//! * Mistral: `[TOOL_CALLS]` (its special token where the tokenizer has one) and
//!   `[{"name": "f", "arguments": {...}}, ...]`.
//!
//! Otherwise vLLM's form: a JSON list of `{"name", "parameters"}` for `"required"`, the named
//! function's arguments alone for a named one. In every form the JSON is written as Python's
//! `json.dumps` writes it (`", "` and `": "`, no other whitespace, llguidance's JSON options):
//! what chat templates render calls with (`tojson`), and an answer only the schema's own
//! freedom can lengthen (free whitespace let a model pad a call until `max_tokens`). A named
//! function, or `parallel_tool_calls: false`, allows exactly one call; `"required"` one or more.

use super::{Call, ToolChoice, ToolParser, Tools, call_of, parse};
use crate::structured::Spec;
use serde_json::{Value, json};

/// How forced calls are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallSyntax {
    /// vLLM's: a JSON list of `{"name", "parameters"}`, or a named function's arguments alone.
    Vllm,
    /// The parser's own format.
    Parser(ToolParser),
}

/// `schema` with llguidance's JSON options set to Python's `json.dumps` layout: `", "` between
/// items, `": "` after keys, no whitespace anywhere else.
fn dumps_layout(schema: &Value) -> Value {
    let mut s = schema.clone();
    if let Value::Object(o) = &mut s {
        o.insert(
            "x-guidance".into(),
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    s
}

/// The functions a forced choice may call: the named one, or all of them.
fn callable(tools: &Tools) -> Vec<&super::Tool> {
    match &tools.choice {
        ToolChoice::Named(n) => tools.list.iter().filter(|t| &t.name == n).collect(),
        _ => tools.list.iter().collect(),
    }
}

/// Whether the choice allows exactly one call.
fn one_call(tools: &Tools) -> bool {
    matches!(tools.choice, ToolChoice::Named(_)) || !tools.parallel
}

/// The constraint that forces `tools.choice` in `syntax` (`None` for `none` and `auto`).
/// `marker` is the id of Mistral's `[TOOL_CALLS]` special token, where the tokenizer has one
/// (the text is forced otherwise).
pub fn grammar(tools: &Tools, syntax: CallSyntax, marker: Option<u32>) -> Option<Spec> {
    if matches!(tools.choice, ToolChoice::None | ToolChoice::Auto) {
        return None;
    }
    let fns = callable(tools);
    if fns.is_empty() {
        return None;
    }
    let p = match syntax {
        CallSyntax::Vllm => return Some(Spec::Json(vllm_schema(tools, &fns))),
        CallSyntax::Parser(p) => p,
    };
    // `(text before the name, the arguments' key, text after the arguments, separator)`.
    let (open, key, close, sep) = match p {
        ToolParser::Hermes => ("<tool_call>\n{\"name\": \"", "arguments", "}\n</tool_call>", "\n"),
        ToolParser::Llama3Json => ("{\"name\": \"", "parameters", "}", "; "),
        ToolParser::Mistral => ("{\"name\": \"", "arguments", "}", ", "),
        // Harmony's headers are special tokens: forced calls take vLLM's JSON form.
        ToolParser::Harmony => return Some(Spec::Json(vllm_schema(tools, &fns))),
    };
    // Lark's string literals are JSON strings.
    let lit = |s: &str| Value::String(s.to_string()).to_string();
    let alternatives: Vec<String> = fns
        .iter()
        .map(|t| {
            let head = format!("{open}{}\", \"{key}\": ", t.name);
            format!("{} %json {} {}", lit(&head), dumps_layout(&t.parameters), lit(close))
        })
        .collect();
    let calls = if one_call(tools) { "call".to_string() } else { format!("call ({} call)*", lit(sep)) };
    let start = match p {
        ToolParser::Mistral => {
            let marker = marker.map_or_else(|| lit("[TOOL_CALLS]"), |id| format!("<[{id}]>"));
            format!("{marker} \"[\" {calls} \"]\"")
        }
        _ => calls,
    };
    Some(Spec::Lark(format!("start: {start}\ncall: {}\n", alternatives.join("\n    | "))))
}

/// vLLM's schema: the named function's arguments, or a list of one or more (exactly one without
/// parallel calls) `{"name", "parameters"}` objects of the tools.
fn vllm_schema(tools: &Tools, fns: &[&super::Tool]) -> Value {
    if let ToolChoice::Named(_) = tools.choice {
        return dumps_layout(&fns[0].parameters);
    }
    let each: Vec<Value> = fns
        .iter()
        .map(|t| {
            json!({"type": "object", "properties": {"name": {"type": "string", "enum": [t.name]},
                "parameters": t.parameters}, "required": ["name", "parameters"]})
        })
        .collect();
    let mut list = json!({"type": "array", "minItems": 1, "items": {"anyOf": each}});
    if one_call(tools) {
        list["maxItems"] = json!(1);
    }
    dumps_layout(&list)
}

/// The calls of an output written under a forced `choice` in `syntax`; `None` if it holds no
/// whole call (a `length` cut). vLLM's named form is the arguments as written; its list form
/// gives each call's arguments as Python's `json.dumps` writes them, as the parsers do.
pub fn parse_forced(choice: &ToolChoice, syntax: CallSyntax, text: &str) -> Option<Vec<Call>> {
    match (syntax, choice) {
        (_, ToolChoice::None | ToolChoice::Auto) => None,
        (CallSyntax::Vllm, ToolChoice::Named(name)) => {
            serde_json::from_str::<Value>(text).ok()?;
            Some(vec![Call { name: name.clone(), arguments: text.to_string() }])
        }
        (CallSyntax::Vllm, ToolChoice::Required) => {
            let list: Vec<Value> = serde_json::from_str(text).ok()?;
            list.iter().map(|c| call_of(c, &["parameters", "arguments"])).collect()
        }
        (CallSyntax::Parser(p), _) => {
            let parsed = parse(p, text);
            let named_ok = match choice {
                ToolChoice::Named(n) => parsed.calls.iter().all(|c| &c.name == n),
                _ => true,
            };
            (!parsed.calls.is_empty() && parsed.content.is_none() && named_ok).then_some(parsed.calls)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(choice: ToolChoice, parallel: bool) -> Tools {
        let list = vec![
            super::super::Tool {
                name: "get".into(),
                parameters: json!({"type": "object", "properties": {"city": {"enum": ["Oslo"]}}, "required": ["city"]}),
            },
            super::super::Tool { name: "f".into(), parameters: json!({"type": "object", "properties": {}}) },
        ];
        Tools { raw: json!([]), list, choice, parallel }
    }

    #[test]
    fn grammars_write_each_format() {
        let Some(Spec::Lark(g)) =
            grammar(&tools(ToolChoice::Required, true), CallSyntax::Parser(ToolParser::Hermes), None)
        else {
            panic!("a lark grammar")
        };
        assert!(g.starts_with("start: call (\"\\n\" call)*\n"), "{g}");
        assert!(g.contains(r#""<tool_call>\n{\"name\": \"get\", \"arguments\": " %json {"#), "{g}");
        assert!(g.contains(r#""}\n</tool_call>""#) && g.contains("\"key_separator\":\": \""), "{g}");
        // A named function: one alternative, one call.
        let Some(Spec::Lark(g)) =
            grammar(&tools(ToolChoice::Named("f".into()), true), CallSyntax::Parser(ToolParser::Llama3Json), None)
        else {
            panic!("a lark grammar")
        };
        assert!(g.starts_with("start: call\ncall: \"{\\\"name\\\": \\\"f\\\", \\\"parameters\\\": \" %json"), "{g}");
        assert!(!g.contains("get"), "{g}");
        // Mistral: its special token by id, a JSON list; no parallel calls: one.
        let Some(Spec::Lark(g)) =
            grammar(&tools(ToolChoice::Required, false), CallSyntax::Parser(ToolParser::Mistral), Some(266))
        else {
            panic!("a lark grammar")
        };
        assert!(g.starts_with("start: <[266]> \"[\" call \"]\"\n"), "{g}");
        // vLLM's form: bounded layout, one item without parallel calls.
        let Some(Spec::Json(s)) = grammar(&tools(ToolChoice::Required, false), CallSyntax::Vllm, None) else {
            panic!("a schema")
        };
        assert_eq!((s["maxItems"].clone(), s["x-guidance"]["whitespace_flexible"].clone()), (json!(1), json!(false)));
        assert_eq!(grammar(&tools(ToolChoice::Auto, true), CallSyntax::Parser(ToolParser::Hermes), None), None);
    }

    #[test]
    fn forced_outputs_parse_into_calls() {
        let vllm = CallSyntax::Vllm;
        let named = parse_forced(&ToolChoice::Named("f".into()), vllm, "{\"a\":1}").unwrap();
        assert_eq!(named, vec![Call { name: "f".into(), arguments: "{\"a\":1}".into() }]);
        let req = parse_forced(&ToolChoice::Required, vllm, "[{\"name\": \"g\", \"parameters\": {\"b\": [true]}}]");
        assert_eq!(req.unwrap(), vec![Call { name: "g".into(), arguments: "{\"b\": [true]}".into() }]);
        assert_eq!(parse_forced(&ToolChoice::Required, vllm, "[{\"name\": \"g\""), None);
        let hermes = CallSyntax::Parser(ToolParser::Hermes);
        let text = "<tool_call>\n{\"name\": \"get\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
        let calls = parse_forced(&ToolChoice::Required, hermes, text).unwrap();
        assert_eq!(calls.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["get", "f"]);
        assert_eq!(calls[0].arguments, "{\"city\": \"Oslo\"}");
        // A cut call, and a call of another function than the named one, are no calls.
        assert_eq!(parse_forced(&ToolChoice::Required, hermes, "<tool_call>\n{\"name\": \"get\", \"argu"), None);
        assert_eq!(parse_forced(&ToolChoice::Named("f".into()), hermes, text), None);
        let mistral = CallSyntax::Parser(ToolParser::Mistral);
        let m = parse_forced(&ToolChoice::Required, mistral, "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}}]");
        assert_eq!(m.unwrap(), vec![Call { name: "f".into(), arguments: "{}".into() }]);
    }
}
