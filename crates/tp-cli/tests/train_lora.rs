//! `tp train` with LoRA adapters, from outside: a PEFT adapter folder trained at TP 3 against
//! PEFT + torch in float64 (log lines, step 1's gradients under PEFT's names, the saved
//! adapter), the checkpoint a PEFT folder that resumes to the same steps, fresh adapters that
//! start at the base's loss, and bad flags and adapters refused with one line.

mod common;

use common::train::{
    assert_same_loss_and_norm, assert_tensors_close, fixture, hyper_flags, log_lines, ok, scratch, tensors, tp_train,
};
use serde_json::Value;
use std::path::Path;

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn a_peft_adapter_trains_as_peft_does_and_saves_a_peft_folder_that_resumes() {
    let case = fixture("llama");
    let lora = case.join("lora");
    let dir = scratch("lora");
    let flags = hyper_flags(&case.join("data.jsonl"));
    let (log, grads, save) = (dir.join("log.jsonl"), dir.join("grads.safetensors"), dir.join("adapter"));
    let adapter = lora.join("adapter_init").display().to_string();
    let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
    let (log_s, grads_s, save_s) = (log.display().to_string(), grads.display().to_string(), save.display().to_string());
    args.extend(["--tensor-parallel-size", "3", "--lora-adapter", &adapter, "--log-json", &log_s]);
    args.extend(["--dump-grads", &grads_s, "--save", &save_s, "--save-every", "1"]);
    ok(&tp_train(&case, &args));

    let reference = read_json(&lora.join("reference.json"));
    let lines = log_lines(&log);
    assert_eq!(lines.len(), 3);
    for (got, want) in lines.iter().zip(reference["steps"].as_array().unwrap()) {
        assert_same_loss_and_norm("LoRA TP 3", got, want);
    }
    let (got, want) = (tensors(&grads), tensors(&lora.join("grads.safetensors")));
    assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "PEFT's tensor names");
    assert_tensors_close(&got, &want, 2e-5);

    // The checkpoint is a PEFT adapter folder (no model weights, no config.json).
    assert!(save.join("adapter_model.safetensors").is_file() && save.join("trainer_state.json").is_file());
    assert!(!save.join("model.safetensors").exists() && !save.join("config.json").exists());
    let cfg = read_json(&save.join("adapter_config.json"));
    assert_eq!(
        (cfg["peft_type"].as_str(), cfg["r"].as_u64(), cfg["lora_alpha"].as_f64()),
        (Some("LORA"), Some(4), Some(8.0))
    );
    let mut targets: Vec<&str> =
        cfg["target_modules"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    targets.sort_unstable();
    assert_eq!(targets, ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]);
    let (saved, after) =
        (tensors(&save.join("adapter_model.safetensors")), tensors(&lora.join("weights_after.safetensors")));
    assert_eq!(saved.keys().collect::<Vec<_>>(), after.keys().collect::<Vec<_>>());
    assert_tensors_close(&saved, &after, 2e-5);

    // Resumed from step 1 (at TP 2): the same steps 2 and 3.
    let log2 = dir.join("resumed.jsonl");
    let (step1, log2_s) = (save.join("step-1").display().to_string(), log2.display().to_string());
    let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
    args.extend(["--tensor-parallel-size", "2", "--resume", &step1, "--log-json", &log2_s]);
    ok(&tp_train(&case, &args));
    let resumed = log_lines(&log2);
    assert_eq!(resumed.len(), 2);
    for (got, want) in resumed.iter().zip(&lines[1..]) {
        assert_same_loss_and_norm("resumed LoRA run", got, want);
    }
}

#[test]
fn a_fresh_adapter_starts_at_the_base_model() {
    let case = fixture("llama");
    let dir = scratch("lora-fresh");
    let flags = hyper_flags(&case.join("data.jsonl"));
    let (log, save) = (dir.join("log.jsonl"), dir.join("adapter"));
    let (log_s, save_s) = (log.display().to_string(), save.display().to_string());
    let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
    args.extend(["--lora-r", "8", "--lora-target-modules", "all-linear", "--use-rslora", "--tp", "2"]);
    args.extend(["--log-json", &log_s, "--save", &save_s]);
    ok(&tp_train(&case, &args));
    // B starts at zero: step 1's loss is the base model's (the full fine-tune fixture's step 1).
    let base = read_json(&case.join("reference.json"));
    let first = &log_lines(&log)[0];
    let (got, want) = (first["loss"].as_f64().unwrap(), base["steps"][0]["loss"].as_f64().unwrap());
    assert!((got - want).abs() < 1e-5 * want, "{got} vs {want}");
    assert!(first["grad_norm"].as_f64().unwrap() > 0.0);
    let cfg = read_json(&save.join("adapter_config.json"));
    assert_eq!(
        (cfg["r"].as_u64(), cfg["lora_alpha"].as_f64(), cfg["use_rslora"].as_bool()),
        (Some(8), Some(8.0), Some(true))
    );
    assert_eq!(cfg["target_modules"].as_array().unwrap().len(), 7);
    assert_eq!(tensors(&save.join("adapter_model.safetensors")).len(), 2 * 7 * 2, "7 modules in 2 layers");
}

#[test]
fn bad_lora_flags_and_adapters_are_refused_in_one_line() {
    let case = fixture("llama");
    let dir = scratch("lora-bad");
    let flags = hyper_flags(&case.join("data.jsonl"));
    let run = |extra: &[&str]| {
        let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
        args.extend(extra);
        let out = tp_train(&case, &args);
        assert!(!out.status.success(), "{extra:?} ran");
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(err.trim().lines().count(), 1, "{extra:?}: {err}");
        err
    };
    assert!(run(&["--lora-alpha", "16"]).contains("--lora-r"));
    assert!(run(&["--lora-r", "0"]).contains("--lora-r 0"));
    assert!(run(&["--lora-r", "4", "--lora-dropout", "1.5"]).contains("--lora-dropout"));
    assert!(run(&["--lora-r", "4", "--lora-target-modules", "nope_proj"]).contains("matched no module"));
    let missing = dir.join("absent").display().to_string();
    assert!(run(&["--lora-adapter", &missing]).contains("absent"));
    // An adapter whose rank is not its tensors', and one with DoRA: named with the file.
    let init = case.join("lora/adapter_init");
    for (key, value, says) in [("r", Value::from(5), "rank 4"), ("use_dora", Value::from(true), "use_dora")] {
        let bad = dir.join(format!("bad-{key}"));
        std::fs::create_dir_all(&bad).unwrap();
        std::fs::copy(init.join("adapter_model.safetensors"), bad.join("adapter_model.safetensors")).unwrap();
        let mut cfg = read_json(&init.join("adapter_config.json"));
        cfg[key] = value;
        std::fs::write(bad.join("adapter_config.json"), cfg.to_string()).unwrap();
        let err = run(&["--lora-adapter", &bad.display().to_string()]);
        assert!(err.contains(says) && err.contains(&format!("bad-{key}")), "{err}");
    }
    let adapter = init.display().to_string();
    assert!(run(&["--lora-adapter", &adapter, "--lora-r", "8"]).contains("fixes r 4"));
}

/// `tp merge` gives PEFT's `merge_and_unload` (f32, within 1e-5), every other tensor as it was,
/// and the folder serves as a plain model.
#[test]
fn tp_merge_equals_peft_merge_and_unload() {
    for case in ["llama", "phi3", "qwen2"] {
        let base = fixture(case);
        let out = scratch("merge").join("merged");
        let run = std::process::Command::new(env!("CARGO_BIN_EXE_tp"))
            .arg("merge")
            .args([&base, &base.join("lora/adapter_init"), &out])
            .output()
            .unwrap();
        ok(&run);
        let (got, want, before) = (
            tensors(&out.join("model.safetensors")),
            tensors(&base.join("lora/merged.safetensors")),
            tensors(&base.join("model.safetensors")),
        );
        assert_eq!(got.keys().collect::<Vec<_>>(), before.keys().collect::<Vec<_>>(), "{case}");
        for (name, w) in &got {
            match want.get(name) {
                Some(m) => {
                    let err = w.iter().zip(m).map(|(a, b)| (a - b).abs()).fold(0f64, f64::max);
                    assert!(err <= 1e-5, "{case} {name}: {err:e}");
                    assert!(w != &before[name], "{case} {name} unchanged");
                }
                None => assert_eq!(w, &before[name], "{case} {name}"),
            }
        }
        assert!(out.join("config.json").is_file());
        // A second merge into the same folder is refused.
        let again = std::process::Command::new(env!("CARGO_BIN_EXE_tp"))
            .arg("merge")
            .args([&base, &base.join("lora/adapter_init"), &out])
            .output()
            .unwrap();
        assert!(!again.status.success() && String::from_utf8_lossy(&again.stderr).contains("not empty"));
    }
}

/// `--lora-dropout`: the adapters' input is dropped while training (the loss moves off the
/// undropped run's, the same on a second run and at another TP degree) and the saved config
/// records the rate.
#[test]
fn lora_dropout_trains_reproducibly_and_is_recorded() {
    let case = fixture("llama");
    let dir = scratch("lora-dropout");
    let flags = hyper_flags(&case.join("data.jsonl"));
    let adapter = case.join("lora/adapter_init").display().to_string();
    let run = |name: &str, extra: &[&str]| {
        let log = dir.join(format!("{name}.jsonl"));
        let log_s = log.display().to_string();
        let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
        args.extend(["--lora-adapter", &adapter, "--log-json", &log_s]);
        args.extend(extra);
        ok(&tp_train(&case, &args));
        log_lines(&log)
    };
    let save = dir.join("saved").display().to_string();
    let with = run("with", &["--lora-dropout", "0.1", "--tp", "2", "--save", &save]);
    let again = run("again", &["--lora-dropout", "0.1", "--tp", "3"]);
    let without = run("without", &[]);
    for (a, b) in with.iter().zip(&again) {
        assert_same_loss_and_norm("dropout at TP 2 and 3", a, b);
    }
    let (l1, l0) = (with[0]["loss"].as_f64().unwrap(), without[0]["loss"].as_f64().unwrap());
    assert!((l1 - l0).abs() > 1e-4, "dropout changed nothing: {l1} vs {l0}");
    let cfg = read_json(&dir.join("saved/adapter_config.json"));
    assert!((cfg["lora_dropout"].as_f64().unwrap() - 0.1).abs() < 1e-6);
}
