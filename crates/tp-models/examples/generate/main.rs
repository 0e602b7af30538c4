//! Runs a Hugging Face Llama / Qwen2 / Mistral checkpoint folder to tokens, tensor-parallel.
//!
//! ```text
//! cargo run --release -p tp-models --example generate -- --model DIR --prompt-ids 1,2,3 \
//!   --max-new-tokens N --world-size W [--backend local|nccl] [--device cpu|cuda] \
//!   [--dtype f32|f16|bf16] [--logits-out FILE.safetensors] [--ignore-eos]
//! ```
//!
//! Prints the generated ids on one line (comma-separated, as `--prompt-ids` takes them), then
//! the prefill and decode throughput. `--logits-out` writes `tokens` (i64, the generated ids),
//! `prefill_logits` (f32 `[prompt_len, vocab]`) and `decode_logits` (f32 `[N - 1, vocab]`, row
//! `i` from the step that consumed `tokens[i]`). `local` runs the ranks as threads; `nccl` as
//! processes, started by torchrun (`RANK` set) or by this program, one GPU each. Every error is
//! one line on stderr and exit status 1 (a failed write to stdout too: a full disk, a closed
//! pipe); the logits file is written whole or not at all, and SIGINT or SIGTERM during its
//! write leaves no temporary file (exit status 130 or 143).

mod args;
mod logits_file;
#[cfg(unix)]
mod signals;
mod tokenizer;

use args::{Args, Backend, DeviceKind, Prompt};
use std::io::Write;
use std::path::Path;
use std::time::Duration;
use tp_comm::DeviceGroup;
use tp_core::Device;
use tp_models::{GenerateOptions, Generation, ModelConfig, ModelOptions, ParallelCausalLm};

fn main() {
    if let Err(e) = run() {
        // One write for the whole line (ranks may share the terminal); a closed stderr is no panic.
        let _ = std::io::stderr().write_all(format!("generate: {e}\n").as_bytes());
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let argv = args::utf8(std::env::args_os().skip(1))?;
    let a = args::parse(&argv)?;
    if a.backend == Backend::Nccl && a.device != DeviceKind::Cuda {
        return Err("--backend nccl needs --device cuda (NCCL moves GPU memory)".into());
    }
    let dir = Path::new(&a.model);
    // The config and the prompt are checked before any rank starts.
    let config = ModelConfig::from_dir(dir).map_err(|e| e.to_string())?;
    let prompt = match &a.prompt {
        Prompt::Ids(ids) => ids.clone(),
        Prompt::Text(text) => tokenizer::encode(dir, text)?,
    };
    check_request(&config, &prompt, a.max_new_tokens)?;
    let out = match a.backend {
        Backend::Local => run_local(&a, &config, &prompt)?,
        Backend::Nccl if std::env::var_os("RANK").is_some() => match run_nccl_rank(&a, &config, &prompt)? {
            Some(out) => out,
            None => return Ok(()), // not rank 0: rank 0 reports
        },
        Backend::Nccl => {
            // Checked here, once, rather than by every spawned rank.
            match tp_kernels::device_count() {
                Ok(n) if n >= a.world_size => {}
                Ok(n) => {
                    return Err(format!(
                        "--backend nccl runs one process per GPU: --world-size {} needs {} GPUs, found {n} \
                         (--backend local lets ranks share a GPU)",
                        a.world_size, a.world_size
                    ));
                }
                Err(e) => return Err(format!("--backend nccl: {e}")),
            }
            return spawn_ranks(&a, &argv);
        }
    };
    if let Some(path) = &a.logits_out {
        logits_file::write_logits(Path::new(path), &out)?;
    }
    report(dir, &prompt, &out)
}

/// The library's request checks, once, before any rank starts.
fn check_request(c: &ModelConfig, prompt: &[i64], n: usize) -> Result<(), String> {
    if let Some((i, id)) =
        prompt.iter().enumerate().find(|(_, id)| usize::try_from(**id).map_or(true, |v| v >= c.vocab_size))
    {
        return Err(format!("prompt id {id} at position {i} is out of range for the vocabulary of {}", c.vocab_size));
    }
    if prompt.len().saturating_add(n) > c.max_position_embeddings {
        return Err(format!(
            "the prompt ({} tokens) plus --max-new-tokens {n} exceeds max_position_embeddings ({})",
            prompt.len(),
            c.max_position_embeddings
        ));
    }
    Ok(())
}

fn timeout() -> Duration {
    let secs = std::env::var("TP_TIMEOUT_SECS").ok().and_then(|v| v.parse::<u64>().ok());
    Duration::from_secs(secs.unwrap_or(tp_comm::DEFAULT_TIMEOUT_SECS).clamp(1, 7 * 24 * 3600))
}

fn device_for(kind: DeviceKind, rank: usize) -> Result<Device, String> {
    match kind {
        DeviceKind::Cpu => Ok(Device::Cpu),
        DeviceKind::Cuda => match tp_kernels::device_count() {
            Ok(n) if n > 0 => Ok(Device::Cuda(rank % n)),
            Ok(_) => Err("--device cuda: no CUDA device found".into()),
            Err(e) => Err(format!("--device cuda: {e}")),
        },
    }
}

/// One rank: load its shards, generate.
fn one_rank(a: &Args, config: &ModelConfig, prompt: &[i64], g: &DeviceGroup) -> Result<Generation, String> {
    let opts = ModelOptions::new().with_dtype(a.dtype).with_max_seq_len(prompt.len() + a.max_new_tokens);
    let mut lm = ParallelCausalLm::load_with_config(&a.model, config, g, &opts).map_err(|e| e.to_string())?;
    let how = GenerateOptions::new().ignore_eos(a.ignore_eos).keep_logits(a.logits_out.is_some());
    lm.generate(prompt, a.max_new_tokens, &how).map_err(|e| e.to_string())
}

/// The ranks as threads; they must agree on every token.
fn run_local(a: &Args, config: &ModelConfig, prompt: &[i64]) -> Result<Generation, String> {
    let devices = (0..a.world_size).map(|r| device_for(a.device, r)).collect::<Result<Vec<_>, _>>()?;
    let groups = DeviceGroup::local(a.world_size, timeout(), |r| devices[r]).map_err(|e| e.to_string())?;
    let results: Vec<Result<Generation, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                std::thread::Builder::new().name(format!("rank-{}", g.rank())).spawn_scoped(s, move || {
                    let out = one_rank(a, config, prompt, &g);
                    if out.is_err() {
                        g.abort("this rank failed"); // the others stop waiting for it
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h {
                Ok(h) => h.join().unwrap_or_else(|_| Err("a rank panicked".into())),
                Err(e) => Err(format!("cannot start a rank thread: {e}")),
            })
            .collect()
    });
    // The error worth reading is the first failing rank's own, not another's report that the
    // group was aborted because of it.
    let failures: Vec<(usize, &String)> =
        results.iter().enumerate().filter_map(|(r, res)| res.as_ref().err().map(|e| (r, e))).collect();
    let cause = failures.iter().find(|(_, e)| !e.contains("aborted: this rank failed")).or(failures.first());
    if let Some((r, e)) = cause {
        return Err(if a.world_size > 1 { format!("rank {r}: {e}") } else { e.to_string() });
    }
    let mut outs: Vec<Generation> = results.into_iter().filter_map(Result::ok).collect();
    if outs.iter().any(|o| o.tokens != outs[0].tokens) {
        return Err("ranks generated different tokens".into());
    }
    Ok(outs.swap_remove(0))
}

/// One process of an NCCL job (RANK etc. from torchrun or from `spawn_ranks`).
fn run_nccl_rank(a: &Args, config: &ModelConfig, prompt: &[i64]) -> Result<Option<Generation>, String> {
    let g = DeviceGroup::from_env().map_err(|e| e.to_string())?;
    if g.world_size() != a.world_size {
        return Err(format!("--world-size {} but WORLD_SIZE is {}", a.world_size, g.world_size()));
    }
    let out = one_rank(a, config, prompt, &g)?;
    Ok((g.rank() == 0).then_some(out))
}

/// Starts `world_size` copies of this program as an NCCL job on this machine and waits for them.
fn spawn_ranks(a: &Args, argv: &[String]) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free port: {e}"))?
        .port();
    let mut children = Vec::new();
    for r in 0..a.world_size {
        let child = std::process::Command::new(&exe)
            .args(argv)
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", a.world_size.to_string())
            .env("LOCAL_RANK", r.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .spawn()
            .map_err(|e| format!("cannot start rank {r}: {e}"))?;
        children.push(child);
    }
    let failed: Vec<usize> = children
        .into_iter()
        .enumerate()
        .filter_map(|(r, mut c)| (!c.wait().is_ok_and(|s| s.success())).then_some(r))
        .collect();
    if failed.is_empty() { Ok(()) } else { Err(format!("rank(s) {failed:?} failed")) }
}

/// Prints the ids line, the text (with a tokenizer) and the throughput lines; a failed write
/// (a full disk, a closed pipe) is an error, not a panic.
fn report(dir: &Path, prompt: &[i64], out: &Generation) -> Result<(), String> {
    let ids: Vec<String> = out.tokens.iter().map(i64::to_string).collect();
    let mut text = format!("{}\n", ids.join(","));
    if let Some(decoded) = tokenizer::decode(dir, &out.tokens) {
        text.push_str(&format!("text: {decoded:?}\n"));
    }
    let rate = |n: usize, t: Duration| {
        let s = t.as_secs_f64();
        if n == 0 || s <= 0.0 { "n/a".to_string() } else { format!("{:.2}", n as f64 / s) }
    };
    text.push_str(&format!(
        "prefill: {} tokens in {:.3} s, {} tokens/s\n",
        prompt.len(),
        out.prefill_time.as_secs_f64(),
        rate(prompt.len(), out.prefill_time)
    ));
    let steps = out.tokens.len().saturating_sub(1);
    text.push_str(&format!(
        "decode: {steps} tokens in {:.3} s, {} tokens/s\n",
        out.decode_time.as_secs_f64(),
        rate(steps, out.decode_time)
    ));
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
        .map_err(|e| format!("cannot write to standard output: {e}"))
}
