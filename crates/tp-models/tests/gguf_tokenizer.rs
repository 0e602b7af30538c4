//! `tp_models::gguf_tokenizer` against transformers: the golden fixtures in
//! `tests/data/gguf_tokenizer/*.json` hold GGUF tokenizer metadata (synthetic vocabularies of
//! `tp-testing/gguf/write_gguf.py` and vocabularies trained there) with the ids and texts
//! transformers' `AutoTokenizer.from_pretrained(dir, gguf_file=...)` gives for a fixed list of
//! texts; `make_fixtures.py` beside them wrote them (its docstring says how). Every id and every
//! decoded text must be equal.
//!
//! `TP_GGUF_TOKENIZER_FIXTURES=DIR` checks the fixtures of another folder instead, e.g. ones
//! made from real GGUF files with `make_fixtures.py --gguf FILE --out DIR/NAME.json`.

use serde_json::Value;
use std::path::PathBuf;
use tp_models::ModelError;
use tp_models::gguf_tokenizer::{GgufVocab, tokenizer_from_gguf};

/// The committed fixtures (each must be present, so that the test cannot pass on none).
const COMMITTED: [&str; 8] =
    ["bpe_gpt2", "bpe_llama3", "bpe_qwen2", "bpe_synthetic", "spm_gemma3", "spm_phi3", "spm_synthetic", "spm_trained"];

fn fixture_dir() -> (PathBuf, bool) {
    match std::env::var_os("TP_GGUF_TOKENIZER_FIXTURES") {
        Some(d) => (PathBuf::from(d), false),
        None => (PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/gguf_tokenizer"), true),
    }
}

fn strings(v: &Value) -> Option<Vec<String>> {
    v.as_array().map(|a| a.iter().map(|s| s.as_str().unwrap_or_default().to_string()).collect())
}

fn id(v: &Value) -> Option<u32> {
    v.as_u64().map(|x| u32::try_from(x).expect("id fits u32"))
}

/// The fixture's `vocab` object as the struct tp fills from a GGUF file.
fn vocab(v: &Value) -> GgufVocab {
    GgufVocab {
        model: v["model"].as_str().expect("model").to_string(),
        pre: v["pre"].as_str().map(str::to_string),
        tokens: strings(&v["tokens"]).expect("tokens"),
        scores: v["scores"].as_array().map(|a| a.iter().map(|x| x.as_f64().expect("score") as f32).collect()),
        token_types: v["token_types"]
            .as_array()
            .map(|a| a.iter().map(|x| i32::try_from(x.as_i64().expect("type")).expect("i32")).collect()),
        merges: strings(&v["merges"]),
        bos: id(&v["bos"]),
        eos: id(&v["eos"]),
        unk: id(&v["unk"]),
        pad: id(&v["pad"]),
        add_bos: v["add_bos"].as_bool(),
        add_eos: v["add_eos"].as_bool(),
        add_space_prefix: v["add_space_prefix"].as_bool(),
        architecture: v["architecture"].as_str().map(str::to_string),
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("ids").iter().map(|x| id(x).expect("id")).collect()
}

/// Compares one fixture; returns (cases, mismatch descriptions).
fn check(path: &std::path::Path) -> (usize, Vec<String>) {
    let text = std::fs::read_to_string(path).expect("fixture readable");
    let fx: Value = serde_json::from_str(&text).expect("fixture is JSON");
    let name = fx["name"].as_str().unwrap_or("?").to_string();
    let tok = tokenizer_from_gguf(&vocab(&fx["vocab"])).unwrap_or_else(|e| panic!("{name}: {e}"));
    let cases = fx["cases"].as_array().expect("cases");
    let mut bad = Vec::new();
    for c in cases {
        let input = c["text"].as_str().expect("text");
        let with = tok.encode(input, true).expect("encode").get_ids().to_vec();
        let plain = tok.encode(input, false).expect("encode").get_ids().to_vec();
        let want = ids(&c["ids"]);
        let decoded = tok.decode(&want, false).expect("decode");
        let skipped = tok.decode(&want, true).expect("decode");
        let pairs = [
            ("ids", format!("{with:?}"), format!("{want:?}")),
            ("ids_plain", format!("{plain:?}"), format!("{:?}", ids(&c["ids_plain"]))),
            ("decoded", format!("{decoded:?}"), format!("{:?}", c["decoded"].as_str().expect("decoded"))),
            ("decoded_skip", format!("{skipped:?}"), format!("{:?}", c["decoded_skip"].as_str().expect("skip"))),
        ];
        for (what, got, want) in pairs {
            if got != want {
                bad.push(format!("{name}: {input:?} {what}: tp {got}, transformers {want}"));
            }
        }
    }
    (cases.len(), bad)
}

#[test]
fn equals_transformers_on_every_fixture() {
    let (dir, committed) = fixture_dir();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("fixture folder")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    if committed {
        let names: Vec<String> =
            files.iter().map(|p| p.file_stem().unwrap_or_default().to_string_lossy().into_owned()).collect();
        assert_eq!(names, COMMITTED, "the committed fixtures");
    }
    assert!(!files.is_empty(), "no fixture in {}", dir.display());
    let mut all_bad = Vec::new();
    for f in &files {
        let (n, bad) = check(f);
        println!("{}: {n} texts, {} differences", f.display(), bad.len());
        assert!(n >= 20, "{}: only {n} texts", f.display());
        all_bad.extend(bad);
    }
    for b in all_bad.iter().take(40) {
        println!("{b}");
    }
    assert!(all_bad.is_empty(), "{} differences from transformers", all_bad.len());
}

fn small() -> GgufVocab {
    let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>"].iter().map(|s| s.to_string()).collect();
    tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
    tokens.extend(["\u{2581}", "a", "b", "\u{2581}a"].iter().map(|s| s.to_string()));
    let n = tokens.len();
    GgufVocab {
        model: "llama".into(),
        scores: Some((0..n).map(|i| -(i as f32)).collect()),
        token_types: Some(vec![1; n]),
        tokens,
        bos: Some(1),
        eos: Some(2),
        ..GgufVocab::default()
    }
}

/// The message of the typed error `v` gives (failing the test on success or another error).
fn error_of(v: &GgufVocab) -> String {
    match tokenizer_from_gguf(v) {
        Err(ModelError::Vocabulary(why)) => why,
        Err(e) => panic!("not a vocabulary error: {e}"),
        Ok(_) => panic!("accepted a bad vocabulary"),
    }
}

#[test]
fn bad_metadata_is_a_typed_error() {
    // The base vocabulary builds and tokenizes, so each failure below is the one change's.
    let ok = tokenizer_from_gguf(&small()).expect("the base vocabulary builds");
    assert_eq!(ok.encode("ab", true).expect("encode").get_ids(), [1, 262, 261]);

    let mut v = small();
    v.model = "t5".into();
    assert!(error_of(&v).contains("\"t5\" is not supported"));
    let mut v = small();
    v.tokens.clear();
    assert!(error_of(&v).contains("empty"));
    let mut v = small();
    v.scores.as_mut().map(Vec::pop);
    assert!(error_of(&v).contains("scores has 262 values for 263 tokens"));
    let mut v = small();
    v.token_types = Some(vec![1; 3]);
    assert!(error_of(&v).contains("token_type has 3 values"));
    let mut v = small();
    v.eos = Some(263);
    assert!(error_of(&v).contains("eos_token_id = 263"));
    let mut v = small();
    v.unk = Some(u32::MAX);
    assert!(error_of(&v).contains("unknown_token_id"));
    let mut v = small();
    v.scores.as_mut().expect("scores")[5] = f32::NAN;
    assert!(error_of(&v).contains("scores[5] is NaN"));
    let mut v = small();
    v.scores = None;
    assert!(error_of(&v).contains("needs tokenizer.ggml.merges or tokenizer.ggml.scores"));
    let mut v = small();
    v.merges = Some(vec!["a b c".into()]);
    assert!(error_of(&v).contains("merges[0]"));
    let mut v = small();
    v.merges = Some(vec!["a zz".into()]);
    assert!(error_of(&v).contains("tokenizer.ggml.merges"));
    let mut v = small();
    v.model = "gpt2".into();
    v.scores = None;
    assert!(error_of(&v).contains("\"gpt2\" vocabulary needs"));
}
