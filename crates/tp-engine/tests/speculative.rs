//! N-gram speculative decoding gives the tokens of a run without it: greedy and seeded sampling
//! (with penalties, min_tokens and logprobs), at TP 1, 2 and 3 and with two pipeline stages,
//! under `batch_invariant` (so the verifying pass's logits are bitwise a decode's); drafts are
//! proposed and accepted on text that repeats, and counted.

mod engine_common;

use engine_common::{model_dir, run_all, stop};
use std::time::Duration;
use tp_engine::api::{Event, Request};
use tp_engine::sampling::SamplingParams;
use tp_engine::spec::NgramConfig;
use tp_engine::{Engine, EngineOptions};
use tp_testing::synthetic::SyntheticModel;

fn spec_model(name: &str) -> std::path::PathBuf {
    model_dir(name, &SyntheticModel { max_position_embeddings: 256, ..SyntheticModel::tiny() })
}

type Tokens = Vec<(i64, Option<u32>)>;

/// Each request's tokens with their logprobs' bits.
fn run(engine: &Engine, requests: &[Request]) -> Vec<Tokens> {
    run_all(engine, requests)
        .into_iter()
        .map(|events| {
            events
                .into_iter()
                .filter_map(|e| match e {
                    Event::Token { id, logprobs } => Some((id, logprobs.map(|l| l.logprob.to_bits()))),
                    Event::PromptLogprobs(_) => panic!("unasked prompt logprobs"),
                    _ => None,
                })
                .collect()
        })
        .collect()
}

#[test]
fn speculation_changes_no_token_at_any_layout() {
    let dir = spec_model("spec-same-tokens");
    // A prompt that repeats itself, so n-grams recur; and one that does not.
    let period: Vec<i64> = vec![5, 17, 300, 42, 9, 77, 5, 901];
    let repeating: Vec<i64> = period.iter().cycle().take(40).copied().collect();
    let plain: Vec<i64> = (0..30).map(|i| (i * 37 + 11) % 1001).collect();
    let request = |prompt: &Vec<i64>, params: SamplingParams| Request {
        prompt: prompt.clone(),
        params,
        max_tokens: 40,
        stop_token_ids: Vec::new(),
        ignore_eos: true,
        adapter: 0,
    };
    let seeded =
        SamplingParams { temperature: 0.8, top_k: Some(20), seed: Some(7), logprobs: Some(2), ..Default::default() };
    let penalised =
        SamplingParams { repetition_penalty: 1.3, frequency_penalty: 0.5, min_tokens: 5, ..SamplingParams::greedy() };
    let requests = vec![
        request(&repeating, SamplingParams::greedy()),
        request(&repeating, seeded.clone()),
        request(&plain, SamplingParams::greedy()),
        request(&plain, seeded),
        request(&repeating, penalised),
    ];
    // Tokens are the same at every layout; logprobs bitwise with and without speculation at one
    // layout (their reductions differ between TP degrees).
    let mut tokens_at_tp1: Option<Vec<Vec<i64>>> = None;
    for (tp, pp) in [(1, 1), (2, 1), (3, 1), (2, 2)] {
        let mut reference = None;
        for spec in [None, Some(NgramConfig { num_speculative_tokens: 4, prompt_lookup_max: 4, prompt_lookup_min: 1 })]
        {
            let mut o = EngineOptions::new(&dir);
            o.tensor_parallel_size = tp;
            o.pipeline_parallel_size = pp;
            o.batch_invariant = true;
            o.speculative = spec;
            o.timeout = Duration::from_secs(60);
            let engine = tp_engine::start(&o).expect("start");
            let got = run(&engine, &requests);
            let stats = engine.handle().stats();
            if spec.is_some() {
                assert!(stats.spec_draft_tokens > 0, "tp {tp} pp {pp}: nothing was drafted");
                assert!(stats.spec_accepted_tokens > 0, "tp {tp} pp {pp}: nothing was accepted: {stats:?}");
                assert!(stats.spec_accepted_tokens <= stats.spec_draft_tokens);
            } else {
                assert_eq!((stats.spec_draft_tokens, stats.spec_accepted_tokens), (0, 0));
            }
            for g in &got {
                assert_eq!(g.len(), 40);
            }
            let tokens: Vec<Vec<i64>> = got.iter().map(|g| g.iter().map(|t| t.0).collect()).collect();
            assert_eq!(tokens_at_tp1.get_or_insert_with(|| tokens.clone()), &tokens, "tp {tp} pp {pp} {spec:?}");
            match &reference {
                None => reference = Some(got),
                Some(r) => {
                    for (i, (a, b)) in r.iter().zip(&got).enumerate() {
                        assert_eq!(a, b, "tp {tp} pp {pp} speculative {spec:?}: request {i}");
                    }
                }
            }
            stop(engine);
        }
    }
}

#[test]
fn a_bad_configuration_is_refused() {
    let mut o = EngineOptions::new(spec_model("spec-bad-config"));
    o.speculative = Some(NgramConfig { num_speculative_tokens: 0, prompt_lookup_max: 3, prompt_lookup_min: 1 });
    let e = tp_engine::start(&o).err().expect("refused");
    assert!(e.to_string().contains("num_speculative_tokens"), "{e}");
}
