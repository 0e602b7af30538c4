//! Tool calling and reasoning over HTTP on the real engine (a tiny random checkpoint): forced
//! calls (`"required"`, a named function) parse and validate, streamed calls equal the
//! non-streamed ones, tool round-trips reach the template, `--chat-template` and
//! `chat_template_kwargs` work, `--reasoning-parser` splits `<think>`, and bad tool requests are
//! 400s naming the field.

mod common;

use common::{EOT, Server, THINK_END, TOOL_CALLS, TOOLS_TEMPLATE, harmony_id, model_dir_with_len};
use serde_json::{Value, json};

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {},
            "additionalProperties": false}}}
    ])
}

fn server_with_template(args: &[&str]) -> Server {
    // The tools' JSON takes a few hundred byte-level tokens.
    let dir = model_dir_with_len(2048);
    let path = dir.join("tools.jinja");
    std::fs::write(&path, TOOLS_TEMPLATE).unwrap();
    let path = path.to_string_lossy().into_owned();
    let mut all = vec!["--chat-template", path.as_str()];
    all.extend_from_slice(args);
    Server::start_in(&dir, &all, &[])
}

fn valid_weather(args: &Value) -> bool {
    let o = args.as_object().unwrap();
    matches!(o.get("city").and_then(Value::as_str), Some("Oslo" | "Rome"))
        && o.get("days").and_then(Value::as_i64).is_some_and(|d| (1..=7).contains(&d))
        && o.len() == 2
}

/// The tool calls of a streamed chat, per choice: (name, concatenated arguments), and the
/// finish reasons.
fn streamed_calls(events: &[String], n: usize) -> (Vec<Vec<(String, String)>>, Vec<String>) {
    let mut calls = vec![Vec::<(String, String)>::new(); n];
    let mut reasons = vec![String::new(); n];
    for e in events.iter().filter(|e| *e != "[DONE]") {
        let c: Value = serde_json::from_str(e).unwrap();
        for ch in c["choices"].as_array().unwrap() {
            let i = ch["index"].as_u64().unwrap() as usize;
            for tc in ch["delta"]["tool_calls"].as_array().into_iter().flatten() {
                let k = tc["index"].as_u64().unwrap() as usize;
                if k == calls[i].len() {
                    assert!(tc["id"].as_str().unwrap().starts_with("chatcmpl-tool-"), "{tc}");
                    assert_eq!(tc["type"], "function");
                    calls[i].push((tc["function"]["name"].as_str().unwrap().to_string(), String::new()));
                }
                calls[i][k].1.push_str(tc["function"]["arguments"].as_str().unwrap_or(""));
            }
            if let Some(r) = ch["finish_reason"].as_str() {
                reasons[i] = r.to_string();
            }
        }
    }
    (calls, reasons)
}

fn message_calls(v: &Value, i: usize) -> Vec<(String, String)> {
    let m = &v["choices"][i]["message"];
    m["tool_calls"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|c| {
                    assert_eq!(c["type"], "function");
                    (
                        c["function"]["name"].as_str().unwrap().to_string(),
                        c["function"]["arguments"].as_str().unwrap().to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn forced_calls_parse_validate_and_stream_alike() {
    let s = server_with_template(&["-tp", "2"]);
    let user = json!([{"role": "user", "content": "Weather in Oslo?"}]);
    for choice in [json!({"type": "function", "function": {"name": "get_weather"}}), json!("required")] {
        let body = json!({"messages": user, "tools": tools(), "tool_choice": choice, "n": 3, "seed": 11,
            "max_tokens": 1000});
        let (st, v) = s.post("/v1/chat/completions", &body);
        assert_eq!(st, 200, "{v}");
        let mut whole = Vec::new();
        let mut called = 0;
        for i in 0..3 {
            let c = &v["choices"][i];
            let calls = message_calls(&v, i);
            if c["finish_reason"] == "length" {
                whole.push(calls);
                continue;
            }
            assert_eq!(c["finish_reason"], "tool_calls", "{c}");
            assert!(c["message"]["content"].is_null(), "{c}");
            assert!(!calls.is_empty(), "{c}");
            for (name, args) in &calls {
                let args: Value = serde_json::from_str(args).unwrap_or_else(|e| panic!("{args}: {e}"));
                match name.as_str() {
                    "get_weather" => assert!(valid_weather(&args), "{args}"),
                    "ping" => assert_eq!(args, json!({})),
                    other => panic!("unknown function {other}"),
                }
                if choice.is_object() {
                    assert_eq!(name, "get_weather");
                }
            }
            whole.push(calls);
            called += 1;
        }
        assert!(called >= 2, "{choice}: too few choices finished their calls: {v}");
        let mut stream = body.clone();
        stream["stream"] = json!(true);
        let (calls, reasons) = streamed_calls(&s.post_stream("/v1/chat/completions", &stream), 3);
        assert_eq!(calls, whole, "{choice}");
        for (i, r) in reasons.iter().enumerate() {
            assert_eq!(r, v["choices"][i]["finish_reason"].as_str().unwrap());
        }
    }
}

/// `--tool-call-parser hermes` on a model whose template names no format (SmolLM2's case): a
/// forced call is written as Hermes writes it, `<tool_call>\n{"name": .., "arguments": ..}\n
/// </tool_call>`, with `json.dumps`'s spacing and nothing else, so every answer closes with
/// `tool_calls` well inside 200 tokens, at temperature 0 and 0.7, whole and streamed alike
/// (free whitespace let them run to the limit inside the call).
#[test]
fn forced_calls_in_the_parsers_format_close_well_inside_the_limit() {
    forced_calls_close(&Server::start(&["--tool-call-parser", "hermes", "-tp", "2"]), true);
}

/// With no known format, vLLM's form (a JSON list of calls, or the named function's arguments),
/// laid out the same way, closes as well where one call is asked for. (With several allowed, a
/// random model may add calls to the list until the limit: only the list's `]` ends it, which no
/// bias toward the end token can reach, unlike a Hermes call followed by the end token.)
#[test]
fn forced_calls_in_vllms_form_close_well_inside_the_limit() {
    forced_calls_close(&Server::start(&["-tp", "3"]), false);
}

/// Forced calls of `s` (several allowed too where `several`) end with `tool_calls`.
fn forced_calls_close(s: &Server, several: bool) {
    let user = json!([{"role": "user", "content": "Weather in Oslo?"}]);
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    let cases = [(json!("required"), true), (json!("required"), false), (named, true)];
    for (choice, parallel) in cases.into_iter().filter(|(c, p)| several || !p || c.is_object()) {
        for temperature in [0.0, 0.7] {
            // A bias toward the end token stands in for a trained model's wish to stop after its
            // call (a random one may repeat calls); the grammar allows it only between calls.
            let body = json!({"messages": user, "tools": tools(), "tool_choice": choice, "n": 3, "seed": 7,
                "temperature": temperature, "max_tokens": 200, "parallel_tool_calls": parallel,
                "logit_bias": {EOT.to_string(): 6}});
            let at = format!("{choice} parallel {parallel} temperature {temperature}");
            let (st, v) = s.post("/v1/chat/completions", &body);
            assert_eq!(st, 200, "{v}");
            let mut whole = Vec::new();
            for i in 0..3 {
                let c = &v["choices"][i];
                assert_eq!(c["finish_reason"], "tool_calls", "{at}: {v}");
                assert!(c["message"]["content"].is_null(), "{at}: {c}");
                let calls = message_calls(&v, i);
                assert!(!calls.is_empty() && (parallel || calls.len() == 1), "{at}: {c}");
                for (name, args) in &calls {
                    let args: Value = serde_json::from_str(args).unwrap_or_else(|e| panic!("{at}: {args}: {e}"));
                    match name.as_str() {
                        "get_weather" => assert!(valid_weather(&args), "{at}: {args}"),
                        "ping" if !choice.is_object() => assert_eq!(args, json!({})),
                        other => panic!("{at}: unexpected function {other}"),
                    }
                }
                whole.push(calls);
            }
            let used = v["usage"]["completion_tokens"].as_u64().unwrap();
            assert!(used <= 3 * 150, "{at}: {used} tokens for 3 answers: {v}");
            let mut stream = body.clone();
            stream["stream"] = json!(true);
            let (calls, reasons) = streamed_calls(&s.post_stream("/v1/chat/completions", &stream), 3);
            assert_eq!(calls, whole, "{at}");
            assert!(reasons.iter().all(|r| r == "tool_calls"), "{at}: {reasons:?}");
        }
    }
}

#[test]
fn tool_round_trips_and_template_options_reach_the_prompt() {
    let s = server_with_template(&[]);
    let conversation = json!([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\",\"days\":2}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    ]);
    let (st, t) = s.post(
        "/tokenize",
        &json!({"messages": conversation, "tools": tools(),
        "chat_template_kwargs": {"enable_thinking": false}}),
    );
    assert_eq!(st, 200, "{t}");
    let (_, d) = s.post("/detokenize", &json!({"tokens": t["tokens"]}));
    let text = d["prompt"].as_str().unwrap();
    // transformers renders the tool and the call's arguments with json.dumps.
    assert!(
        text.contains(r#"{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city""#),
        "{text}"
    );
    assert!(
        text.contains(
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"days\": 2}}\n</tool_call>"
        ),
        "{text}"
    );
    assert!(text.contains("<tool_response>\nsunny\n</tool_response>"), "{text}");
    assert!(text.ends_with("<|start_header_id|>assistant\n<think>\n\n</think>\n\n"), "{text}");
    // The round trip generates (tool_choice auto: the template names <tool_call>, so hermes).
    let (st, v) = s.post(
        "/v1/chat/completions",
        &json!({"messages": conversation, "tools": tools(),
        "max_tokens": 5, "seed": 1}),
    );
    assert_eq!(st, 200, "{v}");
    assert!(["stop", "length", "tool_calls"].contains(&v["choices"][0]["finish_reason"].as_str().unwrap()));
    for (body, param) in [
        (json!({"messages": [{"role": "tool", "tool_call_id": "nope", "content": "x"}]}), "messages[0]"),
        (
            json!({"messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "a", "type": "function",
            "function": {"name": "f", "arguments": "{not json"}}]}]}),
            "messages[0]",
        ),
        (json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}), "tools"),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "tools": tools(), "tool_choice": {"type": "function",
            "function": {"name": "missing"}}}),
            "tool_choice",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "tools": tools(), "tool_choice": "required",
            "response_format": {"type": "json_object"}}),
            "tool_choice",
        ),
        (json!({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": 3}), "chat_template_kwargs"),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "tools": tools(), "parallel_tool_calls": 1}),
            "parallel_tool_calls",
        ),
    ] {
        let (st, v) = s.post("/v1/chat/completions", &body);
        assert_eq!((st, v["error"]["param"].as_str()), (400, Some(param)), "{body} -> {v}");
    }
}

#[test]
fn auto_tool_choice_needs_a_known_format() {
    // The folder's own Llama-3-style template names no tool format.
    let s = Server::start(&[]);
    let body = json!({"messages": [{"role": "user", "content": "x"}], "tools": tools(), "max_tokens": 3});
    let (st, v) = s.post("/v1/chat/completions", &body);
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("tool_choice")), "{v}");
    // tool_choice none needs no format; --tool-call-parser names one.
    let mut none = body.clone();
    none["tool_choice"] = json!("none");
    assert_eq!(s.post("/v1/chat/completions", &none).0, 200);
    let s = Server::start(&["--tool-call-parser", "hermes"]);
    assert_eq!(s.post("/v1/chat/completions", &body).0, 200);
}

#[test]
fn reasoning_is_split_and_constraints_start_after_it() {
    let s = Server::start(&["--reasoning-parser", "deepseek_r1"]);
    // A strong bias on `</think>` ends the reasoning at once; the regex holds after it (the
    // mask then forbids `</think>` whatever its bias).
    let body = json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 30, "seed": 2,
        "logit_bias": {THINK_END.to_string(): 100}, "structured_outputs": {"regex": "[ab]{2,5}c"}});
    let (st, v) = s.post("/v1/chat/completions", &body);
    assert_eq!(st, 200, "{v}");
    let m = &v["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], "", "{v}");
    let content = m["content"].as_str().unwrap();
    assert!(
        content.ends_with('c')
            && content.len() >= 3
            && content[..content.len() - 1].bytes().all(|b| b == b'a' || b == b'b'),
        "{v}"
    );
    // A milder bias lets some reasoning through first; streamed deltas equal the whole answer.
    let mut body = body;
    body["logit_bias"] = json!({THINK_END.to_string(): 4});
    body["max_tokens"] = json!(60);
    body["n"] = json!(3);
    let (_, v) = s.post("/v1/chat/completions", &body);
    body["stream"] = json!(true);
    let events = s.post_stream("/v1/chat/completions", &body);
    let mut parts = vec![(String::new(), String::new()); 3];
    for e in events.iter().filter(|e| *e != "[DONE]") {
        let c: Value = serde_json::from_str(e).unwrap();
        for ch in c["choices"].as_array().unwrap() {
            let i = ch["index"].as_u64().unwrap() as usize;
            parts[i].0.push_str(ch["delta"]["reasoning_content"].as_str().unwrap_or(""));
            parts[i].1.push_str(ch["delta"]["content"].as_str().unwrap_or(""));
        }
    }
    for (i, (r, c)) in parts.iter().enumerate() {
        let m = &v["choices"][i]["message"];
        assert_eq!(r.as_str(), m["reasoning_content"].as_str().unwrap_or(""), "{v}");
        assert_eq!(c.as_str(), m["content"].as_str().unwrap_or(""), "{v}");
        assert!(!r.contains("</think>"));
        if v["choices"][i]["finish_reason"] == "stop" {
            assert!(c.ends_with('c'), "{v}");
        }
    }
}

/// A harmony chat template (gpt-oss's format): its output is read as vLLM reads gpt-oss's, with
/// no flag. A grammar of special tokens makes the tiny model write harmony messages: the
/// analysis channel becomes `reasoning_content`, the final channel `content`, a commentary
/// message to `functions.get_weather` a tool call; streamed deltas add up to the whole answer.
#[test]
fn harmony_messages_split_into_reasoning_content_and_calls() {
    const HARMONY_TEMPLATE: &str = "{% for m in messages %}<|start|>{{ m['role'] }}\
        {% if m['role'] == 'assistant' %}<|channel|>final{% endif %}<|message|>{{ m['content'] }}<|end|>\
        {% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}";
    let dir = model_dir_with_len(2048);
    let path = dir.join("harmony.jinja");
    std::fs::write(&path, HARMONY_TEMPLATE).unwrap();
    let s = Server::start_in(&dir, &["--chat-template", path.to_str().unwrap()], &[]);
    let t = |name: &str| format!("<[{}]>", harmony_id(name));
    let answer = format!(
        "start: {} \"analysis\" {} \"Think a bit.\" {} {} \"assistant\" {} \"final\" {} \"It is sunny.\" {}",
        t("<|channel|>"),
        t("<|message|>"),
        t("<|end|>"),
        t("<|start|>"),
        t("<|channel|>"),
        t("<|message|>"),
        t("<|return|>")
    );
    let call = format!(
        "start: {} \"analysis\" {} \"Use the tool.\" {} {} \"assistant\" {} \"commentary to=functions.get_weather \" \
         {} \"json\" {} \"{{\\\"city\\\":\\\"Oslo\\\",\\\"days\\\":2}}\" {}",
        t("<|channel|>"),
        t("<|message|>"),
        t("<|end|>"),
        t("<|start|>"),
        t("<|channel|>"),
        t("<|constrain|>"),
        t("<|message|>"),
        t("<|call|>")
    );
    for (grammar, reasoning, content, calls) in [
        (answer, "Think a bit.", Some("It is sunny."), vec![]),
        (
            call,
            "Use the tool.",
            None,
            vec![("get_weather".to_string(), "{\"city\": \"Oslo\", \"days\": 2}".to_string())],
        ),
    ] {
        let mut body = json!({"messages": [{"role": "user", "content": "Weather?"}], "tools": tools(),
            "max_tokens": 200, "temperature": 0, "structured_outputs": {"grammar": grammar}});
        let (st, v) = s.post("/v1/chat/completions", &body);
        assert_eq!(st, 200, "{v}");
        let m = &v["choices"][0]["message"];
        assert_eq!(m["reasoning_content"], reasoning, "{v}");
        assert_eq!(m["content"].as_str(), content, "{v}");
        assert_eq!(message_calls(&v, 0), calls, "{v}");
        let want_reason = if calls.is_empty() { "stop" } else { "tool_calls" };
        assert_eq!(v["choices"][0]["finish_reason"], want_reason, "{v}");
        body["stream"] = json!(true);
        let events = s.post_stream("/v1/chat/completions", &body);
        let (mut r, mut c) = (String::new(), String::new());
        for e in events.iter().filter(|e| *e != "[DONE]") {
            let chunk: Value = serde_json::from_str(e).unwrap();
            for ch in chunk["choices"].as_array().unwrap() {
                r.push_str(ch["delta"]["reasoning_content"].as_str().unwrap_or(""));
                c.push_str(ch["delta"]["content"].as_str().unwrap_or(""));
            }
        }
        assert_eq!((r.as_str(), c.as_str()), (reasoning, content.unwrap_or("")), "{events:?}");
        assert_eq!(streamed_calls(&events, 1).0[0], calls, "{events:?}");
    }
}

#[test]
fn the_mistral_parser_reads_its_special_marker() {
    // A bias makes the model write `[TOOL_CALLS]` (a special token) and nothing that parses
    // after it: the answer is content, and the marker is in it only where the parser reads
    // special tokens (Mistral's), as vLLM keeps them for that parser.
    let body = json!({"messages": [{"role": "user", "content": "x"}], "tools": tools(), "max_tokens": 3,
        "temperature": 0, "logit_bias": {TOOL_CALLS.to_string(): 100}});
    for (parser, kept) in [("mistral", true), ("hermes", false)] {
        let s = server_with_template(&["--tool-call-parser", parser]);
        let (st, v) = s.post("/v1/chat/completions", &body);
        assert_eq!(st, 200, "{v}");
        let content = v["choices"][0]["message"]["content"].as_str().unwrap_or("");
        assert_eq!(content.contains("[TOOL_CALLS]"), kept, "{parser}: {v}");
        assert!(v["choices"][0]["message"]["tool_calls"].is_null(), "{v}");
    }
}

#[test]
fn a_missing_chat_template_file_stops_the_start() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tp"))
        .arg("serve")
        .arg(common::model_dir())
        .args(["--port", "0", "--chat-template", "/nonexistent/template.jinja"])
        .output()
        .expect("run tp");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--chat-template") && err.contains("/nonexistent/template.jinja"), "{err}");
}
