//! Shared helpers: temporary folders, tolerances; the float64 forward and the ranks as threads
//! are tp-testing's.
#![allow(dead_code, unused_imports)] // each test binary uses some of the helpers

use std::path::PathBuf;
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
