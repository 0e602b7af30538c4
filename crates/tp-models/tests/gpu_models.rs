//! GPU suite of the models: a whole model on GPU 0 and on LocalGroup ranks sharing it, against
//! the host backend and the float64 forward. Built with `--features gpu-tests`; fails, never
//! skips, without a GPU.

mod common;
use common::*;
use tp_core::{DType, Device};
use tp_models::{GenerateOptions, ModelOptions, ParallelCausalLm};
use tp_testing::synthetic::SyntheticModel;

const GPU: Device = Device::Cuda(0);
const PROMPT: [i64; 7] = [1, 523, 17, 999, 1000, 4, 311];

#[test]
fn models_on_one_gpu_and_on_ranks_sharing_it_match_the_host() {
    tp_kernels::note_sticky_errors_on_panic();
    assert!(tp_kernels::device_count().expect("the GPU suite needs a CUDA device") > 0);
    let dir = tmpdir("gpu");
    let spec =
        SyntheticModel { num_attention_heads: 16, num_key_value_heads: 4, head_dim: Some(6), ..SyntheticModel::tiny() };
    spec.write(&dir).unwrap();
    let want = reference_logits(&dir, &PROMPT);
    let host_tokens = on_ranks(1, CPU, |g| {
        let mut lm = ParallelCausalLm::load(&dir, &g, &ModelOptions::new()).unwrap();
        lm.generate(&PROMPT, 8, &GenerateOptions::new().ignore_eos(true)).unwrap().tokens
    })
    .remove(0);
    for dtype in DType::FLOATS {
        for world in [1, 2, 4] {
            let got = on_ranks(world, GPU, |g| {
                let mut lm = ParallelCausalLm::load(&dir, &g, &ModelOptions::new().with_dtype(dtype)).unwrap();
                let logits = f64s(&lm.prefill(&PROMPT).unwrap());
                let tokens = lm.generate(&PROMPT, 8, &GenerateOptions::new().ignore_eos(true)).unwrap().tokens;
                (logits, tokens)
            });
            let bound = if dtype == DType::F32 { 1e-4 } else { 0.06 };
            for (logits, tokens) in &got {
                assert_close(&format!("gpu {dtype} TP {world}"), logits, &want, bound);
                assert_eq!(tokens, &got[0].1, "ranks disagree");
            }
            if dtype == DType::F32 {
                // Each token is the f64 forward's argmax given the ones before it, within the
                // rounding that separates the GPU's GEMMs from the host's.
                let mut seq = PROMPT.to_vec();
                for (i, &t) in got[0].1.iter().enumerate() {
                    let logits = reference_logits(&dir, &seq);
                    let last = &logits[(seq.len() - 1) * 1001..];
                    let best = argmax(last);
                    assert!(
                        last[t as usize] >= last[best] - 1e-4 * last[best].abs().max(1.0),
                        "token {i}: {t} vs {best}"
                    );
                    if t != host_tokens[i] {
                        eprintln!("note: token {i} differs from the host's ({t} vs {}), a near tie", host_tokens[i]);
                    }
                    seq.push(t);
                }
            }
        }
    }
}

/// Qwen3, Gemma 3, Phi-3 (LongRoPE) and OLMo 2 on GPU 0 and on ranks sharing it, against the f64
/// forward: their q/k norms (per head and full width), norm styles, GeGLU, scales, soft-capping
/// and fused projections on the device.
#[test]
fn newer_families_on_the_gpu_match_the_f64_forward() {
    use serde_json::json;
    use tp_models::Architecture;
    tp_kernels::note_sticky_errors_on_panic();
    assert!(tp_kernels::device_count().expect("the GPU suite needs a CUDA device") > 0);
    let tiny = SyntheticModel { num_key_value_heads: 4, head_dim: Some(8), ..SyntheticModel::tiny() };
    let specs = [
        SyntheticModel { architecture: Architecture::Qwen3, attention_bias: true, ..tiny.clone() },
        SyntheticModel {
            architecture: Architecture::Gemma3,
            tie_word_embeddings: true,
            sliding_window: Some(4),
            extra: Some(json!({"query_pre_attn_scalar": 12, "sliding_window_pattern": 3,
                "rope_local_base_freq": 500.0, "final_logit_softcapping": 3.0})),
            ..tiny.clone()
        },
        SyntheticModel {
            architecture: Architecture::Phi3,
            extra: Some(json!({"original_max_position_embeddings": 4,
                "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0],
                    "long_factor": [1.0, 2.0, 4.0, 9.0]}})),
            ..tiny.clone()
        },
        SyntheticModel { architecture: Architecture::Olmo2, num_key_value_heads: 6, ..tiny },
    ];
    for spec in specs {
        let dir = tmpdir(&format!("gpu-{:?}", spec.architecture));
        spec.write(&dir).unwrap();
        let want = reference_logits(&dir, &PROMPT);
        for dtype in DType::FLOATS {
            for world in [1, 3, 4] {
                let got = on_ranks(world, GPU, |g| {
                    let mut lm = ParallelCausalLm::load(&dir, &g, &ModelOptions::new().with_dtype(dtype)).unwrap();
                    f64s(&lm.prefill(&PROMPT).unwrap())
                });
                let bound = if dtype == DType::F32 { 1e-4 } else { 0.06 };
                for logits in &got {
                    assert_close(&format!("gpu {:?} {dtype} TP {world}", spec.architecture), logits, &want, bound);
                }
            }
        }
    }
}

/// The mixtures of experts on the GPU (`tests/data/moe/`, transformers' float64 logits and
/// greedy tokens): the router and the combine on the device (`kernels/moe.cu`), the experts'
/// products per expert, at TP 1 and 2 with each expert split and with expert parallelism, f32
/// and bf16, each keeping transformers' tokens (the fixtures' prompts route clear of ties).
#[test]
fn mixtures_of_experts_on_the_gpu_match_transformers() {
    tp_kernels::note_sticky_errors_on_panic();
    assert!(tp_kernels::device_count().expect("the GPU suite needs a CUDA device") > 0);
    for name in ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss"] {
        let dir = moe_case(name);
        let want = moe_reference(&dir);
        let prompt: Vec<i64> = want["prompt"].iter().map(|&v| v as i64).collect();
        let tokens: Vec<i64> = want["tokens"].iter().map(|&v| v as i64).collect();
        for dtype in [DType::F32, DType::BF16] {
            for (world, ep) in [(1, false), (2, false), (2, true)] {
                let opts = ModelOptions::new().with_dtype(dtype).with_expert_parallel(ep);
                let got = on_ranks(world, GPU, |g| {
                    let mut lm = ParallelCausalLm::load(&dir, &g, &opts).unwrap();
                    let logits = f64s(&lm.prefill(&prompt).unwrap());
                    let out = lm.generate(&prompt, tokens.len(), &GenerateOptions::new().ignore_eos(true)).unwrap();
                    (logits, out.tokens)
                });
                let at = format!("gpu {name} {dtype} TP {world} EP {ep}");
                if dtype == DType::F32 {
                    assert_close(&at, &got[0].0, &want["prefill"], 1e-4);
                } else {
                    // Per prompt position, within 1.5x transformers' own bf16 error (as the host
                    // suite holds the host's bf16).
                    let theirs = bf16_error(&dir);
                    let v = want["prefill"].len() / prompt.len();
                    for p in 0..prompt.len() {
                        let (g, w) = (&got[0].0[p * v..(p + 1) * v], &want["prefill"][p * v..(p + 1) * v]);
                        let scale = w.iter().fold(0f64, |m, x| m.max(x.abs()));
                        let worst = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0f64, f64::max) / scale;
                        assert!(worst <= 1.5 * theirs, "{at} position {p}: {worst:e} against transformers' {theirs:e}");
                    }
                }
                assert_eq!(got[0].1, tokens, "{at}: greedy tokens");
            }
        }
    }
}

/// transformers' own bf16 error on a MoE case's prompt (`reference.json`).
fn bf16_error(dir: &std::path::Path) -> f64 {
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    meta["transformers_bf16_error"].as_f64().unwrap()
}
