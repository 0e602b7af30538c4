//! Phi-3 LongRoPE past its original length, as transformers generates: the frequencies switch
//! to the long factors once the sequence is longer than `original_max_position_embeddings`, and
//! the cache computed before with the short ones is recomputed whole then (transformers'
//! `Phi3ForCausalLM.prepare_inputs_for_generation`). So every token is the argmax of a fresh
//! forward over the whole sequence so far, which is the reference here: the engine (chunked
//! prefill, batching, TP 1-3, speculation) and `ParallelCausalLm::generate` must give it.

mod engine_common;

use engine_common::{run_all, stop, tokens};
use serde_json::json;
use std::path::PathBuf;
use std::time::Duration;
use tp_core::{DType, Device};
use tp_engine::EngineOptions;
use tp_engine::api::Request;
use tp_engine::sampling::SamplingParams;
use tp_engine::spec::NgramConfig;
use tp_models::{Architecture, GenerateOptions, ModelOptions, ParallelCausalLm};
use tp_testing::ranks::on_ranks;
use tp_testing::synthetic::SyntheticModel;

const ORIGINAL: usize = 8;

fn model_dir() -> PathBuf {
    let spec = SyntheticModel {
        architecture: Architecture::Phi3,
        num_key_value_heads: 6,
        head_dim: Some(8),
        max_position_embeddings: 64,
        seed: 9,
        extra: Some(json!({"original_max_position_embeddings": ORIGINAL, "rope_scaling": {"type": "longrope",
            "short_factor": [1.0, 1.5, 3.0, 4.0], "long_factor": [1.0, 4.0, 16.0, 40.0]}})),
        ..SyntheticModel::tiny()
    };
    engine_common::model_dir("longrope", &spec)
}

/// Greedy tokens where each is the argmax of a fresh forward over the whole sequence so far.
fn fresh_forward_tokens(dir: &PathBuf, prompt: &[i64], n: usize) -> Vec<i64> {
    on_ranks(1, Device::Cpu, |g| {
        let mut m = ParallelCausalLm::load(dir, &g, &ModelOptions::new()).expect("load");
        let mut seq = prompt.to_vec();
        let mut out = Vec::new();
        for _ in 0..n {
            let logits = m.prefill(&seq).unwrap().to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
            let v = logits.len() / seq.len();
            let last = &logits[(seq.len() - 1) * v..];
            let best = (0..v).fold(0, |b, i| if last[i] > last[b] { i } else { b });
            out.push(best as i64);
            seq.push(best as i64);
        }
        out
    })
    .remove(0)
}

#[test]
fn longrope_switches_and_recomputes_as_transformers() {
    let dir = model_dir();
    // Short prompts cross the switch while generating; a long one is past it from the start.
    let prompts: Vec<Vec<i64>> =
        vec![vec![3, 14, 15, 92, 65], vec![1, 2, 3, 4, 5, 6, 7, 8], (0..11).map(|i| i * 7 + 1).collect()];
    let n = 12;
    let want: Vec<Vec<i64>> = prompts.iter().map(|p| fresh_forward_tokens(&dir, p, n)).collect();
    // The switch matters: without the recompute the tokens differ (so the test can fail).
    let no_recompute = on_ranks(1, Device::Cpu, |g| {
        let mut m = ParallelCausalLm::load(&dir, &g, &ModelOptions::new()).unwrap();
        let mut seq = prompts[0].clone();
        let mut logits = m.prefill(&seq).unwrap();
        let mut out = Vec::new();
        for _ in 0..n {
            let l = logits.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
            let v = 1001;
            let last = &l[l.len() - v..];
            let best = (0..v).fold(0, |b, i| if last[i] > last[b] { i } else { b }) as i64;
            out.push(best);
            seq.push(best);
            logits = m.decode_step(best).unwrap();
        }
        out
    })
    .remove(0);
    assert_ne!(no_recompute, want[0], "the long factors change nothing: the test model is too weak");
    // generate(), the single-sequence path.
    for (p, w) in prompts.iter().zip(&want) {
        let got = on_ranks(2, Device::Cpu, |g| {
            let mut m = ParallelCausalLm::load(&dir, &g, &ModelOptions::new()).unwrap();
            m.generate(p, n, &GenerateOptions::new().ignore_eos(true)).unwrap().tokens
        });
        assert_eq!(&got[0], w, "generate, prompt of {}", p.len());
    }
    // The engine: chunked prefill, all three in one batch, TP 1-3, with and without speculation.
    for tp in [1, 2, 3] {
        for spec in [None, Some(NgramConfig { num_speculative_tokens: 3, prompt_lookup_max: 2, prompt_lookup_min: 1 })]
        {
            let mut o = EngineOptions::new(&dir);
            o.tensor_parallel_size = tp;
            o.max_num_batched_tokens = 4;
            o.speculative = spec;
            o.timeout = Duration::from_secs(60);
            let engine = tp_engine::start(&o).expect("start");
            let requests: Vec<Request> = prompts
                .iter()
                .map(|p| Request {
                    prompt: p.clone(),
                    params: SamplingParams::greedy(),
                    max_tokens: n,
                    stop_token_ids: Vec::new(),
                    ignore_eos: true,
                    adapter: 0,
                })
                .collect();
            for (i, events) in run_all(&engine, &requests).iter().enumerate() {
                assert_eq!(tokens(events), want[i], "engine tp {tp} spec {spec:?}: prompt {i}");
            }
            stop(engine);
        }
    }
}
