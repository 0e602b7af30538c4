//! `--speculative-config` over HTTP: the same answers as the server without it (greedy and
//! seeded, n > 1, streamed) at TP 1, 2 and 3, drafted and accepted tokens in /metrics, and a bad
//! configuration refused at start.

mod common;

use common::{Server, model_dir};
use serde_json::{Value, json};

const SPEC: &str =
    r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}"#;

fn answers(s: &Server) -> Vec<Value> {
    // Text that repeats, so the drafts find n-grams; a chat; several seeded choices.
    let prompt = "abcabcabcabcabcabcabc abcabcabc";
    let bodies = [
        json!({"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": true}),
        json!({"prompt": prompt, "max_tokens": 24, "n": 3, "seed": 4, "temperature": 0.9, "ignore_eos": true,
            "logprobs": 2}),
        json!({"prompt": [1, 2, 1, 2, 1, 2, 1, 2], "max_tokens": 16, "seed": 1, "ignore_eos": true,
            "frequency_penalty": 0.4}),
    ];
    let mut out = Vec::new();
    for b in bodies {
        let (st, v) = s.post("/v1/completions", &b);
        assert_eq!(st, 200, "{v}");
        out.push(v["choices"].clone());
    }
    let (_, c) = s.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "xyxyxyxyxyxy"}],
        "max_tokens": 20, "seed": 2}),
    );
    out.push(json!(c["choices"][0]["message"]["content"]));
    out
}

#[test]
fn speculation_serves_the_same_answers() {
    for tp in ["1", "2", "3"] {
        let plain = answers(&Server::start(&["-tp", tp, "--batch-invariant"]));
        let s = Server::start(&["-tp", tp, "--batch-invariant", "--speculative-config", SPEC]);
        let spec = answers(&s);
        // Logprobs included: the verifying pass's logits are bitwise a decode's.
        assert_eq!(plain, spec, "tp {tp}");
        let drafted = s.metric("tp_spec_decode_num_draft_tokens_total{");
        let accepted = s.metric("tp_spec_decode_num_accepted_tokens_total{");
        assert!(
            drafted > 0.0 && accepted > 0.0 && accepted <= drafted,
            "tp {tp}: {drafted} drafted, {accepted} accepted"
        );
    }
}

#[test]
fn a_bad_speculative_config_stops_the_start() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tp"))
        .arg("serve")
        .arg(model_dir())
        .args(["--port", "0", "--speculative-config", r#"{"method": "medusa", "num_speculative_tokens": 2}"#])
        .output()
        .expect("run tp");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--speculative-config") && err.contains("medusa"), "{err}");
}
