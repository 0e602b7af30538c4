//! A model folder as an adversary would write it: configs that are pipes, devices or huge,
//! values that are enormous or hold control characters, sizes whose products wrap, ranks that
//! read different configs, and a request whose KV cache could never be allocated up front. Each
//! is a typed one-line error (or, for the request, simply works), at once, never a hang, a
//! panic or an unbounded allocation.

use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;
use tp_comm::DeviceGroup;
use tp_core::Device;
use tp_models::{GenerateOptions, ModelConfig, ModelError, ModelOptions, ParallelCausalLm};
use tp_testing::synthetic::SyntheticModel;

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tp-models-hostile-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `ModelConfig::from_dir(dir)` on another thread, which must answer within 10 s.
fn config_of(dir: &Path) -> Result<ModelConfig, ModelError> {
    let (tx, rx) = mpsc::channel();
    let dir = dir.to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(ModelConfig::from_dir(&dir));
    });
    rx.recv_timeout(Duration::from_secs(10)).expect("reading the config must not block")
}

fn tiny_config() -> Value {
    SyntheticModel::tiny().config_json()
}

fn write_config(dir: &Path, v: &Value) {
    std::fs::write(dir.join("config.json"), v.to_string()).unwrap();
}

#[test]
fn configs_that_are_pipes_devices_or_huge_are_refused_at_once() {
    let dir = tmpdir("special");
    // A named pipe as config.json: an error, never a blocked open.
    let fifo = dir.join("config.json");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let e = config_of(&dir).unwrap_err();
    assert!(e.to_string().contains("named pipe"), "{e}");
    std::fs::remove_file(&fifo).unwrap();
    // A symlink to /dev/zero: refused, not read until memory runs out.
    std::os::unix::fs::symlink("/dev/zero", &fifo).unwrap();
    let e = config_of(&dir).unwrap_err();
    assert!(e.to_string().contains("character device"), "{e}");
    std::fs::remove_file(&fifo).unwrap();
    // A 2 GiB sparse file: refused past the limit, without reading it all.
    let f = std::fs::File::create(&fifo).unwrap();
    f.set_len(2 << 30).unwrap();
    let e = config_of(&dir).unwrap_err();
    assert!(e.to_string().contains("larger than"), "{e}");
    // generation_config.json is read the same way.
    write_config(&dir, &tiny_config());
    let gen_fifo = dir.join("generation_config.json");
    assert!(std::process::Command::new("mkfifo").arg(&gen_fifo).status().unwrap().success());
    let e = config_of(&dir).unwrap_err();
    assert!(e.to_string().contains("generation_config.json") && e.to_string().contains("named pipe"), "{e}");
}

#[test]
fn enormous_or_hostile_values_are_escaped_and_cut() {
    let dir = tmpdir("values");
    // 10 MB: within the 16 MiB a config may hold (a larger file is refused before parsing).
    let huge = "A".repeat(10 << 20);
    for (key, value) in [
        ("architectures", json!([huge.clone()])),
        ("hidden_size", json!(huge.clone())),
        ("architectures", json!(["Llama\u{1b}[31m\u{0}ForCausalLM\n"])),
        ("hidden_act", json!("\u{1b}]0;pwned\u{7}")),
    ] {
        let mut c = tiny_config();
        c[key] = value;
        write_config(&dir, &c);
        let e = config_of(&dir).unwrap_err().to_string();
        assert!(e.len() < 1024, "{key}: {} bytes of error", e.len());
        assert!(!e.chars().any(|c| c.is_control()), "{key}: raw control characters in {e:?}");
        if key == "architectures" && e.contains("AAAA") {
            assert!(e.contains("bytes)"), "{e}");
        }
    }
}

#[test]
fn sizes_whose_products_wrap_are_typed_errors() {
    let dir = tmpdir("wrap");
    for (key, value, named) in [
        ("head_dim", json!(1u64 << 62), "head_dim"),
        ("vocab_size", json!(1u64 << 60), "vocab_size"),
        ("intermediate_size", json!(1u64 << 62), "intermediate_size"),
        ("num_hidden_layers", json!(1u64 << 40), "num_hidden_layers"),
        ("rms_norm_eps", json!(1e300), "rms_norm_eps"),
    ] {
        let mut c = tiny_config();
        c[key] = value;
        c["num_attention_heads"] = json!(4);
        c["num_key_value_heads"] = json!(4);
        write_config(&dir, &c);
        let e = config_of(&dir).unwrap_err();
        assert!(matches!(&e, ModelError::ConfigField { field, .. } if field == named), "{key}: {e}");
    }
}

#[test]
fn ranks_that_read_different_configs_fail_together_at_once() {
    let dir = tmpdir("differ");
    SyntheticModel::tiny().write(&dir).unwrap();
    let a = ModelConfig::from_dir(&dir).unwrap();
    let mut b = a.clone();
    b.eos_token_ids = vec![7];
    let groups = DeviceGroup::local(2, Duration::from_secs(60), |_| Device::Cpu).unwrap();
    let start = std::time::Instant::now();
    let errs: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = groups
            .into_iter()
            .map(|g| {
                let (dir, c) = (&dir, if g.rank() == 0 { a.clone() } else { b.clone() });
                s.spawn(move || {
                    ParallelCausalLm::load_with_config(dir, &c, &g, &ModelOptions::new()).unwrap_err().to_string()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(start.elapsed() < Duration::from_secs(30), "no rank waits out the timeout");
    assert!(errs.iter().all(|e| e.contains("read another config")), "{errs:?}");
}

#[test]
fn a_huge_token_budget_allocates_only_what_generation_reaches() {
    let dir = tmpdir("budget");
    let spec = SyntheticModel { max_position_embeddings: 1 << 40, ..SyntheticModel::tiny() };
    spec.write(&dir).unwrap();
    let groups = DeviceGroup::local(1, Duration::from_secs(60), |_| Device::Cpu).unwrap();
    let g = &groups[0];
    let prompt = [1, 523, 17];
    let mut lm = ParallelCausalLm::load(&dir, g, &ModelOptions::new()).unwrap();
    let first = lm.generate(&prompt, 1, &GenerateOptions::new()).unwrap().tokens[0];
    // With the first token as end of sequence, a budget of 10^9 tokens makes one token; the KV
    // caches (4 TB at the model's full length) grew only to what the sequence reached.
    std::fs::write(dir.join("generation_config.json"), json!({"eos_token_id": first}).to_string()).unwrap();
    let mut lm = ParallelCausalLm::load(&dir, g, &ModelOptions::new()).unwrap();
    let out = lm.generate(&prompt, 1_000_000_000, &GenerateOptions::new()).unwrap();
    assert_eq!(out.tokens, vec![first]);
    assert!(lm.capacity() <= 256, "caches hold {} positions", lm.capacity());
    // A sequence that does need more than memory holds says so in its own terms.
    let e = lm.reserve(1 << 38).unwrap_err().to_string();
    assert!(e.contains("positions") && e.contains("bytes"), "{e}");
}
