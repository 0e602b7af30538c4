//! What the torch-reference tests share: the fixtures, their hyper-parameters as a
//! [`TrainConfig`], and the comparison.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use tp_models::Recompute;
use tp_train::TrainConfig;
use tp_train::optim::AdamW;
use tp_train::pipeline::ScheduleKind;
use tp_train::schedule::{LrSchedule, LrScheduleKind};

pub fn fixture(case: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(case)
}

pub fn read_json(path: PathBuf) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

pub fn read_tensors(path: PathBuf) -> BTreeMap<String, Vec<f64>> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            let v: Vec<f64> =
                view.data().chunks_exact(4).map(|b| f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))).collect();
            (name, v)
        })
        .collect()
}

pub fn config(hyper: &serde_json::Value, recompute: Recompute, sequence_parallel: bool) -> TrainConfig {
    let f = |k: &str| hyper[k].as_f64().unwrap();
    let u = |k: &str| hyper[k].as_u64().unwrap();
    let kind: LrScheduleKind = hyper["lr_schedule"].as_str().unwrap().parse().unwrap();
    TrainConfig {
        micro_batch_size: u("micro_batch_size") as usize,
        grad_accum: u("grad_accum") as usize,
        adamw: AdamW {
            beta1: f("adam_beta1"),
            beta2: f("adam_beta2"),
            eps: f("adam_eps"),
            weight_decay: f("weight_decay"),
        },
        schedule: LrSchedule::new(kind, f("lr"), u("warmup_steps"), u("steps")).unwrap(),
        max_grad_norm: f("max_grad_norm"),
        recompute,
        sequence_parallel,
        pp_schedule: ScheduleKind::OneFOneB,
        virtual_stages: 1,
    }
}

/// `max |a - b| <= atol + rtol · max |b|` over the tensor.
pub fn close(what: &str, got: &[f64], want: &[f64], rtol: f64, atol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    let worst = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f64, f64::max);
    assert!(worst <= atol + rtol * scale, "{what}: max error {worst:e} against max |want| {scale:e}");
}
