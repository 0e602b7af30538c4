//! Runs a Hugging Face checkpoint folder, or a GGUF file (or a folder holding one), to tokens,
//! tensor-parallel. Without `--dtype` a Hugging Face folder runs in f32 and a GGUF file on its
//! quantized blocks; with one, a GGUF file is dequantized to it while loading.
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
use tp_models::{GenerateOptions, Generation, ModelConfig, ModelOptions, ParallelCausalLm};
use tp_testing::ranks::{self, RankFailure};

fn main() {
    if let Err(e) = run() {
        // One write for the whole line (ranks may share the terminal); a closed stderr is no panic.
        let _ = std::io::stderr().write_all(format!("generate: {e}\n").as_bytes());
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let argv = args::utf8(std::env::args_os().skip(1))?;
    let mut a = args::parse(&argv)?;
    if a.backend == Backend::Nccl && a.device != DeviceKind::Cuda {
        return Err("--backend nccl needs --device cuda (NCCL moves GPU memory)".into());
    }
    // A Hugging Face folder runs in f32 unless told otherwise; a GGUF file on its own blocks.
    if tp_models::gguf::find_gguf(Path::new(&a.model)).map_err(|e| e.to_string())?.is_none() {
        a.dtype = a.dtype.or(Some(tp_core::DType::F32));
    }
    let a = a;
    let dir = Path::new(&a.model);
    // The config and the prompt are checked before any rank starts.
    let config = ModelConfig::from_dir(dir).map_err(|e| e.to_string())?;
    let prompt = match &a.prompt {
        Prompt::Ids(ids) => ids.clone(),
        Prompt::Text(text) => tokenizer::encode(dir, text)?,
    };
    check_request(&config, &prompt, a.max_new_tokens)?;
    if let Some(moe) = &config.moe {
        // Where the experts go, checked (and shown once) before any rank starts.
        let placement = tp_models::tp_layers::ExpertPlacement::new(moe.num_experts, a.world_size, a.expert_parallel)
            .map_err(|e| e.to_string())?;
        if std::env::var("RANK").is_err() {
            eprintln!("experts: {}", placement.describe());
        }
    }
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
            return ranks::spawn_ranks(a.world_size, &argv);
        }
    };
    if let Some(path) = &a.logits_out {
        logits_file::write_logits(Path::new(path), &out)?;
    }
    report(dir, &prompt, &out)
}

/// The library's request checks, once, before any rank starts.
fn check_request(c: &ModelConfig, prompt: &[i64], n: usize) -> Result<(), String> {
    if prompt.is_empty() {
        return Err("the prompt is empty (the tokenizer made no tokens of it)".into());
    }
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

/// One rank: load its shards, generate.
fn one_rank(a: &Args, config: &ModelConfig, prompt: &[i64], g: &DeviceGroup) -> Result<Generation, String> {
    let mut opts =
        ModelOptions::new().with_max_seq_len(prompt.len() + a.max_new_tokens).with_expert_parallel(a.expert_parallel);
    if let Some(d) = a.dtype {
        opts = opts.with_dtype(d);
    }
    let mut lm = ParallelCausalLm::load_with_config(&a.model, config, g, &opts).map_err(|e| e.to_string())?;
    let how = GenerateOptions::new().ignore_eos(a.ignore_eos).keep_logits(a.logits_out.is_some());
    lm.generate(prompt, a.max_new_tokens, &how).map_err(|e| e.to_string())
}

/// The ranks as threads; they must agree on every token.
fn run_local(a: &Args, config: &ModelConfig, prompt: &[i64]) -> Result<Generation, String> {
    let cuda = a.device == DeviceKind::Cuda;
    let devices = (0..a.world_size).map(|r| ranks::device_for(cuda, r)).collect::<Result<Vec<_>, _>>()?;
    let groups = DeviceGroup::local(a.world_size, ranks::timeout(), |r| devices[r]).map_err(|e| e.to_string())?;
    let results = ranks::run_threads(groups, "rank", |g| one_rank(a, config, prompt, g));
    // The error worth reading is the first failing rank's own, not another's report that the
    // group was aborted because of it.
    // (Any rank's "the group is poisoned" report: a failure, a panic or a thread that could
    // not start elsewhere.)
    if let Some((r, failure)) = ranks::root_cause(&results, |e: &String| e.contains(": the group is poisoned: ")) {
        let e = match failure {
            RankFailure::Failed(e) => e.clone(),
            RankFailure::Panicked => "a rank panicked".to_string(),
            RankFailure::NotStarted(e) => format!("cannot start a rank thread: {e}"),
        };
        return Err(if a.world_size > 1 { format!("rank {r}: {e}") } else { e });
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
