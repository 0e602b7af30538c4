//! GGUF rows of tp-bench: the TinyLlama-shaped random checkpoint of the model rows written as
//! GGUF files (Q4_0 and Q8_0 by `crates/tp-testing/gguf/write_gguf.py` with the `gguf`
//! package's quantizers; Q4_K_M by llama.cpp's own quantizer, through llama-cpp-python, from
//! the F16 file), run by tp on their quantized blocks at TP 1 and 2, beside llama.cpp
//! (`llama_cpp.Llama(path, n_threads=T)`, the same file and threads) in the same run, and
//! beside tp's own bf16 run of the safetensors checkpoint.
//!
//! Each file gets a prefill row (a 512-token prompt, best of 2) and two decode rows (tokens/s of
//! greedy steps after that prompt, `decode`, and after its first 8 tokens, `decode@8`: the
//! weights alone against the weights plus attention over a 512-token cache). The roofline column of a decode row is our tokens/s over
//! `bandwidth / bytes of the file's weights one step reads` (every linear weight and the LM
//! head; one embedding row); a prefill row's is over tp's own bf16 prefill of the same prompt,
//! the issue's floor being 0.8 of it.

use crate::{Args, Row};
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use tp_comm::DeviceGroup;
use tp_core::{DType, Device};
use tp_models::{GenerateOptions, ModelOptions, ParallelCausalLm};

pub(crate) const PROMPT_LEN: usize = 512;

/// The files measured: (label, how it is made).
const FILES: [(&str, Make); 3] = [("Q4_0", Make::Gguf), ("Q8_0", Make::Gguf), ("Q4_K_M", Make::LlamaCpp)];

#[derive(Clone, Copy)]
enum Make {
    /// `write_gguf.py --type LABEL` from the safetensors checkpoint.
    Gguf,
    /// llama.cpp's quantizer from the F16 file.
    LlamaCpp,
}

/// llama.cpp's quantizer: `llama_model_quantize(src, dst, params)` with ftype `LLAMA_FTYPE_*`.
const QUANTIZE_SCRIPT: &str = r#"
import sys, ctypes, llama_cpp
src, dst, ftype, threads = sys.argv[1].encode(), sys.argv[2].encode(), int(sys.argv[3]), int(sys.argv[4])
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = ftype
p.nthread = threads
rc = llama_cpp.llama_model_quantize(src, dst, ctypes.byref(p))
sys.exit(rc)
"#;

/// llama.cpp's prefill (best of 2) and greedy decode tokens/s on `path`, `threads` threads:
/// decode after the whole prompt, and after its first 8 tokens.
const LLAMA_CPP_SCRIPT: &str = r#"
import sys, time
import numpy as np
from llama_cpp import Llama
path, threads, plen, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_ctx=plen + steps + 8, n_threads=threads, n_threads_batch=threads,
            n_batch=plen, n_ubatch=plen, verbose=False)
ids = [(i * 7919 + 13) % llm.n_vocab() for i in range(plen)]
llm.eval(ids[:8]); llm.reset()
pre = []
for _ in range(2):
    llm.reset(); t = time.perf_counter(); llm.eval(ids); pre.append(time.perf_counter() - t)
tok = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))
t = time.perf_counter()
for _ in range(steps):
    llm.eval([tok]); tok = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))
dec = time.perf_counter() - t
llm.reset(); llm.eval(ids[:8])
tok = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))
t = time.perf_counter()
for _ in range(steps):
    llm.eval([tok]); tok = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))
short = time.perf_counter() - t
print(plen / min(pre), steps / dec, steps / short)
"#;

/// Writes (once) the GGUF file `label` of the checkpoint in `dir`; `None` (with the reason
/// printed) when the tool it needs is missing.
fn file(dir: &Path, label: &str, make: Make) -> Result<Option<PathBuf>> {
    let out = dir.parent().unwrap_or(Path::new(".")).join("gguf");
    std::fs::create_dir_all(&out)?;
    let path = out.join(format!("tinyllama-{label}.gguf"));
    if path.exists() {
        return Ok(Some(path));
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../crates/tp-testing/gguf/write_gguf.py");
    let write = |ty: &str, to: &Path| -> Result<bool> {
        eprintln!("  writing {} (once)...", to.display());
        let st = Command::new("python3").arg(&script).arg(dir).arg(to).args(["--type", ty]).status()?;
        Ok(st.success())
    };
    match make {
        Make::Gguf => {
            if !write(label, &path)? {
                println!("GGUF {label} skipped: write_gguf.py failed (pip install gguf)");
                return Ok(None);
            }
        }
        Make::LlamaCpp => {
            let f16 = out.join("tinyllama-F16.gguf");
            if !f16.exists() && !write("F16", &f16)? {
                println!("GGUF {label} skipped: write_gguf.py failed (pip install gguf)");
                return Ok(None);
            }
            // LLAMA_FTYPE_MOSTLY_Q4_K_M = 15.
            let threads = tp_core::cpu::num_threads().to_string();
            let st = Command::new("python3")
                .args(["-c", QUANTIZE_SCRIPT])
                .arg(&f16)
                .arg(&path)
                .args(["15", &threads])
                .status()?;
            if !st.success() {
                println!("GGUF {label} skipped: llama.cpp's quantizer failed (pip install llama-cpp-python)");
                let _ = std::fs::remove_file(&path);
                return Ok(None);
            }
        }
    }
    Ok(Some(path))
}

/// Bytes one decode step reads of the file's weights: every 2-D tensor but the embedding (whose
/// one row is nothing), the embedding itself when it is the LM head (tied).
fn step_bytes(path: &Path) -> Result<f64> {
    let f = tp_gguf::GgufFile::open(path)?;
    let tied = f.tensor("output.weight").is_none();
    let bytes: usize = f
        .tensors()
        .iter()
        .filter(|t| t.dims.len() == 2 && (t.name != "token_embd.weight" || tied))
        .map(|t| t.n_bytes)
        .sum();
    Ok(bytes as f64)
}

/// Tokens/s: prefill of the prompt, decode after it, decode after its first 8 tokens.
pub(crate) type Speeds = (f64, f64, f64);

/// [`Speeds`] of tp on `path` at `world` ranks (`dtype`: `None` runs the quantized blocks).
pub(crate) fn measure(path: &Path, dtype: Option<DType>, world: usize, prompt: &[i64], steps: usize) -> Result<Speeds> {
    let groups = DeviceGroup::local(world, Duration::from_secs(600), |_| Device::Cpu)?;
    let results: Vec<Result<Speeds>> = std::thread::scope(|s| {
        let hs: Vec<_> = groups
            .into_iter()
            .map(|g| {
                s.spawn(move || -> Result<Speeds> {
                    let mut opts = ModelOptions::new().with_max_seq_len(prompt.len() + steps + 1);
                    if let Some(d) = dtype {
                        opts = opts.with_dtype(d);
                    }
                    let mut lm = ParallelCausalLm::load(path, &g, &opts)?;
                    lm.pack_host_weights()?;
                    let greedy = GenerateOptions::new().ignore_eos(true);
                    lm.generate(&prompt[..8], 2, &greedy)?; // warm-up
                    let mut prefill = f64::INFINITY;
                    for _ in 0..2 {
                        prefill = prefill.min(lm.generate(prompt, 1, &greedy)?.prefill_time.as_secs_f64());
                    }
                    let out = lm.generate(prompt, steps + 1, &greedy)?;
                    let short = lm.generate(&prompt[..8], steps + 1, &greedy)?;
                    Ok((
                        prompt.len() as f64 / prefill,
                        steps as f64 / out.decode_time.as_secs_f64(),
                        steps as f64 / short.decode_time.as_secs_f64(),
                    ))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("rank panicked")))).collect()
    });
    let per_rank = results.into_iter().collect::<Result<Vec<_>>>()?;
    let slowest = |f: fn(&Speeds) -> f64| per_rank.iter().map(f).fold(f64::INFINITY, f64::min);
    Ok((slowest(|r| r.0), slowest(|r| r.1), slowest(|r| r.2)))
}

/// llama.cpp's [`Speeds`] on `path`.
pub(crate) fn llama_cpp(path: &Path, steps: usize) -> Result<Speeds> {
    let threads = tp_core::cpu::num_threads().to_string();
    let out = Command::new("python3")
        .args(["-c", LLAMA_CPP_SCRIPT])
        .arg(path)
        .args([threads.as_str(), &PROMPT_LEN.to_string(), &steps.to_string()])
        .output()
        .context("cannot run python3")?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        bail!("{} (pip install llama-cpp-python to compare)", err.lines().last().unwrap_or("python3 failed"));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    match text.lines().last().map(|l| l.split_whitespace().filter_map(|t| t.parse().ok()).collect::<Vec<f64>>()) {
        Some(v) if v.len() == 3 => Ok((v[0], v[1], v[2])),
        _ => bail!("llama-cpp-python printed {text:?}"),
    }
}

/// The GGUF rows, for the bf16 checkpoint folder `dir`.
pub fn rows(args: &Args, dir: &Path) -> Result<Vec<Row>> {
    let bandwidth = crate::cpu::read_bandwidth()?;
    let config = tp_models::ModelConfig::from_dir(dir)?;
    let steps = if args.quick { 8 } else { 32 };
    let prompt: Vec<i64> = (0..PROMPT_LEN as i64).map(|i| (i * 7919 + 13) % config.vocab_size as i64).collect();
    println!(
        "GGUF rows: tinyllama-shaped, {PROMPT_LEN}-token prompt, {steps} decode steps, bandwidth {bandwidth:.1} GB/s"
    );
    eprint!("\r  measuring tp bf16 (the safetensors checkpoint)...          ");
    let (bf16_prefill, bf16_decode, bf16_short) = measure(dir, Some(DType::BF16), 1, &prompt, steps)?;
    let mut rows = Vec::new();
    let row = |name: String, ours: f64, base: Option<(&'static str, f64)>, roof: Option<(f64, &'static str)>| Row {
        kind: "gguf",
        name,
        shape: format!("{PROMPT_LEN} tokens"),
        dtype: "gguf".into(),
        ours,
        unit: "tokens/s",
        baseline_name: base.map_or("-", |b| b.0),
        baseline: base.map(|b| b.1),
        matched: None,
        roofline: roof.map(|r| r.0),
        bound: roof.map(|r| r.1),
    };
    rows.push(row("prefill bf16 TP1 (tp, safetensors)".into(), bf16_prefill, None, None));
    rows.push(row("decode bf16 TP1 (tp, safetensors)".into(), bf16_decode, None, None));
    rows.push(row("decode@8 bf16 TP1 (tp, safetensors)".into(), bf16_short, None, None));
    for (label, make) in FILES {
        let Some(path) = file(dir, label, make)? else { continue };
        let roof = bandwidth * 1e9 / step_bytes(&path)?;
        let lc = llama_cpp(&path, steps);
        if let Err(why) = &lc {
            println!("llama.cpp baseline ({label}) skipped: {why}");
        }
        for world in [1, 2] {
            eprint!("\r  measuring GGUF {label} TP {world}...          ");
            let (prefill, decode, short) = measure(&path, None, world, &prompt, steps)?;
            let base = |f: fn(&Speeds) -> f64| lc.as_ref().ok().filter(|_| world == 1).map(|b| ("llama.cpp", f(b)));
            rows.push(row(
                format!("prefill {label} TP{world} (vs tp bf16 {:.2}x)", prefill / bf16_prefill),
                prefill,
                base(|b| b.0),
                Some((prefill / bf16_prefill, "tp-bf16")),
            ));
            rows.push(row(
                format!("decode {label} TP{world} (vs tp bf16 {:.2}x)", decode / bf16_decode),
                decode,
                base(|b| b.1),
                Some((decode / roof, "memory")),
            ));
            rows.push(row(
                format!("decode@8 {label} TP{world} (vs tp bf16 {:.2}x)", short / bf16_short),
                short,
                base(|b| b.2),
                Some((short / roof, "memory")),
            ));
        }
    }
    Ok(rows)
}
