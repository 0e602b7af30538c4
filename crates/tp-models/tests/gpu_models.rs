//! GPU suite of the models: a whole model on GPU 0 and on LocalGroup ranks sharing it, against
//! the host backend and the float64 forward. Built with `--features gpu-tests`; fails, never
//! skips, without a GPU.

mod common;
use common::*;
use tp_core::{DType, Device};
use tp_models::synthetic::SyntheticModel;
use tp_models::{GenerateOptions, ModelOptions, ParallelCausalLm};

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
