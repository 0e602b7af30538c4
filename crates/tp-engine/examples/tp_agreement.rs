//! How often float rounding flips a sampled token between TP degrees: the same seeded requests
//! on a synthetic f32 model at TP 1 and TP N (the logits differ only in the order of the
//! all-reduces' sums), counting requests whose tokens differ and where they first part.
//! `cargo run --release -p tp-engine --example tp_agreement -- [REQUESTS] [TOKENS]`.

use serde_json::json;
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tp_core::DType;
use tp_engine::EngineOptions;
use tp_engine::api::{Event, Request};
use tp_engine::sampling::SamplingParams;
use tp_models::Architecture;
use tp_testing::synthetic::SyntheticModel;

fn main() {
    if let Err(e) = run() {
        eprintln!("tp_agreement: {e}");
        std::process::exit(1);
    }
}

fn tokens_at(dir: &std::path::Path, tp: usize, reqs: &[Request]) -> Result<Vec<Vec<i64>>, String> {
    let mut o = EngineOptions::new(dir);
    o.tensor_parallel_size = tp;
    o.dtype = Some(DType::F32);
    let engine = tp_engine::start(&o).map_err(|e| e.to_string())?;
    let h = engine.handle();
    let rxs: Vec<_> = reqs
        .iter()
        .map(|r| {
            let (tx, rx) = mpsc::channel();
            h.submit(r.clone(), Box::new(tx)).map(|_| rx).map_err(|e| e.to_string())
        })
        .collect::<Result<_, _>>()?;
    let mut out = Vec::new();
    for rx in rxs {
        let mut t = Vec::new();
        loop {
            match rx.recv().map_err(|e| e.to_string())? {
                Event::Token { id, .. } => t.push(id),
                Event::PromptLogprobs(_) => {}
                Event::Finished { .. } => break,
                Event::Failed(why) => return Err(why),
            }
        }
        out.push(t);
    }
    h.begin_shutdown();
    drop(h);
    engine.join(Instant::now() + Duration::from_secs(30)).map_err(|e| e.to_string())?;
    Ok(out)
}

fn run() -> Result<(), String> {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let (n, len) = (args.first().copied().unwrap_or(64), args.get(1).copied().unwrap_or(32));
    let spec = SyntheticModel {
        architecture: Architecture::Llama,
        vocab_size: 4096,
        hidden_size: 256,
        intermediate_size: 704,
        num_hidden_layers: 4,
        num_attention_heads: 8,
        num_key_value_heads: 4,
        max_position_embeddings: 256,
        files: 1,
        extra: Some(json!({})),
        ..SyntheticModel::tiny()
    };
    let dir = std::env::temp_dir().join(format!("tp-agreement-{}", std::process::id()));
    spec.write(&dir).map_err(|e| e.to_string())?;
    let prompt = |i: usize| (0..8 + i % 24).map(|j| ((i * 7_919 + j * 104_729 + 13) % 4096) as i64).collect::<Vec<_>>();
    for (label, params) in [
        ("greedy", SamplingParams::greedy()),
        ("temperature 1", SamplingParams { temperature: 1.0, ..Default::default() }),
        ("top_p 0.9, temperature 0.8", SamplingParams { temperature: 0.8, top_p: 0.9, ..Default::default() }),
    ] {
        let reqs: Vec<Request> = (0..n)
            .map(|i| Request {
                prompt: prompt(i),
                params: SamplingParams { seed: Some(i as u64), ..params.clone() },
                max_tokens: len,
                stop_token_ids: vec![],
                ignore_eos: true,
                adapter: 0,
            })
            .collect();
        let base = tokens_at(&dir, 1, &reqs)?;
        for tp in [2, 4, 8] {
            let other = tokens_at(&dir, tp, &reqs)?;
            let parted: Vec<usize> =
                base.iter().zip(&other).filter_map(|(a, b)| a.iter().zip(b).position(|(x, y)| x != y)).collect();
            println!(
                "{label}: TP {tp} against TP 1: {} of {n} requests differ ({} tokens each){}",
                parted.len(),
                len,
                if parted.is_empty() { String::new() } else { format!(", first at tokens {parted:?}") }
            );
        }
    }
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}
