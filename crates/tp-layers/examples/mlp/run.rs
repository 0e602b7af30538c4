//! The `mlp` example's program: flags, the ranks (threads or processes), the output file.
//!
//! ```text
//! mlp --checkpoint PATH --prefix PREFIX --input X --world-size N [--backend local|nccl]
//!     [--device cpu|cuda] [--dtype f32|f16|bf16] --output Y
//! ```
//! `X` is a safetensors file with one tensor `x: [tokens, hidden]`; `Y` receives `y: [tokens,
//! hidden]` in the chosen dtype. `local` runs the N ranks as threads (on `cuda` they share the
//! GPUs round-robin); `nccl` runs them as processes, either started by torchrun (`RANK` is set)
//! or by this program itself, one GPU each. `N` is at most [`tp_comm::MAX_WORLD_SIZE`] (and,
//! with `nccl`, the number of GPUs).
//!
//! Errors are one line each. A rank of an NCCL job (`RANK` set) names itself in its error, so
//! the lines of several ranks on one terminal can be told apart.

use tp_comm::{DeviceGroup, MAX_WORLD_SIZE};
use tp_core::{Activation, DType, Device, Tensor};
use tp_layers::{Checkpoint, LayerError, LoadOptions, Loader, MlpNames, ParallelMlp, save};
use tp_testing::ranks::{self, RankFailure};

/// The command line as UTF-8 (a non-UTF-8 argument is an error, not a panic).
pub fn utf8_args() -> Result<Vec<String>, String> {
    std::env::args_os()
        .skip(1)
        .map(|a| a.into_string().map_err(|a| format!("argument {a:?} is not valid UTF-8")))
        .collect()
}

/// Parsed command line.
#[derive(Debug, Clone, PartialEq)]
pub struct Args {
    /// `--checkpoint`: safetensors file, index json or folder.
    pub checkpoint: String,
    /// `--prefix`: the MLP's name prefix, e.g. `model.layers.0.mlp`.
    pub prefix: String,
    /// `--input`: safetensors file holding `x: [tokens, hidden]`.
    pub input: String,
    /// `--world-size`: number of ranks.
    pub world_size: usize,
    /// `--backend`.
    pub backend: Backend,
    /// `--device`.
    pub device: DeviceKind,
    /// `--dtype` of the computation and of `y`.
    pub dtype: DType,
    /// `--output`: safetensors file to write `y` to.
    pub output: String,
}

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
    /// CUDA GPUs (ranks round-robin over them with the local backend).
    Cuda,
}

const USAGE: &str = "usage: mlp --checkpoint PATH --prefix PREFIX --input X --world-size N [--backend local|nccl] \
                     [--device cpu|cuda] [--dtype f32|f16|bf16] --output Y";

/// Parses the flags; every problem is one line.
pub fn parse(args: &[String]) -> Result<Args, String> {
    let (mut ckpt, mut prefix, mut input, mut world, mut output) = (None, None, None, None, None);
    let (mut backend, mut device, mut dtype) = (Backend::Local, DeviceKind::Cpu, DType::F32);
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().cloned().ok_or_else(|| format!("{flag} needs a value; {USAGE}"));
        match flag.as_str() {
            "--checkpoint" => ckpt = Some(value()?),
            "--prefix" => prefix = Some(value()?),
            "--input" => input = Some(value()?),
            "--output" => output = Some(value()?),
            "--world-size" => {
                let v = value()?;
                let n: usize = v.parse().map_err(|_| format!("--world-size {v:?} is not a number"))?;
                if n == 0 {
                    return Err("--world-size must be at least 1".into());
                }
                if n > MAX_WORLD_SIZE {
                    return Err(format!("--world-size {n} exceeds the maximum of {MAX_WORLD_SIZE} ranks"));
                }
                world = Some(n);
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
            "--dtype" => dtype = value()?.parse().map_err(|e| format!("--dtype: {e}"))?,
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other:?}; {USAGE}")),
        }
    }
    let need = |v: Option<String>, name: &str| v.ok_or_else(|| format!("{name} is required; {USAGE}"));
    Ok(Args {
        checkpoint: need(ckpt, "--checkpoint")?,
        prefix: need(prefix, "--prefix")?,
        input: need(input, "--input")?,
        world_size: world.ok_or_else(|| format!("--world-size is required; {USAGE}"))?,
        output: need(output, "--output")?,
        backend,
        device,
        dtype,
    })
}

/// Runs the example with `args` (without the program name).
pub fn run(args: &[String]) -> Result<(), String> {
    run_args(args).map_err(|e| match std::env::var("RANK") {
        Ok(r) => format!("rank {}: {e}", tp_comm::peer_text(r.as_bytes())),
        Err(_) => e,
    })
}

fn run_args(args: &[String]) -> Result<(), String> {
    let a = parse(args)?;
    let e = |e: LayerError| e.to_string();
    if a.backend == Backend::Nccl && a.device != DeviceKind::Cuda {
        return Err("--backend nccl needs --device cuda (NCCL moves GPU memory)".into());
    }
    let x = Checkpoint::open(&a.input).map_err(e)?;
    let (_, x_dims) = x.info("x").map_err(e)?;
    if x_dims.len() != 2 {
        return Err(format!("{}: x must be [tokens, hidden], got {x_dims:?}", a.input));
    }
    let x = x.load("x", Some(a.dtype), &Device::Cpu).map_err(e)?;
    let ckpt = Checkpoint::open(&a.checkpoint).map_err(e)?;
    let y = match a.backend {
        Backend::Local => run_local(&a, &ckpt, &x)?,
        Backend::Nccl if std::env::var_os("RANK").is_some() => match run_nccl_rank(&a, &ckpt, &x)? {
            Some(y) => y,
            None => return Ok(()), // not rank 0: rank 0 writes the output
        },
        Backend::Nccl => return spawn_ranks(&a, args),
    };
    save(&a.output, &[("y", &y)]).map_err(e)
}

/// N ranks as threads; every rank must produce the same output.
fn run_local(a: &Args, ckpt: &Checkpoint, x: &Tensor) -> Result<Tensor, String> {
    let cuda = a.device == DeviceKind::Cuda;
    let devices = (0..a.world_size).map(|r| ranks::device_for(cuda, r)).collect::<Result<Vec<_>, _>>()?;
    let groups = DeviceGroup::local(a.world_size, ranks::timeout(), |r| devices[r]).map_err(|e| e.to_string())?;
    let results = ranks::run_threads(groups, "mlp-rank", |g| one_rank(a, ckpt, x, g));
    // The failure to report: the first rank's own error, not another rank's report that the
    // group was poisoned by it.
    let echo = |e: &LayerError| matches!(e, LayerError::Comm(c) if ranks::is_poisoned(c));
    if let Some((r, failure)) = ranks::root_cause(&results, echo) {
        return Err(match failure {
            RankFailure::Failed(e) => format!("rank {r}: {e}"),
            RankFailure::Panicked => format!("rank {r}: panicked"),
            RankFailure::NotStarted(e) => format!("cannot start the thread of rank {r} of {}: {e}", a.world_size),
        });
    }
    let mut ys: Vec<Tensor> = results.into_iter().filter_map(Result::ok).collect();
    if ys.iter().any(|y| y != &ys[0]) {
        return Err("ranks disagree on the output".into());
    }
    Ok(ys.swap_remove(0))
}

fn one_rank(a: &Args, ckpt: &Checkpoint, x: &Tensor, g: &DeviceGroup) -> Result<Tensor, LayerError> {
    let ld = Loader::new(ckpt, g, LoadOptions::new().with_dtype(a.dtype)).pp(&a.prefix);
    let mlp = ParallelMlp::load(&ld, MlpNames::default(), Activation::Silu)?;
    let y = mlp.forward(&x.to_device(&g.device())?)?;
    Ok(y.to_device(&Device::Cpu)?)
}

/// One process of an NCCL job (RANK etc. set by torchrun or by `spawn_ranks`).
fn run_nccl_rank(a: &Args, ckpt: &Checkpoint, x: &Tensor) -> Result<Option<Tensor>, String> {
    let g = DeviceGroup::from_env().map_err(|e| e.to_string())?;
    if g.world_size() != a.world_size {
        return Err(format!("--world-size {} but WORLD_SIZE is {}", a.world_size, g.world_size()));
    }
    let y = one_rank(a, ckpt, x, &g).map_err(|e| e.to_string())?;
    Ok((g.rank() == 0).then_some(y))
}

/// Checks there is a GPU per rank, then starts `world_size` copies of this program as an NCCL
/// job on this machine and waits for them ([`ranks::spawn_ranks`]).
fn spawn_ranks(a: &Args, args: &[String]) -> Result<(), String> {
    let gpus = tp_kernels::device_count().map_err(|e| format!("--device cuda: {e}"))?;
    if gpus < a.world_size {
        return Err(format!(
            "--backend nccl runs one rank per GPU: --world-size {} but {gpus} GPU(s) found",
            a.world_size
        ));
    }
    ranks::spawn_ranks(a.world_size, args)
}
