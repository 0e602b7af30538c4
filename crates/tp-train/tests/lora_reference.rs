//! LoRA training against PEFT + torch autograd: for the tiny model of each family,
//! `benches/reference/lora_fixtures.py` wrote a starting adapter with PEFT's own
//! `save_pretrained` (`tests/fixtures/<case>/lora/adapter_init`), then trained it three
//! optimizer steps on the frozen base in float64 (losses, gradient norms over the adapters,
//! step 1's gradients of every `lora_A` / `lora_B`, the adapters after step 3). Here tp reads
//! that adapter folder, trains it on the same rows at TP 1, 2, 3 and the most the heads allow
//! (uneven heads, KV heads replicated past their count), with sequence parallelism, full
//! recompute, pipeline stages and data-parallel replicas, and must match.

mod common;

use common::{Run, close, config, fixture, read_json, read_tensors, run_mesh};
use tp_comm::MeshShape;
use tp_core::Device;
use tp_models::adapter::{PEFT_PREFIX, peft_names, read_adapter};
use tp_models::{ModelConfig, ModelOptions, ParallelCausalLm, Recompute, stage_parts};

/// A `(dp, pp, tp)` mesh trains the fixture's adapter on `case`'s frozen base: what the first
/// rank saw, the adapters under PEFT's names.
fn train(case: &str, (dp, pp, tp): (usize, usize, usize), sp: bool, recompute: Recompute) -> Run {
    let dir = fixture(case);
    let reference = read_json(dir.join("lora/reference.json"));
    let hyper = &reference["hyper"];
    let config = ModelConfig::from_dir(&dir).unwrap();
    let adapter = read_adapter(&dir.join("lora/adapter_init"), config.num_hidden_layers).unwrap();
    let parts = stage_parts(config.num_hidden_layers, pp, None).unwrap();
    let mut cfg = self::config(hyper, recompute, sp);
    if pp > 1 || dp > 1 {
        let rows = (hyper["micro_batch_size"].as_u64().unwrap() * hyper["grad_accum"].as_u64().unwrap()) as usize;
        cfg.micro_batch_size = 1;
        cfg.grad_accum = rows / dp;
    }
    let load = |mesh: &tp_comm::Mesh| {
        let part = &parts[mesh.coords().pp];
        let mut chunk = ParallelCausalLm::load_part(&dir, &config, mesh.tp(), &ModelOptions::new(), part)
            .map_err(|e| e.to_string())?;
        chunk.set_sequence_parallel(sp);
        match chunk.add_lora(adapter.spec()).map_err(|e| e.to_string())? {
            0 => Err("no module adapted".to_string()),
            _ => Ok(chunk),
        }
    };
    let (logs, grads, weights) = run_mesh(&dir, hyper, MeshShape::new(dp, pp, tp).unwrap(), cfg, false, &load)
        .unwrap_or_else(|e| panic!("{case} at dp {dp} x pp {pp} x tp {tp}: {e}"));
    (logs, peft_names(grads).unwrap(), peft_names(weights).unwrap())
}

/// `run` against the PEFT fixture of `case`.
fn check(case: &str, at: &str, (logs, grads, weights): Run) {
    let dir = fixture(case).join("lora");
    let reference = read_json(dir.join("reference.json"));
    let want_grads = read_tensors(dir.join("grads.safetensors"));
    let want_weights = read_tensors(dir.join("weights_after.safetensors"));
    let before = read_tensors(dir.join("adapter_init/adapter_model.safetensors"));
    assert_eq!(logs.len(), reference["steps"].as_array().unwrap().len(), "{at}: steps");
    for (i, (loss, norm, lr, tokens)) in logs.iter().enumerate() {
        let s = &reference["steps"][i];
        let rel = |a: f64, b: f64| (a - b).abs() / b.abs().max(1e-12);
        assert!(rel(*loss, s["loss"].as_f64().unwrap()) < 2e-6, "{at} step {}: loss {loss} vs {}", i + 1, s["loss"]);
        assert!(
            rel(*norm, s["grad_norm"].as_f64().unwrap()) < 2e-5,
            "{at} step {}: grad_norm {norm} vs {}",
            i + 1,
            s["grad_norm"]
        );
        assert!((lr - s["lr"].as_f64().unwrap()).abs() < 1e-15, "{at} step {}: lr", i + 1);
        assert_eq!(*tokens as u64, s["tokens"].as_u64().unwrap(), "{at} step {}: tokens", i + 1);
    }
    assert_eq!(grads.keys().collect::<Vec<_>>(), want_grads.keys().collect::<Vec<_>>(), "{at}: the adapters");
    assert!(grads.keys().all(|k| k.starts_with(PEFT_PREFIX)));
    for (name, want) in &want_grads {
        close(&format!("{at} grad {name}"), &grads[name].to_f64_vec().unwrap(), want, 2e-5, 1e-9);
    }
    for (name, want) in &want_weights {
        let got: Vec<f64> = weights[name].to_f64_vec().unwrap().iter().zip(&before[name]).map(|(a, b)| a - b).collect();
        let delta: Vec<f64> = want.iter().zip(&before[name]).map(|(a, b)| a - b).collect();
        close(&format!("{at} update of {name}"), &got, &delta, 2e-3, 1e-8);
    }
}

fn check_tp(case: &str, worlds: &[usize]) {
    for &tp in worlds {
        check(case, &format!("{case} LoRA TP {tp}"), train(case, (1, 1, tp), false, Recompute::None));
    }
}

#[test]
fn llama_adapters_match_peft_at_tp_1_2_3_8() {
    check_tp("llama", &[1, 2, 3, 8]);
}

#[test]
fn adapters_on_biased_tied_llama_match_peft() {
    check_tp("llama_tied_biases", &[1, 3, 8]);
}

#[test]
fn qwen2_rslora_adapters_match_peft() {
    check_tp("qwen2", &[1, 2, 3, 4]);
}

#[test]
fn qwen3_adapters_match_peft() {
    check_tp("qwen3", &[1, 3, 8]);
}

#[test]
fn mistral_adapters_match_peft() {
    check_tp("mistral", &[1, 3, 8]);
}

#[test]
fn gemma3_rslora_adapters_match_peft() {
    check_tp("gemma3", &[1, 3, 8]);
}

#[test]
fn phi3_fused_projection_adapters_match_peft() {
    check_tp("phi3", &[1, 2, 3, 4]);
}

#[test]
fn olmo2_mlp_adapters_match_peft() {
    check_tp("olmo2", &[1, 3, 4]);
}

#[test]
fn moe_attention_adapters_match_peft() {
    check_tp("qwen3_moe", &[1, 3, 8]);
}

#[test]
fn adapters_train_with_sequence_parallelism_and_recompute() {
    check("llama", "llama LoRA TP 3 SP", train("llama", (1, 1, 3), true, Recompute::None));
    check("phi3", "phi3 LoRA TP 2 full recompute", train("phi3", (1, 1, 2), false, Recompute::Full));
}

#[test]
fn adapters_train_over_pipeline_stages_and_replicas() {
    check("llama", "llama LoRA dp 2 x pp 2 x tp 2", train("llama", (2, 2, 2), false, Recompute::None));
    check("gemma3", "gemma3 LoRA pp 2 x tp 3", train("gemma3", (1, 2, 3), false, Recompute::None));
}

/// A PEFT adapter served by tp gives PEFT's logits: as the trained adapter (every row) and as
/// a served slot chosen per token, at TP 1, 2 and 3.
#[test]
fn peft_adapters_give_peft_logits() {
    for case in ["llama", "llama_tied_biases", "qwen2", "qwen3", "mistral", "gemma3", "phi3", "olmo2", "qwen3_moe"] {
        let dir = fixture(case);
        let config = ModelConfig::from_dir(&dir).unwrap();
        let adapter = read_adapter(&dir.join("lora/adapter_init"), config.num_hidden_layers).unwrap();
        let want = read_tensors(dir.join("lora/logits.safetensors"))["logits"].clone();
        let rows: Vec<serde_json::Value> = std::fs::read_to_string(dir.join("data.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let ids: Vec<i64> =
            rows[0]["input_ids"].as_array().unwrap().iter().take(16).map(|v| v.as_i64().unwrap()).collect();
        for world in [1, 2, 3] {
            let got = tp_testing::ranks::on_ranks(world, Device::Cpu, |g| {
                let mut lm = ParallelCausalLm::load(&dir, &g, &ModelOptions::new()).unwrap();
                lm.add_adapter(3, adapter.spec()).unwrap();
                let tokens: std::sync::Arc<[u32]> = vec![3; ids.len()].into();
                let served = tp_layers::lora::with_token_adapters(tokens, || lm.prefill(&ids).unwrap());
                lm.reset();
                let base = lm.prefill(&ids).unwrap();
                lm.reset();
                lm.add_lora(adapter.spec()).unwrap();
                let trained = lm.prefill(&ids).unwrap();
                (served.to_f64_vec().unwrap(), trained.to_f64_vec().unwrap(), base.to_f64_vec().unwrap())
            });
            let (served, trained, base) = &got[0];
            close(&format!("{case} TP {world} served adapter logits"), served, &want, 1e-5, 1e-6);
            close(&format!("{case} TP {world} trained adapter logits"), trained, &want, 1e-5, 1e-6);
            assert!(base.iter().zip(&want).any(|(a, b)| (a - b).abs() > 1e-3), "{case}: the adapter changes nothing");
        }
    }
}
