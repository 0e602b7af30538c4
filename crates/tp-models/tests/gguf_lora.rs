//! LoRA adapters trained on a GGUF file's quantized weights (QLoRA's idea: the base stays in
//! its blocks, dequantized for each product while training, the adapters in f32): the loss and
//! every adapter gradient equal those on the Hugging Face folder of the same dequantized
//! weights (the `--ref` folder of `write_gguf.py`, what transformers' GGUF loader holds, on which
//! the PEFT fixtures of tp-train pin the float64 reference), at TP 1 and 3.

mod common;
use common::*;
use std::collections::BTreeMap;
use std::sync::Arc;
use tp_core::rng::SplitMix64;
use tp_core::{Device, Tensor};
use tp_layers::lora::{LoraInit, LoraSettings, LoraSpec, LoraTargets};
use tp_layers::{Gather, gather_full};
use tp_models::{Architecture, ModelOptions, ParallelCausalLm, Recompute, TrainRow};

/// Random `A` and `B` (both non-zero) on every projection of the test model.
fn adapter(seed: u64) -> LoraSpec {
    let mut rng = SplitMix64::new(seed);
    let r = 4;
    let mut full = BTreeMap::new();
    for layer in 0..2 {
        for (module, out, inp) in [
            ("self_attn.q_proj", 256, 256),
            ("self_attn.k_proj", 64, 256),
            ("self_attn.v_proj", 64, 256),
            ("self_attn.o_proj", 256, 256),
            ("mlp.gate_proj", 768, 256),
            ("mlp.up_proj", 768, 256),
            ("mlp.down_proj", 256, 768),
        ] {
            let name = format!("model.layers.{layer}.{module}");
            let mut t = |rows: usize, cols: usize| {
                let v: Vec<f32> = (0..rows * cols).map(|_| rng.uniform(-0.1, 0.1) as f32).collect();
                Tensor::from_vec(v, &[rows, cols], &Device::Cpu).unwrap()
            };
            full.insert(format!("{name}.lora_A.weight"), t(r, inp));
            full.insert(format!("{name}.lora_B.weight"), t(out, r));
        }
    }
    LoraSpec {
        settings: LoraSettings { r, alpha: 8.0, use_rslora: false },
        targets: LoraTargets::AllLinear,
        init: LoraInit::Tensors(Arc::new(full)),
    }
}

/// `(loss sum, adapter gradients)` of one micro-batch through `path` at `world` ranks, the
/// model loaded with no dtype (a GGUF file keeps its blocks).
fn step(path: &std::path::Path, world: usize, spec: &LoraSpec) -> (f64, BTreeMap<String, Vec<f64>>) {
    let ids: Vec<u32> = (0..20).map(|i| (i * 37 + 5) % 1001).collect();
    let labels: Vec<i64> = ids.iter().map(|&i| i64::from(i)).collect();
    let rows =
        [TrainRow { input_ids: &ids, labels: &labels }, TrainRow { input_ids: &ids[3..15], labels: &labels[3..15] }];
    let out = on_ranks(world, CPU, |g| {
        let mut lm = ParallelCausalLm::load(path, &g, &ModelOptions::new()).unwrap();
        assert_eq!(lm.add_lora(spec.clone()).unwrap(), 14);
        let loss = lm.train_micro_batch(&rows, 1.0 / 30.0, Recompute::None).unwrap();
        let params = lm.params_mut().unwrap();
        assert_eq!(params.len(), 28, "the adapters alone are parameters");
        let grads = gather_full(&params, Gather::Grads, &g).unwrap();
        (loss.loss_sum, grads.into_iter().map(|(n, t)| (n, t.to_f64_vec().unwrap())).collect())
    });
    out.into_iter().next().unwrap()
}

#[test]
fn adapters_on_a_quantized_gguf_base_train_as_on_its_dequantized_weights() {
    for (name, arch, qtype) in [("llama", Architecture::Llama, "Q4_K"), ("qwen2", Architecture::Qwen2, "Q8_0")] {
        let dir = tmpdir(&format!("gguf-lora-{name}"));
        let hf = dir.join("hf");
        gguf_spec(arch, false, 31).write(&hf).unwrap();
        let (gguf, reference) = (dir.join("model.gguf"), dir.join("ref"));
        write_gguf(&hf, &gguf, qtype, &reference, &[]);
        let lora = adapter(7);
        for world in [1, 3] {
            let (loss_q, grads_q) = step(&gguf, world, &lora);
            let (loss_r, grads_r) = step(&reference, world, &lora);
            assert!((loss_q - loss_r).abs() <= 1e-5 * loss_r.abs(), "{name} TP {world}: loss {loss_q} vs {loss_r}");
            assert_eq!(grads_q.keys().collect::<Vec<_>>(), grads_r.keys().collect::<Vec<_>>());
            for (n, g) in &grads_q {
                assert_close(&format!("{name} {qtype} TP {world} grad {n}"), g, &grads_r[n], 1e-4);
            }
        }
    }
}
