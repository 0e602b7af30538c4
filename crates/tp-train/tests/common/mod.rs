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
        zero: false,
    }
}

/// `max |a - b| <= atol + rtol · max |b|` over the tensor.
pub fn close(what: &str, got: &[f64], want: &[f64], rtol: f64, atol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    let worst = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f64, f64::max);
    assert!(worst <= atol + rtol * scale, "{what}: max error {worst:e} against max |want| {scale:e}");
}

/// What rank 0 saw: per-step (loss, grad_norm, lr, tokens), step 1's full gradients and the
/// full weights at the end (as gathered, before any renaming).
pub type Run = (Vec<(f64, f64, f64, usize)>, BTreeMap<String, tp_core::Tensor>, BTreeMap<String, tp_core::Tensor>);

/// Trains the fixture in `dir` (its `data.jsonl`, `hyper`'s steps and rows per step) on a mesh of
/// `shape`, one thread per rank: each rank's chunk comes from `load` (its mesh and stage part),
/// the trainer is set by `cfg`; with `experts`, each expert-parallel replica's routed experts
/// are summed over the expert-parallel group before gathering. Returns what the first
/// replica's first tensor-parallel ranks gathered (every stage's full tensors).
pub fn run_mesh(
    dir: &std::path::Path,
    hyper: &serde_json::Value,
    shape: tp_comm::MeshShape,
    cfg: TrainConfig,
    experts: bool,
    load: &(dyn Fn(&tp_comm::Mesh) -> Result<tp_models::ParallelCausalLm, String> + Sync),
) -> Result<Run, String> {
    use std::sync::Mutex;
    use tp_layers::{Gather, gather_full};
    use tp_models::ParallelCausalLm;
    let config = tp_models::ModelConfig::from_dir(dir).map_err(|e| e.to_string())?;
    let meshes = tp_comm::Mesh::local(shape, tp_testing::ranks::timeout(), |_| tp_core::Device::Cpu)
        .map_err(|e| e.to_string())?;
    let (grads, weights, logs) = (Mutex::new(BTreeMap::new()), Mutex::new(BTreeMap::new()), Mutex::new(Vec::new()));
    let rows_per_step = (hyper["micro_batch_size"].as_u64().unwrap() * hyper["grad_accum"].as_u64().unwrap()) as usize;
    let errors: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = meshes
            .into_iter()
            .map(|mesh| {
                let (config, grads, weights, logs, cfg) = (&config, &grads, &weights, &logs, cfg.clone());
                s.spawn(move || -> Result<(), String> {
                    let out = (|| -> Result<(), String> {
                        let e = |e: &dyn std::fmt::Display| e.to_string();
                        let mut chunks = vec![load(&mesh)?];
                        let mut data =
                            tp_train::data::Dataset::open(&dir.join("data.jsonl"), config.vocab_size, 16, None)
                                .map_err(|x| e(&x))?;
                        let mut trainer = tp_train::Trainer::new(cfg).map_err(|x| e(&x))?;
                        let groups = tp_train::StepGroups::of_mesh(&mesh, None);
                        let writer = mesh.coords().dp == 0 && mesh.coords().tp == 0;
                        let ep = experts.then(|| mesh.ep());
                        let gather =
                            |chunks: &mut Vec<ParallelCausalLm>,
                             what: Gather,
                             into: &Mutex<BTreeMap<String, tp_core::Tensor>>| {
                                let group = chunks[0].group().clone();
                                let params = chunks[0].params_mut().map_err(|x| e(&x))?;
                                let full = gather_full(&params, what, &group).map_err(|x| e(&x))?;
                                // Each expert-parallel replica holds other experts (zeros for the rest).
                                let full = tp_train::checkpoint::sum_experts(full, ep).map_err(|x| e(&x))?;
                                if writer {
                                    into.lock().unwrap().extend(full);
                                }
                                Ok::<(), String>(())
                            };
                        for step in 1..=hyper["steps"].as_u64().unwrap() {
                            let rows = data.next_rows(rows_per_step);
                            let acc = trainer.accumulate_stages(&mut chunks, &groups, &rows).map_err(|x| e(&x))?;
                            if step == 1 {
                                gather(&mut chunks, Gather::Grads, grads)?;
                            }
                            let lr = trainer.apply_stages(&mut chunks, acc.grad_norm).map_err(|x| e(&x))?;
                            if mesh.rank() == 0 {
                                logs.lock().unwrap().push((
                                    acc.loss_sum / acc.targets as f64,
                                    acc.grad_norm,
                                    lr,
                                    acc.targets,
                                ));
                            }
                        }
                        gather(&mut chunks, Gather::Values, weights)
                    })();
                    if let Err(why) = &out {
                        mesh.abort(&format!("rank {} failed: {why}", mesh.rank()));
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().expect("rank panicked").err()).collect()
    });
    if let Some(e) = errors.into_iter().next() {
        return Err(e);
    }
    Ok((logs.into_inner().unwrap(), grads.into_inner().unwrap(), weights.into_inner().unwrap()))
}
