//! Serving rows of tp-bench: the engine (`tp_engine`, the same one `tp serve` runs, without the
//! HTTP layer) on the TinyLlama-shaped checkpoint in bf16, on the host at TP 1.
//!
//! * Concurrency 1, 4, 16 and 64: that many requests at once (distinct 64-token prompts, 32
//!   new tokens each, greedy): output tokens/s over the run, and each request's time to first
//!   token (TTFT) and time per output token after it (TPOT), p50 and p99. The ratio column of the
//!   concurrency rows is against concurrency 1 (the goal: 16 sequences >= 8x one). The
//!   "all decoding" rows are the tokens/s once every request has its first token (the decode
//!   steps of the whole batch, no prefill between them), 64 beside 16 (the goal: not below).
//! * The step phases of the 16-request run's decode steps (from the engine's `Stats::phases`:
//!   products, attention, element-wise, sampling, scheduler), milliseconds per step.
//! * Poisson arrivals: 32 requests arriving at random (exponential gaps) at a rate near the
//!   engine's capacity.
//! * A 16-sequence decode step beside its GEMMs alone (each projection at M = 16 on a weight
//!   packed once, as the engine packs them, timed bare).
//! * Chunked prefill: 8 decoding requests while a long prompt is admitted in chunks of
//!   `CHUNK` tokens: the decodes' p99 gap between tokens over their median.
//! * transformers' batched `generate` (batch 16, the same prompts and lengths, greedy, same
//!   threads) beside the concurrency-16 row, when python3 has torch and transformers.
//!
//! With `--model FILE.gguf`, [`gguf_rows`] serves the file on its quantized blocks with the load
//! generator's workload (128-token prompts, 64-token answers, concurrency 1, 4, 16 and 64, all
//! at once): output tokens/s, TTFT p50 and the time per output token p50 (guidellm's ITL), and
//! the 16-request run's step phases; `benches/reference/load_vs_llama_server.py` puts the same
//! workload through guidellm against `tp serve` and `llama-server`.

use crate::{Args, Row};
use anyhow::{Context, Result, bail};
use std::path::Path;
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tp_core::{DType, Device, Tensor};
use tp_engine::api::{Event, EventSink, Request, StepPhases};
use tp_engine::sampling::SamplingParams;
use tp_engine::{Engine, EngineOptions};

pub(crate) const PROMPT_LEN: usize = 64;
/// Tokens per step while the long prompt is admitted.
const CHUNK: usize = 32;

/// Token arrival times of one request.
pub(crate) struct Timed {
    submitted: Instant,
    tokens: Vec<Instant>,
}

/// A sink that stamps each event as it arrives.
struct Stamp(mpsc::Sender<(usize, Instant, bool)>, usize);

impl EventSink for Stamp {
    fn send(&mut self, e: Event) -> bool {
        let now = Instant::now();
        let done = !matches!(e, Event::Token { .. });
        if let Event::Failed(why) = &e {
            eprintln!("  request {} failed: {why}", self.1);
        }
        self.0.send((self.1, now, done)).is_ok()
    }
}

pub(crate) fn prompt(i: usize, len: usize, vocab: usize) -> Vec<i64> {
    (0..len).map(|j| ((i * 7_919 + j * 104_729 + 13) % vocab) as i64).collect()
}

/// Shuts the engine down and waits (a minute at most) for its ranks.
pub(crate) fn stop(engine: Engine) {
    let h = engine.handle();
    h.begin_shutdown();
    drop(h);
    let _ = engine.join(Instant::now() + Duration::from_secs(60));
}

/// Submits `prompts` at the given offsets from now and waits for all; the timings per request.
fn run_requests(engine: &Engine, prompts: &[Vec<i64>], max_tokens: usize, offsets: &[Duration]) -> Result<Vec<Timed>> {
    Ok(run_phased(engine, prompts, max_tokens, offsets)?.0)
}

/// [`run_requests`], and the engine's step phases from the moment every request had its second
/// token to the end (the decode steps alone when all arrive at once: the statistics of the step
/// that gave a token may be recorded after its token arrives, so the first token's moment could
/// still count the prefill step).
pub(crate) fn run_phased(
    engine: &Engine,
    prompts: &[Vec<i64>],
    max_tokens: usize,
    offsets: &[Duration],
) -> Result<(Vec<Timed>, StepPhases)> {
    run_adapted(engine, prompts, max_tokens, offsets, &[])
}

/// [`run_phased`] with request `i` through LoRA slot `adapters[i]` (0, or none given: the base).
pub(crate) fn run_adapted(
    engine: &Engine,
    prompts: &[Vec<i64>],
    max_tokens: usize,
    offsets: &[Duration],
    adapters: &[u32],
) -> Result<(Vec<Timed>, StepPhases)> {
    let h = engine.handle();
    let mut with_second = 0;
    let mut at_second = None;
    let (tx, rx) = mpsc::channel();
    let start = Instant::now();
    let mut timed: Vec<Timed> = Vec::new();
    let mut done = 0;
    let mut next = 0;
    while done < prompts.len() {
        while next < prompts.len() && start.elapsed() >= offsets[next] {
            let r = Request {
                prompt: prompts[next].clone(),
                params: SamplingParams::greedy(),
                max_tokens,
                stop_token_ids: vec![],
                ignore_eos: true,
                adapter: adapters.get(next).copied().unwrap_or(0),
            };
            timed.push(Timed { submitted: Instant::now(), tokens: Vec::new() });
            h.submit(r, Box::new(Stamp(tx.clone(), next))).map_err(|e| anyhow::anyhow!("submit: {e}"))?;
            next += 1;
        }
        let wait = offsets.get(next).map_or(Duration::from_secs(600), |o| o.saturating_sub(start.elapsed()));
        match rx.recv_timeout(wait.max(Duration::from_millis(1))) {
            Ok((i, at, true)) => {
                let _ = (i, at);
                done += 1;
            }
            Ok((i, at, false)) => {
                timed[i].tokens.push(at);
                if timed[i].tokens.len() == 2 {
                    with_second += 1;
                    if with_second == prompts.len() {
                        at_second = Some(h.stats().phases);
                    }
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(e) => bail!("the engine went away: {e}"),
        }
    }
    let end = h.stats().phases;
    let start = at_second.unwrap_or(end);
    let phases = StepPhases {
        steps: end.steps - start.steps,
        gemm: end.gemm - start.gemm,
        attention: end.attention - start.attention,
        elementwise: end.elementwise - start.elementwise,
        sampling: end.sampling - start.sampling,
        scheduler: end.scheduler - start.scheduler,
    };
    Ok((timed, phases))
}

/// `(p50, p99)` of `v`.
fn pcts(mut v: Vec<f64>) -> (f64, f64) {
    if v.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

/// Output tokens/s, TTFT (p50, p99) and TPOT (p50, p99) in milliseconds.
pub(crate) struct Summary {
    pub(crate) tps: f64,
    /// Tokens/s from the moment every request had its first token to the last token: the
    /// decode rate with the whole batch running, no prefill in between.
    pub(crate) steady: f64,
    ttft: (f64, f64),
    tpot: (f64, f64),
}

pub(crate) fn summarize(t: &[Timed]) -> Summary {
    let first = t.iter().map(|r| r.submitted).min().unwrap_or_else(Instant::now);
    let last = t.iter().filter_map(|r| r.tokens.last().copied()).max().unwrap_or(first);
    let n: usize = t.iter().map(|r| r.tokens.len()).sum();
    let ttft = t.iter().filter_map(|r| r.tokens.first().map(|f| (*f - r.submitted).as_secs_f64() * 1e3)).collect();
    let tpot = t
        .iter()
        .filter(|r| r.tokens.len() > 1)
        .map(|r| (r.tokens[r.tokens.len() - 1] - r.tokens[0]).as_secs_f64() * 1e3 / (r.tokens.len() - 1) as f64)
        .collect();
    let all_first = t.iter().filter_map(|r| r.tokens.first().copied()).max().unwrap_or(first);
    let after = t.iter().flat_map(|r| r.tokens.iter()).filter(|&&at| at > all_first).count();
    let steady = after as f64 / (last - all_first).as_secs_f64().max(1e-9);
    Summary { tps: n as f64 / (last - first).as_secs_f64().max(1e-9), steady, ttft: pcts(ttft), tpot: pcts(tpot) }
}

pub(crate) fn row(
    name: String,
    shape: String,
    ours: f64,
    unit: &'static str,
    base: Option<(&'static str, f64)>,
) -> Row {
    Row {
        kind: "serve",
        name,
        shape,
        dtype: "bf16".into(),
        ours,
        unit,
        baseline_name: base.map_or("-", |b| b.0),
        baseline: base.map(|b| b.1),
        matched: None,
        roofline: None,
        bound: None,
    }
}

/// The serving rows on the host.
pub fn rows(args: &Args, dir: &Path) -> Result<Vec<Row>> {
    let config = tp_models::ModelConfig::from_dir(dir)?;
    let vocab = config.vocab_size;
    let new_tokens = if args.quick { 8 } else { 32 };
    let levels: &[usize] = if args.quick { &[1, 4] } else { &[1, 4, 16, 64] };
    let mut opts = EngineOptions::new(dir);
    opts.dtype = Some(DType::BF16);
    opts.max_num_batched_tokens = 2048;
    let engine = tp_engine::start(&opts).context("starting the engine")?;
    let mut rows = Vec::new();
    // Warm-up.
    run_requests(&engine, &[prompt(999, 8, vocab)], 2, &[Duration::ZERO])?;
    let mut single_tps = None;
    let mut tps16 = None;
    let mut decode_phases = None;
    let mut steady16 = None;
    for &c in levels {
        eprint!("\r  measuring serving, {c} concurrent requests...          ");
        let prompts: Vec<_> = (0..c).map(|i| prompt(i + 1000 * c, PROMPT_LEN, vocab)).collect();
        let (t, phases) = run_phased(&engine, &prompts, new_tokens, &vec![Duration::ZERO; c])?;
        let s = summarize(&t);
        if c == 16 {
            decode_phases = Some(phases);
        }
        // Decode rate: sequences over their median time per output token.
        let decode = c as f64 / (s.tpot.0 / 1e3);
        let base = single_tps.map(|b| ("concurrency 1", b));
        if c == 1 {
            single_tps = Some(decode);
        }
        if c == 16 {
            tps16 = Some(decode);
        }
        let shape = format!("{c}x({PROMPT_LEN}+{new_tokens})");
        rows.push(row(format!("decode, {c} concurrent"), shape.clone(), decode, "tokens/s", base));
        rows.push(row(format!("output, {c} concurrent"), shape.clone(), s.tps, "tokens/s", None));
        let steady_base = steady16.filter(|_| c == 64).map(|b| ("16 concurrent", b));
        rows.push(row(format!("all decoding, {c} conc."), shape.clone(), s.steady, "tokens/s", steady_base));
        if c == 16 {
            steady16 = Some(s.steady);
        }
        rows.push(row(format!("TTFT p50, {c} conc."), shape.clone(), s.ttft.0, "ms", None));
        rows.push(row(format!("TTFT p99, {c} conc."), shape.clone(), s.ttft.1, "ms", None));
        rows.push(row(format!("TPOT p50, {c} conc."), shape.clone(), s.tpot.0, "ms", None));
        rows.push(row(format!("TPOT p99, {c} conc."), shape, s.tpot.1, "ms", None));
    }
    if !args.quick {
        eprint!("\r  measuring serving, Poisson arrivals...          ");
        let n = 32;
        let rate = single_tps.unwrap_or(1.0) / new_tokens as f64 * 4.0; // requests/s
        let mut s = 0x2545_f491_4f6c_dd1du64;
        let mut at = 0.0;
        let offsets: Vec<Duration> = (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let u = ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
                at += -u.ln() / rate;
                Duration::from_secs_f64(at)
            })
            .collect();
        let prompts: Vec<_> = (0..n).map(|i| prompt(i + 77_000, PROMPT_LEN, vocab)).collect();
        let p = summarize(&run_requests(&engine, &prompts, new_tokens, &offsets)?);
        let shape = format!("{n} at {rate:.2}/s");
        rows.push(row("Poisson output".into(), shape.clone(), p.tps, "tokens/s", None));
        rows.push(row("Poisson TTFT p50".into(), shape.clone(), p.ttft.0, "ms", None));
        rows.push(row("Poisson TTFT p99".into(), shape.clone(), p.ttft.1, "ms", None));
        rows.push(row("Poisson TPOT p50".into(), shape.clone(), p.tpot.0, "ms", None));
        rows.push(row("Poisson TPOT p99".into(), shape, p.tpot.1, "ms", None));
        // A 16-sequence decode step beside its GEMMs alone.
        if let Some(d) = tps16 {
            let step_ms = 16.0 / d * 1e3;
            let gemm_ms = gemms_alone_ms(&config, 16)?;
            rows.push(row(
                "decode step 16 vs GEMMs".into(),
                "16 tokens".into(),
                step_ms,
                "ms",
                Some(("GEMMs alone", gemm_ms)),
            ));
            if let Some(p) = decode_phases.filter(|p| p.steps > 0) {
                let per = |secs: f64| secs / p.steps as f64 * 1e3;
                for (name, secs) in p.named() {
                    rows.push(row(format!("step 16: {name}"), format!("{} steps", p.steps), per(secs), "ms", None));
                }
            }
        }
    }
    stop(engine);
    if !args.quick {
        eprint!("\r  measuring serving, chunked prefill beside 8 decodes...          ");
        rows.push(chunked_prefill_row(dir, vocab, config.max_position_embeddings)?);
        eprint!("\r  measuring transformers' batched generate (16)...          ");
        match transformers_batched(dir, 16, PROMPT_LEN, new_tokens, vocab) {
            Ok(tps) => {
                if let Some(ours) = tps16 {
                    rows.push(row(
                        "decode 16 vs transformers".into(),
                        format!("16x({PROMPT_LEN}+{new_tokens})"),
                        ours,
                        "tokens/s",
                        Some(("transformers", tps)),
                    ));
                }
            }
            Err(e) => println!("transformers batched baseline skipped: {e}"),
        }
    }
    Ok(rows)
}

/// The serving rows of a GGUF file on its quantized blocks, with the load generator's workload.
pub fn gguf_rows(args: &Args, file: &Path) -> Result<Vec<Row>> {
    const PROMPT: usize = 128;
    const ANSWER: usize = 64;
    let vocab = tp_models::ModelConfig::from_dir(file)?.vocab_size;
    let levels: &[usize] = if args.quick { &[1, 4] } else { &[1, 4, 16, 64] };
    let engine = tp_engine::start(&EngineOptions::new(file)).context("starting the engine")?;
    run_requests(&engine, &[prompt(999, 8, vocab)], 2, &[Duration::ZERO])?; // warm-up
    let mut rows = Vec::new();
    let mut one = None;
    for &c in levels {
        eprint!("\r  measuring GGUF serving, {c} concurrent requests...          ");
        let prompts: Vec<_> = (0..c).map(|i| prompt(i + 3000 * c, PROMPT, vocab)).collect();
        let (t, phases) = run_phased(&engine, &prompts, ANSWER, &vec![Duration::ZERO; c])?;
        let s = summarize(&t);
        let shape = format!("{c}x({PROMPT}+{ANSWER})");
        let mut gguf_row = |name: String, ours, unit, base| {
            let mut r = row(name, shape.clone(), ours, unit, base);
            r.dtype = "gguf".into();
            rows.push(r);
        };
        gguf_row(format!("gguf output, {c} conc."), s.tps, "tokens/s", one.map(|b| ("concurrency 1", b)));
        gguf_row(format!("gguf TTFT p50, {c} conc."), s.ttft.0, "ms", None);
        gguf_row(format!("gguf ITL p50, {c} conc."), s.tpot.0, "ms", None);
        if c == 1 {
            one = Some(s.tps);
        }
        if c == 16 && phases.steps > 0 {
            let per = |secs: f64| secs / phases.steps as f64 * 1e3;
            for (name, secs) in phases.named() {
                gguf_row(format!("gguf step 16: {name}"), per(secs), "ms", None);
            }
        }
    }
    stop(engine);
    Ok(rows)
}

/// Eight decoding requests; then a long prompt arrives and is prefilled `CHUNK` tokens per step.
/// The row: the decodes' p99 gap between tokens over their median (the goal: at most 3).
fn chunked_prefill_row(dir: &Path, vocab: usize, max_pos: usize) -> Result<Row> {
    let mut opts = EngineOptions::new(dir);
    opts.dtype = Some(DType::BF16);
    opts.max_num_batched_tokens = CHUNK;
    let engine = tp_engine::start(&opts)?;
    let decode_tokens = 64;
    let long = 2048usize.min(max_pos.saturating_sub(decode_tokens + 1)).max(1);
    let mut prompts: Vec<_> = (0..8).map(|i| prompt(i + 5_000, 16, vocab)).collect();
    prompts.push(prompt(6_000, long, vocab));
    let mut offsets = vec![Duration::ZERO; 8];
    offsets.push(Duration::from_millis(500));
    let t = run_requests(&engine, &prompts, decode_tokens, &offsets)?;
    let gaps: Vec<f64> = t[..8]
        .iter()
        .flat_map(|r| r.tokens.windows(2).map(|w| (w[1] - w[0]).as_secs_f64() * 1e3).collect::<Vec<_>>())
        .collect();
    let (p50, p99) = pcts(gaps);
    stop(engine);
    Ok(row(format!("p99/p50 gap, {long}-token prompt"), format!("8 decodes, chunks of {CHUNK}"), p99 / p50, "x", None))
}

/// Milliseconds of one step's GEMMs alone at `m` tokens: every layer's four products (fused
/// QKV, o, merged gate/up, down) on weights of their own, packed once as the engine packs
/// them, and the LM head, run one after the other as a step runs them (so each product streams
/// its weight from memory, as in the engine), the best of three passes.
fn gemms_alone_ms(c: &tp_models::ModelConfig, m: usize) -> Result<f64> {
    let mut products = Vec::new();
    for layer in 0..c.num_hidden_layers {
        for (i, (n, k)) in crate::model::layer_products(c).into_iter().enumerate() {
            products.push((m, n, k, 4 * layer as u64 + i as u64));
        }
    }
    products.push((m, c.vocab_size, c.hidden_size, u64::MAX / 2));
    let weights = products
        .iter()
        .map(|&(m, n, k, seed)| {
            let x = Tensor::rand(&[m, k], DType::BF16, 1, &Device::Cpu)?;
            let w = Tensor::rand(&[n, k], DType::BF16, seed + 2, &Device::Cpu)?;
            let packed = w.pack_weight()?;
            Ok((x, w, packed))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let start = Instant::now();
        for (x, w, packed) in &weights {
            std::hint::black_box(x.linear_packed(w, packed, None)?);
        }
        best = best.min(start.elapsed().as_secs_f64());
    }
    Ok(best * 1e3)
}

const TRANSFORMERS_BATCHED: &str = r#"
import sys, time, torch
from transformers import AutoModelForCausalLM
path, batch, plen, new, vocab, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
torch.set_num_threads(threads)
m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
ids = torch.tensor([[((i + 1000 * batch) * 7919 + j * 104729 + 13) % vocab for j in range(plen)] for i in range(batch)])
mask = torch.ones_like(ids)
kw = dict(do_sample=False, pad_token_id=0, attention_mask=mask)
with torch.inference_mode():
    m.generate(ids[:, :8], max_new_tokens=2, min_new_tokens=2, **{**kw, "attention_mask": mask[:, :8]})
    t = time.perf_counter(); m.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw); pre = time.perf_counter() - t
    t = time.perf_counter(); m.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw); full = time.perf_counter() - t
print(batch * (new - 1) / max(full - pre, 1e-9))
"#;

/// transformers' batched greedy decode tokens/s (batch `b`, the same prompt length and tokens).
fn transformers_batched(dir: &Path, b: usize, plen: usize, new: usize, vocab: usize) -> Result<f64> {
    let out = Command::new("python3")
        .arg("-c")
        .arg(TRANSFORMERS_BATCHED)
        .arg(dir)
        .args([b, plen, new, vocab, tp_core::cpu::num_threads()].map(|v| v.to_string()))
        .output()
        .context("cannot run python3")?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        bail!("{} (pip install torch transformers to compare)", err.lines().last().unwrap_or("python3 failed"));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines().last().and_then(|l| l.trim().parse().ok()).with_context(|| format!("transformers printed {text:?}"))
}
