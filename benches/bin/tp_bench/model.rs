//! Whole-model rows of tp-bench: a Llama-shaped random checkpoint with TinyLlama-1.1B's shapes
//! (written once to `target/bench-model/` in bf16, Hugging Face's layout), run through
//! `tp_models::ParallelCausalLm` at TP 1 and 2 on LocalGroup ranks of one device, in f32 and
//! bf16: prefill tokens/s (128 tokens) and decode tokens/s, beside transformers on the same
//! files, threads and dtype in the same run when `python3` has torch and transformers. The
//! model's host weights are packed once after loading, as `tp serve` packs them (prefill's
//! products then do not repack them on every call; decode reads them as stored).
//!
//! The roofline column: for decode, our tokens/s over the memory roof, `bandwidth / weight bytes
//! read per token` (all ranks share this machine's memory, so the bytes of every rank count);
//! for prefill, our tokens/s over what the model's GEMMs alone give (each projection of every
//! layer at 128 tokens, and the LM head on the last token: on the host on packed weights of
//! their own streamed from memory, as the model runs them; on a GPU as bare `matmul_t` calls).
//! Prefill figures (ours, transformers', the GEMMs') are each the best of 3 runs.

use crate::{Args, Row};
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use tp_comm::DeviceGroup;
use tp_core::{DType, Device, Tensor};
use tp_models::{GenerateOptions, ModelOptions, ParallelCausalLm};
use tp_testing::synthetic::SyntheticModel;

const PROMPT_LEN: usize = 128;

/// Which model the rows run on.
pub enum Which {
    /// The synthetic TinyLlama-shaped checkpoint.
    TinyLlama,
    /// A checkpoint folder given with `--model DIR`.
    Dir(PathBuf),
}

/// Writes (once) the synthetic checkpoint and returns its folder.
fn synthetic_dir() -> Result<PathBuf> {
    let spec = SyntheticModel::tinyllama(DType::BF16);
    let dir = PathBuf::from("target/bench-model/tinyllama-bf16");
    let marker = dir.join("tp-synthetic.json");
    let want = format!("{:?}", spec);
    if std::fs::read_to_string(&marker).is_ok_and(|m| m == want) {
        return Ok(dir);
    }
    eprintln!("  writing a TinyLlama-shaped random checkpoint to {} (2.2 GB, once)...", dir.display());
    let _ = std::fs::remove_dir_all(&dir);
    spec.write(&dir).context("writing the synthetic model")?;
    std::fs::write(&marker, want)?;
    Ok(dir)
}

/// The checkpoint folder the model rows run on (written once for the synthetic one).
pub fn dir_of(which: &Which) -> Result<PathBuf> {
    match which {
        Which::TinyLlama => synthetic_dir(),
        Which::Dir(d) => Ok(d.clone()),
    }
}

/// Memory bandwidth of `device` in GB/s, as a decode step uses it: on the host, reading 256 MiB
/// on every thread (a step streams the weights and writes next to nothing); on a GPU, a 256 MiB
/// device copy counting the bytes read and written, best of 5.
fn bandwidth_gbs(device: Device) -> Result<f64> {
    if device == Device::Cpu {
        return crate::cpu::read_bandwidth();
    }
    let n = 64 << 20; // f32 elements
    let x = Tensor::zeros(&[2, n], DType::F32, &device)?;
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let start = Instant::now();
        let y = x.narrow(0, 1, 1)?; // a copy of n elements
        std::hint::black_box(y.narrow(1, 0, 1)?.to_device(&Device::Cpu)?); // waits for the device
        best = best.min(start.elapsed().as_secs_f64());
    }
    Ok(2.0 * (n * 4) as f64 / best / 1e9)
}

/// The model rows on `device` (`Device::Cpu`, or GPU 0 with ranks sharing it).
pub fn rows(args: &Args, which: &Which, device: Device) -> Result<Vec<Row>> {
    let bandwidth_gbs = bandwidth_gbs(device)?;
    let dir = dir_of(which)?;
    let label = match which {
        Which::TinyLlama => "tinyllama-shaped".to_string(),
        Which::Dir(d) => d.file_name().map_or("model".into(), |n| n.to_string_lossy().into_owned()),
    };
    let config = tp_models::ModelConfig::from_dir(&dir)?;
    let how = if device == Device::Cpu { "read on every thread" } else { "device copy, read + write" };
    println!("model rows: {label} on {device}, memory bandwidth {bandwidth_gbs:.1} GB/s ({how})");
    let steps = if args.quick { 8 } else { 16 };
    let prompt_len = PROMPT_LEN.min(config.max_position_embeddings.saturating_sub(steps + 1)).max(1);
    let prompt: Vec<i64> = (0..prompt_len as i64).map(|i| (i * 7919 + 13) % config.vocab_size as i64).collect();
    let dtypes: Vec<DType> = args.dtypes.iter().copied().filter(|d| matches!(d, DType::F32 | DType::BF16)).collect();
    let mut rows = Vec::new();
    for dtype in dtypes {
        let hf = transformers_baseline(&dir, dtype, device, &prompt, steps);
        if let Err(why) = &hf {
            println!("transformers baseline ({dtype}) skipped: {why}");
        }
        let gemm_prefill = gemm_alone_prefill_tps(&config, prompt_len, dtype, device)?;
        for world in [1, 2] {
            eprint!("\r  measuring model {label} {dtype} TP {world}...          ");
            let m = measure(&dir, dtype, device, world, &prompt, steps)?;
            let roof_decode = bandwidth_gbs * 1e9 / m.weight_bytes;
            let base = |f: fn(&(f64, f64, Vec<i64>)) -> f64| hf.as_ref().ok().filter(|_| world == 1).map(f);
            // Greedy tokens equal to transformers' on the same prompt (bf16 rounding may flip a
            // near tie, so a mismatch there is worth a look, not proof of a bug).
            let matched = hf.as_ref().ok().map(|h| h.2 == m.tokens);
            let row = |name: String, ours: f64, baseline: Option<f64>, roof: f64, bound| Row {
                kind: "model",
                name,
                shape: format!("{prompt_len} tokens"),
                dtype: dtype.to_string(),
                ours,
                unit: "tokens/s",
                baseline_name: if baseline.is_some() { "transformers" } else { "-" },
                baseline,
                matched,
                roofline: Some(ours / roof),
                bound: Some(bound),
            };
            rows.push(row(
                format!("prefill {label} TP{world} {device}"),
                m.prefill_tps,
                base(|h| h.0),
                gemm_prefill,
                "gemm",
            ));
            rows.push(row(
                format!("decode {label} TP{world} {device}"),
                m.decode_tps,
                base(|h| h.1),
                roof_decode,
                "memory",
            ));
        }
    }
    Ok(rows)
}

struct Measured {
    prefill_tps: f64,
    decode_tps: f64,
    /// Rank 0's greedy tokens of the measured run (the first from the prefill).
    tokens: Vec<i64>,
    /// Parameter bytes every decode step reads, over all ranks (embedding rows excluded).
    weight_bytes: f64,
}

fn measure(dir: &Path, dtype: DType, device: Device, world: usize, prompt: &[i64], steps: usize) -> Result<Measured> {
    let groups = DeviceGroup::local(world, Duration::from_secs(600), |_| device)?;
    let results: Vec<Result<(f64, f64, Vec<i64>)>> = std::thread::scope(|s| {
        let hs: Vec<_> = groups
            .into_iter()
            .map(|g| {
                s.spawn(move || -> Result<(f64, f64, Vec<i64>)> {
                    let opts = ModelOptions::new().with_dtype(dtype).with_max_seq_len(prompt.len() + steps + 1);
                    let mut lm = ParallelCausalLm::load(dir, &g, &opts)?;
                    // The weights packed once, as `tp serve` packs them (a no-op on a GPU).
                    lm.pack_host_weights()?;
                    let greedy = GenerateOptions::new().ignore_eos(true);
                    lm.generate(&prompt[..8], 2, &greedy)?; // warm-up
                    let mut prefill = Vec::new();
                    for _ in 0..3 {
                        prefill.push(lm.generate(prompt, 1, &greedy)?.prefill_time.as_secs_f64());
                    }
                    prefill.sort_by(f64::total_cmp);
                    let out = lm.generate(prompt, steps + 1, &greedy)?;
                    Ok((prompt.len() as f64 / prefill[0], steps as f64 / out.decode_time.as_secs_f64(), out.tokens))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("rank panicked")))).collect()
    });
    let per_rank = results.into_iter().collect::<Result<Vec<_>>>()?;
    // The slowest rank sets the pace (they run in lockstep anyway).
    let prefill_tps = per_rank.iter().map(|r| r.0).fold(f64::INFINITY, f64::min);
    let decode_tps = per_rank.iter().map(|r| r.1).fold(f64::INFINITY, f64::min);
    let c = tp_models::ModelConfig::from_dir(dir)?;
    let tokens = per_rank.into_iter().next().map(|r| r.2).unwrap_or_default();
    Ok(Measured { prefill_tps, decode_tps, tokens, weight_bytes: decode_bytes(&c, dtype) })
}

/// Bytes of parameters one decode step reads: every layer's projections and norms, the final
/// norm and the LM head (the embedding contributes one row).
fn decode_bytes(c: &tp_models::ModelConfig, dtype: DType) -> f64 {
    let (h, i, q, kv) =
        (c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim);
    let layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h;
    let params = c.num_hidden_layers * layer + h + c.vocab_size * h + h;
    (params * dtype.size_in_bytes()) as f64
}

/// `(N, K)` of one decoder layer's four products (`[N, K]` weights): the fused QKV, the output
/// projection, the merged gate/up and the down projection.
pub fn layer_products(c: &tp_models::ModelConfig) -> [(usize, usize); 4] {
    let (h, i, q, kv) =
        (c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim);
    [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]
}

/// Tokens/s of a `t`-token prefill if only its GEMMs ran. On the host, the products as the
/// model runs them ([`host_gemms_alone_tps`]); on a GPU, one layer's four products timed
/// (fused QKV, o, merged gate/up, down), times the layers, plus the LM head on the last token.
fn gemm_alone_prefill_tps(c: &tp_models::ModelConfig, t: usize, dtype: DType, device: Device) -> Result<f64> {
    if device == Device::Cpu {
        return host_gemms_alone_tps(c, t, dtype);
    }
    let mut layer = 0.0;
    for (n, k) in layer_products(c) {
        layer += time_matmul(t, n, k, dtype, device)?;
    }
    let head = time_matmul(1, c.vocab_size, c.hidden_size, dtype, device)?;
    Ok(t as f64 / (layer * c.num_hidden_layers as f64 + head))
}

/// Host prefill tokens/s of the products alone, run as the model runs them: weights packed
/// once into the host GEMM's panels, every layer's four products one after the other, each on
/// weights of its own (three copies of a layer's weights in turn, far more than the caches
/// hold, so each product streams its weight from memory as in the model), then the LM head on
/// the last token; the best of three passes. (Bare `matmul_t` on one weight timed repeatedly
/// packs the weight on every call, and keeps the smaller weights in the cache: neither is
/// what the model's prefill does.)
fn host_gemms_alone_tps(c: &tp_models::ModelConfig, t: usize, dtype: DType) -> Result<f64> {
    const COPIES: usize = 3;
    let product = |m: usize, n: usize, k: usize, seed: u64| -> Result<(Tensor, Tensor, tp_core::PackedWeight)> {
        let x = Tensor::rand(&[m, k], dtype, 1, &Device::Cpu)?;
        let w = Tensor::rand(&[n, k], dtype, seed, &Device::Cpu)?;
        let packed = w.pack_weight()?;
        Ok((x, w, packed))
    };
    let layers = (0..COPIES as u64)
        .map(|copy| {
            layer_products(c)
                .into_iter()
                .enumerate()
                .map(|(i, (n, k))| product(t, n, k, 10 * copy + i as u64 + 2))
                .collect()
        })
        .collect::<Result<Vec<Vec<_>>>>()?;
    let head = product(1, c.vocab_size, c.hidden_size, 1000)?;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let start = Instant::now();
        for layer in 0..c.num_hidden_layers {
            for (x, w, packed) in &layers[layer % COPIES] {
                std::hint::black_box(x.linear_packed(w, packed, None)?);
            }
        }
        let (x, w, packed) = &head;
        std::hint::black_box(x.linear_packed(w, packed, None)?);
        best = best.min(start.elapsed().as_secs_f64());
    }
    Ok(t as f64 / best)
}

fn time_matmul(m: usize, n: usize, k: usize, dtype: DType, device: Device) -> Result<f64> {
    let x = Tensor::rand(&[m, k], dtype, 1, &Device::Cpu)?.to_device(&device)?;
    let w = Tensor::rand(&[n, k], dtype, 2, &Device::Cpu)?.to_device(&device)?;
    let run = || -> Result<()> {
        // Copying the result to the host waits for a device to finish.
        std::hint::black_box(x.matmul_t(&w)?.narrow(0, 0, 1)?.to_device(&Device::Cpu)?);
        Ok(())
    };
    run()?;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let start = Instant::now();
        run()?;
        best = best.min(start.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// transformers' script: the same files, dtype, threads, prompt and number of decode steps;
/// greedy, KV cache on; prints prefill and decode tokens/s.
const TRANSFORMERS_SCRIPT: &str = r#"
import sys, time
import torch, transformers
from transformers import AutoModelForCausalLM
path, dtype, device, threads, steps = sys.argv[1], getattr(torch, sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
ids = torch.tensor([[int(t) for t in sys.argv[6].split(",")]], device=device)
torch.set_num_threads(threads)
major = int(transformers.__version__.split(".")[0])
kw = {"dtype": dtype} if major >= 5 else {"torch_dtype": dtype}
m = AutoModelForCausalLM.from_pretrained(path, **kw).to(device).eval()
sync = (lambda: torch.cuda.synchronize()) if device.startswith("cuda") else (lambda: None)
with torch.inference_mode():
    m(ids[:, :8], use_cache=True); sync()
    pre = []
    for _ in range(3):
        t = time.perf_counter(); out = m(ids, use_cache=True); tok = out.logits[:, -1:].argmax(-1); sync()
        pre.append(time.perf_counter() - t)
    pre.sort()
    past = out.past_key_values
    tokens = [int(tok[0, 0])]
    t = time.perf_counter()
    for _ in range(steps):
        out = m(tok, past_key_values=past, use_cache=True); past = out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)
        tokens.append(int(tok[0, 0]))
    sync()
    dec = time.perf_counter() - t
print(ids.shape[1] / pre[0], steps / dec)
print(",".join(map(str, tokens)))
"#;

/// transformers' prefill and decode tokens/s, and its greedy tokens (the first from the prefill,
/// then one per decode step).
fn transformers_baseline(
    dir: &Path,
    dtype: DType,
    device: Device,
    prompt: &[i64],
    steps: usize,
) -> Result<(f64, f64, Vec<i64>)> {
    let torch_dtype = match dtype {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        other => bail!("no torch dtype for {other}"),
    };
    let dev = match device {
        Device::Cpu => "cpu".to_string(),
        Device::Cuda(i) => format!("cuda:{i}"),
    };
    let ids: Vec<String> = prompt.iter().map(i64::to_string).collect();
    let out = Command::new("python3")
        .arg("-c")
        .arg(TRANSFORMERS_SCRIPT)
        .arg(dir)
        .args([torch_dtype, &dev, &tp_core::cpu::num_threads().to_string(), &steps.to_string(), &ids.join(",")])
        .env_remove("OPENBLAS_CORETYPE")
        .output()
        .context("cannot run python3")?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        bail!("{} (pip install torch transformers to compare)", err.lines().last().unwrap_or("python3 failed"));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines = text.lines().rev().take(2).collect::<Vec<_>>();
    lines.reverse();
    let rates: Vec<f64> =
        lines.first().map_or(vec![], |l| l.split_whitespace().filter_map(|t| t.parse().ok()).collect());
    let tokens: Vec<i64> =
        lines.get(1).map_or(vec![], |l| l.split(',').filter_map(|t| t.trim().parse().ok()).collect());
    match (&rates[..], tokens.len()) {
        (&[p, d], n) if n == steps + 1 => Ok((p, d, tokens)),
        _ => bail!("transformers printed {text:?}"),
    }
}
