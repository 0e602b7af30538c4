//! `tp train` from outside: the binary against the float64 torch reference of a fixture (log
//! lines, step 1's dumped gradients, the saved checkpoint), resume equality, micro-batch split
//! invariance, text and chat rows through the model folder's tokenizer and template, and every
//! bad input refused with the file and line, writing nothing.

mod common;

use serde_json::{Value, json};
use std::path::Path;

use common::train::{
    assert_same_loss_and_norm, assert_tensors_close, fixture, hyper_flags, log_lines, ok, scratch, tensors, tp_train,
};

#[test]
fn the_command_matches_torch_and_writes_a_loadable_checkpoint() {
    matches_torch_and_saves("gemma3", &["--tensor-parallel-size", "3", "--sequence-parallel"]);
}

/// gpt-oss's gradients are dumped and its weights saved in its own fused, interleaved expert
/// layout (the names and shapes of its checkpoint, which transformers loads), under expert
/// parallelism too.
#[test]
fn gpt_oss_trains_and_saves_in_its_own_expert_layout() {
    matches_torch_and_saves("gpt_oss", &["--tensor-parallel-size", "3"]);
    matches_torch_and_saves("gpt_oss", &["--tensor-parallel-size", "2", "--enable-expert-parallel"]);
}

/// `tp train` of the torch fixture `case` with `flags`: torch's step logs, step 1's gradients
/// (`--dump-grads`, the checkpoint's names) and weights after 3 steps (`--save`, a folder tp
/// loads).
fn matches_torch_and_saves(name: &str, flags: &[&str]) {
    let case = fixture(name);
    let dir = scratch("torch");
    let (log, grads, save) = (dir.join("log.jsonl"), dir.join("grads.safetensors"), dir.join("ckpt"));
    let mut args = hyper_flags(&case.join("data.jsonl"));
    for (k, v) in [("--log-json", &log), ("--dump-grads", &grads), ("--save", &save)] {
        args.extend([k.to_string(), v.display().to_string()]);
    }
    args.extend(flags.iter().map(|f| f.to_string()));
    let out = tp_train(&case, &args.iter().map(String::as_str).collect::<Vec<_>>());
    ok(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("step 3/3") && stderr.contains("tok/s") && stderr.contains("ETA"), "progress: {stderr}");

    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(case.join("reference.json")).unwrap()).unwrap();
    let lines = log_lines(&log);
    assert_eq!(lines.len(), 3);
    for (got, want) in lines.iter().zip(reference["steps"].as_array().unwrap()) {
        assert_eq!(got["step"], want["step"]);
        assert_eq!(got["tokens"], want["tokens"]);
        let rel = |k: &str| {
            (got[k].as_f64().unwrap() - want[k].as_f64().unwrap()).abs() / want[k].as_f64().unwrap().abs().max(1e-12)
        };
        assert!(rel("loss") < 2e-6 && rel("grad_norm") < 2e-5, "{name} {flags:?}: {got} vs {want}");
        assert_eq!(got["lr"].as_f64(), want["lr"].as_f64());
        assert!(got["elapsed_s"].as_f64().unwrap() >= 0.0);
        // The step's peak resident memory: at least the model's weights are held.
        let peak = got["peak_rss_bytes"].as_u64().unwrap_or(0);
        assert!(peak > 1 << 20, "{name}: peak_rss_bytes {}", got["peak_rss_bytes"]);
    }

    let (got, want) = (tensors(&grads), tensors(&case.join("grads.safetensors")));
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{name}: tied embedding once, checkpoint names"
    );
    assert_tensors_close(&got, &want, 2e-5);

    // The checkpoint: an HF folder whose weights are the reference's after 3 steps, that tp
    // loads; a state file marking it complete.
    for f in ["config.json", "model.safetensors", "optimizer.safetensors", "trainer_state.json"] {
        assert!(save.join(f).is_file(), "{f} missing");
    }
    let (saved, after, before) = (
        tensors(&save.join("model.safetensors")),
        tensors(&case.join("weights_after.safetensors")),
        tensors(&case.join("model.safetensors")),
    );
    assert_eq!(saved.keys().collect::<Vec<_>>(), after.keys().collect::<Vec<_>>(), "{name}: saved names");
    for (t, w) in &after {
        let err = saved[t].iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0f64, f64::max);
        let moved = w.iter().zip(&before[t]).map(|(a, b)| (a - b).abs()).fold(0f64, f64::max);
        assert!(err <= 2e-3 * moved + 1e-7, "{name} {t}: {err:e} (moved {moved:e})");
    }
    let group = tp_comm::DeviceGroup::local(1, std::time::Duration::from_secs(60), |_| tp_core::Device::Cpu).unwrap();
    tp_models::ParallelCausalLm::load(&save, &group[0], &tp_models::ModelOptions::new())
        .expect("tp loads the checkpoint");
}

/// A log line without its measurements (elapsed seconds, the pipeline's idle fraction, peak memory).
fn fields(v: &Value) -> Value {
    let mut v = v.clone();
    v.as_object_mut().unwrap().remove("elapsed_s");
    v.as_object_mut().unwrap().remove("bubble");
    v.as_object_mut().unwrap().remove("peak_rss_bytes");
    v
}

#[test]
fn a_resumed_run_logs_what_the_uninterrupted_one_does() {
    // gpt-oss: its checkpoint holds the experts fused; the optimizer's state is per expert.
    for (case, dtype) in [("qwen3", "f32"), ("llama_tied_biases", "bf16"), ("gpt_oss", "f32")] {
        let case = fixture(case);
        let dir = scratch("resume");
        let base = hyper_flags(&case.join("data.jsonl"));
        let run = |extra: &[&str], log: &Path| {
            let mut args: Vec<&str> = base.iter().map(String::as_str).collect();
            let log = log.display().to_string();
            args.extend(["--tensor-parallel-size", "2", "--dtype", dtype, "--log-json", &log]);
            args.extend(extra);
            ok(&tp_train(&case, &args));
        };
        let save = dir.join("ckpt").display().to_string();
        run(&["--save", &save, "--save-every", "1"], &dir.join("full.jsonl"));
        let step1 = dir.join("ckpt/step-1").display().to_string();
        run(&["--resume", &step1], &dir.join("resumed.jsonl"));
        let (full, resumed) = (log_lines(&dir.join("full.jsonl")), log_lines(&dir.join("resumed.jsonl")));
        assert_eq!(resumed.len(), 2, "{dtype}: logs the steps after the checkpoint");
        assert_eq!(
            resumed.iter().map(fields).collect::<Vec<_>>(),
            full[1..].iter().map(fields).collect::<Vec<_>>(),
            "{dtype}"
        );
    }
}

#[test]
fn how_a_step_is_split_into_micro_batches_changes_nothing() {
    let case = fixture("mistral");
    let dir = scratch("split");
    let mut logs = Vec::new();
    for (b, k) in [("4", "1"), ("2", "2"), ("1", "4"), ("3", "2")] {
        let log = dir.join(format!("{b}x{k}.jsonl"));
        let data = case.join("data.jsonl");
        let args = [
            "--data",
            &data.display().to_string(),
            "--steps",
            "3",
            "--micro-batch-size",
            b,
            "--grad-accum",
            k,
            "--lr",
            "1e-3",
            "--seq-len",
            "16",
            "--log-json",
            &log.display().to_string(),
            "--tensor-parallel-size",
            "2",
        ]
        .map(String::from);
        ok(&tp_train(&case, &args.iter().map(String::as_str).collect::<Vec<_>>()));
        logs.push(log_lines(&log));
    }
    // 4x1, 2x2 and 1x4 take the same rows per step: the same loss, norm and tokens.
    for other in &logs[1..3] {
        for (a, b) in logs[0].iter().zip(other) {
            assert_eq!(a["tokens"], b["tokens"]);
            assert_same_loss_and_norm("split", a, b);
        }
    }
    assert_ne!(logs[0][1]["tokens"], logs[3][1]["tokens"], "3x2 takes six rows a step");
}

/// LongRoPE (original length 8) with rows of 3 to 16 tokens: 8x1, 1x8 and 2x4 put rows on both
/// sides of the original length in one micro-batch or in separate ones, and each row must take
/// its own length's factors either way: the same loss, norm and step-1 gradients.
#[test]
fn longrope_rows_give_the_same_step_in_any_micro_batch_split() {
    let case = fixture("phi3_longrope");
    let dir = scratch("split-longrope");
    let data = case.join("data.jsonl").display().to_string();
    let mut runs = Vec::new();
    for (b, k) in [("8", "1"), ("1", "8"), ("2", "4")] {
        let (log, grads) = (dir.join(format!("{b}x{k}.jsonl")), dir.join(format!("{b}x{k}.safetensors")));
        let (log_s, grads_s) = (log.display().to_string(), grads.display().to_string());
        let args = [
            "--data",
            &data,
            "--steps",
            "2",
            "--micro-batch-size",
            b,
            "--grad-accum",
            k,
            "--lr",
            "1e-3",
            "--seq-len",
            "16",
            "--log-json",
            &log_s,
            "--dump-grads",
            &grads_s,
            "--tensor-parallel-size",
            "2",
        ];
        ok(&tp_train(&case, &args));
        runs.push((log_lines(&log), tensors(&grads)));
    }
    let (first_log, first_grads) = &runs[0];
    for (log, grads) in &runs[1..] {
        for (a, b) in first_log.iter().zip(log) {
            assert_eq!(a["tokens"], b["tokens"]);
            assert_same_loss_and_norm("longrope split", a, b);
        }
        assert_tensors_close(grads, first_grads, 1e-5);
    }
}

/// Mixtures of experts through the command: Qwen2-MoE (shared expert, the load-balancing loss)
/// trains at TP 3 in f32 and bf16, with `--enable-expert-parallel`, and over two pipeline
/// stages, step 1's loss as torch's float64 one (within bf16's rounding for bf16), and its
/// checkpoint loads back.
#[test]
fn a_mixture_of_experts_trains_in_f32_and_bf16() {
    let case = fixture("qwen2_moe");
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(case.join("reference.json")).unwrap()).unwrap();
    let want = reference["steps"][0]["loss"].as_f64().unwrap();
    for (dtype, tol, ep, pp) in
        [("f32", 2e-6, false, "1"), ("bf16", 2e-2, false, "1"), ("f32", 2e-6, true, "1"), ("f32", 2e-6, true, "2")]
    {
        let dir = scratch("moe");
        let (log, save) = (dir.join("log.jsonl"), dir.join("ckpt"));
        let mut args = hyper_flags(&case.join("data.jsonl"));
        for (k, v) in [("--log-json", log.display().to_string()), ("--save", save.display().to_string())] {
            args.extend([k.to_string(), v]);
        }
        args.extend(
            ["--tensor-parallel-size", "3", "--pipeline-parallel-size", pp, "--dtype", dtype].map(String::from),
        );
        if ep {
            args.push("--enable-expert-parallel".into());
        }
        ok(&tp_train(&case, &args.iter().map(String::as_str).collect::<Vec<_>>()));
        let got = log_lines(&log)[0]["loss"].as_f64().unwrap();
        assert!((got - want).abs() <= tol * want, "{dtype} (EP {ep}, PP {pp}): step 1 loss {got} vs torch's {want}");
        let group =
            tp_comm::DeviceGroup::local(1, std::time::Duration::from_secs(60), |_| tp_core::Device::Cpu).unwrap();
        tp_models::ParallelCausalLm::load(&save, &group[0], &tp_models::ModelOptions::new())
            .unwrap_or_else(|e| panic!("{dtype}: the checkpoint loads: {e}"));
    }
}

/// `-dp 2 -ep 2` (Megatron's expert-model-parallel axis): two replicas hold different rows and
/// different experts; the step logs, step 1's gradients (`--dump-grads`, every expert) and the
/// weights after 3 steps (`--save`) are torch's; the checkpoint resumes without expert
/// parallelism at another layout and logs what the uninterrupted run does. Bad layouts are
/// refused before anything runs.
#[test]
fn expert_parallel_replicas_train_as_torch_and_resume_at_another_layout() {
    let case = fixture("qwen2_moe");
    let dir = scratch("ep");
    let mut base = hyper_flags(&case.join("data.jsonl"));
    // One row per micro-batch: 2 replicas x 1 row x 2 micro-batches, torch's 4 rows a step.
    let at = base.iter().position(|a| a == "--micro-batch-size").unwrap();
    base[at + 1] = "1".into();
    let run = |layout: &[&str], extra: &[String]| {
        let mut args: Vec<String> = base.clone();
        args.extend(layout.iter().map(|s| s.to_string()));
        args.extend(extra.iter().cloned());
        tp_train(&case, &args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let (log, grads, save) = (dir.join("ep.jsonl"), dir.join("grads.safetensors"), dir.join("ckpt"));
    let extra: Vec<String> = [("--log-json", &log), ("--dump-grads", &grads), ("--save", &save)]
        .iter()
        .flat_map(|(k, v)| [k.to_string(), v.display().to_string()])
        .chain(["--save-every".to_string(), "1".to_string()])
        .collect();
    let out = run(&["-dp", "2", "-ep", "2", "-tp", "2"], &extra);
    ok(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("replica 0 experts 0-3, replica 1 experts 4-7"), "the placement is printed: {stderr}");
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(case.join("reference.json")).unwrap()).unwrap();
    let lines = log_lines(&log);
    for (got, want) in lines.iter().zip(reference["steps"].as_array().unwrap()) {
        assert_eq!(got["tokens"], want["tokens"]);
        assert_same_loss_and_norm("-ep 2", got, want);
    }
    assert_tensors_close(&tensors(&grads), &tensors(&case.join("grads.safetensors")), 2e-5);
    let (saved, after) = (tensors(&save.join("model.safetensors")), tensors(&case.join("weights_after.safetensors")));
    assert_eq!(saved.keys().collect::<Vec<_>>(), after.keys().collect::<Vec<_>>());
    assert_tensors_close(&saved, &after, 1e-5);
    // Resume step 1's checkpoint on one replica of 3 ranks, without expert parallelism.
    let step1 = dir.join("ckpt/step-1").display().to_string();
    let resumed_log = dir.join("resumed.jsonl");
    let resumed_flags = ["--log-json".to_string(), resumed_log.display().to_string(), "--resume".into(), step1];
    let mut base_two = base.clone();
    let at = base_two.iter().position(|a| a == "--micro-batch-size").unwrap();
    base_two[at + 1] = "2".into();
    let mut args = base_two;
    args.extend(["-tp".to_string(), "3".to_string()]);
    args.extend(resumed_flags);
    ok(&tp_train(&case, &args.iter().map(String::as_str).collect::<Vec<_>>()));
    let resumed = log_lines(&resumed_log);
    assert_eq!(resumed.len(), 2);
    for (r, f) in resumed.iter().zip(&lines[1..]) {
        assert_same_loss_and_norm("resumed without -ep", r, f);
    }
    for (layout, why) in [
        (&["-dp", "2", "-ep", "3"][..], "must divide the 2 data-parallel replicas"),
        (&["-dp", "2", "-ep", "2", "--enable-expert-parallel"][..], "use one"),
    ] {
        let out = run(layout, &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(why), "{layout:?}: {err}");
    }
    let llama = fixture("llama");
    let out = tp_train(&llama, &["--data", llama.join("data.jsonl").to_str().unwrap(), "-dp", "2", "-ep", "2"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("the model has no experts"), "{err}");
}

#[test]
fn text_and_chat_rows_train_through_the_tokenizer_and_template() {
    let model = common::model_dir();
    let dir = scratch("text");
    let data = dir.join("data.jsonl");
    let rows = [
        json!({"text": "hello world, hello tp"}),
        json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "well, hello"}]}),
        json!({"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]}),
    ];
    std::fs::write(&data, rows.iter().map(|r| r.to_string() + "\n").collect::<String>()).unwrap();
    let (log, save) = (dir.join("log.jsonl"), dir.join("out"));
    let out = tp_train(
        &model,
        &[
            "--data",
            data.to_str().unwrap(),
            "--steps",
            "2",
            "--micro-batch-size",
            "3",
            "--lr",
            "1e-2",
            "--log-json",
            log.to_str().unwrap(),
            "--save",
            save.to_str().unwrap(),
            "--tensor-parallel-size",
            "2",
        ],
    );
    ok(&out);
    let lines = log_lines(&log);
    assert_eq!(lines.len(), 2);
    assert!(
        lines[1]["loss"].as_f64().unwrap() < lines[0]["loss"].as_f64().unwrap(),
        "a step at lr 1e-2 lowers the loss on the same rows: {lines:?}"
    );
    for f in ["tokenizer.json", "tokenizer_config.json", "config.json"] {
        assert!(save.join(f).is_file(), "{f} copied into the checkpoint");
    }
}

#[test]
fn bad_inputs_are_refused_naming_the_file_and_line_and_nothing_is_written() {
    let case = fixture("llama");
    let dir = scratch("bad");
    let cases: Vec<(&str, String, &str)> = vec![
        ("malformed", "{\"input_ids\": [1, 2], \"labels\": [1, 2]}\n{\"input_ids\": [1,\n".into(), ":2:"),
        ("neither", "{\"input_ids\": [1, 2], \"labels\": [1, 2]}\n{\"prompt\": \"x\"}\n".into(), ":2:"),
        ("length", "{\"input_ids\": [1, 2, 3], \"labels\": [1, 2]}\n".into(), ":1:"),
        ("vocab", "{\"input_ids\": [1, 97], \"labels\": [1, 2]}\n".into(), ":1:"),
        ("empty", "\n\n".into(), "no rows"),
        ("no target", "{\"input_ids\": [1, 2], \"labels\": [-100, -100]}\n".into(), "step 1"),
    ];
    for (name, text, want) in cases {
        let data = dir.join(format!("{name}.jsonl"));
        std::fs::write(&data, text).unwrap();
        let (log, save) = (dir.join(format!("{name}.log")), dir.join(format!("{name}-ckpt")));
        let out = tp_train(
            &case,
            &[
                "--data",
                data.to_str().unwrap(),
                "--steps",
                "1",
                "--log-json",
                log.to_str().unwrap(),
                "--save",
                save.to_str().unwrap(),
            ],
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name}: accepted");
        assert!(err.contains(want), "{name}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{name}: one line: {err}");
        assert!(!log.exists() && !save.exists(), "{name}: wrote something");
    }
    let data = case.join("data.jsonl");
    let d = data.to_str().unwrap();
    // A TP degree the model cannot take; --save into a foreign non-empty folder.
    let out = tp_train(&case, &["--data", d, "--tensor-parallel-size", "9"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("9 ranks"));
    let foreign = dir.join("foreign");
    std::fs::create_dir_all(&foreign).unwrap();
    std::fs::write(foreign.join("notes.txt"), "mine").unwrap();
    let out = tp_train(&case, &["--data", d, "--steps", "1", "--save", foreign.to_str().unwrap()]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("not a tp checkpoint"));
    assert_eq!(std::fs::read_dir(&foreign).unwrap().count(), 1, "the foreign folder is untouched");
}

#[test]
fn a_non_finite_loss_stops_at_its_step_and_leaves_the_checkpoint_alone() {
    // A model whose weights overflow f32 in the first step: an infinite loss.
    let case = fixture("llama");
    let dir = scratch("nan");
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::copy(case.join("config.json"), model.join("config.json")).unwrap();
    let bytes = std::fs::read(case.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (n, v) in st.tensors() {
        let mut data = v.data().to_vec();
        if n == "lm_head.weight" {
            data = data
                .chunks_exact(4)
                .flat_map(|b| (f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * 3e38).to_le_bytes())
                .collect();
        }
        owned.push((n, v.shape().to_vec(), data));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = owned
        .iter()
        .map(|(n, s, d)| {
            (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &model.join("model.safetensors")).unwrap();
    let save = dir.join("ckpt");
    let out = tp_train(
        &model,
        &["--data", case.join("data.jsonl").to_str().unwrap(), "--steps", "2", "--save", save.to_str().unwrap()],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("step 1") && err.contains("not finite"), "{err}");
    assert!(!save.exists(), "no checkpoint after a non-finite step");
}

#[test]
fn pipeline_and_data_parallel_runs_log_the_single_rank_losses_and_a_trace() {
    let case = fixture("llama");
    let dir = scratch("pipeline");
    let data = case.join("data.jsonl");
    let run = |name: &str, extra: &[&str]| {
        let log = dir.join(format!("{name}.jsonl"));
        let mut args = vec![
            "--data".to_string(),
            data.display().to_string(),
            "--steps".into(),
            "3".into(),
            "--micro-batch-size".into(),
            "1".into(),
            "--lr".into(),
            "1e-3".into(),
            "--seq-len".into(),
            "16".into(),
            "--log-json".into(),
            log.display().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let out = tp_train(&case, &args.iter().map(String::as_str).collect::<Vec<_>>());
        ok(&out);
        (log_lines(&log), String::from_utf8_lossy(&out.stderr).to_string())
    };
    let (base, _) = run("base", &["--grad-accum", "4"]);
    let trace = dir.join("trace.json");
    let trace_arg = trace.display().to_string();
    for (name, extra) in [
        ("pp2", vec!["--pipeline-parallel-size", "2", "--grad-accum", "4"]),
        ("dp2-pp2-tp2", vec!["-dp", "2", "-pp", "2", "-tp", "2", "--grad-accum", "2", "--pp-schedule", "zb-h1"]),
        ("gpipe", vec!["-pp", "2", "--grad-accum", "4", "--pp-schedule", "gpipe", "--trace", &trace_arg]),
        ("partition", vec!["-pp", "2", "--grad-accum", "4", "--pp-layer-partition", "0,2"]),
    ] {
        let (lines, stderr) = run(name, &extra);
        assert!(stderr.contains("bubble"), "{name}: progress line: {stderr}");
        assert_eq!(lines.len(), base.len(), "{name}");
        for (a, b) in lines.iter().zip(&base) {
            assert_eq!(a["tokens"], b["tokens"], "{name}");
            assert_same_loss_and_norm(name, a, b);
            let bubble = a["bubble"].as_f64().unwrap();
            assert!((0.0..1.0).contains(&bubble), "{name}: bubble {bubble}");
        }
    }
    // The trace: Chrome's trace-event JSON, one track per rank, forwards and backwards of every
    // micro-batch on both stages, microseconds.
    let t: Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = t["traceEvents"].as_array().unwrap();
    let complete: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    for pid in [0, 1] {
        for name in ["forward", "backward"] {
            let n = complete.iter().filter(|e| e["pid"] == pid && e["name"] == name).count();
            assert_eq!(n, 3 * 4, "rank {pid}: {name} events (3 steps x 4 micro-batches)");
        }
    }
    assert!(complete.iter().all(|e| e["ts"].as_f64().unwrap() >= 0.0 && e["dur"].as_f64().unwrap() >= 0.0));
    assert!(complete.iter().any(|e| e["name"] == "recv-wait"));
}

#[test]
fn bad_pipeline_flags_are_refused_before_anything_runs() {
    let case = fixture("llama");
    let data = case.join("data.jsonl").display().to_string();
    for (args, want) in [
        (vec!["-pp", "3"], "more stages than the model has layers (2)"),
        (vec!["-pp", "0"], "at least 1"),
        (vec!["--virtual-stages", "2"], "needs --pp-schedule interleaved"),
        (vec!["-pp", "2", "--pp-schedule", "interleaved", "--virtual-stages", "2", "--grad-accum", "2"], "layers"),
        (vec!["-pp", "2", "--pp-schedule", "zero"], "zero"),
        (vec!["-pp", "2", "--pp-layer-partition", "1,2"], "sums to 3"),
        (vec!["-pp", "2", "--pp-layer-partition", "1,x"], "\"x\""),
        // The distributed optimizer: stage 1 only, and not beside expert parallelism.
        (vec!["--zero", "2"], "--zero"),
        (vec!["--zero", "1", "-dp", "2", "-ep", "2"], "does not share out expert-parallel replicas"),
    ] {
        let mut all = vec!["--data", data.as_str(), "--steps", "1", "--seq-len", "16"];
        all.extend(&args);
        let out = tp_train(&case, &all);
        assert!(!out.status.success(), "{args:?} succeeded");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
}

#[test]
fn pipeline_checkpoints_resume_at_any_layout_and_dump_the_same_gradients() {
    let case = fixture("llama_tied_biases");
    let dir = scratch("pp-ckpt");
    let base = hyper_flags(&case.join("data.jsonl"));
    let run = |extra: &[&str], log: &Path| {
        let mut args: Vec<&str> = base.iter().map(String::as_str).collect();
        let log = log.display().to_string();
        args.extend(["--log-json", &log]);
        args.extend(extra);
        ok(&tp_train(&case, &args));
    };
    let save = dir.join("ckpt").display().to_string();
    let grads_pp = dir.join("grads-pp.safetensors").display().to_string();
    let grads_one = dir.join("grads-one.safetensors").display().to_string();
    run(
        &["-pp", "2", "-tp", "2", "--save", &save, "--save-every", "1", "--dump-grads", &grads_pp],
        &dir.join("full.jsonl"),
    );
    run(&["--dump-grads", &grads_one], &dir.join("one.jsonl"));
    // The dump holds the whole model (the tied table once) and equals the one-rank dump.
    let (a, b) = (tensors(Path::new(&grads_pp)), tensors(Path::new(&grads_one)));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    assert_tensors_close(&a, &b, 2e-5);
    // A pipeline checkpoint is one HF folder; it resumes at another layout with the same log.
    let step1 = dir.join("ckpt/step-1").display().to_string();
    for (name, layout) in [("pp2", vec!["-pp", "2"]), ("tp3", vec!["-tp", "3"])] {
        let log = dir.join(format!("resumed-{name}.jsonl"));
        let mut extra = layout.clone();
        extra.extend(["--resume", step1.as_str()]);
        run(&extra, &log);
        let (full, resumed) = (log_lines(&dir.join("full.jsonl")), log_lines(&log));
        assert_eq!(resumed.len(), 2, "{name}");
        for (a, b) in resumed.iter().zip(&full[1..]) {
            assert_same_loss_and_norm(name, a, b);
        }
    }
    let group = tp_comm::DeviceGroup::local(1, std::time::Duration::from_secs(60), |_| tp_core::Device::Cpu).unwrap();
    tp_models::ParallelCausalLm::load(dir.join("ckpt"), &group[0], &tp_models::ModelOptions::new())
        .expect("tp loads the pipeline's checkpoint");
}
