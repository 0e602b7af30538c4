//! `tp train MODEL --data FILE.jsonl [FLAGS]`: fine-tunes a Hugging Face model folder (or,
//! with LoRA adapters on its frozen weights, a GGUF file) at any TP degree, ranks as threads of this process on the host backend (tp-train's loop on every
//! rank). Flags follow transformers' `TrainingArguments` where they overlap, with their
//! defaults (lr 5e-5, betas 0.9/0.999, eps 1e-8, no weight decay, clipping at 1.0, a linear
//! schedule without warmup, 8 rows per micro-batch, three passes over the data).
//!
//! Rank 0 writes one JSON line per step to `--log-json` and a progress line to stderr. Every
//! input is checked before anything is written: the data file (file and line of the first bad
//! row), the TP degree against the model, the `--save` folder.

use crate::error::CliError;
use crate::text::TextModel;
use clap::ValueEnum;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;
use tp_comm::{Mesh, MeshShape};
use tp_core::{DType, Device};
use tp_models::{
    ModelConfig, ModelOptions, ParallelCausalLm, Recompute, StagePart, parse_layer_partition, stage_parts,
};
use tp_train::data::{Dataset, TextTokenizer};
use tp_train::optim::AdamW;
use tp_train::pipeline::{ScheduleKind, TraceClock, TraceEvent};
use tp_train::schedule::{LrSchedule, LrScheduleKind};
use tp_train::{RunOptions, StepGroups, StepLog, TrainConfig, Trainer, checkpoint};

/// The training dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TrainDType {
    /// 32-bit float everywhere.
    #[value(alias = "float32")]
    F32,
    /// bfloat16 weights and activations, fp32 master weights and optimizer state.
    #[value(alias = "bfloat16")]
    Bf16,
}

/// `--lr-schedule`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ScheduleArg {
    /// The rate after warmup stays.
    Constant,
    /// Decays linearly to 0 at the last step.
    Linear,
    /// Half a cosine down to 0 at the last step.
    Cosine,
}

/// `--recompute`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RecomputeArg {
    /// Keep the blocks' activations.
    None,
    /// Recompute attention's scores (tp never stores them, so as `none`).
    Selective,
    /// Keep only each block's input; rerun the block in the backward.
    Full,
}

/// `tp train MODEL --data FILE.jsonl [FLAGS]`.
#[derive(Debug, Clone, clap::Args)]
pub struct TrainArgs {
    /// A Hugging Face model folder (config.json, safetensors in f32 or bf16, tokenizer files
    /// for `text` and `messages` rows).
    pub model: PathBuf,
    /// The training rows: one JSON object a line, `{"input_ids", "labels"}`, `{"text"}` or
    /// `{"messages"}`.
    #[arg(long)]
    pub data: PathBuf,
    /// Ranks the model is split over.
    #[arg(long = "tensor-parallel-size", alias = "tp", default_value_t = 1)]
    pub tensor_parallel_size: usize,
    /// Pipeline stages, each a tensor-parallel group (world = D x P x N ranks).
    #[arg(long = "pipeline-parallel-size", alias = "pp", default_value_t = 1)]
    pub pipeline_parallel_size: usize,
    /// Data-parallel replicas of the whole pipeline; a step takes D x B x K rows.
    #[arg(long = "data-parallel-size", alias = "dp", default_value_t = 1)]
    pub data_parallel_size: usize,
    /// Expert parallelism over data-parallel replicas (Megatron's axis, `-ep`): a mixture's
    /// experts whole over E of the D replicas (E divides D), each split over the tensor-parallel
    /// group, tokens sent to them by all-to-all.
    #[arg(long = "expert-model-parallel-size", alias = "ep", default_value_t = 1)]
    pub expert_model_parallel_size: usize,
    /// The pipeline schedule: gpipe, 1f1b, interleaved (with --virtual-stages) or zb-h1.
    #[arg(long, default_value = "1f1b", value_parser = parse_schedule)]
    pub pp_schedule: ScheduleKind,
    /// Model chunks per pipeline rank (interleaved 1F1B).
    #[arg(long, default_value_t = 1)]
    pub virtual_stages: usize,
    /// Layers per pipeline stage, e.g. 10,12,10 (vLLM's VLLM_PP_LAYER_PARTITION); one count
    /// per virtual stage with --virtual-stages.
    #[arg(long)]
    pub pp_layer_partition: Option<String>,
    /// Write a Chrome trace-event JSON of every rank's forwards, backwards, waits and
    /// optimizer steps (open it in Perfetto or chrome://tracing).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Training dtype (default: the checkpoint's, when it is f32 or bf16).
    #[arg(long, value_enum)]
    pub dtype: Option<TrainDType>,
    /// Longest row in tokens; longer rows are truncated (default: max_position_embeddings).
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Rows per micro-batch.
    #[arg(long, default_value_t = 8)]
    pub micro_batch_size: usize,
    /// Micro-batches per step (gradient accumulation).
    #[arg(long, default_value_t = 1)]
    pub grad_accum: usize,
    /// Optimizer steps (default: three passes over the data, as the Trainer's 3 epochs).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Peak learning rate.
    #[arg(long, default_value_t = 5e-5)]
    pub lr: f64,
    /// Decoupled weight decay (not on biases and norm weights).
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
    /// AdamW's beta1.
    #[arg(long, default_value_t = 0.9)]
    pub adam_beta1: f64,
    /// AdamW's beta2.
    #[arg(long, default_value_t = 0.999)]
    pub adam_beta2: f64,
    /// AdamW's epsilon.
    #[arg(long, default_value_t = 1e-8)]
    pub adam_eps: f64,
    /// Global gradient-norm clipping (0: none).
    #[arg(long, default_value_t = 1.0)]
    pub max_grad_norm: f64,
    /// Steps of linear warmup.
    #[arg(long, default_value_t = 0)]
    pub warmup_steps: u64,
    /// The rate after warmup.
    #[arg(long, value_enum, default_value = "linear")]
    pub lr_schedule: ScheduleArg,
    /// Seed (rows are read in file order and nothing samples, so it changes nothing yet; kept
    /// in the log for the record).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Sequence parallelism: norms and residuals on sequence shards.
    #[arg(long)]
    pub sequence_parallel: bool,
    /// A mixture of experts' experts whole on ranks, in balanced ranges over the
    /// tensor-parallel group (vLLM's flag); without it each expert is split over the ranks.
    #[arg(long)]
    pub enable_expert_parallel: bool,
    /// What the forward keeps for the backward.
    #[arg(long, value_enum, default_value = "none")]
    pub recompute: RecomputeArg,
    /// One JSON line per step: step, loss, grad_norm, lr, tokens, elapsed_s.
    #[arg(long)]
    pub log_json: Option<PathBuf>,
    /// Step 1's gradients (full, f32, before clipping) as a safetensors file.
    #[arg(long)]
    pub dump_grads: Option<PathBuf>,
    /// Write a checkpoint (an HF folder plus optimizer state) here at the end.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Also write SAVE/step-N every N steps.
    #[arg(long)]
    pub save_every: Option<u64>,
    /// Continue from a checkpoint of this run (same flags; a LoRA run's base stays MODEL).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// LoRA adapters on the frozen model.
    #[command(flatten)]
    pub lora: crate::train_lora::LoraArgs,
    /// The distributed optimizer (ZeRO stage 1, Megatron's --use-distributed-optimizer): 1
    /// shares AdamW's moments and the fp32 master weights out over the data-parallel replicas
    /// (gradients reduce-scattered, updated weights all-gathered); 0 keeps them whole on every
    /// replica. Results are the same bits either way.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1))]
    pub zero: u8,
    /// How the ranks talk: threads of this process, or (under `mpirun` or `srun`) each
    /// process one rank over MPI.
    #[arg(long, value_enum, default_value = "local")]
    pub backend: TrainBackend,
}

/// `tp train --backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TrainBackend {
    /// Every rank a thread of this process.
    Local,
    /// Each process of an `mpirun` or `srun` job one rank, over MPI (Open MPI, loaded at run
    /// time).
    Mpi,
}

/// The model folder's tokenizer and chat template, as the data reader asks for them.
struct Tokenizer(TextModel);

impl TextTokenizer for Tokenizer {
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String> {
        Ok(self.0.encode(text, add_special_tokens)?.into_iter().filter_map(|i| u32::try_from(i).ok()).collect())
    }
    fn render_chat(&self, messages: &[serde_json::Value], add_generation_prompt: bool) -> Result<String, String> {
        let t = self.0.template().ok_or("the model folder has no chat template")?;
        t.render_with(&serde_json::Value::Array(messages.to_vec()), add_generation_prompt)
    }
}

fn bad(msg: impl Into<String>) -> CliError {
    CliError::Args(msg.into())
}

fn parse_schedule(s: &str) -> Result<ScheduleKind, String> {
    ScheduleKind::parse(s)
}

/// Checks the flags' ranges.
fn check(a: &TrainArgs) -> Result<(), CliError> {
    if a.tensor_parallel_size == 0 || a.micro_batch_size == 0 || a.grad_accum == 0 {
        return Err(bad("--tensor-parallel-size, --micro-batch-size and --grad-accum must be at least 1"));
    }
    if a.pipeline_parallel_size == 0 || a.data_parallel_size == 0 || a.virtual_stages == 0 {
        return Err(bad("--pipeline-parallel-size, --data-parallel-size and --virtual-stages must be at least 1"));
    }
    if a.expert_model_parallel_size > 1 && a.enable_expert_parallel {
        return Err(bad(format!(
            "--expert-model-parallel-size {} places experts over data-parallel replicas and --enable-expert-parallel \
             over the tensor-parallel ranks: use one",
            a.expert_model_parallel_size
        )));
    }
    if a.zero == 1 && (a.expert_model_parallel_size > 1) {
        return Err(bad("--zero 1 does not share out expert-parallel replicas yet: use --zero 0 with \
             --expert-model-parallel-size"));
    }
    if a.virtual_stages > 1 && a.pp_schedule != ScheduleKind::Interleaved1F1B {
        return Err(bad(format!(
            "--virtual-stages {} needs --pp-schedule interleaved (got {})",
            a.virtual_stages,
            a.pp_schedule.name()
        )));
    }
    if a.seq_len == Some(0) || a.steps == Some(0) || a.save_every == Some(0) {
        return Err(bad("--seq-len, --steps and --save-every must be at least 1"));
    }
    if !(a.lr.is_finite() && a.lr >= 0.0 && a.weight_decay.is_finite() && a.weight_decay >= 0.0) {
        return Err(bad("--lr and --weight-decay must be finite and >= 0"));
    }
    if !a.max_grad_norm.is_finite() || a.max_grad_norm < 0.0 {
        return Err(bad("--max-grad-norm must be finite and >= 0 (0: no clipping)"));
    }
    if a.save_every.is_some() && a.save.is_none() {
        return Err(bad("--save-every needs --save DIR"));
    }
    Ok(())
}

/// Keeps freed memory in glibc's heap for reuse: a training step frees and allocates the same
/// large activation buffers every step, and by default glibc maps each one over 32 MiB afresh
/// (page faults and zeroing on every touch) and returns freed heap to the kernel; a step then
/// spends a tenth of its time in the kernel. PyTorch's CPU runs avoid the same cost with its
/// caching allocator.
fn keep_freed_memory() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: mallopt only changes glibc's allocation thresholds (no memory is touched); it
        // is called once, before the rank threads start allocating, and a refused setting is
        // harmless (glibc keeps its default).
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        }
    }
}

/// Runs `tp train`.
pub fn train(a: TrainArgs) -> Result<(), CliError> {
    check(&a)?;
    keep_freed_memory();
    let model_err = |e: tp_models::ModelError| CliError::Model(e.to_string());
    let train_err = |e: tp_train::TrainError| CliError::Model(e.to_string());
    if let Some(dir) = &a.save {
        checkpoint::check_save_dir(dir).map_err(train_err)?;
    }
    let resumed = a.resume.as_deref().map(checkpoint::read_state).transpose().map_err(train_err)?;
    // The weights come from the checkpoint when resuming; its config, dtype and tokenizer too.
    // A LoRA run's checkpoint holds the adapter: its base is MODEL still.
    let lora = a.lora.active(a.resume.as_deref());
    let weights_dir: &Path = if lora { &a.model } else { a.resume.as_deref().unwrap_or(&a.model) };
    let source = tp_models::ModelSource::open(weights_dir).map_err(model_err)?;
    let config = source.config().map_err(model_err)?;
    let lora_spec = a.lora.spec(a.resume.as_deref(), &config, a.seed)?;
    if source.gguf().is_some() && lora_spec.is_none() {
        return Err(bad(format!(
            "{}: a GGUF file trains LoRA adapters on its frozen weights (--lora-r R); full fine-tuning needs a \
             Hugging Face folder",
            weights_dir.display()
        )));
    }
    let n = a.tensor_parallel_size;
    tp_layers::QkvLayout::new(config.num_attention_heads, config.num_key_value_heads, config.head_dim, 0, n)
        .map_err(|e| bad(format!("--tensor-parallel-size {n}: {e}")))?;
    let ep = a.expert_model_parallel_size;
    let shape = MeshShape::new(a.data_parallel_size, a.pipeline_parallel_size, n)
        .and_then(|s| s.with_expert_parallel(ep))
        .map_err(|e| bad(format!("--expert-model-parallel-size {ep}: {e}")))?;
    if ep > 1 {
        let experts = config.moe.as_ref().filter(|m| m.sparse_layers.iter().any(|&s| s)).map(|m| m.num_experts);
        match experts {
            None => return Err(bad(format!("--expert-model-parallel-size {ep}: the model has no experts"))),
            Some(e) if e < ep => {
                return Err(bad(format!(
                    "--expert-model-parallel-size {ep}: the model has {e} experts, fewer than the {ep} replicas"
                )));
            }
            Some(e) => {
                let placement = tp_layers::ExpertPlacement::new(e, ep, true).map_err(|x| bad(x.to_string()))?;
                eprintln!(
                    "expert parallelism over {ep} data-parallel replicas (each expert split over {n} tensor-parallel \
                     rank(s)): {}",
                    placement.describe_over("replica").trim_start_matches("expert parallelism: ")
                );
            }
        }
    }
    let (p, v) = (a.pipeline_parallel_size, a.virtual_stages);
    let partition = a.pp_layer_partition.as_deref().map(parse_layer_partition).transpose().map_err(model_err)?;
    let parts = stage_parts(config.num_hidden_layers, p * v, partition.as_deref())
        .map_err(|e| bad(format!("--pipeline-parallel-size {p} x --virtual-stages {v}: {e}")))?;
    let dtype = match a.dtype {
        Some(TrainDType::F32) => Some(DType::F32),
        Some(TrainDType::Bf16) => Some(DType::BF16),
        // A GGUF base stays in its blocks (its adapters train in f32).
        None if source.gguf().is_some() => None,
        None => {
            let ckpt = tp_layers::Checkpoint::open(weights_dir).map_err(|e| CliError::Model(e.to_string()))?;
            match ckpt.param_info("model.embed_tokens.weight").map_err(|e| CliError::Model(e.to_string()))?.0 {
                DType::BF16 => Some(DType::BF16),
                _ => Some(DType::F32),
            }
        }
    };
    let seq_len = a.seq_len.unwrap_or(config.max_position_embeddings).min(config.max_position_embeddings);
    let tokenizer = if weights_dir.join("tokenizer.json").is_file() || source.gguf().is_some() {
        Some(Tokenizer(TextModel::from_source(&source)?))
    } else {
        None
    };
    let tok: Option<&dyn TextTokenizer> = tokenizer.as_ref().map(|t| t as &dyn TextTokenizer);
    let mut data = Dataset::open(&a.data, config.vocab_size, seq_len, tok).map_err(train_err)?;
    let steps = a.steps.unwrap_or_else(|| {
        let per_epoch = data.len().div_ceil(a.micro_batch_size).div_ceil(a.grad_accum).max(1);
        3 * per_epoch as u64
    });
    if let Some(r) = resumed {
        if r.step >= steps {
            return Err(bad(format!("--resume: the checkpoint is at step {}, past --steps {steps}", r.step)));
        }
        data.set_position(r.data_position);
    }
    let kind = match a.lr_schedule {
        ScheduleArg::Constant => LrScheduleKind::Constant,
        ScheduleArg::Linear => LrScheduleKind::Linear,
        ScheduleArg::Cosine => LrScheduleKind::Cosine,
    };
    let recompute = match a.recompute {
        RecomputeArg::None => Recompute::None,
        RecomputeArg::Selective => Recompute::Selective,
        RecomputeArg::Full => Recompute::Full,
    };
    let config_t = TrainConfig {
        micro_batch_size: a.micro_batch_size,
        grad_accum: a.grad_accum,
        adamw: AdamW { beta1: a.adam_beta1, beta2: a.adam_beta2, eps: a.adam_eps, weight_decay: a.weight_decay },
        schedule: LrSchedule::new(kind, a.lr, a.warmup_steps, steps).map_err(train_err)?,
        max_grad_norm: a.max_grad_norm,
        recompute,
        sequence_parallel: a.sequence_parallel,
        pp_schedule: a.pp_schedule,
        virtual_stages: v,
        zero: a.zero == 1,
    };
    Trainer::new(config_t.clone()).map_err(train_err)?;
    // The schedule's own checks (micro-batches against stages) before any rank starts.
    tp_train::pipeline::Schedule::new(a.pp_schedule, p, a.grad_accum, v)
        .map_err(|e| bad(format!("--pp-schedule {} with --grad-accum {}: {e}", a.pp_schedule.name(), a.grad_accum)))?;
    let opts = RunOptions {
        steps,
        dump_grads: a.dump_grads.clone(),
        save: a.save.clone(),
        save_every: a.save_every,
        source: weights_dir.to_path_buf(),
    };
    let timeout = tp_comm::LaunchEnv::timeout_from_lookup(|k| std::env::var(k).ok()).map_err(|e| bad(e.to_string()))?;
    let resume = resumed.is_some().then_some(a.resume.as_deref()).flatten();
    let job = RankJob {
        source: &source,
        config: &config,
        dtype,
        parts: &parts,
        opts: &opts,
        resume,
        expert_parallel: a.enable_expert_parallel,
        lora: lora_spec.as_ref(),
        lora_dropout: (a.lora.lora_dropout as f32, a.seed),
    };
    let log = Log::new(a.log_json.clone(), steps);
    match a.backend {
        TrainBackend::Local => run_threads(&a, shape, timeout, &job, &log, config_t, &data),
        TrainBackend::Mpi => run_process(&a, shape, timeout, &job, &log, config_t, data),
    }
}

/// The trace's origin and every rank's events (in this process).
type Trace = Option<(Instant, Mutex<Vec<TraceEvent>>)>;

/// Every rank as a thread of this process (`--backend local`).
fn run_threads(
    a: &TrainArgs,
    shape: MeshShape,
    timeout: std::time::Duration,
    job: &RankJob<'_>,
    log: &Log,
    config_t: TrainConfig,
    data: &Dataset,
) -> Result<(), CliError> {
    crate::launch::refuse_local_under_launcher()?;
    let meshes = Mesh::local(shape, timeout, |_| Device::Cpu).map_err(|e| CliError::Engine(e.to_string()))?;
    let trace: Trace = a.trace.as_ref().map(|_| (Instant::now(), Mutex::new(Vec::new())));
    let errors: Mutex<Vec<(usize, String)>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for mesh in meshes {
            let (data, config_t, errors, trace) = (data.clone(), config_t.clone(), &errors, &trace);
            let rank = mesh.rank();
            let spawned = std::thread::Builder::new().name(format!("train-{rank}")).spawn_scoped(s, move || {
                let out = job.run(&mesh, config_t, data, log, trace);
                if let Err(e) = out {
                    mesh.abort(&format!("rank {rank} (stage {}) failed", mesh.coords().pp));
                    if let Ok(mut v) = errors.lock() {
                        v.push((rank, e));
                    }
                }
            });
            if let Err(e) = spawned {
                if let Ok(mut v) = errors.lock() {
                    v.push((usize::MAX, format!("cannot start a rank's thread: {e}")));
                }
                break;
            }
        }
    });
    if let (Some(path), Some((_, events))) = (&a.trace, trace) {
        write_trace(path, events.into_inner().unwrap_or_default())?;
    }
    let mut errors = errors.into_inner().unwrap_or_default();
    errors.sort();
    // The first rank's own error, not the others' "aborted by a peer".
    match errors.into_iter().next() {
        Some((_, e)) => Err(CliError::Model(e)),
        None => Ok(()),
    }
}

/// This process as one rank of an MPI job (`--backend mpi`, under `mpirun` or `srun`): the
/// mesh's groups over MPI, this rank's loop here; rank 0 logs, writes the trace (every rank's
/// events gathered to it) and the checkpoints. A failure aborts the mesh, so that every other
/// rank stops within the deadline with this rank's reason.
fn run_process(
    a: &TrainArgs,
    shape: MeshShape,
    timeout: std::time::Duration,
    job: &RankJob<'_>,
    log: &Log,
    config_t: TrainConfig,
    data: Dataset,
) -> Result<(), CliError> {
    let mesh = Mesh::from_mpi(shape, timeout).map_err(|e| CliError::Engine(format!("--backend mpi: {e}")))?;
    let rank = mesh.rank();
    // Every process's trace clock starts as the mesh is complete.
    mesh.world().barrier().map_err(|e| CliError::Engine(e.to_string()))?;
    let trace: Trace = a.trace.as_ref().map(|_| (Instant::now(), Mutex::new(Vec::new())));
    let failed = |e: String| {
        let why = format!("rank {rank} (stage {}, replica {}) failed: {e}", mesh.coords().pp, mesh.coords().dp);
        mesh.abort(&why);
        CliError::Model(why)
    };
    job.run(&mesh, config_t, data, log, &trace).map_err(failed)?;
    if let (Some(path), Some((_, events))) = (&a.trace, trace) {
        let events = events.into_inner().unwrap_or_default();
        let all = gather_trace(&mesh, &events).map_err(|e| failed(e.to_string()))?;
        if rank == 0 {
            write_trace(path, all)?;
        }
    }
    mesh.world().barrier().map_err(|e| CliError::Engine(e.to_string()))?;
    drop(mesh);
    crate::launch::mpi_finalize()
}

/// Every rank's trace events, on every rank (an all-gather of their text over the world).
fn gather_trace(mesh: &Mesh, events: &[TraceEvent]) -> Result<Vec<TraceEvent>, tp_comm::CommError> {
    let opt = |v: Option<usize>| v.map_or(-1, |x| x as i64);
    let text: String = events
        .iter()
        .map(|e| {
            format!(
                "{}\t{}\t{}\t{}\t{}\t{}\t{}\n",
                e.rank,
                e.stage,
                e.name,
                opt(e.mb),
                opt(e.chunk),
                e.start_us,
                e.dur_us
            )
        })
        .collect();
    let bytes: Vec<i64> = text.bytes().map(i64::from).collect();
    let n = bytes.len();
    let t = tp_core::Tensor::from_vec(bytes, &[n], &Device::Cpu)?;
    let all = mesh.world().all_gather(&t, 0)?.to_i64_vec()?;
    let text: String = all.into_iter().map(|b| b as u8 as char).collect();
    let back = |v: &str| v.parse::<i64>().ok().and_then(|x| usize::try_from(x).ok());
    Ok(text
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            let [rank, stage, name, mb, chunk, start, dur] = f.as_slice() else { return None };
            Some(TraceEvent {
                rank: rank.parse().ok()?,
                stage: stage.parse().ok()?,
                name: name.to_string(),
                mb: back(mb),
                chunk: back(chunk),
                start_us: start.parse().ok()?,
                dur_us: dur.parse().ok()?,
            })
        })
        .collect())
}

/// Writes `events` in start order as a Chrome trace.
fn write_trace(path: &Path, mut events: Vec<TraceEvent>) -> Result<(), CliError> {
    events.sort_by(|x, y| x.start_us.total_cmp(&y.start_us));
    std::fs::write(path, tp_train::pipeline::chrome_trace_json(&events))
        .map_err(|e| CliError::Io(format!("--trace {}: {e}", path.display())))
}

/// What every rank's thread shares.
struct RankJob<'a> {
    source: &'a tp_models::ModelSource,
    config: &'a ModelConfig,
    /// The base's dtype (`None`: a GGUF file's blocks, as they are).
    dtype: Option<DType>,
    /// Every virtual stage's part, in virtual-stage order.
    parts: &'a [StagePart],
    opts: &'a RunOptions,
    /// The checkpoint this run continues.
    resume: Option<&'a Path>,
    /// Experts whole on ranks.
    expert_parallel: bool,
    /// LoRA adapters to attach (the base frozen).
    lora: Option<&'a tp_layers::lora::LoraSpec>,
    /// Their dropout rate and its seed.
    lora_dropout: (f32, u64),
}

impl RankJob<'_> {
    /// One rank: load its chunks (virtual stages `c·P + s`), restore the optimizer when
    /// resuming, run the loop.
    /// Rank 0 reports to `log`; every rank adds its events to `trace`.
    fn run(
        &self,
        mesh: &Mesh,
        config_t: TrainConfig,
        mut data: Dataset,
        log: &Log,
        trace: &Trace,
    ) -> Result<(), String> {
        let (p, s) = (mesh.shape().pp, mesh.coords().pp);
        let mut opts = ModelOptions::new().with_expert_parallel(self.expert_parallel);
        if let Some(d) = self.dtype {
            opts = opts.with_dtype(d);
        }
        let mut chunks = (0..self.parts.len() / p)
            .map(|c| {
                let part = &self.parts[c * p + s];
                if mesh.ep().world_size() > 1 {
                    ParallelCausalLm::load_part_expert_parallel(
                        self.source.path(),
                        self.config,
                        mesh.tp(),
                        mesh.ep(),
                        &opts,
                        part,
                    )
                } else {
                    ParallelCausalLm::load_part_from(self.source, self.config, mesh.tp(), &opts, part)
                }
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        if let Some(spec) = self.lora {
            let mut adapted = 0;
            for c in &mut chunks {
                adapted += c.add_lora(spec.clone()).map_err(|e| e.to_string())?;
                c.set_lora_dropout(self.lora_dropout.0, self.lora_dropout.1).map_err(|e| e.to_string())?;
            }
            if adapted == 0 {
                return Err(format!("LoRA: {:?} matched no module of this model", spec.targets));
            }
        }
        let mut trainer = Trainer::new(config_t).map_err(|e| e.to_string())?;
        if let Some(ckpt) = self.resume {
            tp_train::checkpoint::resume_stages(ckpt, &mut chunks, &mut trainer).map_err(|e| e.to_string())?;
        }
        let rank = mesh.rank();
        // Every rank has loaded before the clock starts.
        mesh.world().barrier().map_err(|e| e.to_string())?;
        if rank == 0 {
            log.start_now(); // elapsed_s counts training, not loading
        }
        let clock = trace.as_ref().map(|(origin, _)| TraceClock { rank, origin: *origin });
        let groups = StepGroups::of_mesh(mesh, clock);
        let mut failed = None;
        // For tests of a rank that dies: TP_DEBUG_FAULT=RANK:STEP ends that rank's process
        // (SIGABRT) once it has finished STEP, before that step's checkpoint.
        let fault = std::env::var("TP_DEBUG_FAULT").ok().and_then(|v| {
            let (r, s) = v.trim().split_once(':')?;
            Some((r.parse::<usize>().ok()?, s.parse::<u64>().ok()?))
        });
        let mut on_step = |l: &StepLog, events: &[TraceEvent]| {
            if fault == Some((rank, l.step)) {
                eprintln!("TP_DEBUG_FAULT: rank {rank} ends itself after step {}", l.step);
                std::process::abort();
            }
            if let Some((_, all)) = trace
                && let Ok(mut all) = all.lock()
            {
                all.extend_from_slice(events);
            }
            if rank == 0
                && failed.is_none()
                && let Err(e) = log.step(l)
            {
                failed = Some(e);
            }
        };
        tp_train::run_stages(&mut chunks, &groups, &mut trainer, &mut data, self.opts, &mut on_step)
            .map_err(|e| e.to_string())?;
        failed.map_or(Ok(()), Err)
    }
}

/// Rank 0's step reports: the JSON log and the progress line.
struct Log {
    path: Option<PathBuf>,
    file: Mutex<Option<std::fs::File>>,
    start: Mutex<Instant>,
    steps: u64,
    /// Tokens run so far (this process's steps).
    seen: AtomicU64,
}

impl Log {
    fn new(path: Option<PathBuf>, steps: u64) -> Log {
        Log { path, file: Mutex::new(None), start: Mutex::new(Instant::now()), steps, seen: AtomicU64::new(0) }
    }

    /// Training starts now (the model is loaded).
    fn start_now(&self) {
        if let Ok(mut s) = self.start.lock() {
            *s = Instant::now();
        }
    }

    fn step(&self, l: &StepLog) -> Result<(), String> {
        let elapsed = self.start.lock().map_err(|_| "the log's clock is poisoned".to_string())?.elapsed().as_secs_f64();
        if let Some(path) = &self.path {
            let mut file = self.file.lock().map_err(|_| "the log's lock is poisoned".to_string())?;
            if file.is_none() {
                *file = Some(std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?);
            }
            let line = serde_json::json!({
                "step": l.step, "loss": l.loss, "grad_norm": l.grad_norm, "lr": l.lr, "tokens": l.tokens, "elapsed_s": elapsed,
                "bubble": l.bubble, "optimizer_bytes": l.optimizer_bytes, "peak_rss_bytes": crate::peak::take(),
            });
            if let Some(f) = file.as_mut() {
                writeln!(f, "{line}").and_then(|()| f.flush()).map_err(|e| format!("{}: {e}", path.display()))?;
            }
        }
        let seen = self.seen.fetch_add(l.input_tokens as u64, Ordering::Relaxed) + l.input_tokens as u64;
        let rate = seen as f64 / elapsed.max(1e-9);
        let left = self.steps.saturating_sub(l.step) as f64 * elapsed / l.step.max(1) as f64;
        eprintln!(
            "step {}/{} | loss {:.4} | grad_norm {:.3} | lr {:.3e} | {:.0} tok/s | ETA {} | fwd {:.2}s bwd {:.2}s opt {:.2}s \
             | bubble {:.1}%",
            l.step,
            self.steps,
            l.loss,
            l.grad_norm,
            l.lr,
            rate,
            clock(left),
            l.forward_secs,
            l.backward_secs,
            l.optimizer_secs,
            100.0 * l.bubble
        );
        Ok(())
    }
}

/// `h:mm:ss`.
fn clock(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}
