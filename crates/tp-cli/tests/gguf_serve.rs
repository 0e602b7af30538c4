//! `tp serve FILE.gguf`: a GGUF file written by the `gguf` Python package
//! (`crates/tp-testing/gguf/write_gguf.py`) served at TP 2 on its quantized blocks, with the
//! tokenizer and chat template the file carries: greedy completions equal the library's own
//! greedy generation on the same file, and chat requests go through the file's template.
//! Needs python3 with `gguf` (`pip install gguf==0.19.0`; `cargo xtask test` installs it).

mod common;

use common::Server;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use tp_models::tp_comm::DeviceGroup;
use tp_models::tp_core::Device;
use tp_models::{GenerateOptions, ModelOptions, ParallelCausalLm};
use tp_testing::synthetic::SyntheticModel;

/// A tiny Llama written as a Q8_0 GGUF file with a SentencePiece-style vocabulary.
fn gguf_file() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tp-cli-gguf-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let hf = dir.join("hf");
    let spec = SyntheticModel {
        vocab_size: 600,
        hidden_size: 64,
        intermediate_size: 96,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        max_position_embeddings: 128,
        files: 1,
        eos_token_id: Some(2),
        ..SyntheticModel::tiny()
    };
    spec.write(&hf).expect("synthetic checkpoint");
    let file = dir.join("tiny-q8_0.gguf");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tp-testing/gguf/write_gguf.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(&hf)
        .arg(&file)
        .args(["--type", "Q8_0", "--tokenizer", "spm"])
        .output()
        .expect("python3 must be installed for the GGUF tests");
    assert!(
        out.status.success(),
        "write_gguf.py failed (pip install gguf==0.19.0): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    file
}

/// The library's greedy tokens on `file` at TP 2 (quantized blocks, as the server runs it).
fn library_greedy(file: &Path, prompt: &[i64], n: usize) -> Vec<i64> {
    let groups = DeviceGroup::local(2, Duration::from_secs(60), |_| Device::Cpu).expect("group");
    let outs: Vec<Vec<i64>> = std::thread::scope(|s| {
        let hs: Vec<_> = groups
            .into_iter()
            .map(|g| {
                s.spawn(move || {
                    let mut lm = ParallelCausalLm::load(file, &g, &ModelOptions::new()).expect("load");
                    lm.generate(prompt, n, &GenerateOptions::new().ignore_eos(true)).expect("generate").tokens
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    outs[0].clone()
}

#[test]
fn a_gguf_file_is_served_with_its_own_tokenizer_and_template() {
    let file = gguf_file();
    let s = Server::start_in(&file, &["--tensor-parallel-size", "2"], &[]);
    let model = file.display().to_string();

    // Greedy completion from ids: the library's tokens, decoded by the file's tokenizer.
    let prompt = [1i64, 300, 301, 77, 260];
    let want = library_greedy(&file, &prompt, 6);
    let body = json!({"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let (st, v) = s.post("/v1/completions", &body);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 6, "{v}");
    let tokenizer = tp_models::gguf::GgufModel::open(&file).expect("open").tokenizer().expect("tokenizer");
    // Decoded after the prompt, as a stream is (a SentencePiece word piece's `▁` is a space there).
    let ids = |t: &[i64]| -> Vec<u32> { t.iter().map(|&i| i as u32).collect() };
    let all: Vec<i64> = prompt.iter().chain(&want).copied().collect();
    let (head, whole) = (tokenizer.decode(&ids(&prompt), true).unwrap(), tokenizer.decode(&ids(&all), true).unwrap());
    let text = whole.strip_prefix(head.as_str()).expect("the prompt's text leads");
    assert_eq!(v["choices"][0]["text"], json!(text), "{v}");

    // Text prompts go through the file's tokenizer (BOS first, as the file asks).
    let enc = tokenizer.encode("ab ba", true).expect("encode");
    assert_eq!(enc.get_ids().first(), Some(&1), "the file's add_bos_token puts <s> first");
    let (st, v) = s.post("/v1/completions", &json!({"model": model, "prompt": "ab ba", "max_tokens": 2}));
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], enc.get_ids().len(), "{v}");

    // Chat: the file's template (`<role>content\n` ... `<assistant>`), rendered and encoded.
    let chat = json!({"model": model, "messages": [{"role": "user", "content": "ab"}], "max_tokens": 3});
    let (st, v) = s.post("/v1/chat/completions", &chat);
    assert_eq!(st, 200, "{v}");
    let rendered = tokenizer.encode("<user>ab\n<assistant>", false).expect("encode");
    assert_eq!(v["usage"]["prompt_tokens"], rendered.get_ids().len(), "{v}");
}
