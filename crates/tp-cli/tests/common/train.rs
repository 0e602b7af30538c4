//! `tp train` test support: the torch fixtures of tp-train, scratch folders, the binary run
//! with the fixtures' hyper-parameters, and reading its logs and tensors.

use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

pub fn fixture(case: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tp-train/tests/fixtures").join(case)
}

pub fn scratch(name: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "tp-train-cli-{}-{name}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

pub fn tp_train(model: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tp")).arg("train").arg(model).args(args).output().unwrap()
}

/// The fixtures' hyper-parameters as flags.
pub fn hyper_flags(data: &Path) -> Vec<String> {
    let mut v: Vec<String> = [
        "--steps",
        "3",
        "--micro-batch-size",
        "2",
        "--grad-accum",
        "2",
        "--lr",
        "1e-3",
        "--warmup-steps",
        "1",
        "--lr-schedule",
        "cosine",
        "--weight-decay",
        "0.1",
        "--adam-beta1",
        "0.9",
        "--adam-beta2",
        "0.95",
        "--adam-eps",
        "1e-8",
        "--max-grad-norm",
        "1.0",
        "--seq-len",
        "16",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(["--data".to_string(), data.display().to_string()]);
    v
}

pub fn log_lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

pub fn tensors(path: &Path) -> BTreeMap<String, Vec<f64>> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            assert_eq!(v.dtype(), safetensors::Dtype::F32, "{n}");
            (n, v.data().chunks_exact(4).map(|b| f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))).collect())
        })
        .collect()
}

pub fn ok(out: &Output) {
    assert!(out.status.success(), "tp train failed: {}", String::from_utf8_lossy(&out.stderr));
}

/// Asserts that step log line `a` has the loss and gradient norm of `b` within 1e-5 (relative).
pub fn assert_same_loss_and_norm(what: &str, a: &Value, b: &Value) {
    for k in ["loss", "grad_norm"] {
        let (x, y) = (a[k].as_f64().unwrap(), b[k].as_f64().unwrap());
        assert!((x - y).abs() <= 1e-5 * y.abs(), "{what} {k}: {x} vs {y}");
    }
}

/// Asserts that each tensor of `want` is in `got`, every element within `rel` times the tensor's
/// largest magnitude (plus 1e-9).
pub fn assert_tensors_close(got: &BTreeMap<String, Vec<f64>>, want: &BTreeMap<String, Vec<f64>>, rel: f64) {
    for (name, w) in want {
        let scale = w.iter().fold(0f64, |m, v| m.max(v.abs()));
        let err = got[name].iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0f64, f64::max);
        assert!(err <= rel * scale + 1e-9, "{name}: {err:e} of {scale:e}");
    }
}
