//! KV-cache storage rows of tp-bench (`--only kv-cache`, opt-in): a checkpoint on the host at
//! TP 1 with its keys and values cached in the model dtype, in FP8 E4M3 or in Q8_0 blocks
//! (`--kv-cache-dtype auto|fp8|q8_0`).
//!
//! * Memory: bytes of keys and values per cached position (all layers), and the ratio of
//!   positions the same budget holds against the model dtype.
//! * Speed: 16 concurrent requests (64-token prompts, 32 new tokens, greedy) through the
//!   engine: tokens/s once all decode, and the decode steps' attention (cache writes and reads)
//!   in milliseconds per step, each beside the model-dtype cache.
//! * Quality: one 512-token sequence fed through the batched forward in 64-token chunks, every
//!   position's logits over the 8-bit cache against those over the model-dtype cache: the mean
//!   KL divergence `KL(dense || 8-bit)` per position (millinats), how often the top token agrees,
//!   and the largest logit difference over the largest logit (llama.cpp measures its cache
//!   types the same way, by KL against the unquantized run).

use crate::serving::{PROMPT_LEN, prompt, run_phased, stop, summarize};
use crate::{Args, Row};
use anyhow::{Context, Result};
use std::path::Path;
use std::time::Duration;
use tp_comm::DeviceGroup;
use tp_core::{DType, Device, KvQuant};
use tp_engine::EngineOptions;
use tp_models::{ModelOptions, ParallelCausalLm};

/// Positions of the quality sequence, and its chunks.
const QUALITY_LEN: usize = 512;
const QUALITY_CHUNK: usize = 64;

/// The rows for the checkpoint at `dir` (a folder, or a GGUF file) computing in `dtype`.
pub fn rows(args: &Args, dir: &Path, dtype: DType) -> Result<Vec<Row>> {
    let config = tp_models::ModelConfig::from_dir(dir)?;
    let vocab = config.vocab_size;
    let new_tokens = if args.quick { 8 } else { 32 };
    let kinds = [None, Some(KvQuant::Fp8E4M3), Some(KvQuant::Q8_0)];
    let name = |q: Option<KvQuant>| q.map_or(format!("{dtype}"), |q| q.name().to_string());
    let mut rows = Vec::new();
    let (mut dense_tps, mut dense_attn) = (None, None);
    for q in kinds {
        eprint!("\r  measuring the KV cache as {}, 16 concurrent...          ", name(q));
        let mut opts = EngineOptions::new(dir);
        opts.dtype = Some(dtype);
        opts.kv_cache_dtype = q;
        let engine = tp_engine::start(&opts).context("starting the engine")?;
        run_phased(&engine, &[prompt(999, 8, vocab)], 2, &[Duration::ZERO])?; // warm-up
        let prompts: Vec<_> = (0..16).map(|i| prompt(i + 5000, PROMPT_LEN, vocab)).collect();
        let (t, phases) = run_phased(&engine, &prompts, new_tokens, &[Duration::ZERO; 16])?;
        stop(engine);
        let steady = summarize(&t).steady;
        let attn = phases.attention / phases.steps.max(1) as f64 * 1e3;
        let base = |b: Option<f64>| if q.is_some() { b.map(|b| (dense_label(dtype), b)) } else { None };
        let shape = format!("16x({PROMPT_LEN}+{new_tokens})");
        rows.push(row(format!("all decoding, KV {}", name(q)), shape.clone(), steady, "tokens/s", base(dense_tps)));
        rows.push(row(format!("step attention, KV {}", name(q)), shape, attn, "ms", base(dense_attn)));
        if q.is_none() {
            (dense_tps, dense_attn) = (Some(steady), Some(attn));
        }
    }
    eprint!("\r  measuring the KV cache's quality ({QUALITY_LEN} positions)...          ");
    let ids = prompt(4242, QUALITY_LEN, vocab);
    let groups = DeviceGroup::local(1, Duration::from_secs(600), |_| Device::Cpu)?;
    let g = groups.into_iter().next().context("one rank")?;
    let lm = ParallelCausalLm::load(dir, &g, &ModelOptions::new().with_dtype(dtype))?;
    let dense = logits(&lm, &ids, None)?;
    let per_position = |q: Option<KvQuant>| -> Result<f64> { Ok(lm.kv_bytes_per_block(16, q)? as f64 / 16.0) };
    let dense_bytes = per_position(None)?;
    for q in [KvQuant::Fp8E4M3, KvQuant::Q8_0] {
        let got = logits(&lm, &ids, Some(q))?;
        let shape = format!("{QUALITY_LEN} positions");
        let bytes = per_position(Some(q))?;
        let per_mib = |b: f64| f64::from(1u32 << 20) / b;
        rows.push(row(
            format!("positions per MiB, KV {}", q.name()),
            format!("{bytes:.0} B/position"),
            per_mib(bytes),
            "pos/MiB",
            Some((dense_label(dtype), per_mib(dense_bytes))),
        ));
        let (kl, agree, worst) = compare(&dense, &got, vocab);
        rows.push(row(format!("KL vs {dtype} cache, KV {}", q.name()), shape.clone(), kl * 1e3, "mnats", None));
        rows.push(row(format!("top-1 agreement, KV {}", q.name()), shape.clone(), agree * 100.0, "%", None));
        rows.push(row(format!("max logit diff, KV {}", q.name()), shape, worst * 100.0, "% of max", None));
    }
    Ok(rows)
}

/// The label of the model-dtype cache in the baseline column.
fn dense_label(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32 cache",
        DType::F16 => "f16 cache",
        _ => "bf16 cache",
    }
}

/// Every position's logits (`[len, V]`, f64) of `ids` fed in chunks through the batched forward
/// with caches stored as `quant` says.
fn logits(lm: &ParallelCausalLm, ids: &[i64], quant: Option<KvQuant>) -> Result<Vec<f64>> {
    let bs = 16;
    let blocks = ids.len().div_ceil(bs);
    let mut caches = lm.new_paged_caches(blocks, bs, quant)?;
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut out = Vec::with_capacity(ids.len() * lm.vocab_shard().1);
    for start in (0..ids.len()).step_by(QUALITY_CHUNK) {
        let n = QUALITY_CHUNK.min(ids.len() - start);
        let seq = tp_layers::BatchSeq { tokens: n, context: start, blocks: table.clone() };
        let batch = tp_layers::TokenBatch::new(vec![seq], bs)?;
        let rows: Vec<usize> = (0..n).collect();
        let l = lm.forward_batch(&ids[start..start + n], &batch, &mut caches, &rows)?;
        out.extend(l.to_f64_vec()?);
    }
    Ok(out)
}

/// Mean `KL(p || q)` per row of the softmaxes of `a` (p) and `b` (q), the share of rows whose
/// largest logit is at the same token, and the largest `|a - b|` over the largest `|a|`.
fn compare(a: &[f64], b: &[f64], vocab: usize) -> (f64, f64, f64) {
    let log_softmax = |r: &[f64]| -> Vec<f64> {
        let m = r.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let z = r.iter().map(|x| (x - m).exp()).sum::<f64>().ln() + m;
        r.iter().map(|x| x - z).collect()
    };
    let argmax = |r: &[f64]| r.iter().enumerate().max_by(|x, y| x.1.total_cmp(y.1)).map_or(0, |m| m.0);
    let (mut kl, mut agree) = (0.0, 0usize);
    let rows = a.len() / vocab;
    for (ra, rb) in a.chunks_exact(vocab).zip(b.chunks_exact(vocab)) {
        let (la, lb) = (log_softmax(ra), log_softmax(rb));
        kl += la.iter().zip(&lb).map(|(p, q)| p.exp() * (p - q)).sum::<f64>();
        agree += usize::from(argmax(ra) == argmax(rb));
    }
    let scale = a.iter().fold(0f64, |m, x| m.max(x.abs())).max(f64::MIN_POSITIVE);
    let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    (kl / rows.max(1) as f64, agree as f64 / rows.max(1) as f64, worst / scale)
}

/// A row of this table (the serving table's, in its own kind).
fn row(name: String, shape: String, ours: f64, unit: &'static str, base: Option<(&'static str, f64)>) -> Row {
    Row { kind: "kv-cache", dtype: "host".into(), ..crate::serving::row(name, shape, ours, unit, base) }
}
