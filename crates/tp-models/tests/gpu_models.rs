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
