//! `tp serve`'s command line (vLLM's flag names) and its checks: the engine's options go into
//! [`EngineArgs`], the HTTP server's into [`ServerArgs`].

use crate::error::CliError;
use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::time::Duration;

/// The `tp` command.
#[derive(Debug, Parser)]
#[command(name = "tp", version, about = "Tensor-parallel LLM serving")]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// `tp`'s subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve a Hugging Face model folder over OpenAI's HTTP API.
    Serve(Box<ServeArgs>),
    /// Fine-tune a Hugging Face model folder on a JSONL file (tensor-parallel, on the host).
    Train(Box<crate::train::TrainArgs>),
    /// Merge a LoRA adapter into a Hugging Face model folder (PEFT's merge_and_unload).
    Merge(Box<crate::merge::MergeArgs>),
}

/// Weight and activation dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DTypeArg {
    /// The checkpoint's own (`torch_dtype` / `dtype` of config.json).
    Auto,
    /// 32-bit float.
    #[value(alias = "float32")]
    F32,
    /// 16-bit float.
    #[value(alias = "float16", alias = "half")]
    F16,
    /// bfloat16.
    #[value(alias = "bfloat16")]
    Bf16,
}

/// How the KV cache stores keys and values (`--kv-cache-dtype`, vLLM's flag).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvCacheDtypeArg {
    /// The model's dtype.
    Auto,
    /// FP8 E4M3, one byte per element, saturating at +-448 (vLLM's `fp8` with scales of 1.0).
    #[value(alias = "fp8_e4m3")]
    Fp8,
    /// llama.cpp's Q8_0 blocks: 32 signed bytes and an f16 scale per 32 elements.
    #[value(name = "q8_0")]
    Q8_0,
}

impl KvCacheDtypeArg {
    /// The 8-bit format, or `None` for the model's dtype.
    pub fn quant(self) -> Option<tp_core::KvQuant> {
        match self {
            KvCacheDtypeArg::Auto => None,
            KvCacheDtypeArg::Fp8 => Some(tp_core::KvQuant::Fp8E4M3),
            KvCacheDtypeArg::Q8_0 => Some(tp_core::KvQuant::Q8_0),
        }
    }
}

/// Where the ranks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    /// Host kernels.
    Cpu,
    /// NVIDIA GPUs.
    Cuda,
}

/// How the ranks talk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    /// Ranks as threads of this process.
    Local,
    /// One process per GPU over NCCL.
    Nccl,
    /// Each process of an `mpirun` or `srun` job one rank, on the host, over MPI (Open MPI,
    /// loaded at run time); rank 0 serves HTTP.
    Mpi,
}

/// `tp serve MODEL_DIR [FLAGS]`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// The model folder (config.json, safetensors, tokenizer.json, tokenizer_config.json), or a
    /// GGUF file (or a folder holding one), which carries its tokenizer and chat template.
    pub model_dir: PathBuf,
    /// Ranks the model is split over.
    #[arg(long = "tensor-parallel-size", alias = "tp", default_value_t = 1)]
    pub tensor_parallel_size: usize,
    /// Pipeline stages (`-pp`): the layers split over them; each stage a tensor-parallel
    /// group (`pipeline x tensor` ranks).
    #[arg(long = "pipeline-parallel-size", alias = "pp", default_value_t = 1)]
    pub pipeline_parallel_size: usize,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the chosen one is logged).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Weight and activation dtype.
    #[arg(long, value_enum, default_value = "auto")]
    pub dtype: DTypeArg,
    /// Where the ranks run.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceArg,
    /// How the ranks talk.
    #[arg(long, value_enum, default_value = "local")]
    pub backend: BackendArg,
    /// Most sequences in one step.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Most tokens in one step (longer prompts are prefilled in chunks).
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Longest prompt plus output (default: the model's `max_position_embeddings`).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Positions per KV-cache block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV-cache budget per rank, in bytes (suffixes K, M, G, KiB, MiB, GiB allowed).
    #[arg(long, value_parser = parse_bytes)]
    pub kv_cache_memory: Option<u64>,
    /// How the KV cache stores keys and values: the model's dtype, or 8 bits on the host (as
    /// many more positions in the same --kv-cache-memory).
    #[arg(long, value_enum, default_value = "auto")]
    pub kv_cache_dtype: KvCacheDtypeArg,
    /// Turn prefix caching on (the default).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    /// Turn prefix caching off.
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// The model's name in the API (default: MODEL_DIR as given).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Seed of requests that give none.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Require `Authorization: Bearer KEY` on /v1/ endpoints.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Most requests queued before new ones get 429.
    #[arg(long, default_value_t = 1024)]
    pub max_waiting_requests: usize,
    /// Largest request body, in bytes (larger ones get 413).
    #[arg(long, default_value = "8MiB", value_parser = parse_bytes)]
    pub max_request_bytes: u64,
    /// Seconds in-flight requests get to finish after SIGTERM/SIGINT before they are aborted.
    #[arg(long, default_value_t = 30.0)]
    pub shutdown_timeout: f64,
    /// Host products on the packed GEMM only: a request's logits are bitwise the same whatever
    /// runs beside it (slower small-batch decode).
    #[arg(long)]
    pub batch_invariant: bool,
    /// A mixture-of-experts model's experts whole on ranks, split in balanced ranges over the
    /// tensor-parallel group (vLLM's flag); without it each expert is split over the ranks.
    #[arg(long)]
    pub enable_expert_parallel: bool,
    /// Do not pack the host weights once for the GEMM (saves as much memory as the weights;
    /// batched steps then repack them on every call).
    #[arg(long)]
    pub no_prepack_weights: bool,
    /// A Jinja chat template file that replaces the model's own.
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// How the model writes tool calls: hermes (also qwen), llama3_json, mistral, openai
    /// (gpt-oss's harmony) (default: read from the chat template).
    #[arg(long, value_name = "NAME")]
    pub tool_call_parser: Option<String>,
    /// Accepted for vLLM compatibility: `tool_choice: "auto"` is on whenever a tool-call format
    /// is known.
    #[arg(long)]
    pub enable_auto_tool_choice: bool,
    /// Move the reasoning into `reasoning_content`: qwen3 or deepseek_r1 (`<think>...</think>`),
    /// openai_gptoss (harmony's analysis channel; on by itself for a harmony chat template).
    #[arg(long, value_name = "NAME")]
    pub reasoning_parser: Option<String>,
    /// Speculative decoding, as JSON: `{"method": "ngram", "num_speculative_tokens": K,
    /// "prompt_lookup_max": N, "prompt_lookup_min": M}` (vLLM's).
    #[arg(long, value_name = "JSON")]
    pub speculative_config: Option<String>,
    /// LoRA adapters served beside the model.
    #[command(flatten)]
    pub lora: crate::lora_serve::LoraServeArgs,
}

/// What the engine is started with (read by `engine::start_engine` alone).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineArgs {
    /// The model folder.
    pub model_dir: PathBuf,
    /// Ranks per stage.
    pub tensor_parallel_size: usize,
    /// Pipeline stages.
    pub pipeline_parallel_size: usize,
    /// Dtype.
    pub dtype: DTypeArg,
    /// Device.
    pub device: DeviceArg,
    /// Backend.
    pub backend: BackendArg,
    /// Most sequences per step.
    pub max_num_seqs: usize,
    /// Token budget per step.
    pub max_num_batched_tokens: usize,
    /// Longest prompt plus output (`None`: the model's).
    pub max_model_len: Option<usize>,
    /// Positions per block.
    pub block_size: usize,
    /// KV-cache bytes per rank (`None`: the engine's default).
    pub kv_cache_memory: Option<u64>,
    /// KV-cache storage.
    pub kv_cache_dtype: KvCacheDtypeArg,
    /// Prefix caching on.
    pub enable_prefix_caching: bool,
    /// Engine seed.
    pub seed: u64,
    /// Most queued requests.
    pub max_waiting: usize,
    /// Batch-invariant host products.
    pub batch_invariant: bool,
    /// Experts whole on ranks.
    pub expert_parallel: bool,
    /// Pack host weights once.
    pub prepack_weights: bool,
    /// `--speculative-config`.
    pub speculative: Option<tp_engine::spec::NgramConfig>,
    /// The LoRA adapters to serve.
    pub lora: crate::lora_serve::LoraServing,
}

/// What the HTTP server is started with.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerArgs {
    /// The model folder (tokenizer and chat template).
    pub model_dir: PathBuf,
    /// Listen address.
    pub host: String,
    /// Listen port.
    pub port: u16,
    /// The model's name in the API.
    pub served_model_name: String,
    /// Bearer key, if required.
    pub api_key: Option<String>,
    /// Largest body.
    pub max_request_bytes: usize,
    /// Grace period at shutdown.
    pub shutdown_timeout: Duration,
    /// `--chat-template FILE`.
    pub chat_template: Option<PathBuf>,
    /// `--tool-call-parser`.
    pub tool_call_parser: Option<crate::tools::ToolParser>,
    /// `--reasoning-parser`.
    pub reasoning_parser: Option<crate::reasoning::ReasoningParser>,
    /// The LoRA adapters served (names and slots).
    pub lora: crate::lora_serve::LoraServing,
}

/// Parses `tp`'s arguments; vLLM's single-dash `-tp N` / `-tp=N` is read as
/// `--tensor-parallel-size`, `-pp` as `--pipeline-parallel-size`, `-dp` as
/// `--data-parallel-size` and `-ep` as `--expert-model-parallel-size` (clap's short flags are
/// one letter).
pub fn parse_cli<I: IntoIterator<Item = std::ffi::OsString>>(args: I) -> Result<Cli, clap::Error> {
    const SHORT: [(&str, &str); 4] = [
        ("-tp", "--tensor-parallel-size"),
        ("-pp", "--pipeline-parallel-size"),
        ("-dp", "--data-parallel-size"),
        ("-ep", "--expert-model-parallel-size"),
    ];
    let args = args.into_iter().map(|a| {
        let Some(s) = a.to_str() else { return a };
        for (short, long) in SHORT {
            if s == short {
                return long.into();
            }
            if let Some(v) = s.strip_prefix(short).and_then(|r| r.strip_prefix('=')) {
                return format!("{long}={v}").into();
            }
        }
        a
    });
    Cli::try_parse_from(args)
}

/// Largest `--block-size`.
const MAX_BLOCK_SIZE: usize = 256;

impl ServeArgs {
    /// Checks the numbers and splits the flags into the engine's and the server's.
    pub fn split(self) -> Result<(EngineArgs, ServerArgs), CliError> {
        let bad = |flag: &str, msg: String| Err(CliError::Args(format!("--{flag}: {msg}")));
        if self.tensor_parallel_size == 0 {
            return bad("tensor-parallel-size", "must be at least 1".into());
        }
        if self.pipeline_parallel_size == 0 {
            return bad("pipeline-parallel-size", "must be at least 1".into());
        }
        if self.max_num_seqs == 0 {
            return bad("max-num-seqs", "must be at least 1".into());
        }
        if self.max_num_batched_tokens < self.max_num_seqs {
            return bad(
                "max-num-batched-tokens",
                format!("{} is below --max-num-seqs {}", self.max_num_batched_tokens, self.max_num_seqs),
            );
        }
        if self.max_model_len == Some(0) {
            return bad("max-model-len", "must be at least 1".into());
        }
        if !self.block_size.is_power_of_two() || self.block_size > MAX_BLOCK_SIZE {
            return bad(
                "block-size",
                format!("must be a power of two up to {MAX_BLOCK_SIZE}, got {}", self.block_size),
            );
        }
        if self.kv_cache_memory == Some(0) {
            return bad("kv-cache-memory", "must be more than 0 bytes".into());
        }
        if self.max_waiting_requests == 0 {
            return bad("max-waiting-requests", "must be at least 1".into());
        }
        let max_request_bytes = usize::try_from(self.max_request_bytes)
            .ok()
            .filter(|b| *b >= 1024)
            .ok_or_else(|| CliError::Args("--max-request-bytes: must be at least 1024".into()))?;
        if !(self.shutdown_timeout.is_finite() && (0.0..=86_400.0).contains(&self.shutdown_timeout)) {
            return bad("shutdown-timeout", format!("must be 0 to 86400 seconds, got {}", self.shutdown_timeout));
        }
        if self.host.is_empty() {
            return bad("host", "is empty".into());
        }
        if self.api_key.as_deref() == Some("") {
            return bad("api-key", "is empty".into());
        }
        let served_model_name =
            self.served_model_name.clone().unwrap_or_else(|| self.model_dir.to_string_lossy().into_owned());
        if served_model_name.is_empty() {
            return bad("served-model-name", "is empty".into());
        }
        let tool_call_parser = match &self.tool_call_parser {
            None => None,
            Some(n) => Some(crate::tools::ToolParser::from_name(n).ok_or_else(|| {
                CliError::Args(format!(
                    "--tool-call-parser: unknown parser `{n}` (expected hermes, qwen, llama3_json, mistral or openai)"
                ))
            })?),
        };
        let reasoning_parser = match &self.reasoning_parser {
            None => None,
            Some(n) => Some(crate::reasoning::ReasoningParser::from_name(n).ok_or_else(|| {
                CliError::Args(format!(
                    "--reasoning-parser: unknown parser `{n}` (expected qwen3, deepseek_r1 or openai_gptoss)"
                ))
            })?),
        };
        let lora = self.lora.check()?;
        let engine = EngineArgs {
            lora: lora.clone(),
            model_dir: self.model_dir.clone(),
            tensor_parallel_size: self.tensor_parallel_size,
            pipeline_parallel_size: self.pipeline_parallel_size,
            dtype: self.dtype,
            device: self.device,
            backend: self.backend,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_model_len: self.max_model_len,
            block_size: self.block_size,
            kv_cache_memory: self.kv_cache_memory,
            kv_cache_dtype: self.kv_cache_dtype,
            enable_prefix_caching: !self.no_enable_prefix_caching,
            seed: self.seed,
            max_waiting: self.max_waiting_requests,
            batch_invariant: self.batch_invariant,
            expert_parallel: self.enable_expert_parallel,
            prepack_weights: !self.no_prepack_weights,
            speculative: match &self.speculative_config {
                None => None,
                Some(j) => {
                    Some(speculative_config(j).map_err(|e| CliError::Args(format!("--speculative-config: {e}")))?)
                }
            },
        };
        let server = ServerArgs {
            model_dir: self.model_dir,
            host: self.host,
            port: self.port,
            served_model_name,
            api_key: self.api_key,
            max_request_bytes,
            shutdown_timeout: Duration::from_secs_f64(self.shutdown_timeout),
            chat_template: self.chat_template,
            tool_call_parser,
            reasoning_parser,
            lora,
        };
        Ok((engine, server))
    }
}

/// vLLM's `--speculative-config` JSON for the n-gram method: `num_speculative_tokens` is
/// required; given one of `prompt_lookup_max` and `prompt_lookup_min`, the other takes its
/// value, and given neither they are 5 and 1 (vLLM's defaults).
pub fn speculative_config(json: &str) -> Result<tp_engine::spec::NgramConfig, String> {
    let v: serde_json::Value = serde_json::from_str(json).map_err(|e| format!("not JSON: {e}"))?;
    let o = v.as_object().ok_or("must be a JSON object")?;
    for k in o.keys() {
        if !["method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"].contains(&k.as_str()) {
            return Err(format!("unknown key `{k}` (tp implements the ngram method's keys)"));
        }
    }
    match o.get("method").and_then(serde_json::Value::as_str) {
        Some("ngram") => {}
        Some(m) => return Err(format!("method `{m}` is not supported (tp implements \"ngram\")")),
        None => return Err("`method` must be \"ngram\"".into()),
    }
    let num = |k: &str| -> Result<Option<usize>, String> {
        match o.get(k) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(v) => {
                v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| format!("`{k}` must be a non-negative integer"))
            }
        }
    };
    let k = num("num_speculative_tokens")?.ok_or("`num_speculative_tokens` is required")?;
    let (max, min) = match (num("prompt_lookup_max")?, num("prompt_lookup_min")?) {
        (Some(a), Some(b)) => (a, b),
        (Some(a), None) => (a, a),
        (None, Some(b)) => (b, b),
        (None, None) => (5, 1),
    };
    let cfg =
        tp_engine::spec::NgramConfig { num_speculative_tokens: k, prompt_lookup_max: max, prompt_lookup_min: min };
    cfg.validate()?;
    Ok(cfg)
}

/// Parses a byte count: a plain integer or one with a suffix K, M, G, T (powers of 1000) or
/// KiB, MiB, GiB, TiB (powers of 1024).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("`{s}` is not a byte count (e.g. 4000000000, 4G, 4GiB)"))?;
    let mul: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "m" | "mb" => 1_000_000,
        "g" | "gb" => 1_000_000_000,
        "t" | "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        u => return Err(format!("unknown unit `{u}` in `{s}` (K, M, G, T, KiB, MiB, GiB, TiB)")),
    };
    n.checked_mul(mul).ok_or_else(|| format!("`{s}` does not fit in 64 bits"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<(EngineArgs, ServerArgs), String> {
        let cli = parse_cli(args.iter().map(std::ffi::OsString::from)).map_err(|e| e.to_string())?;
        match cli.command {
            Command::Serve(s) => s.split().map_err(|e| e.to_string()),
            Command::Train(_) | Command::Merge(_) => Err("not tp serve".into()),
        }
    }

    #[test]
    fn train_flags_have_the_issue_names_and_trainer_defaults() {
        let cli = parse_cli(["tp", "train", "m", "--data", "d.jsonl"].map(std::ffi::OsString::from)).unwrap();
        let Command::Train(t) = cli.command else { panic!("not train") };
        assert_eq!(
            (t.lr, t.adam_beta1, t.adam_beta2, t.adam_eps, t.weight_decay, t.max_grad_norm),
            (5e-5, 0.9, 0.999, 1e-8, 0.0, 1.0)
        );
        assert_eq!((t.micro_batch_size, t.grad_accum, t.warmup_steps, t.tensor_parallel_size), (8, 1, 0, 1));
        let all = [
            "tp",
            "train",
            "m",
            "--data",
            "d",
            "--tensor-parallel-size",
            "2",
            "--dtype",
            "bf16",
            "--seq-len",
            "64",
            "--micro-batch-size",
            "2",
            "--grad-accum",
            "3",
            "--steps",
            "9",
            "--lr",
            "1e-4",
            "--weight-decay",
            "0.1",
            "--adam-beta1",
            "0.8",
            "--adam-beta2",
            "0.95",
            "--adam-eps",
            "1e-6",
            "--max-grad-norm",
            "0.5",
            "--warmup-steps",
            "2",
            "--lr-schedule",
            "cosine",
            "--seed",
            "7",
            "--sequence-parallel",
            "--recompute",
            "selective",
            "--log-json",
            "l",
            "--dump-grads",
            "g",
            "--save",
            "s",
            "--save-every",
            "3",
            "--resume",
            "r",
        ];
        let cli = parse_cli(all.map(std::ffi::OsString::from)).unwrap();
        let Command::Train(t) = cli.command else { panic!("not train") };
        assert!(t.sequence_parallel && t.steps == Some(9) && t.save_every == Some(3) && t.resume.is_some());
    }

    #[test]
    fn defaults_follow_vllm() {
        let (e, s) = parse(&["tp", "serve", "m/dir"]).unwrap();
        assert_eq!((s.host.as_str(), s.port, s.served_model_name.as_str()), ("127.0.0.1", 8000, "m/dir"));
        assert_eq!((e.tensor_parallel_size, e.block_size, e.enable_prefix_caching), (1, 16, true));
        assert_eq!((e.dtype, e.device, e.backend), (DTypeArg::Auto, DeviceArg::Cpu, BackendArg::Local));
        assert_eq!(s.max_request_bytes, 8 << 20);
    }

    #[test]
    fn every_flag_is_read() {
        let (e, s) = parse(&[
            "tp",
            "serve",
            "d",
            "-tp",
            "2",
            "--host",
            "0.0.0.0",
            "--port",
            "9",
            "--dtype",
            "bfloat16",
            "--device",
            "cuda",
            "--backend",
            "nccl",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "64",
            "--max-model-len",
            "100",
            "--block-size",
            "32",
            "--kv-cache-memory",
            "2GiB",
            "--no-enable-prefix-caching",
            "--served-model-name",
            "x",
            "--seed",
            "7",
            "--api-key",
            "k",
            "--chat-template",
            "t.jinja",
            "--tool-call-parser",
            "llama3_json",
            "--enable-auto-tool-choice",
            "--reasoning-parser",
            "qwen3",
        ])
        .unwrap();
        assert_eq!(s.chat_template.as_deref(), Some(std::path::Path::new("t.jinja")));
        assert_eq!(s.tool_call_parser, Some(crate::tools::ToolParser::Llama3Json));
        assert_eq!(s.reasoning_parser, Some(crate::reasoning::ReasoningParser::Qwen3));
        let (spec, _) = parse(&[
            "tp",
            "serve",
            "d",
            "--speculative-config",
            r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}"#,
        ])
        .unwrap();
        assert_eq!(
            spec.speculative,
            Some(tp_engine::spec::NgramConfig {
                num_speculative_tokens: 3,
                prompt_lookup_max: 4,
                prompt_lookup_min: 2
            })
        );
        for bad in [
            r#"{"method": "eagle", "num_speculative_tokens": 3}"#,
            r#"{"method": "ngram"}"#,
            "[1]",
            r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 1, "prompt_lookup_min": 2}"#,
            r#"{"method": "ngram", "num_speculative_tokens": 3, "model": "x"}"#,
        ] {
            let e = parse(&["tp", "serve", "d", "--speculative-config", bad]).unwrap_err();
            assert!(e.contains("--speculative-config"), "{bad}: {e}");
        }
        for (flag, v) in [("--tool-call-parser", "pythonic"), ("--reasoning-parser", "o1")] {
            let e = parse(&["tp", "serve", "d", flag, v]).unwrap_err();
            assert!(e.contains(flag), "{e}");
        }
        assert_eq!(e.tensor_parallel_size, 2);
        assert_eq!((e.dtype, e.device, e.backend), (DTypeArg::Bf16, DeviceArg::Cuda, BackendArg::Nccl));
        assert_eq!((e.max_num_seqs, e.max_num_batched_tokens, e.max_model_len), (4, 64, Some(100)));
        assert_eq!((e.block_size, e.kv_cache_memory, e.enable_prefix_caching, e.seed), (32, Some(2 << 30), false, 7));
        assert_eq!((s.host.as_str(), s.port, s.served_model_name.as_str()), ("0.0.0.0", 9, "x"));
        assert_eq!(s.api_key.as_deref(), Some("k"));
    }

    #[test]
    fn bad_numbers_are_refused_with_the_flag_named() {
        for (args, flag) in [
            (vec!["-tp", "0"], "--tensor-parallel-size"),
            (vec!["--block-size", "12"], "--block-size"),
            (vec!["--max-num-seqs", "8", "--max-num-batched-tokens", "4"], "--max-num-batched-tokens"),
            (vec!["--kv-cache-memory", "3XB"], "--kv-cache-memory"),
            (vec!["--max-model-len", "0"], "--max-model-len"),
            (vec!["--port", "70000"], "--port"),
        ] {
            let mut all = vec!["tp", "serve", "d"];
            all.extend(args);
            let err = parse(&all).unwrap_err();
            assert!(err.contains(flag), "{flag}: {err}");
        }
    }

    #[test]
    fn byte_counts() {
        assert_eq!(parse_bytes("123").unwrap(), 123);
        assert_eq!(parse_bytes("4G").unwrap(), 4_000_000_000);
        assert_eq!(parse_bytes("1MiB").unwrap(), 1 << 20);
        assert!(parse_bytes("99999999999TiB").is_err());
        assert!(parse_bytes("x").is_err());
    }
}
