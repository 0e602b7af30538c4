//! Pipeline and data parallelism change nothing: a step's loss, gradient norm, gradients and
//! updated weights at any (dp, pp, tp) equal those of one rank holding the whole model
//! (f32 rounding: sums over micro-batches and replicas run in another order), for every
//! schedule, with uneven layer splits, GQA heads split unevenly, a vocabulary that no degree
//! divides, and tied embeddings held by two stages. Schedules that only reorder work give the
//! same bits. A rank that fails or stalls ends every rank with an error naming it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tp_comm::{Mesh, MeshShape};
use tp_core::Device;
use tp_layers::{Gather, Placement, gather_blocks};
use tp_models::{ModelConfig, ModelOptions, ParallelCausalLm, Recompute, stage_parts};
use tp_testing::synthetic::SyntheticModel;
use tp_train::data::Example;
use tp_train::optim::AdamW;
use tp_train::pipeline::ScheduleKind;
use tp_train::schedule::{LrSchedule, LrScheduleKind};
use tp_train::{StepGroups, TrainConfig, Trainer};

/// A 5-layer Llama (6 heads, 2 KV heads, vocabulary 97), tied or not, written once per process.
fn model_dir(tied: bool) -> PathBuf {
    // Tests run in parallel: one writes the folder while the others wait for it.
    static WRITING: Mutex<()> = Mutex::new(());
    let _guard = WRITING.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("tp-pipeline-test-{}-{}", std::process::id(), tied));
    if !dir.join("config.json").is_file() {
        SyntheticModel {
            vocab_size: 97,
            hidden_size: 24,
            intermediate_size: 40,
            num_hidden_layers: 5,
            num_attention_heads: 6,
            num_key_value_heads: 2,
            tie_word_embeddings: tied,
            files: 1,
            seed: 7,
            ..SyntheticModel::tiny()
        }
        .write(&dir)
        .unwrap();
    }
    dir
}

/// `n` rows of 3 to 11 tokens, some labels masked.
fn rows(n: usize) -> Vec<Example> {
    let mut rng = tp_core::rng::SplitMix64::new(11);
    (0..n)
        .map(|_| {
            let len = 3 + (rng.next_u64() % 9) as usize;
            let input_ids: Vec<u32> = (0..len).map(|_| (rng.next_u64() % 97) as u32).collect();
            let labels = input_ids
                .iter()
                .enumerate()
                .map(|(i, &t)| if i > 0 && rng.next_u64() % 5 == 0 { -100 } else { i64::from(t) })
                .collect();
            Example { input_ids, labels }
        })
        .collect()
}

#[derive(Debug)]
struct Run {
    /// Per step: (loss, grad_norm).
    logs: Vec<(f64, f64)>,
    /// Step 1's full gradients, by checkpoint name.
    grads: BTreeMap<String, Vec<f32>>,
    /// The full weights after the last step.
    weights: BTreeMap<String, Vec<f32>>,
    /// The mean measured bubble over the steps.
    bubble: f64,
    /// Rank 0's parameters whose data-parallel sum overlapped the backward, in step 1.
    overlapped: usize,
    /// Rank 0's bytes of optimizer state at the end.
    state_bytes: u64,
}

struct Setup<'a> {
    dir: &'a Path,
    shape: (usize, usize, usize),
    kind: ScheduleKind,
    virtual_stages: usize,
    /// Micro-batches per replica per step.
    grad_accum: usize,
    steps: usize,
    sequence_parallel: bool,
    partition: Option<Vec<usize>>,
    /// The distributed optimizer (ZeRO-1).
    zero: bool,
}

impl Setup<'_> {
    fn config(&self) -> TrainConfig {
        TrainConfig {
            micro_batch_size: 2,
            grad_accum: self.grad_accum,
            adamw: AdamW { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 },
            schedule: LrSchedule::new(LrScheduleKind::Cosine, 1e-2, 1, self.steps as u64).unwrap(),
            max_grad_norm: 0.5,
            recompute: Recompute::None,
            sequence_parallel: self.sequence_parallel,
            pp_schedule: self.kind,
            virtual_stages: self.virtual_stages,
            zero: self.zero,
        }
    }

    fn run(&self, data: &[Example]) -> Result<Run, String> {
        let (dp, pp, tp) = self.shape;
        let config = ModelConfig::from_dir(self.dir).map_err(|e| e.to_string())?;
        let v = self.virtual_stages;
        let parts =
            stage_parts(config.num_hidden_layers, pp * v, self.partition.as_deref()).map_err(|e| e.to_string())?;
        let meshes = Mesh::local(MeshShape::new(dp, pp, tp).unwrap(), Duration::from_secs(60), |_| Device::Cpu)
            .map_err(|e| e.to_string())?;
        let grads = Mutex::new(BTreeMap::new());
        let weights = Mutex::new(BTreeMap::new());
        let logs = Mutex::new(Vec::new());
        let overlapped = Mutex::new(0usize);
        let state_bytes = Mutex::new(0u64);
        let per_step = 2 * self.grad_accum * dp;
        let errors: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = meshes
                .into_iter()
                .map(|mesh| {
                    let (config, parts, grads, weights, logs, overlapped, state_bytes) =
                        (&config, &parts, &grads, &weights, &logs, &overlapped, &state_bytes);
                    s.spawn(move || -> Result<(), String> {
                        let out = (|| -> Result<(), String> {
                            let e = |e: &dyn std::fmt::Display| e.to_string();
                            let st = mesh.coords().pp;
                            let mut chunks = (0..v)
                                .map(|c| {
                                    ParallelCausalLm::load_part(
                                        self.dir,
                                        config,
                                        mesh.tp(),
                                        &ModelOptions::new(),
                                        &parts[c * pp + st],
                                    )
                                })
                                .collect::<Result<Vec<_>, _>>()
                                .map_err(|x| e(&x))?;
                            let mut trainer = Trainer::new(self.config()).map_err(|x| e(&x))?;
                            let groups = StepGroups::of_mesh(&mesh, None);
                            let writer = mesh.coords().dp == 0 && mesh.coords().tp == 0;
                            for step in 0..self.steps {
                                let step_rows = &data[step * per_step..][..per_step];
                                let acc =
                                    trainer.accumulate_stages(&mut chunks, &groups, step_rows).map_err(|x| e(&x))?;
                                if step == 0 {
                                    trainer.gather_grads(&mut chunks, mesh.dp()).map_err(|x| e(&x))?;
                                    collect(&mut chunks, Gather::Grads, writer, grads)?;
                                    if mesh.rank() == 0 {
                                        *overlapped.lock().unwrap() = acc.overlapped_params;
                                    }
                                }
                                trainer.apply_over(&mut chunks, acc.grad_norm, mesh.dp()).map_err(|x| e(&x))?;
                                if mesh.rank() == 0 {
                                    logs.lock().unwrap().push((
                                        acc.loss_sum / acc.targets as f64,
                                        acc.grad_norm,
                                        acc.bubble,
                                    ));
                                }
                            }
                            if mesh.rank() == 0 {
                                *state_bytes.lock().unwrap() = trainer.state_bytes();
                            }
                            collect(&mut chunks, Gather::Values, writer, weights)
                        })();
                        if let Err(why) = &out {
                            mesh.abort(&format!("rank {} failed: {why}", mesh.rank()));
                        }
                        out
                    })
                })
                .collect();
            handles.into_iter().filter_map(|h| h.join().unwrap().err()).collect()
        });
        if let Some(e) = errors.into_iter().next() {
            return Err(e);
        }
        let logs = logs.into_inner().unwrap();
        let bubble = logs.iter().map(|l| l.2).sum::<f64>() / logs.len().max(1) as f64;
        Ok(Run {
            logs: logs.iter().map(|l| (l.0, l.1)).collect(),
            grads: grads.into_inner().unwrap(),
            weights: weights.into_inner().unwrap(),
            bubble,
            overlapped: overlapped.into_inner().unwrap(),
            state_bytes: state_bytes.into_inner().unwrap(),
        })
    }
}

/// Every chunk's full tensors (gathered over the chunk's tensor-parallel group) into `into`;
/// a tied copy on the last stage must equal the first stage's table (checked when both are in).
fn collect(
    chunks: &mut [ParallelCausalLm],
    what: Gather,
    writer: bool,
    into: &Mutex<BTreeMap<String, Vec<f32>>>,
) -> Result<(), String> {
    const TABLE: &str = "model.embed_tokens.weight";
    for c in chunks.iter_mut() {
        let group = c.group().clone();
        let copy = c.holds_tied_copy();
        let params = c.params_mut().map_err(|e| e.to_string())?;
        // The last stage's copy of a tied table is not owned (never counted twice); gather it
        // as if it were, under its own key, to compare it with the first stage's.
        let placements: Vec<Vec<Placement>> = params
            .iter()
            .map(|p| {
                p.placements
                    .iter()
                    .cloned()
                    .map(|mut pl| {
                        pl.owned |= copy && pl.name == TABLE;
                        pl
                    })
                    .collect()
            })
            .collect();
        let items: Vec<_> = params
            .iter()
            .zip(&placements)
            .map(|(p, pl)| {
                let t = match what {
                    Gather::Values => Some(p.value.clone()),
                    Gather::Grads => p.grad.get().cloned(),
                };
                (pl.as_slice(), p.value.dims(), t)
            })
            .collect();
        let full = gather_blocks(&items, &group).map_err(|e| e.to_string())?;
        if !writer {
            continue;
        }
        let mut map = into.lock().unwrap();
        for (name, t) in full {
            let v = t.to_vec::<f32>().map_err(|e| e.to_string())?;
            let key = if copy && name == TABLE { format!("{name} (last stage's copy)") } else { name };
            assert!(map.insert(key.clone(), v).is_none(), "{key} gathered twice");
        }
    }
    Ok(())
}

/// `max |a - b| <= rtol · max |b|` for every tensor, the same names on both sides.
fn assert_close(what: &str, got: &BTreeMap<String, Vec<f32>>, want: &BTreeMap<String, Vec<f32>>, rtol: f64) {
    let base: Vec<&String> = want.keys().collect();
    let names: Vec<&String> = got.keys().filter(|k| !k.ends_with("(last stage's copy)")).collect();
    assert_eq!(names, base, "{what}: tensor names");
    for (name, w) in want {
        let g = &got[name];
        assert_eq!(g.len(), w.len(), "{what}: {name} length");
        let scale = w.iter().fold(0f64, |m, &x| m.max(f64::from(x).abs()));
        let worst = g.iter().zip(w).map(|(&a, &b)| (f64::from(a) - f64::from(b)).abs()).fold(0f64, f64::max);
        assert!(worst <= rtol * scale.max(1e-30), "{what}: {name} differs by {worst:e} (max |want| {scale:e})");
    }
    // A tied copy held by the last stage is the first stage's table, bit for bit.
    for (name, g) in got.iter().filter(|(k, _)| k.ends_with("(last stage's copy)")) {
        let base = name.trim_end_matches(" (last stage's copy)");
        assert_eq!(g, &got[base], "{what}: {name} differs from the first stage's");
    }
}

fn assert_same_run(what: &str, got: &Run, want: &Run) {
    assert_eq!(got.logs.len(), want.logs.len());
    for (i, (g, w)) in got.logs.iter().zip(&want.logs).enumerate() {
        assert!((g.0 - w.0).abs() <= 2e-6 * w.0.abs(), "{what} step {}: loss {} vs {}", i + 1, g.0, w.0);
        assert!((g.1 - w.1).abs() <= 2e-5 * w.1.abs(), "{what} step {}: grad_norm {} vs {}", i + 1, g.1, w.1);
    }
    assert_close(&format!("{what} gradients"), &got.grads, &want.grads, 2e-5);
    assert_close(&format!("{what} weights"), &got.weights, &want.weights, 2e-5);
}

fn setup(dir: &Path, shape: (usize, usize, usize), kind: ScheduleKind, grad_accum: usize, steps: usize) -> Setup<'_> {
    Setup {
        dir,
        shape,
        kind,
        virtual_stages: 1,
        grad_accum,
        steps,
        sequence_parallel: false,
        partition: None,
        zero: false,
    }
}

/// The distributed optimizer shares out the state and gives the unsharded optimizer's run bit
/// for bit: losses, norms, step 1's gradients and the weights after three steps, at 2 and 3
/// replicas (uneven ranges) with pipeline and tensor parallelism.
#[test]
fn the_distributed_optimizer_is_bitwise_the_unsharded_one() {
    let dir = model_dir(true);
    let data = rows(2 * 4 * 3 * 3);
    for (dp, pp, tp) in [(2, 2, 2), (3, 1, 2), (2, 1, 1)] {
        let base = setup(&dir, (dp, pp, tp), ScheduleKind::OneFOneB, 4, 3).run(&data).unwrap();
        let zero = Setup { zero: true, ..setup(&dir, (dp, pp, tp), ScheduleKind::OneFOneB, 4, 3) }.run(&data).unwrap();
        assert_eq!(zero.logs, base.logs, "dp {dp} pp {pp} tp {tp}: losses and norms");
        assert_eq!(zero.grads, base.grads, "dp {dp} pp {pp} tp {tp}: step 1's gradients");
        assert_eq!(zero.weights, base.weights, "dp {dp} pp {pp} tp {tp}: weights");
        assert_eq!(zero.overlapped, 0, "the distributed optimizer reduce-scatters after the backward");
        // Replica 0 holds its share: at most its chunks' (rounded up) of every parameter.
        let share = zero.state_bytes as f64 / base.state_bytes as f64;
        assert!(share < 1.0 / dp as f64 + 0.15, "dp {dp}: replica 0 holds {share:.2} of the state");
    }
}

#[test]
fn every_mesh_of_dp_1_2_pp_1_to_4_tp_1_to_3_matches_one_rank() {
    for tied in [false, true] {
        let dir = model_dir(tied);
        let data = rows(2 * 4 * 2 * 2);
        // One rank, the step's micro-batches of every replica one after the other.
        let base = setup(&dir, (1, 1, 1), ScheduleKind::OneFOneB, 8, 2).run(&data).unwrap();
        for dp in [1, 2] {
            for pp in [1, 2, 3, 4] {
                for tp in [1, 2, 3] {
                    let got = setup(&dir, (dp, pp, tp), ScheduleKind::OneFOneB, 8 / dp, 2).run(&data).unwrap();
                    assert_same_run(&format!("tied {tied} dp {dp} pp {pp} tp {tp}"), &got, &base);
                    // Rank 0's blocks (6 parameters each: fused QKV, o, fused gate/up, down, two
                    // norms) are summed over the replicas while the backward still runs.
                    let blocks = stage_parts(5, pp, None).unwrap()[0].layers.len();
                    let want = if dp == 1 { 0 } else { 6 * blocks };
                    assert_eq!(got.overlapped, want, "dp {dp} pp {pp} tp {tp}: parameters summed during the backward");
                    if dp == 2 && tp == 2 && pp > 1 {
                        let zb = setup(&dir, (dp, pp, tp), ScheduleKind::ZeroBubbleH1, 4, 2).run(&data).unwrap();
                        assert_same_run(&format!("zb-h1 tied {tied} dp {dp} pp {pp}"), &zb, &base);
                        assert_eq!(zb.overlapped, want, "zb-h1 pp {pp}: summed after the last weight gradients");
                    }
                }
            }
        }
    }
}

#[test]
fn schedules_that_reorder_work_give_the_same_bits() {
    for tied in [false, true] {
        let dir = model_dir(tied);
        let data = rows(4 * 2 * 2);
        for (pp, tp) in [(2, 1), (4, 2), (3, 3)] {
            let base = setup(&dir, (1, pp, tp), ScheduleKind::OneFOneB, 4, 2).run(&data).unwrap();
            for kind in [ScheduleKind::GPipe, ScheduleKind::ZeroBubbleH1] {
                let got = setup(&dir, (1, pp, tp), kind, 4, 2).run(&data).unwrap();
                let what = format!("{} tied {tied} pp {pp} tp {tp}", kind.name());
                assert_eq!(got.grads, base.grads, "{what}: gradients");
                assert_eq!(got.weights, base.weights, "{what}: weights");
                assert_eq!(got.logs, base.logs, "{what}: losses and norms");
            }
        }
        // Interleaved: two chunks per rank (virtual stages 0..4 of 5 layers).
        let one = setup(&dir, (1, 1, 1), ScheduleKind::OneFOneB, 4, 2).run(&data).unwrap();
        let mut s = setup(&dir, (1, 2, 2), ScheduleKind::Interleaved1F1B, 4, 2);
        s.virtual_stages = 2;
        let got = s.run(&data).unwrap();
        assert_same_run(&format!("interleaved tied {tied}"), &got, &one);
    }
}

#[test]
fn uneven_partitions_and_sequence_parallelism_match_one_rank() {
    let dir = model_dir(true);
    let data = rows(2 * 4 * 2 * 2);
    let base = setup(&dir, (1, 1, 1), ScheduleKind::OneFOneB, 8, 2).run(&data).unwrap();
    for partition in [vec![0, 5], vec![4, 1], vec![1, 0, 4]] {
        let mut s = setup(&dir, (2, partition.len(), 2), ScheduleKind::OneFOneB, 4, 2);
        s.partition = Some(partition.clone());
        s.sequence_parallel = true;
        let got = s.run(&data).unwrap();
        assert_same_run(&format!("partition {partition:?} with SP"), &got, &base);
    }
}

#[test]
fn a_twenty_step_loss_curve_at_dp2_pp2_is_the_single_rank_curve() {
    let dir = model_dir(false);
    let data = rows(20 * 2 * 4);
    let base = setup(&dir, (1, 1, 1), ScheduleKind::OneFOneB, 4, 20).run(&data).unwrap();
    let got = setup(&dir, (2, 2, 1), ScheduleKind::OneFOneB, 2, 20).run(&data).unwrap();
    assert_eq!(got.logs.len(), 20);
    for (i, (g, w)) in got.logs.iter().zip(&base.logs).enumerate() {
        assert!((g.0 - w.0).abs() <= 1e-5 * w.0.abs(), "step {}: loss {} vs {}", i + 1, g.0, w.0);
    }
    // It trained: the loss fell.
    assert!(base.logs[19].0 < base.logs[0].0, "{:?}", base.logs);
    assert!(got.bubble >= 0.0 && got.bubble < 1.0);
}

#[test]
fn a_bad_schedule_shape_is_a_clear_error() {
    let dir = model_dir(false);
    let data = rows(16);
    // Interleaved needs micro-batches in multiples of the stages.
    let mut s = setup(&dir, (1, 2, 1), ScheduleKind::Interleaved1F1B, 3, 1);
    s.virtual_stages = 2;
    let e = s.run(&data).unwrap_err();
    assert!(e.contains("schedule"), "{e}");
    // More stages than layers.
    let e = setup(&dir, (1, 6, 1), ScheduleKind::OneFOneB, 2, 1).run(&data).unwrap_err();
    assert!(e.contains("more stages than the model has layers"), "{e}");
}

#[test]
fn a_stage_that_fails_or_stalls_ends_every_rank_with_an_error_naming_it() {
    let dir = model_dir(false);
    let config = ModelConfig::from_dir(&dir).unwrap();
    let parts = stage_parts(config.num_hidden_layers, 3, None).unwrap();
    let data = rows(8);
    for stall in [false, true] {
        let timeout = Duration::from_secs(2);
        let meshes = Mesh::local(MeshShape::new(1, 3, 1).unwrap(), timeout, |_| Device::Cpu).unwrap();
        let started = Instant::now();
        let errors: Vec<(usize, String)> = std::thread::scope(|s| {
            let handles: Vec<_> = meshes
                .into_iter()
                .map(|mesh| {
                    let (config, parts, data, dir) = (&config, &parts, &data, &dir);
                    s.spawn(move || -> (usize, String) {
                        let st = mesh.coords().pp;
                        let mut chunk =
                            ParallelCausalLm::load_part(dir, config, mesh.tp(), &ModelOptions::new(), &parts[st])
                                .unwrap();
                        if st == 1 {
                            if stall {
                                // Never takes part: the others' receives reach their deadline.
                                std::thread::sleep(Duration::from_secs(4));
                                return (st, "stalled on purpose".into());
                            }
                            mesh.abort("stage 1 died on purpose");
                            return (st, "died on purpose".into());
                        }
                        let mut trainer =
                            Trainer::new(setup(dir, (1, 3, 1), ScheduleKind::OneFOneB, 4, 1).config()).unwrap();
                        let groups = StepGroups::of_mesh(&mesh, None);
                        let e = trainer.accumulate_stages(std::slice::from_mut(&mut chunk), &groups, data).unwrap_err();
                        (st, e.to_string())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let took = started.elapsed();
        assert!(took < Duration::from_secs(10), "stall {stall}: took {took:?}");
        for (st, e) in errors.iter().filter(|(st, _)| *st != 1) {
            if stall {
                // Stage 0 waits for stage 1's gradients, stage 2 for its activations: either
                // the deadline names rank 1, or a peer's failure (naming its stage) arrives first.
                assert!(e.contains('1') && (e.contains("rank") || e.contains("stage")), "stage {st}: {e}");
            } else {
                assert!(e.contains("stage 1 died on purpose"), "stage {st}: {e}");
            }
        }
    }
}
