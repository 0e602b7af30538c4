//! Training against torch autograd on the transformers models: for each family of the
//! architecture table, a tiny random model, its data and the float64 reference of three
//! optimizer steps (loss, gradient norm and rate per step; every gradient of step 1; every
//! weight after step 3) were written once by `benches/reference/train_fixtures.py` into
//! `tests/fixtures/<case>/`. Here tp trains the same model on the same rows at TP 1 and at
//! uneven TP degrees (heads, KV heads and vocabulary split unevenly, KV heads replicated past
//! their count) and must match.

use std::collections::BTreeMap;
use tp_comm::{DeviceGroup, MeshShape};
use tp_core::{Device, Tensor};
use tp_layers::{Gather, gather_full};
use tp_models::{ModelConfig, ModelOptions, ParallelCausalLm, Recompute, stage_parts, to_checkpoint_layout};
use tp_train::Trainer;
use tp_train::data::Dataset;
use tp_train::pipeline::ScheduleKind;

mod common;
use common::{Run, close, config, fixture, read_json, read_tensors, run_mesh};

fn train(case: &str, world: usize, recompute: Recompute, sp: bool) -> Run {
    train_opts(case, world, recompute, sp, ModelOptions::new())
}

fn train_opts(case: &str, world: usize, recompute: Recompute, sp: bool, opts: ModelOptions) -> Run {
    let dir = fixture(case);
    let reference = read_json(dir.join("reference.json"));
    let hyper = &reference["hyper"];
    let groups = DeviceGroup::local(world, tp_testing::ranks::timeout(), |_| Device::Cpu).unwrap();
    let results = tp_testing::ranks::run_threads(groups, "train", |g| -> Result<Run, String> {
        let mut model = ParallelCausalLm::load(&dir, g, &opts).map_err(|e| e.to_string())?;
        let vocab = model.config().vocab_size;
        let seq_len = hyper["seq_len"].as_u64().unwrap() as usize;
        let mut data = Dataset::open(&dir.join("data.jsonl"), vocab, seq_len, None).map_err(|e| e.to_string())?;
        let mut trainer = Trainer::new(config(hyper, recompute, sp)).map_err(|e| e.to_string())?;
        let (mut logs, mut grads) = (Vec::new(), BTreeMap::new());
        for step in 1..=hyper["steps"].as_u64().unwrap() {
            let rows = data.next_rows(trainer.rows_per_step());
            let acc = trainer.accumulate(&mut model, &rows).map_err(|e| e.to_string())?;
            if step == 1 {
                let params = model.params_mut().map_err(|e| e.to_string())?;
                grads = gather_full(&params, Gather::Grads, g).map_err(|e| e.to_string())?;
            }
            let arch = model.config().architecture;
            if step == 1 {
                grads = to_checkpoint_layout(arch, grads).map_err(|e| e.to_string())?;
            }
            let lr = trainer.apply(&mut model, acc.grad_norm).map_err(|e| e.to_string())?;
            logs.push((acc.loss_sum / acc.targets as f64, acc.grad_norm, lr, acc.targets));
        }
        let arch = model.config().architecture;
        let params = model.params_mut().map_err(|e| e.to_string())?;
        let weights = gather_full(&params, Gather::Values, g).map_err(|e| e.to_string())?;
        Ok((logs, grads, to_checkpoint_layout(arch, weights).map_err(|e| e.to_string())?))
    });
    let mut results: Vec<Run> =
        results.into_iter().map(|r| r.unwrap_or_else(|e| panic!("{case} at TP {world}: {e:?}"))).collect();
    results.swap_remove(0)
}

/// A data-, pipeline- and tensor-parallel mesh of `shape = (dp, pp, tp)` trains `case` (one
/// thread per rank, each stage's layers split evenly, 1F1B over one-row micro-batches): what
/// its first replica's first tensor-parallel ranks gathered (every stage's full tensors).
fn train_mesh(case: &str, shape: (usize, usize, usize), sp: bool, opts: ModelOptions) -> Run {
    train_mesh_ep(case, shape, 1, (sp, Recompute::None, ScheduleKind::OneFOneB), opts)
}

/// [`train_mesh`] with `ep` expert-parallel replicas out of the `dp` (experts placed over
/// replicas, tokens dispatched by all-to-all).
fn train_mesh_ep(
    case: &str,
    shape: (usize, usize, usize),
    ep: usize,
    (sp, recompute, schedule): (bool, Recompute, ScheduleKind),
    opts: ModelOptions,
) -> Run {
    let (dp, pp, tp) = shape;
    let dir = fixture(case);
    let reference = read_json(dir.join("reference.json"));
    let hyper = &reference["hyper"];
    let config = ModelConfig::from_dir(&dir).unwrap();
    let parts = stage_parts(config.num_hidden_layers, pp, None).unwrap();
    let mesh_shape = MeshShape::new(dp, pp, tp).unwrap().with_expert_parallel(ep).unwrap();
    let mut cfg = self::config(hyper, recompute, sp);
    cfg.micro_batch_size = 1;
    cfg.pp_schedule = schedule;
    let load = |mesh: &tp_comm::Mesh| {
        let part = &parts[mesh.coords().pp];
        let chunk = if ep > 1 {
            ParallelCausalLm::load_part_expert_parallel(&dir, &config, mesh.tp(), mesh.ep(), &opts, part)
        } else {
            ParallelCausalLm::load_part(&dir, &config, mesh.tp(), &opts, part)
        };
        chunk.map_err(|e| e.to_string())
    };
    let (logs, grads, weights) = run_mesh(&dir, hyper, mesh_shape, cfg, ep > 1, &load)
        .unwrap_or_else(|e| panic!("{case} at dp {dp} x pp {pp} x tp {tp}: {e}"));
    let layout = |m: BTreeMap<String, Tensor>| to_checkpoint_layout(config.architecture, m).unwrap();
    (logs, layout(grads), layout(weights))
}

fn check_case(case: &str, worlds: &[usize]) {
    check_case_with(case, worlds, false);
}

fn check_case_with(case: &str, worlds: &[usize], sp: bool) {
    check_case_opts(case, worlds, sp, ModelOptions::new());
}

fn check_case_opts(case: &str, worlds: &[usize], sp: bool, opts: ModelOptions) {
    for &world in worlds {
        let ep = if opts.expert_parallel { " EP" } else { "" };
        let at = format!("{case} TP {world}{}{ep}", if sp { " SP" } else { "" });
        check_run(case, &at, train_opts(case, world, Recompute::None, sp, opts));
    }
}

/// `run` (what rank 0 saw) against the torch fixture of `case`.
fn check_run(case: &str, at: &str, (logs, grads, weights): Run) {
    let dir = fixture(case);
    let reference = read_json(dir.join("reference.json"));
    let want_grads = read_tensors(dir.join("grads.safetensors"));
    let want_weights = read_tensors(dir.join("weights_after.safetensors"));
    let before = read_tensors(dir.join("model.safetensors"));
    {
        for (i, (loss, norm, lr, tokens)) in logs.iter().enumerate() {
            let s = &reference["steps"][i];
            let rel = |a: f64, b: f64| (a - b).abs() / b.abs().max(1e-12);
            assert!(
                rel(*loss, s["loss"].as_f64().unwrap()) < 2e-6,
                "{at} step {}: loss {loss} vs {}",
                i + 1,
                s["loss"]
            );
            assert!(
                rel(*norm, s["grad_norm"].as_f64().unwrap()) < 2e-5,
                "{at} step {}: grad_norm {norm} vs {}",
                i + 1,
                s["grad_norm"]
            );
            assert!((lr - s["lr"].as_f64().unwrap()).abs() < 1e-15, "{at} step {}: lr", i + 1);
            assert_eq!(*tokens as u64, s["tokens"].as_u64().unwrap(), "{at} step {}: tokens", i + 1);
        }
        let names: Vec<&String> = want_grads.keys().collect();
        assert_eq!(grads.keys().collect::<Vec<_>>(), names, "{at}: the gradients' names");
        for (name, want) in &want_grads {
            close(&format!("{at} grad {name}"), &grads[name].to_f64_vec().unwrap(), want, 2e-5, 1e-9);
        }
        for (name, want) in &want_weights {
            // Compare the updates (the weights move by about 1e-3 in three steps).
            let got: Vec<f64> =
                weights[name].to_f64_vec().unwrap().iter().zip(&before[name]).map(|(a, b)| a - b).collect();
            let delta: Vec<f64> = want.iter().zip(&before[name]).map(|(a, b)| a - b).collect();
            close(&format!("{at} update of {name}"), &got, &delta, 2e-3, 1e-8);
        }
    }
}

#[test]
fn llama_matches_torch_at_tp_1_3_8() {
    check_case("llama", &[1, 3, 8]);
}

#[test]
fn llama_tied_biases_matches_torch() {
    check_case("llama_tied_biases", &[1, 2, 5]);
}

#[test]
fn qwen2_matches_torch() {
    check_case("qwen2", &[1, 3, 4]);
}

#[test]
fn qwen3_matches_torch() {
    check_case("qwen3", &[1, 3, 6]);
}

#[test]
fn mistral_matches_torch() {
    check_case("mistral", &[1, 4, 7]);
}

#[test]
fn gemma3_matches_torch() {
    check_case("gemma3", &[1, 3, 8]);
}

#[test]
fn phi3_matches_torch() {
    check_case("phi3", &[1, 2, 3]);
}

#[test]
fn olmo2_matches_torch() {
    check_case("olmo2", &[1, 3, 4]);
}

/// transformers' tables are `nn.Embedding(V, H, padding_idx=pad_token_id)`: the pad token's
/// row (76, held by the first step's rows; on a rank past the first at TP 2, 3 and 8) gets no
/// lookup gradient, only the tied LM head's.
#[test]
fn the_pad_tokens_row_trains_as_transformers_trains_it() {
    check_case("llama_tied_pad", &[1, 2, 3, 8]);
    check_case_with("llama_tied_pad", &[3], true);
}

/// LongRoPE with an original length of 8: micro-batches hold rows on both sides of it, and
/// each row takes the factors of its own length, as it does alone in transformers.
#[test]
fn longrope_rows_take_their_own_factors() {
    check_case("phi3_longrope", &[1, 2, 3]);
    check_case_with("phi3_longrope", &[4], true);
}

/// Mixtures of experts (8 experts of 20 features, top 2, uneven splits of every expert over
/// the ranks): backward through the router, the top-k weights (renormalised in Qwen3-MoE), the
/// experts and Qwen2-MoE's gated shared expert, and the load-balancing loss where the config
/// asks for it (`output_router_logits`; Mixtral's does not), each row's own, averaged over the
/// step's rows.
/// gpt-oss: the sinks' and the clamped SwiGLU's backward, biases everywhere, the window, YaRN,
/// the router's softmax over its top k with the load-balancing loss; gradients and weights
/// compared in gpt-oss's fused interleaved layout (`to_checkpoint_layout`, the layout tp
/// saves), at TP 1 and 3, with expert parallelism, and over two pipeline stages.
#[test]
fn gpt_oss_matches_torch() {
    check_case("gpt_oss", &[1, 3]);
    check_case_with("gpt_oss", &[2], true);
    check_case_opts("gpt_oss", &[3], false, ModelOptions::new().with_expert_parallel(true));
    check_run("gpt_oss", "gpt_oss dp 2 x pp 2 x tp 2", train_mesh("gpt_oss", (2, 2, 2), false, ModelOptions::new()));
}

#[test]
fn mixtures_of_experts_match_torch() {
    check_case("qwen3_moe", &[1, 3, 8]);
    check_case("qwen2_moe", &[1, 2, 3]);
    check_case("mixtral", &[1, 3]);
    check_case("olmoe", &[1, 3]);
    for (case, world) in [("qwen3_moe", 3), ("qwen2_moe", 2), ("olmoe", 4)] {
        check_case_with(case, &[world], true);
    }
}

/// Expert parallelism in training: whole experts on ranks (8 over 3: 3, 3, 2; over 4; over 8),
/// each expert's gradients on its rank alone, the other ranks listing empty stand-ins, and the
/// same gradients and weights as torch's; with sequence parallelism too.
#[test]
fn expert_parallel_training_matches_torch() {
    let ep = ModelOptions::new().with_expert_parallel(true);
    check_case_opts("qwen3_moe", &[3, 8], false, ep);
    check_case_opts("qwen2_moe", &[3, 4], false, ep);
    check_case_opts("mixtral", &[3], true, ep);
}

/// Pipeline stages with the load-balancing loss: each row's router sums travel with the hidden
/// states to the last stage and back with the gradients, so every stage's routers get the
/// whole model's gradient (Qwen3-MoE's first layer is dense: its stage only passes them on).
/// With data parallelism and expert parallelism inside each stage, and sequence parallelism.
#[test]
fn moe_training_at_dp_2_x_pp_2_with_ep_matches_torch() {
    let ep = ModelOptions::new().with_expert_parallel(true);
    for (case, shape, sp) in [
        ("qwen2_moe", (2, 2, 3), false),
        ("olmoe", (2, 2, 2), true),
        ("qwen3_moe", (2, 2, 3), false),
        ("qwen2_moe", (1, 2, 1), false),
    ] {
        let (dp, pp, tp) = shape;
        let at = format!("{case} dp {dp} x pp {pp} x tp {tp} EP{}", if sp { " SP" } else { "" });
        check_run(case, &at, train_mesh(case, shape, sp, ep));
    }
}

/// Expert parallelism over data-parallel replicas (Megatron's `--expert-model-parallel-size`):
/// the replicas hold different rows and different experts (each split over the
/// tensor-parallel group), tokens reach their experts by all-to-all and come back, the
/// experts' gradients are summed over the replicas holding the same experts; the same
/// gradients and weights as torch's. 8 experts over 2 and 4 replicas, with pipeline stages
/// and sequence parallelism; gpt-oss's biased experts too.
#[test]
fn expert_parallel_mesh_training_matches_torch() {
    let none = ModelOptions::new();
    for (case, shape, ep, sp) in [
        ("qwen2_moe", (2, 1, 1), 2, false),
        ("olmoe", (4, 1, 1), 4, false),
        ("qwen3_moe", (4, 1, 2), 2, true),
        ("mixtral", (2, 2, 2), 2, false),
        ("gpt_oss", (2, 1, 3), 2, false),
    ] {
        let (dp, pp, tp) = shape;
        let at = format!("{case} dp {dp} (ep {ep}) x pp {pp} x tp {tp}{}", if sp { " SP" } else { "" });
        check_run(case, &at, train_mesh_ep(case, shape, ep, (sp, Recompute::None, ScheduleKind::OneFOneB), none));
    }
    // Full recompute runs each layer's exchanges again in the backward; ZB-H1 defers the
    // experts' weight gradients; both keep torch's numbers.
    let recompute = (false, Recompute::Full, ScheduleKind::OneFOneB);
    check_run(
        "qwen2_moe",
        "qwen2_moe dp 2 (ep 2) recompute",
        train_mesh_ep("qwen2_moe", (2, 1, 1), 2, recompute, none),
    );
    let zb = (false, Recompute::None, ScheduleKind::ZeroBubbleH1);
    check_run("olmoe", "olmoe dp 2 (ep 2) x pp 2 zb-h1", train_mesh_ep("olmoe", (2, 2, 1), 2, zb, none));
}

#[test]
fn full_recompute_gives_the_same_bits() {
    for case in ["gemma3", "olmo2", "qwen2_moe"] {
        let a = train(case, 3, Recompute::None, false);
        let b = train(case, 3, Recompute::Full, false);
        assert_eq!(a.0, b.0, "{case}: step logs");
        assert_eq!(a.1, b.1, "{case}: gradients");
        assert_eq!(a.2, b.2, "{case}: weights");
    }
}

#[test]
fn sequence_parallelism_matches_torch_in_every_family() {
    // Norm weights see each rank's rows only: their gradients must be summed over the group.
    for (case, worlds) in [
        ("llama", &[2, 3, 8][..]),
        ("llama_tied_biases", &[4][..]),
        ("qwen2", &[3][..]),
        ("qwen3", &[5][..]),
        ("mistral", &[2][..]),
        ("gemma3", &[3, 7][..]),
        ("phi3", &[4][..]),
        ("olmo2", &[3][..]),
    ] {
        check_case_with(case, worlds, true);
    }
}

#[test]
fn full_recompute_under_sequence_parallelism_gives_the_same_bits() {
    let a = train("gemma3", 4, Recompute::None, true);
    let b = train("gemma3", 4, Recompute::Full, true);
    assert_eq!(a.0, b.0);
    assert_eq!(a.1, b.1);
}

/// A stage of a mixture trained with its load-balancing loss refuses hidden states without the
/// previous stage's router sums, sums of another shape, and sums given to the first stage, each
/// naming the stage; no step runs.
#[test]
fn a_stage_refuses_missing_or_wrong_router_sums() {
    use tp_models::{Handoff, TrainRow};
    let dir = fixture("qwen2_moe");
    let config = ModelConfig::from_dir(&dir).unwrap();
    let parts = stage_parts(config.num_hidden_layers, 2, None).unwrap();
    let g = DeviceGroup::local(1, tp_testing::ranks::timeout(), |_| Device::Cpu).unwrap().remove(0);
    let row = TrainRow { input_ids: &[1, 2, 3], labels: &[1, 2, 3] };
    let hidden = || Tensor::zeros(&[3, config.hidden_size], tp_core::DType::F32, &Device::Cpu).unwrap();
    let mut second = ParallelCausalLm::load_part(&dir, &config, &g, &ModelOptions::new(), &parts[1]).unwrap();
    let mb = second.micro_batch(&[row]).unwrap();
    let dims = second.stage_router_sums_dims(&mb).unwrap().expect("the loss is on");
    let bad_sums = Tensor::zeros(&[dims[0], dims[1] + 1], tp_core::DType::I64, &Device::Cpu).unwrap();
    for (sums, why) in [(None, "needs the previous stage's router sums"), (Some(bad_sums), "router sums of shape")] {
        let input = Handoff { hidden: hidden(), router_sums: sums };
        let err = second.stage_forward(&mb, Some(input), 1.0, Recompute::None).unwrap_err().to_string();
        assert!(err.contains(why), "{err}");
    }
    let mut first = ParallelCausalLm::load_part(&dir, &config, &g, &ModelOptions::new(), &parts[0]).unwrap();
    let sums = Tensor::zeros(&dims, tp_core::DType::I64, &Device::Cpu).unwrap();
    let err = first
        .stage_forward(&mb, Some(Handoff { hidden: hidden(), router_sums: Some(sums) }), 1.0, Recompute::None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("first stage"), "{err}");
}
