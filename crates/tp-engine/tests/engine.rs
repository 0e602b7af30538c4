//! The engine against the single-sequence path: every request of a mixed batch (different
//! lengths, chunked prefills beside decodes, preemption forced by a small cache, prefix hits)
//! gets the tokens `ParallelCausalLm::generate` gives it alone; seeded sampling gives the same
//! tokens at every TP degree and in any company; the cache's blocks all come back.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tp_core::{DType, Device};
use tp_engine::api::{Event, FinishReason, Request, SubmitError, Usage};
use tp_engine::sampling::SamplingParams;
use tp_engine::{Engine, EngineOptions};
use tp_models::{GenerateOptions, ModelOptions, ParallelCausalLm};
use tp_testing::ranks::on_ranks;
use tp_testing::synthetic::SyntheticModel;

fn model_dir(name: &str, spec: &SyntheticModel) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tp-engine-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    spec.write(&dir).expect("write the synthetic model");
    dir
}

/// A prompt of `len` ids from a small generator, in `0..vocab`.
fn prompt(seed: u64, len: usize, vocab: usize) -> Vec<i64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as i64
        })
        .collect()
}

/// Greedy tokens of `prompt` from the single-sequence path at TP 1.
fn alone(dir: &Path, prompt: &[i64], max_tokens: usize) -> Vec<i64> {
    on_ranks(1, Device::Cpu, |g| {
        let mut m = ParallelCausalLm::load(dir, &g, &ModelOptions::new()).expect("load");
        m.generate(prompt, max_tokens, &GenerateOptions::new().ignore_eos(true)).expect("generate").tokens
    })
    .remove(0)
}

/// Everything a request produced.
#[derive(Debug)]
struct Outcome {
    tokens: Vec<i64>,
    reason: Option<FinishReason>,
    usage: Option<Usage>,
    failed: Option<String>,
}

fn collect(rx: mpsc::Receiver<Event>) -> Outcome {
    let mut o = Outcome { tokens: Vec::new(), reason: None, usage: None, failed: None };
    loop {
        match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(Event::Token { id, .. }) => o.tokens.push(id),
            Ok(Event::Finished { reason, usage }) => {
                o.reason = Some(reason);
                o.usage = Some(usage);
                return o;
            }
            Ok(Event::PromptLogprobs(_)) => panic!("no prompt logprobs were asked for"),
            Ok(Event::Failed(why)) => {
                o.failed = Some(why);
                return o;
            }
            Err(e) => panic!("no event within 120 s: {e}"),
        }
    }
}

fn request(prompt: Vec<i64>, max_tokens: usize, params: SamplingParams) -> Request {
    Request { prompt, params, max_tokens, stop_token_ids: Vec::new(), ignore_eos: true, adapter: 0 }
}

/// Submits every request at once and waits for all of them.
fn run_all(engine: &Engine, requests: Vec<Request>) -> Vec<Outcome> {
    let h = engine.handle();
    let rxs: Vec<_> = requests
        .into_iter()
        .map(|r| {
            let (tx, rx) = mpsc::channel();
            h.submit(r, Box::new(tx)).expect("submit");
            rx
        })
        .collect();
    rxs.into_iter().map(collect).collect()
}

fn stop(engine: Engine) {
    let h = engine.handle();
    h.begin_shutdown();
    drop(h);
    assert!(engine.join(Instant::now() + Duration::from_secs(60)).expect("clean stop"), "the engine did not stop");
}

/// Waits until the engine's figures show nothing running or waiting and no block in use.
fn assert_drained(engine: &Engine) {
    let h = engine.handle();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = h.stats();
        if s.running == 0 && s.waiting == 0 && s.kv_cache_usage == 0.0 {
            return;
        }
        assert!(Instant::now() < deadline, "blocks or requests left over: {s:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn options(dir: &Path, tp: usize) -> EngineOptions {
    let mut o = EngineOptions::new(dir);
    o.tensor_parallel_size = tp;
    o.timeout = Duration::from_secs(60);
    o
}

#[test]
fn a_mixed_batch_gives_every_request_its_tokens_alone() {
    let spec = SyntheticModel::tiny(); // 12 heads, vocab 1001, 64 positions
    let dir = model_dir("mixed", &spec);
    let lens = [(1, 9), (5, 3), (17, 12), (30, 20), (8, 1), (23, 7)];
    let prompts: Vec<Vec<i64>> = lens.iter().enumerate().map(|(i, &(l, _))| prompt(i as u64 + 1, l, 1001)).collect();
    let want: Vec<Vec<i64>> = prompts.iter().zip(&lens).map(|(p, &(_, n))| alone(&dir, p, n)).collect();
    // One position costs 3 layers x (keys + values) x 12 KV heads x 4 dims x 4 bytes over all
    // ranks; TP 1..4 divides the heads, so a rank pays its share.
    let per_position_bytes = 3 * 2 * 12 * 4 * 4;
    for (tp, block_size, budget_tokens, blocks) in [(1, 4, 7, 1000), (2, 16, 2048, 100), (3, 4, 5, 14), (4, 3, 16, 20)]
    {
        let mut o = options(&dir, tp);
        o.block_size = block_size;
        o.max_num_batched_tokens = budget_tokens;
        // A small cache forces preemption (every rank holds the same block count; TP divides
        // the heads, so a rank's block costs a share of the whole).
        o.kv_cache_memory = blocks * block_size * per_position_bytes / tp;
        let engine = tp_engine::start(&o).expect("start");
        assert_eq!(engine.num_blocks, blocks.min(256 * 64usize.div_ceil(block_size)));
        let reqs =
            prompts.iter().zip(&lens).map(|(p, &(_, n))| request(p.clone(), n, SamplingParams::greedy())).collect();
        let got = run_all(&engine, reqs);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.failed, None, "tp {tp} request {i}");
            assert_eq!(
                &g.tokens, w,
                "tp {tp}, block {block_size}, budget {budget_tokens}, blocks {blocks}: request {i}"
            );
            assert_eq!(g.reason, Some(FinishReason::Length));
            let u = g.usage.expect("usage");
            assert_eq!((u.prompt_tokens, u.completion_tokens), (prompts[i].len(), w.len()));
        }
        assert_drained(&engine);
        stop(engine);
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_repeated_prompt_hits_the_prefix_cache_and_gives_the_same_tokens() {
    let dir = model_dir("prefix", &SyntheticModel::tiny());
    let p = prompt(99, 37, 1001);
    let want = alone(&dir, &p, 6);
    let mut o = options(&dir, 2);
    o.block_size = 8;
    let engine = tp_engine::start(&o).expect("start");
    let first = run_all(&engine, vec![request(p.clone(), 6, SamplingParams::greedy())]).remove(0);
    let second = run_all(&engine, vec![request(p.clone(), 6, SamplingParams::greedy())]).remove(0);
    assert_eq!(first.tokens, want);
    assert_eq!(second.tokens, want);
    assert_eq!(first.usage.unwrap().cached_prompt_tokens, 0);
    // 37 prompt ids fill 4 blocks of 8; all 32 of them are reused.
    assert_eq!(second.usage.unwrap().cached_prompt_tokens, 32);
    assert_eq!(engine.handle().stats().prefix_cache_hits, 32);
    assert_drained(&engine);
    stop(engine);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn seeded_sampling_is_the_same_at_every_tp_degree_and_in_any_batch() {
    let dir = model_dir("seeded", &SyntheticModel::tiny());
    let params =
        SamplingParams { temperature: 0.9, top_p: 0.95, top_k: Some(50), seed: Some(1234), ..Default::default() };
    let target = prompt(7, 11, 1001);
    let mut reference: Option<Vec<i64>> = None;
    for tp in [1, 2, 3, 4] {
        let engine = tp_engine::start(&options(&dir, tp)).expect("start");
        let mut reqs = vec![request(target.clone(), 15, params.clone())];
        if tp % 2 == 0 {
            // In company: other sampled and greedy requests around it.
            for i in 0..5 {
                let p = SamplingParams { seed: Some(i), ..params.clone() };
                reqs.insert(0, request(prompt(100 + i, 3 + 4 * i as usize, 1001), 9, p));
            }
        }
        let got = run_all(&engine, reqs).pop().expect("the target").tokens;
        assert_eq!(got.len(), 15);
        match &reference {
            None => reference = Some(got),
            Some(r) => assert_eq!(&got, r, "tp {tp}"),
        }
        assert_drained(&engine);
        stop(engine);
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn aborts_and_departed_clients_free_their_blocks_and_bad_requests_are_refused() {
    let dir = model_dir("abort", &SyntheticModel::tiny());
    let engine = tp_engine::start(&options(&dir, 2)).expect("start");
    let h = engine.handle();
    // Aborted at once.
    let (tx, rx) = mpsc::channel();
    let id = h.submit(request(prompt(1, 20, 1001), 40, SamplingParams::greedy()), Box::new(tx)).unwrap();
    h.abort(id);
    let o = collect(rx);
    assert!(matches!(o.reason, Some(FinishReason::Abort | FinishReason::Length)), "{o:?}");
    // A client that goes away: its receiver dropped.
    let (tx, rx) = mpsc::channel();
    h.submit(request(prompt(2, 20, 1001), 40, SamplingParams::greedy()), Box::new(tx)).unwrap();
    drop(rx);
    assert_drained(&engine);
    // Refused up front, naming the lengths.
    let too_long = h.submit(request(prompt(3, 60, 1001), 10, SamplingParams::greedy()), Box::new(mpsc::channel().0));
    assert!(matches!(&too_long, Err(SubmitError::TooLong(m)) if m.contains("64") && m.contains("60")), "{too_long:?}");
    let bad_id = h.submit(request(vec![5, 1001], 1, SamplingParams::greedy()), Box::new(mpsc::channel().0));
    assert!(matches!(bad_id, Err(SubmitError::Invalid { param: "prompt", .. })), "{bad_id:?}");
    let bad_p = SamplingParams { top_p: 0.0, ..Default::default() };
    let bad = h.submit(request(vec![5], 1, bad_p), Box::new(mpsc::channel().0));
    assert!(matches!(bad, Err(SubmitError::Invalid { param: "top_p", .. })), "{bad:?}");
    drop(h);
    stop(engine);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_engine_runs_bf16_models() {
    let spec = SyntheticModel { dtype: DType::BF16, ..SyntheticModel::tiny() };
    let dir = model_dir("bf16", &spec);
    let engine = tp_engine::start(&options(&dir, 3)).expect("start");
    let got = run_all(&engine, vec![request(prompt(5, 9, 1001), 4, SamplingParams::greedy())]).remove(0);
    assert_eq!(got.tokens.len(), 4);
    assert!(got.tokens.iter().all(|&t| (0..1001).contains(&t)));
    stop(engine);
    let _ = std::fs::remove_dir_all(dir);
}

/// A token's id, its logprob's bits and its top alternatives' (id, bits).
type TokenBits = (i64, u32, Vec<(i64, u32)>);

/// Every token's id, logprob and top-5 logprobs, as bits.
fn logprob_bits(rx: mpsc::Receiver<Event>) -> Vec<TokenBits> {
    let mut out = Vec::new();
    loop {
        match rx.recv_timeout(Duration::from_secs(120)).expect("an event within 120 s") {
            Event::Token { id, logprobs } => {
                let lp = logprobs.expect("logprobs were asked for");
                out.push((id, lp.logprob.to_bits(), lp.top.iter().map(|&(t, l)| (t, l.to_bits())).collect()));
            }
            Event::PromptLogprobs(_) => panic!("no prompt logprobs were asked for"),
            Event::Finished { .. } => return out,
            Event::Failed(why) => panic!("failed: {why}"),
        }
    }
}

#[test]
fn batch_invariant_logits_are_bitwise_the_same_alone_and_beside_63_others() {
    let dir = model_dir("invariant", &SyntheticModel::tiny());
    let target = || {
        let p = SamplingParams { logprobs: Some(5), ..SamplingParams::greedy() };
        request(prompt(4242, 21, 1001), 10, p)
    };
    for tp in [1, 2] {
        let mut o = options(&dir, tp);
        o.batch_invariant = true;
        o.max_num_batched_tokens = 64; // the target's prompt is chunked differently in company
        o.enable_prefix_caching = false; // its second run computes everything again
        let engine = tp_engine::start(&o).expect("start");
        let h = engine.handle();
        let (tx, rx) = mpsc::channel();
        h.submit(target(), Box::new(tx)).unwrap();
        let alone = logprob_bits(rx);
        assert_eq!(alone.len(), 10);
        let mut others = Vec::new();
        for i in 0..63u64 {
            let params = if i % 3 == 0 {
                SamplingParams { seed: Some(i), ..Default::default() }
            } else {
                SamplingParams::greedy()
            };
            let (tx, rx) = mpsc::channel();
            h.submit(
                request(prompt(i + 1, 1 + (i as usize * 7) % 40, 1001), 1 + (i as usize % 12), params),
                Box::new(tx),
            )
            .unwrap();
            others.push(rx);
            if i == 30 {
                let (tx, rx) = mpsc::channel();
                h.submit(target(), Box::new(tx)).unwrap();
                others.push(rx);
            }
        }
        let in_batch = logprob_bits(others.remove(31));
        for rx in others {
            collect(rx);
        }
        assert_eq!(in_batch, alone, "tp {tp}: the target's logprobs differ bitwise in company");
        assert_drained(&engine);
        drop(h);
        stop(engine);
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// An 8-bit KV cache runs requests on the host (at TP 2, every rank's cache 8-bit) and is
/// refused up front for a GPU engine, naming the flag.
#[test]
fn an_8_bit_kv_cache_serves_on_the_host_and_is_refused_for_a_gpu() {
    let spec =
        SyntheticModel { head_dim: Some(32), num_attention_heads: 4, num_key_value_heads: 2, ..SyntheticModel::tiny() };
    let dir = model_dir("kv8", &spec);
    for quant in [tp_core::KvQuant::Fp8E4M3, tp_core::KvQuant::Q8_0] {
        let mut opts = options(&dir, 2);
        opts.kv_cache_dtype = Some(quant);
        let engine = tp_engine::start(&opts).expect("start");
        let got = run_all(&engine, vec![request(prompt(5, 9, 1001), 4, SamplingParams::greedy())]).remove(0);
        assert_eq!(got.tokens.len(), 4, "{quant}");
        stop(engine);
        opts.device = tp_engine::DeviceKind::Cuda;
        let err = tp_engine::start(&opts).err().expect("a GPU engine with an 8-bit cache").to_string();
        assert!(err.contains("--kv-cache-dtype") && err.contains("host memory"), "{err}");
    }
    let _ = std::fs::remove_dir_all(dir);
}
