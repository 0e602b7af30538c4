//! N-gram speculative decoding gives the tokens of a run without it: greedy and seeded sampling
//! (with penalties, min_tokens and logprobs), at TP 1, 2 and 3 and with two pipeline stages,
//! under `batch_invariant` (so the verifying pass's logits are bitwise a decode's); drafts are
//! proposed and accepted on text that repeats, and counted.

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tp_engine::api::{Event, Request};
use tp_engine::sampling::SamplingParams;
use tp_engine::spec::NgramConfig;
use tp_engine::{Engine, EngineOptions};
use tp_testing::synthetic::SyntheticModel;

/// A fresh folder per test (tests run in parallel).
fn model_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tp-engine-spec-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    SyntheticModel { max_position_embeddings: 256, ..SyntheticModel::tiny() }.write(&dir).expect("write");
    dir
}

type Tokens = Vec<(i64, Option<u32>)>;

fn run(engine: &Engine, requests: &[Request]) -> Vec<Tokens> {
    let h = engine.handle();
    let rxs: Vec<_> = requests
        .iter()
        .map(|r| {
            let (tx, rx) = mpsc::channel();
            h.submit(r.clone(), Box::new(tx)).expect("submit");
            rx
        })
        .collect();
    rxs.into_iter()
        .map(|rx| {
            let mut out = Vec::new();
            loop {
                match rx.recv_timeout(Duration::from_secs(120)).expect("an event") {
                    Event::Token { id, logprobs } => out.push((id, logprobs.map(|l| l.logprob.to_bits()))),
                    Event::Finished { .. } => return out,
                    Event::PromptLogprobs(_) => panic!("unasked prompt logprobs"),
                    Event::Failed(why) => panic!("failed: {why}"),
                }
            }
        })
        .collect()
}

fn stop(engine: Engine) {
    let h = engine.handle();
    h.begin_shutdown();
    drop(h);
    assert!(engine.join(Instant::now() + Duration::from_secs(60)).expect("clean stop"));
}

#[test]
fn speculation_changes_no_token_at_any_layout() {
    let dir = model_dir("speculation_changes_no_token_at_any_layout");
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
    let mut o = EngineOptions::new(model_dir("bad-config"));
    o.speculative = Some(NgramConfig { num_speculative_tokens: 0, prompt_lookup_max: 3, prompt_lookup_min: 1 });
    let e = tp_engine::start(&o).err().expect("refused");
    assert!(e.to_string().contains("num_speculative_tokens"), "{e}");
}
