//! The official `openai` Python package against `tp serve` (tests/openai_client.py, and
//! tests/openai_features.py with `jsonschema` and `tokenizers` as references). Fails, never
//! skips, when python3 or a package is missing: `cargo xtask test` installs them (pinned).

mod common;

use common::{Server, TOOLS_TEMPLATE, model_dir, model_dir_with_len};
use std::process::Command;

/// Panics unless python3 can import every module of `modules`.
fn require_python(modules: &str) {
    let probe = Command::new("python3").args(["-c", &format!("import {modules}")]).output();
    match probe {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "python3 cannot import {modules} (cargo xtask test installs them; or pip install them): {}",
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => panic!("python3 is not installed or cannot run ({e}); this test needs python3 with {modules}"),
    }
}

/// Runs tests/openai_features.py with `args`; panics with its output unless it passes.
fn features(args: &[&str]) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_features.py");
    let out = Command::new("python3").arg(script).args(args).output().expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the openai feature checks failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("all checks passed"), "{stdout}");
}

#[test]
fn structured_outputs_tools_and_tokenize_through_the_openai_client() {
    require_python("openai, jsonschema, tokenizers, httpx");
    // The schemas' answers take a few hundred byte-level tokens.
    let dir = model_dir_with_len(2048);
    let template = dir.join("tools.jinja");
    std::fs::write(&template, TOOLS_TEMPLATE).expect("template");
    let template = template.to_string_lossy().into_owned();
    let s = Server::start_in(&dir, &["--served-model-name", "tiny", "--chat-template", &template, "-tp", "2"], &[]);
    let base = format!("http://{}/v1", s.addr);
    let tokenizer = dir.join("tokenizer.json");
    features(&["structured", &base, "tiny", &tokenizer.to_string_lossy()]);
}

#[test]
fn speculative_decoding_answers_as_without_it_through_the_openai_client() {
    require_python("openai, jsonschema, tokenizers, httpx");
    let spec = r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}"#;
    for tp in ["1", "2", "3"] {
        let dir = model_dir();
        let plain = Server::start_in(&dir, &["--served-model-name", "tiny", "-tp", tp, "--batch-invariant"], &[]);
        let args = ["--served-model-name", "tiny", "-tp", tp, "--batch-invariant", "--speculative-config", spec];
        let fast = Server::start_in(&dir, &args, &[]);
        features(&["same", &format!("http://{}/v1", plain.addr), &format!("http://{}/v1", fast.addr), "tiny"]);
    }
}

#[test]
fn the_openai_python_client_works_against_tp_serve() {
    require_python("openai");
    let s = Server::start_in(&model_dir(), &["--served-model-name", "tiny", "--api-key", "k3y"], &[]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let base = format!("http://{}/v1", s.addr);
    let out = Command::new("python3").args([script, &base, "tiny", "k3y"]).output().expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the openai client checks failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("all checks passed"), "{stdout}");
}
