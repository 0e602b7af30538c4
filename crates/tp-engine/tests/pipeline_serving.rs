//! Serving with pipeline stages: the engine at `-pp P -tp N` gives every request the tokens
//! (and, with batch invariance, the logprob bits) it gets at `-pp 1 -tp 1`, greedy and seeded,
//! in a mixed batch with chunked prefills and preemption; a stage that fails ends every
//! request with an error.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tp_engine::api::{Event, Request};
use tp_engine::sampling::SamplingParams;
use tp_engine::{Engine, EngineOptions, Fault};
use tp_testing::synthetic::SyntheticModel;

fn model_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tp-engine-pp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    SyntheticModel { num_hidden_layers: 5, ..SyntheticModel::tiny() }.write(&dir).expect("write the model");
    dir
}

fn prompt(seed: u64, len: usize) -> Vec<i64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 1001) as i64
        })
        .collect()
}

/// Per request: the tokens and their logprob bits, or the failure.
type Outcome = Result<Vec<(i64, u32)>, String>;

fn run(engine: &Engine, requests: Vec<Request>) -> Vec<Outcome> {
    let h = engine.handle();
    let rxs: Vec<_> = requests
        .into_iter()
        .map(|r| {
            let (tx, rx) = mpsc::channel();
            h.submit(r, Box::new(tx)).expect("submit");
            rx
        })
        .collect();
    rxs.into_iter()
        .map(|rx| {
            let mut out = Vec::new();
            loop {
                match rx.recv_timeout(Duration::from_secs(120)).expect("an event within 120 s") {
                    Event::Token { id, logprobs } => out.push((id, logprobs.map_or(0, |l| l.logprob.to_bits()))),
                    Event::PromptLogprobs(_) => return Err("unasked prompt logprobs".into()),
                    Event::Finished { .. } => return Ok(out),
                    Event::Failed(why) => return Err(why),
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

fn options(dir: &Path, pp: usize, tp: usize) -> EngineOptions {
    let mut o = EngineOptions::new(dir);
    o.pipeline_parallel_size = pp;
    o.tensor_parallel_size = tp;
    o.timeout = Duration::from_secs(60);
    o.batch_invariant = true;
    o.max_num_batched_tokens = 24; // chunked prefills beside decodes
    o
}

fn requests() -> Vec<Request> {
    (0..8u64)
        .map(|i| {
            let params = if i % 2 == 0 {
                SamplingParams { logprobs: Some(3), ..SamplingParams::greedy() }
            } else {
                SamplingParams {
                    temperature: 0.8,
                    top_k: Some(40),
                    seed: Some(i),
                    logprobs: Some(3),
                    ..Default::default()
                }
            };
            Request {
                prompt: prompt(i + 1, 3 + 5 * i as usize),
                params,
                max_tokens: 4 + i as usize,
                stop_token_ids: Vec::new(),
                ignore_eos: true,
                adapter: 0,
            }
        })
        .collect()
}

#[test]
fn every_pipeline_layout_gives_the_single_stage_tokens_and_logprobs() {
    let dir = model_dir("layouts");
    let tokens = |o: &[Outcome]| -> Vec<Vec<i64>> {
        o.iter().map(|r| r.as_ref().expect("served").iter().map(|t| t.0).collect()).collect()
    };
    let mut one_rank: Option<Vec<Vec<i64>>> = None;
    for (tp, stages) in [(1, vec![2, 3, 5]), (2, vec![2, 3])] {
        // The same tensor-parallel degree without stages: bitwise the same logprobs (the
        // stages only move the hidden states; batch invariance keeps each row's GEMMs).
        let base_engine = tp_engine::start(&options(&dir, 1, tp)).expect("start");
        let base = run(&base_engine, requests());
        stop(base_engine);
        assert!(base.iter().all(|o| o.as_ref().is_ok_and(|t| !t.is_empty())), "{base:?}");
        // Token for token the same as one rank (TP changes only the sums' rounding).
        match &one_rank {
            None => one_rank = Some(tokens(&base)),
            Some(t) => assert_eq!(&tokens(&base), t, "tp {tp}"),
        }
        for pp in stages {
            let mut o = options(&dir, pp, tp);
            if pp == 3 {
                // 12 blocks of 16 positions on the 2-layer stages (keys and values of 12 heads
                // of 4 dims in f32, split over TP): the 8 requests need more, so some are
                // preempted and recomputed.
                o.kv_cache_memory = 12 * 2 * 2 * 12 * 4 * 4 * 16 / tp;
            }
            let engine = tp_engine::start(&o).expect("start");
            if pp == 3 {
                assert_eq!(engine.num_blocks, 12);
            }
            let got = run(&engine, requests());
            assert_eq!(got, base, "pp {pp} tp {tp}");
            stop(engine);
            // The stages taking turns (one step at a time) give the same bits too.
            let engine = tp_engine::start(&EngineOptions { pipelined: false, ..o.clone() }).expect("start");
            assert_eq!(run(&engine, requests()), base, "pp {pp} tp {tp}, one step at a time");
            stop(engine);
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn pipeline_settings_the_model_cannot_take_are_refused() {
    let dir = model_dir("bad");
    let e = tp_engine::start(&options(&dir, 6, 1)).err().expect("6 stages of 5 layers").to_string();
    assert!(e.contains("more stages than the model has layers"), "{e}");
    let e = tp_engine::start(&options(&dir, 0, 1)).err().expect("0 stages").to_string();
    assert!(e.contains("pipeline parallel size"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_stage_that_fails_ends_every_request_with_an_error() {
    let dir = model_dir("fault");
    let mut o = options(&dir, 2, 2);
    // World rank 3: the last stage's second rank.
    o.fault = Some(Fault { rank: 3, step: 2, hang: None });
    let engine = tp_engine::start(&o).expect("start");
    let started = Instant::now();
    let got = run(&engine, requests());
    assert!(started.elapsed() < Duration::from_secs(30));
    assert!(got.iter().all(|o| o.as_ref().is_err_and(|e| e.contains("rank 3"))), "{got:?}");
    let h = engine.handle();
    h.begin_shutdown();
    drop(h);
    assert!(engine.join(Instant::now() + Duration::from_secs(30)).is_err(), "the engine reports the failure");
    let _ = std::fs::remove_dir_all(dir);
}

/// An abort of a request whose step is in flight (pipelined steps) waits for that step: the
/// request ends, its blocks are not reused under the step, and every other request gets the
/// tokens it gets without the abort.
#[test]
fn aborting_a_request_in_flight_leaves_the_others_alone() {
    let dir = model_dir("abort");
    let reqs = || -> Vec<Request> {
        (0..6u64)
            .map(|i| Request {
                prompt: prompt(i + 11, 5 + 3 * i as usize),
                params: SamplingParams::greedy(),
                max_tokens: 24,
                stop_token_ids: Vec::new(),
                ignore_eos: true,
                adapter: 0,
            })
            .collect()
    };
    // A pause after each step, so that the abort comes while the request still runs.
    let engine = tp_engine::start(&EngineOptions { step_delay: Duration::from_millis(20), ..options(&dir, 2, 1) })
        .expect("start");
    let want = run(&engine, reqs());
    // The same requests, request 2 aborted once its first token is out.
    let h = engine.handle();
    let mut rxs = Vec::new();
    let mut ids = Vec::new();
    for r in reqs() {
        let (tx, rx) = mpsc::channel();
        ids.push(h.submit(r, Box::new(tx)).expect("submit"));
        rxs.push(rx);
    }
    let mut got: Vec<Vec<i64>> = vec![Vec::new(); rxs.len()];
    let mut aborted = false;
    // Request 2's stream first: its abort goes out at its first token.
    for i in [2, 0, 1, 3, 4, 5] {
        let rx = &rxs[i];
        loop {
            match rx.recv_timeout(Duration::from_secs(120)).expect("an event within 120 s") {
                Event::Token { id, .. } => {
                    got[i].push(id);
                    if i == 2 && !aborted {
                        h.abort(ids[2]);
                        aborted = true;
                    }
                }
                Event::Finished { .. } => break,
                Event::Failed(why) => panic!("request {i} failed: {why}"),
                Event::PromptLogprobs(_) => panic!("unasked prompt logprobs"),
            }
        }
    }
    assert!(got[2].len() < 24, "request 2 ran to its end: {:?}", got[2]);
    for (i, w) in want.iter().enumerate() {
        let w: Vec<i64> = w.as_ref().expect("served").iter().map(|t| t.0).collect();
        if i == 2 {
            assert_eq!(got[2], w[..got[2].len()], "request 2's tokens before the abort");
        } else {
            assert_eq!(got[i], w, "request {i}");
        }
    }
    drop(h);
    stop(engine);
    let _ = std::fs::remove_dir_all(dir);
}
