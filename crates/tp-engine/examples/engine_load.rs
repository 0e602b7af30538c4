//! Drives the engine with `N` concurrent greedy requests on a model folder and prints the
//! aggregate decode rate, for profiling (`perf record`) outside the benchmark harness:
//! `cargo run --release -p tp-engine --example engine_load -- DIR [N] [PROMPT] [TOKENS] [TP]`.

use std::sync::mpsc;
use std::time::Instant;
use tp_core::DType;
use tp_engine::EngineOptions;
use tp_engine::api::{Event, EventSink, Request};
use tp_engine::sampling::SamplingParams;

/// Stamps each event with the time the engine sent it.
struct Stamp(mpsc::Sender<(Instant, Event)>);

impl EventSink for Stamp {
    fn send(&mut self, e: Event) -> bool {
        self.0.send((Instant::now(), e)).is_ok()
    }
}

fn main() {
    if let Err(e) = run() {
        eprintln!("engine_load: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = args.first().ok_or("usage: engine_load DIR [N] [PROMPT] [TOKENS] [TP]")?;
    let num = |i: usize, d: usize| args.get(i).map_or(Ok(d), |v| v.parse::<usize>().map_err(|e| format!("{v}: {e}")));
    let (n, plen, tokens, tp) = (num(1, 16)?, num(2, 64)?, num(3, 32)?, num(4, 1)?);
    let mut opts = EngineOptions::new(dir);
    opts.dtype = Some(DType::BF16);
    opts.tensor_parallel_size = tp;
    let engine = tp_engine::start(&opts).map_err(|e| e.to_string())?;
    let h = engine.handle();
    let vocab = h.limits().vocab_size;
    let start = Instant::now();
    let rxs: Vec<_> = (0..n)
        .map(|i| {
            let (tx, rx) = mpsc::channel();
            let prompt = (0..plen).map(|j| ((i * 7_919 + j * 104_729 + 13) % vocab) as i64).collect();
            let r = Request {
                prompt,
                params: SamplingParams::greedy(),
                max_tokens: tokens,
                stop_token_ids: vec![],
                ignore_eos: true,
                adapter: 0,
            };
            h.submit(r, Box::new(Stamp(tx))).map(|_| rx).map_err(|e| e.to_string())
        })
        .collect::<Result<_, _>>()?;
    let mut firsts = Vec::new();
    let mut last = start;
    for rx in rxs {
        let mut first = None;
        loop {
            match rx.recv().map_err(|e| e.to_string())? {
                (now, Event::Token { .. }) => {
                    first.get_or_insert(now);
                    last = last.max(now);
                }
                (_, Event::PromptLogprobs(_)) => {}
                (_, Event::Finished { .. }) => break,
                (_, Event::Failed(why)) => return Err(why),
            }
        }
        firsts.push(first.unwrap_or(start));
    }
    let decode_from = firsts.into_iter().max().unwrap_or(start);
    let decoded = n * tokens.saturating_sub(1);
    println!(
        "{n} requests x ({plen} + {tokens}) at TP {tp}: prefill done after {:.2} s; decode {:.1} tokens/s over {:.2} s",
        (decode_from - start).as_secs_f64(),
        decoded as f64 / (last - decode_from).as_secs_f64().max(1e-9),
        (last - decode_from).as_secs_f64()
    );
    h.begin_shutdown();
    drop(h);
    engine.join(Instant::now() + std::time::Duration::from_secs(30)).map_err(|e| e.to_string())?;
    Ok(())
}
