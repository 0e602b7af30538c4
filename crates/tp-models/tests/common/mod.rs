//! Shared helpers: temporary folders, tolerances; the float64 forward and the ranks as threads
//! are tp-testing's.
#![allow(dead_code, unused_imports)] // each test binary uses some of the helpers

use std::path::{Path, PathBuf};
use tp_core::Device;
use tp_models::{Architecture, ModelConfig};
pub use tp_testing::ranks::on_ranks;
pub use tp_testing::reference::block::f64s;
pub use tp_testing::reference::model::reference_logits;

pub const CPU: Device = Device::Cpu;

/// A fresh temporary folder for one test.
pub fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tp-models-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Writes the Hugging Face folder `hf` as the GGUF file `gguf` of `qtype` with tp-testing's
/// `write_gguf.py`, its dequantized reference folder at `reference`, and the script's further
/// `args` (`--tokenizer`, `--meta`, ...); fails the test, naming the package to install, when
/// the script fails.
pub fn write_gguf(hf: &Path, gguf: &Path, qtype: &str, reference: &Path, args: &[&str]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tp-testing/gguf/write_gguf.py");
    let out = std::process::Command::new("python3")
        .arg(script)
        .args([hf, gguf])
        .args(["--type", qtype, "--ref"])
        .arg(reference)
        .args(args)
        .output()
        .expect("python3 must be installed for the GGUF tests");
    assert!(
        out.status.success(),
        "write_gguf.py failed (the GGUF tests need python3 with `pip install gguf==0.19.0`): {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Asserts `got` is within `tol` (absolute, scaled by the largest |want|) of `want`.
pub fn assert_close(what: &str, got: &[f64], want: &[f64], rel: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= rel * scale, "{what}: element {i}: got {g}, want {w} (scale {scale})");
    }
}

/// Argmax with torch's rule (first maximum).
pub fn argmax(row: &[f64]) -> usize {
    let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    row.iter().position(|&v| v == m).unwrap()
}

pub fn is_llama(c: &ModelConfig) -> bool {
    c.architecture == Architecture::Llama
}

/// The folder of `benches/reference/moe_fixtures.py`'s case `name` (`tests/data/moe/`).
pub fn moe_case(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/moe").join(name)
}

/// A MoE case's transformers reference (`reference.safetensors`): each tensor as f64 values
/// (`prompt` and `tokens` as ids).
pub fn moe_reference(dir: &Path) -> std::collections::BTreeMap<String, Vec<f64>> {
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            let vals = match v.dtype() {
                safetensors::Dtype::F64 => {
                    v.data().chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().unwrap())).collect()
                }
                safetensors::Dtype::I64 => {
                    v.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as f64).collect()
                }
                d => panic!("{n}: {d:?}"),
            };
            (n, vals)
        })
        .collect()
}

/// A small model with shapes off the quantized blocks at most TP degrees (8 query heads of 32
/// over 2 KV heads, an intermediate size of 768, a vocabulary of 1001), 2 layers.
pub fn gguf_spec(architecture: Architecture, tie: bool, seed: u64) -> tp_testing::synthetic::SyntheticModel {
    tp_testing::synthetic::SyntheticModel {
        architecture,
        vocab_size: 1001,
        hidden_size: 256,
        intermediate_size: 768,
        num_hidden_layers: 2,
        num_attention_heads: 8,
        num_key_value_heads: 2,
        head_dim: Some(32),
        tie_word_embeddings: tie,
        max_position_embeddings: 64,
        files: 1,
        seed,
        ..tp_testing::synthetic::SyntheticModel::tiny()
    }
}
