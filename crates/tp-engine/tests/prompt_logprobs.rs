//! Prompt logprobs against a float64 log-softmax of the model's own full-sequence logits: every
//! prompt token's logprob, rank and top alternatives at TP 1, 2, 3 (an odd vocabulary, so uneven
//! shards) and with two pipeline stages, prompts chunked across steps, beside plain requests,
//! with the prefix cache on (a scored prompt is computed whole), and `max_tokens: 0` scoring a
//! prompt without generating.

mod engine_common;

use engine_common::{model_dir, run_all, stop};
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;
use tp_core::{DType, Device};
use tp_engine::EngineOptions;
use tp_engine::api::{Event, FinishReason, PromptLogprob, Request};
use tp_engine::sampling::SamplingParams;
use tp_models::{ModelOptions, ParallelCausalLm};
use tp_testing::ranks::on_ranks;
use tp_testing::synthetic::SyntheticModel;

/// `(logprob, rank, top k)` of each prompt token after the first, in float64 from the logits
/// the single-sequence path gives at TP 1.
fn reference(dir: &PathBuf, prompt: &[i64], k: usize) -> Vec<(f64, usize, Vec<i64>)> {
    let logits = on_ranks(1, Device::Cpu, |g| {
        let mut m = ParallelCausalLm::load(dir, &g, &ModelOptions::new()).expect("load");
        m.prefill(prompt).expect("prefill").to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap()
    })
    .remove(0);
    let v = logits.len() / prompt.len();
    (0..prompt.len() - 1)
        .map(|p| {
            let row: Vec<f64> = logits[p * v..(p + 1) * v].iter().map(|&x| f64::from(x)).collect();
            let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            let t = prompt[p + 1] as usize;
            let rank = row.iter().filter(|&&x| x >= row[t]).count();
            let mut ids: Vec<usize> = (0..v).collect();
            ids.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            (row[t] - lse, rank, ids[..k].iter().map(|&i| i as i64).collect())
        })
        .collect()
}

struct Out {
    prompt: Option<Vec<Option<PromptLogprob>>>,
    tokens: usize,
    reason: FinishReason,
    completion: usize,
}

/// Each request's prompt logprobs (checked to come once, before any token), token count, finish
/// reason and completion tokens.
fn run(engine: &tp_engine::Engine, requests: Vec<Request>) -> Vec<Out> {
    run_all(engine, &requests)
        .into_iter()
        .map(|events| {
            let mut o = Out { prompt: None, tokens: 0, reason: FinishReason::Abort, completion: 0 };
            for e in events {
                match e {
                    Event::PromptLogprobs(p) => {
                        assert_eq!(o.tokens, 0, "prompt logprobs come before the tokens");
                        assert!(o.prompt.replace(p).is_none(), "prompt logprobs sent twice");
                    }
                    Event::Token { .. } => o.tokens += 1,
                    Event::Finished { reason, usage } => {
                        o.reason = reason;
                        o.completion = usage.completion_tokens;
                    }
                    Event::Failed(_) => unreachable!("run_all panics on a failure"),
                }
            }
            o
        })
        .collect()
}

fn prompt(seed: u64, len: usize) -> Vec<i64> {
    let mut s = seed | 1;
    (0..len)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) % 1001) as i64
        })
        .collect()
}

#[test]
fn prompt_logprobs_match_float64_at_every_layout() {
    let dir = model_dir("prompt-lp-float64", &SyntheticModel::tiny());
    let prompts = [prompt(1, 37), prompt(2, 5), prompt(3, 1), prompt(1, 37)];
    let k = 3;
    let want: Vec<_> = prompts.iter().map(|p| reference(&dir, p, k)).collect();
    for (tp, pp) in [(1, 1), (2, 1), (3, 1), (2, 2)] {
        let mut o = EngineOptions::new(&dir);
        o.tensor_parallel_size = tp;
        o.pipeline_parallel_size = pp;
        o.max_num_batched_tokens = 16; // the 37-token prompts take three chunks
        o.timeout = Duration::from_secs(60);
        let engine = tp_engine::start(&o).expect("start");
        let scored = |max_tokens| Request {
            prompt: Vec::new(),
            params: SamplingParams { prompt_logprobs: Some(k), ..SamplingParams::greedy() },
            max_tokens,
            stop_token_ids: Vec::new(),
            ignore_eos: true,
            adapter: 0,
        };
        let mut reqs: Vec<Request> =
            prompts.iter().enumerate().map(|(i, p)| Request { prompt: p.clone(), ..scored([0, 3, 2, 0][i]) }).collect();
        // A plain request beside them, sharing the first prompt (its blocks go to the prefix cache).
        reqs.insert(1, Request { prompt: prompts[0].clone(), params: SamplingParams::greedy(), ..scored(4) });
        let outs = run(&engine, reqs);
        let plain = &outs[1];
        assert!(plain.prompt.is_none());
        assert_eq!(plain.tokens, 4);
        for (i, o) in outs.iter().enumerate().filter(|(i, _)| *i != 1) {
            let j = if i == 0 { 0 } else { i - 1 };
            let got =
                o.prompt.as_ref().unwrap_or_else(|| panic!("tp {tp} pp {pp}: request {i} has no prompt logprobs"));
            assert_eq!(got.len(), prompts[j].len());
            assert!(got[0].is_none());
            for (p, (g, w)) in got[1..].iter().zip(&want[j]).enumerate() {
                let g = g.as_ref().unwrap_or_else(|| panic!("tp {tp}: request {i} position {} unscored", p + 1));
                let what = format!("tp {tp} pp {pp}: request {i} position {}", p + 1);
                assert!((f64::from(g.logprob) - w.0).abs() < 1e-4, "{what}: {} vs {}", g.logprob, w.0);
                assert_eq!(g.rank, w.1, "{what}");
                assert_eq!(g.top.iter().map(|t| t.0).collect::<Vec<_>>(), w.2, "{what}");
            }
            let max_tokens = [0, 0, 3, 2, 0][i];
            assert_eq!((o.tokens, o.completion), (max_tokens, max_tokens), "tp {tp}: request {i}");
            if max_tokens == 0 {
                assert_eq!(o.reason, FinishReason::Length);
            }
        }
        stop(engine);
    }
}

#[test]
fn max_tokens_zero_needs_prompt_logprobs() {
    let dir = model_dir("prompt-lp-max-tokens-0", &SyntheticModel::tiny());
    let engine = tp_engine::start(&EngineOptions::new(&dir)).expect("start");
    let h = engine.handle();
    let (tx, _rx) = mpsc::channel();
    let r = Request {
        prompt: vec![1, 2],
        params: SamplingParams::greedy(),
        max_tokens: 0,
        stop_token_ids: Vec::new(),
        ignore_eos: false,
        adapter: 0,
    };
    let e = h.submit(r, Box::new(tx)).unwrap_err();
    assert!(e.to_string().contains("max_tokens"), "{e}");
    let (tx, _rx) = mpsc::channel();
    let bad = Request {
        prompt: vec![1, 2],
        params: SamplingParams { prompt_logprobs: Some(21), ..SamplingParams::greedy() },
        max_tokens: 1,
        stop_token_ids: Vec::new(),
        ignore_eos: false,
        adapter: 0,
    };
    assert!(h.submit(bad, Box::new(tx)).unwrap_err().to_string().contains("prompt logprobs"));
}
