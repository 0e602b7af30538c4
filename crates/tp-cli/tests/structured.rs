//! Structured outputs over HTTP on the real engine (a tiny random checkpoint whose vocabulary of
//! 1001 ids is larger than its tokenizer's 267, so an unmasked draw would mostly land past it):
//! every finished answer matches its regex, choice, grammar or schema, at n > 1, streamed or
//! not, vocab-parallel at TP 2 and 3 and with two pipeline stages equal to TP 1; bad constraints are 400s naming the field.

mod common;

use common::Server;
use serde_json::{Value, json};

fn texts(v: &Value) -> Vec<(String, String)> {
    v["choices"]
        .as_array()
        .unwrap_or_else(|| panic!("no choices in {v}"))
        .iter()
        .map(|c| {
            let text = c["text"].as_str().or_else(|| c["message"]["content"].as_str()).unwrap_or_default();
            (text.to_string(), c["finish_reason"].as_str().unwrap_or_default().to_string())
        })
        .collect()
}

/// Whether `s` is exactly `[ab]{2,5}c`.
fn ab_c(s: &str) -> bool {
    let Some(body) = s.strip_suffix('c') else { return false };
    (2..=5).contains(&body.len()) && body.chars().all(|c| c == 'a' || c == 'b')
}

#[test]
fn regex_choice_and_grammar_hold_for_every_choice_and_tp_degree() {
    let mut answers = Vec::new();
    for args in [&["-tp", "1"][..], &["-tp", "2"], &["-tp", "3"], &["-tp", "2", "-pp", "2"]] {
        let tp = args.join(" ");
        let s = Server::start(args);
        let (st, v) = s.post(
            "/v1/completions",
            &json!({"prompt": "x", "n": 4, "seed": 5, "max_tokens": 20, "structured_outputs": {"regex": "[ab]{2,5}c"}}),
        );
        assert_eq!(st, 200, "{v}");
        for (t, r) in texts(&v) {
            assert!(ab_c(&t), "tp {tp}: {t:?} does not match");
            assert_eq!(r, "stop", "tp {tp}: {t:?}");
        }
        let (_, c) = s.post(
            "/v1/completions",
            &json!({"prompt": "pick", "n": 6, "temperature": 1.5, "max_tokens": 30,
                "structured_outputs": {"choice": ["red", "gr(ee)n?", "blue sky", "{x}"]}}),
        );
        for (t, r) in texts(&c) {
            assert!(["red", "gr(ee)n?", "blue sky", "{x}"].contains(&t.as_str()), "tp {tp}: choice {t:?}");
            assert_eq!(r, "stop");
        }
        let grammar = "start: item (\",\" item)*\nitem: \"a\" | \"bb\" | NUM\nNUM: /[0-9]{1,2}/";
        let (st, g) = s.post(
            "/v1/completions",
            &json!({"prompt": "g", "n": 3, "seed": 1, "max_tokens": 12, "structured_outputs": {"grammar": grammar}}),
        );
        assert_eq!(st, 200, "{g}");
        for (t, r) in texts(&g) {
            let ok = t.split(',').all(|i| {
                i == "a" || i == "bb" || (!i.is_empty() && i.len() <= 2 && i.bytes().all(|b| b.is_ascii_digit()))
            });
            // A grammar that never has to end may be cut by max_tokens; then only a prefix holds.
            if r == "stop" {
                assert!(ok, "tp {tp}: grammar output {t:?}");
            } else {
                assert_eq!(r, "length");
            }
        }
        answers.push((texts(&v), texts(&c)));
    }
    // Seeded sampling under a mask is the same at every TP degree and with pipeline stages.
    for a in &answers[1..] {
        assert_eq!(&answers[0], a);
    }
}

/// The schema's answer, checked by hand: `{"name": one of two, "age": 0..=99, "tags": 1-3 of
/// "x"/"y"}` with nothing else.
fn valid_person(v: &Value) -> bool {
    let Some(o) = v.as_object() else { return false };
    let name_ok = matches!(o.get("name").and_then(Value::as_str), Some("ann" | "bob"));
    let age_ok = o.get("age").and_then(Value::as_i64).is_some_and(|a| (0..=99).contains(&a));
    let tags_ok = o
        .get("tags")
        .and_then(Value::as_array)
        .is_some_and(|t| (1..=3).contains(&t.len()) && t.iter().all(|x| matches!(x.as_str(), Some("x" | "y"))));
    name_ok && age_ok && tags_ok && o.len() == 3
}

const PERSON: &str = r#"{"type": "object", "properties": {
    "name": {"enum": ["ann", "bob"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": false}"#;

#[test]
fn json_schema_answers_parse_and_validate_streamed_or_not() {
    let s = Server::start(&[]);
    let schema: Value = serde_json::from_str(PERSON).unwrap();
    let body = json!({"messages": [{"role": "user", "content": "who?"}], "n": 4, "seed": 3, "max_tokens": 120,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": true}},
        "structured_outputs": null});
    let (st, v) = s.post("/v1/chat/completions", &body);
    assert_eq!(st, 200, "{v}");
    let whole = texts(&v);
    let mut stopped = 0;
    for (t, r) in &whole {
        if r == "stop" {
            let parsed: Value = serde_json::from_str(t).unwrap_or_else(|e| panic!("{t:?} is not JSON: {e}"));
            assert!(valid_person(&parsed), "{t:?} does not validate");
            stopped += 1;
        } else {
            assert_eq!(r, "length", "{t:?}");
        }
    }
    assert!(stopped >= 2, "too few answers finished: {whole:?}");
    // Streamed: the same answers, piece by piece.
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let events = s.post_stream("/v1/chat/completions", &stream_body);
    let mut got = vec![(String::new(), String::new()); 4];
    for e in events.iter().filter(|e| *e != "[DONE]") {
        let c: Value = serde_json::from_str(e).unwrap();
        for ch in c["choices"].as_array().unwrap() {
            let i = ch["index"].as_u64().unwrap() as usize;
            got[i].0.push_str(ch["delta"]["content"].as_str().unwrap_or(""));
            if let Some(r) = ch["finish_reason"].as_str() {
                got[i].1 = r.to_string();
            }
        }
    }
    assert_eq!(got, whole);
    // json_object: any JSON object.
    let (_, o) = s.post(
        "/v1/completions",
        &json!({"prompt": "{", "n": 3, "seed": 9, "max_tokens": 60, "response_format": {"type": "json_object"}}),
    );
    for (t, r) in texts(&o) {
        if r == "stop" {
            let parsed: Value = serde_json::from_str(&t).unwrap_or_else(|e| panic!("{t:?}: {e}"));
            assert!(parsed.is_object(), "{t:?}");
        }
    }
    // Free text is unchanged by the feature: a plain greedy request still reaches ids past 266.
    let (_, free) = s.post(
        "/v1/completions",
        &json!({"prompt": [1, 2], "max_tokens": 8, "temperature": 0,
        "ignore_eos": true, "response_format": {"type": "text"}}),
    );
    assert_eq!(texts(&free).len(), 1);
}

#[test]
fn bad_constraints_are_400s_naming_the_field_and_spare_the_batch() {
    let s = Server::start(&[]);
    let bad = [
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "p",
            "schema": {"type": "object", "if": {"type": "object"}}}}}),
            "response_format",
            "if",
        ),
        (json!({"response_format": {"type": "xml"}}), "response_format", "xml"),
        (json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}), "response_format", "name"),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "p",
            "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}}),
            "response_format",
            "",
        ),
        (json!({"structured_outputs": {"regex": "(unclosed"}}), "structured_outputs", ""),
        (json!({"structured_outputs": {"grammar": "start: undefined_rule"}}), "structured_outputs", ""),
        (json!({"structured_outputs": {"choice": []}}), "structured_outputs", "choice"),
        (json!({"structured_outputs": {"regex": "a", "choice": ["a"]}}), "structured_outputs", "exactly one"),
        (json!({"structured_outputs": {"jsonn": {}}}), "structured_outputs", "jsonn"),
        (
            json!({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}),
            "structured_outputs",
            "together",
        ),
    ];
    for (extra, param, word) in bad {
        let mut body = json!({"prompt": "x", "max_tokens": 4});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (st, v) = s.post("/v1/completions", &body);
        assert_eq!(st, 400, "{body} -> {v}");
        assert_eq!(v["error"]["param"], param, "{body} -> {v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(word), "{body} -> {v}");
    }
    // The server still serves, constrained and not.
    let (st, v) = s.post(
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 10, "seed": 2, "structured_outputs": {"regex": "[ab]{2,5}c"}}),
    );
    assert_eq!(st, 200, "{v}");
    assert!(ab_c(&texts(&v)[0].0), "{v}");
}
