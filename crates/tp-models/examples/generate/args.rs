//! The example's command line, parsed into [`Args`]; every problem is one line.

use std::ffi::OsString;
use tp_core::DType;

pub const USAGE: &str = "usage: generate --model DIR (--prompt-ids 1,2,3 | --prompt TEXT) --max-new-tokens N --world-size W \
                         [--backend local|nccl] [--device cpu|cuda] [--dtype f32|f16|bf16] \
                         [--logits-out FILE.safetensors] [--ignore-eos] [--enable-expert-parallel]";

/// Largest `--world-size` accepted (tp-comm's limit for a group).
pub const MAX_WORLD_SIZE: usize = tp_comm::MAX_WORLD_SIZE;

/// How ranks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Ranks as threads of this process (LocalGroup).
    Local,
    /// Ranks as processes over NCCL, one GPU each.
    Nccl,
}

/// Where ranks compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// The host backend.
    Cpu,
    /// CUDA GPUs (round-robin over them with the local backend).
    Cuda,
}

/// The prompt, as ids or as text for the folder's tokenizer.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Ids(Vec<i64>),
    Text(String),
}

/// Parsed command line.
#[derive(Debug, Clone, PartialEq)]
pub struct Args {
    pub model: String,
    pub prompt: Prompt,
    pub max_new_tokens: usize,
    pub world_size: usize,
    pub backend: Backend,
    pub device: DeviceKind,
    /// `None`: f32 for a Hugging Face folder; a GGUF file's own quantized blocks.
    pub dtype: Option<DType>,
    pub logits_out: Option<String>,
    pub ignore_eos: bool,
    /// A mixture-of-experts model's experts whole on ranks (vLLM's flag).
    pub expert_parallel: bool,
}

/// The arguments as UTF-8 strings (a non-UTF-8 argument is an error, not a panic).
pub fn utf8(args: impl Iterator<Item = OsString>) -> Result<Vec<String>, String> {
    args.map(|a| a.into_string().map_err(|a| format!("argument {a:?} is not valid UTF-8"))).collect()
}

fn ids(v: &str) -> Result<Vec<i64>, String> {
    let ids = v
        .split(',')
        .map(|s| s.trim().parse::<i64>().map_err(|_| format!("--prompt-ids: {s:?} is not an integer token id")))
        .collect::<Result<Vec<_>, _>>()?;
    if ids.is_empty() {
        return Err("--prompt-ids is empty".into());
    }
    Ok(ids)
}

/// Parses the flags (without the program name).
pub fn parse(args: &[String]) -> Result<Args, String> {
    let (mut model, mut prompt, mut n, mut world, mut logits_out) = (None, None, None, None, None);
    let (mut backend, mut device, mut dtype, mut ignore_eos) = (Backend::Local, DeviceKind::Cpu, None, false);
    let mut expert_parallel = false;
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().cloned().ok_or_else(|| format!("{flag} needs a value; {USAGE}"));
        match flag.as_str() {
            "--model" => model = Some(value()?),
            "--prompt-ids" => prompt = Some(Prompt::Ids(ids(&value()?)?)),
            "--prompt" => prompt = Some(Prompt::Text(value()?)),
            "--max-new-tokens" => {
                let v = value()?;
                let k: usize = v.parse().map_err(|_| format!("--max-new-tokens {v:?} is not a number"))?;
                if k == 0 {
                    return Err("--max-new-tokens must be at least 1".into());
                }
                n = Some(k);
            }
            "--world-size" => {
                let v = value()?;
                let w: usize = v.parse().map_err(|_| format!("--world-size {v:?} is not a number"))?;
                if w == 0 || w > MAX_WORLD_SIZE {
                    return Err(format!("--world-size must be between 1 and {MAX_WORLD_SIZE}, got {w}"));
                }
                world = Some(w);
            }
            "--backend" => {
                backend = match value()?.as_str() {
                    "local" => Backend::Local,
                    "nccl" => Backend::Nccl,
                    other => return Err(format!("--backend {other:?}: expected local or nccl")),
                }
            }
            "--device" => {
                device = match value()?.as_str() {
                    "cpu" => DeviceKind::Cpu,
                    "cuda" => DeviceKind::Cuda,
                    other => return Err(format!("--device {other:?}: expected cpu or cuda")),
                }
            }
            "--dtype" => {
                let v = value()?;
                dtype = match v.parse::<DType>() {
                    Ok(d) if d.is_float() => Some(d),
                    _ => return Err(format!("--dtype {v:?}: expected f32, f16 or bf16")),
                }
            }
            "--logits-out" => logits_out = Some(value()?),
            "--ignore-eos" => ignore_eos = true,
            "--enable-expert-parallel" => expert_parallel = true,
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other:?}; {USAGE}")),
        }
    }
    let need = |v: Option<String>, name: &str| v.ok_or_else(|| format!("{name} is required; {USAGE}"));
    Ok(Args {
        model: need(model, "--model")?,
        prompt: prompt.ok_or_else(|| format!("--prompt-ids (or --prompt) is required; {USAGE}"))?,
        max_new_tokens: n.ok_or_else(|| format!("--max-new-tokens is required; {USAGE}"))?,
        world_size: world.ok_or_else(|| format!("--world-size is required; {USAGE}"))?,
        backend,
        device,
        dtype,
        logits_out,
        ignore_eos,
        expert_parallel,
    })
}
