//! Starting the engine: the ranks as threads of this process (`Backend::Local`: CPU, or GPUs
//! shared round-robin), each loading its shard of the model and allocating its paged KV cache;
//! rank 0's thread then runs the scheduler loop ([`leader`]) and the others follow its step
//! messages ([`plan`]).

mod leader;
mod plan;
mod rank;

use crate::api::{EngineHandle, Limits, SharedStats};
use crate::scheduler::{Scheduler, SchedulerConfig};
use leader::{Leader, LeaderRules};
use plan::StepKind;
pub use rank::Fault;
use rank::RankWorker;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tp_comm::DeviceGroup;
use tp_comm::{Mesh, MeshShape};
use tp_core::{DType, Device, Tensor};
use tp_models::{ModelConfig, ModelOptions, ModelSource, ParallelCausalLm, StagePart};

/// Why the engine could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A setting is out of range.
    #[error("{0}")]
    Config(String),
    /// Loading the model failed.
    #[error(transparent)]
    Model(#[from] tp_models::ModelError),
    /// A layer failed.
    #[error(transparent)]
    Layer(#[from] tp_layers::LayerError),
    /// A collective failed (a rank died or hung past the deadline).
    #[error(transparent)]
    Comm(#[from] tp_comm::CommError),
    /// A tensor operation failed.
    #[error(transparent)]
    Tensor(#[from] tp_core::Error),
    /// A step failed.
    #[error("{0}")]
    Step(String),
    /// A step message could not be read (ranks out of step).
    #[error("step message: {0}")]
    Protocol(String),
}

/// Where the ranks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// The host.
    Cpu,
    /// CUDA GPUs, rank `r` on GPU `r % count`.
    Cuda,
}

/// How the engine is set up (`tp serve`'s flags, vLLM's names).
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// The Hugging Face model folder.
    pub model_dir: PathBuf,
    /// The model already opened from `model_dir` (a GGUF file's mapping and parsed header,
    /// shared by every rank of this process); `None`: the engine opens it once at start.
    pub source: Option<ModelSource>,
    /// Ranks per pipeline stage (`--tensor-parallel-size`).
    pub tensor_parallel_size: usize,
    /// Pipeline stages (`--pipeline-parallel-size`): the layers split over them as vLLM splits
    /// them; `pipeline × tensor` ranks in all.
    pub pipeline_parallel_size: usize,
    /// With pipeline stages, keep one step per stage in flight over disjoint requests, so that
    /// the stages work at the same time (as vLLM's pipeline-parallel serving does); `false`:
    /// one step at a time, the stages taking turns.
    pub pipelined: bool,
    /// Compute dtype (`None`: the checkpoint's).
    pub dtype: Option<DType>,
    /// Where the ranks compute.
    pub device: DeviceKind,
    /// Most sequences in one step (`--max-num-seqs`).
    pub max_num_seqs: usize,
    /// Most tokens in one step (`--max-num-batched-tokens`): long prompts are prefilled in chunks.
    pub max_num_batched_tokens: usize,
    /// Longest prompt plus output (`None`: the model's `max_position_embeddings`).
    pub max_model_len: Option<usize>,
    /// Positions per KV-cache block (`--block-size`).
    pub block_size: usize,
    /// KV-cache bytes per rank (`--kv-cache-memory`).
    pub kv_cache_memory: usize,
    /// Keys and values in 8 bits on the host (`--kv-cache-dtype fp8 | q8_0`), or (`None`) in
    /// the model dtype: an 8-bit cache holds 2x the positions of a 16-bit one in the same
    /// `kv_cache_memory` (4x of an f32 one).
    pub kv_cache_dtype: Option<tp_core::KvQuant>,
    /// Share full blocks between requests with the same prefix.
    pub enable_prefix_caching: bool,
    /// Seed of the seeds drawn for requests without one.
    pub seed: u64,
    /// Deadline of every collective (a rank that dies or hangs fails the engine within it).
    pub timeout: Duration,
    /// Most requests waiting before new ones are refused.
    pub max_waiting: usize,
    /// Every host product on the packed GEMM ([`tp_core::cpu::set_batch_invariant`]): a request's
    /// logits are then bitwise the same whatever else runs beside it, at some cost to
    /// small-batch decode.
    pub batch_invariant: bool,
    /// A mixture-of-experts model's experts whole on ranks (expert parallelism) instead of
    /// each split over them.
    pub expert_parallel: bool,
    /// Pack the host weights once for the GEMM ([`ParallelCausalLm::pack_host_weights`]): batched
    /// steps stop repacking them (about 2x on 16-row products), for as much memory again as the
    /// weights. On by default; a no-op on a GPU.
    pub prepack_weights: bool,
    /// A fault to inject into one rank (tests of what a dying or hung rank does); `None` in use.
    pub fault: Option<Fault>,
    /// A pause after every step that runs sequences (zero by default): lets tests of a server
    /// hold requests open long enough to disconnect or signal mid-stream.
    pub step_delay: Duration,
    /// N-gram speculative decoding (`--speculative-config`), off by default.
    pub speculative: Option<crate::spec::NgramConfig>,
    /// LoRA adapters served beside the base model (`--lora-modules`), each in its slot
    /// (`> 0`; a request's [`Request::adapter`](crate::api::Request::adapter) names it).
    pub lora_adapters: Vec<(u32, std::sync::Arc<tp_models::adapter::LoraAdapter>)>,
    /// Most distinct adapters among the running requests (`--max-loras`); others wait.
    pub max_loras: usize,
}

impl EngineOptions {
    /// vLLM's defaults for `model_dir` on one CPU rank: 256 sequences, 2048 tokens per step,
    /// blocks of 16, 4 GiB of KV cache (vLLM's CPU default), prefix caching on, seed 0.
    pub fn new(model_dir: impl Into<PathBuf>) -> EngineOptions {
        EngineOptions {
            model_dir: model_dir.into(),
            source: None,
            tensor_parallel_size: 1,
            pipeline_parallel_size: 1,
            pipelined: true,
            dtype: None,
            device: DeviceKind::Cpu,
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            max_model_len: None,
            block_size: 16,
            kv_cache_memory: 4 << 30,
            kv_cache_dtype: None,
            enable_prefix_caching: true,
            seed: 0,
            timeout: Duration::from_secs(tp_comm::DEFAULT_TIMEOUT_SECS),
            max_waiting: 4096,
            batch_invariant: false,
            expert_parallel: false,
            prepack_weights: true,
            fault: None,
            step_delay: Duration::ZERO,
            speculative: None,
            lora_adapters: Vec::new(),
            max_loras: 1,
        }
    }
}

/// A running engine: the handle servers use, and the rank threads.
pub struct Engine {
    handle: EngineHandle,
    threads: Vec<JoinHandle<Result<(), EngineError>>>,
    /// The KV-cache blocks each rank holds.
    pub num_blocks: usize,
}

impl Engine {
    /// A handle for submitting requests.
    pub fn handle(&self) -> EngineHandle {
        self.handle.clone()
    }

    /// Waits for the rank threads to end (after [`EngineHandle::begin_shutdown`] and the last
    /// request, or once every handle is dropped), at most until `deadline`. `Ok(true)` if they
    /// all ended; `Ok(false)` at the deadline (the threads are left running); the first
    /// rank's error otherwise.
    pub fn join(mut self, deadline: Instant) -> Result<bool, EngineError> {
        while Instant::now() < deadline {
            if self.threads.iter().all(JoinHandle::is_finished) {
                let mut first = None;
                for t in self.threads.drain(..) {
                    let r = t.join().unwrap_or_else(|_| Err(EngineError::Step("a rank thread panicked".into())));
                    if let (Err(e), None) = (r, &first) {
                        first = Some(e);
                    }
                }
                return first.map_or(Ok(true), Err);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(false)
    }
}

/// Loads the model on `opts.tensor_parallel_size` ranks (threads of this process), sizes the
/// paged KV cache from `opts.kv_cache_memory`, and starts the engine.
///
/// Errors: settings out of range, the model's (config, tensors, heads that cannot be split),
/// a KV cache that cannot hold one block per layer.
pub fn start(opts: &EngineOptions) -> Result<Engine, EngineError> {
    let settings = checked_settings(opts)?;
    let n = opts.tensor_parallel_size * opts.pipeline_parallel_size;
    let devices: Vec<Device> = match opts.device {
        DeviceKind::Cpu => vec![Device::Cpu; n],
        DeviceKind::Cuda => {
            let count = tp_kernels::device_count().map_err(|e| EngineError::Config(format!("--device cuda: {e}")))?;
            if count == 0 {
                return Err(EngineError::Config("--device cuda: no CUDA device found".into()));
            }
            (0..n).map(|r| Device::Cuda(r % count)).collect()
        }
    };
    if opts.pipeline_parallel_size > 1 {
        let shape = MeshShape::new(1, opts.pipeline_parallel_size, opts.tensor_parallel_size)?;
        let ranks = Mesh::local(shape, opts.timeout, |r| devices[r])?
            .into_iter()
            .map(|m| RankGroups::Mesh(Box::new(m)))
            .collect();
        return launch(ranks, opts, &settings);
    }
    let groups = DeviceGroup::local(n, opts.timeout, |r| devices[r])?;
    launch(groups.into_iter().map(RankGroups::Tp).collect(), opts, &settings)
}

/// The groups of one engine rank: its tensor-parallel group alone, or its place in a pipeline.
enum RankGroups {
    Tp(DeviceGroup),
    Mesh(Box<Mesh>),
}

impl RankGroups {
    /// Every rank (step messages).
    fn world(&self) -> &DeviceGroup {
        match self {
            RankGroups::Tp(g) => g,
            RankGroups::Mesh(m) => m.world(),
        }
    }
    /// The stage's tensor-parallel group (the model's).
    fn tp(&self) -> &DeviceGroup {
        match self {
            RankGroups::Tp(g) => g,
            RankGroups::Mesh(m) => m.tp(),
        }
    }
    fn abort(&self, why: &str) {
        match self {
            RankGroups::Tp(g) => g.abort(why),
            RankGroups::Mesh(m) => m.abort(why),
        }
    }
}

/// What this process does in an engine whose ranks are processes.
pub enum ProcessRank {
    /// Rank 0: the running engine (its rank on a thread of this process).
    Leader(Engine),
    /// Another rank: its part ran here until rank 0 stopped the engine.
    Follower,
}

/// This process's rank of an engine whose ranks are processes (one per GPU over NCCL, `group`
/// from [`DeviceGroup::from_env`], as torchrun or `tp serve` itself starts them). Rank 0 returns
/// at once with the running engine; every other rank runs its part of every step here and
/// returns [`ProcessRank::Follower`] once rank 0 stops the engine (or the error that ended it:
/// a rank that dies or hangs fails the others within the group's deadline).
///
/// Errors: as [`start`]; a group whose world size is not `opts.tensor_parallel_size`.
pub fn start_process_rank(opts: &EngineOptions, group: DeviceGroup) -> Result<ProcessRank, EngineError> {
    if opts.pipeline_parallel_size != 1 {
        return Err(EngineError::Config(
            "--pipeline-parallel-size over processes takes an MPI job (start_process_mesh); processes launched \
             by torchrun serve without pipeline stages for now"
                .into(),
        ));
    }
    if group.world_size() != opts.tensor_parallel_size {
        return Err(EngineError::Config(format!(
            "the job has {} processes but --tensor-parallel-size is {}",
            group.world_size(),
            opts.tensor_parallel_size
        )));
    }
    let settings = checked_settings(opts)?;
    if group.rank() == 0 {
        return launch(vec![RankGroups::Tp(group)], opts, &settings).map(ProcessRank::Leader);
    }
    let (ready_tx, _ready_rx) = mpsc::channel();
    rank_main(RankGroups::Tp(group), opts, &settings, Arc::new(SharedStats::default()), ready_tx)?;
    Ok(ProcessRank::Follower)
}

/// [`start_process_rank`] for a mesh of `1 × pp × tp` ranks that are processes (an MPI job's,
/// [`Mesh::from_mpi`](tp_comm::Mesh::from_mpi)): with pipeline stages, each process holds its
/// stage's blocks, the hidden states travel between the processes of consecutive stages, and
/// rank 0 (the first stage's first rank) leads. Without stages it is [`start_process_rank`] on
/// the mesh's tensor-parallel group.
///
/// Errors: as [`start`]; a mesh whose shape is not `1 × --pipeline-parallel-size ×
/// --tensor-parallel-size`.
pub fn start_process_mesh(opts: &EngineOptions, mesh: Mesh) -> Result<ProcessRank, EngineError> {
    let shape = mesh.shape();
    if shape.dp != 1 || shape.pp != opts.pipeline_parallel_size || shape.tp != opts.tensor_parallel_size {
        return Err(EngineError::Config(format!(
            "the job's mesh is {} x {} x {} (data x pipeline x tensor parallel) but the engine takes 1 x {} x {}",
            shape.dp, shape.pp, shape.tp, opts.pipeline_parallel_size, opts.tensor_parallel_size
        )));
    }
    if shape.pp == 1 {
        return start_process_rank(opts, mesh.tp().clone());
    }
    let settings = checked_settings(opts)?;
    let leader = mesh.rank() == 0;
    let groups = RankGroups::Mesh(Box::new(mesh));
    if leader {
        return launch(vec![groups], opts, &settings).map(ProcessRank::Leader);
    }
    let (ready_tx, _ready_rx) = mpsc::channel();
    rank_main(groups, opts, &settings, Arc::new(SharedStats::default()), ready_tx)?;
    Ok(ProcessRank::Follower)
}

/// Checks the settings and opens the model (once): its source, config and the longest sequence.
fn checked_settings(opts: &EngineOptions) -> Result<Settings, EngineError> {
    if let Some(s) = &opts.speculative {
        s.validate().map_err(|e| EngineError::Config(format!("speculative decoding: {e}")))?;
    }
    let n = opts.tensor_parallel_size;
    if n == 0 || n > tp_comm::MAX_WORLD_SIZE {
        return Err(EngineError::Config(format!(
            "tensor parallel size must be in 1..={}, got {n}",
            tp_comm::MAX_WORLD_SIZE
        )));
    }
    let p = opts.pipeline_parallel_size;
    if p == 0 || p.saturating_mul(n) > tp_comm::MAX_WORLD_SIZE {
        return Err(EngineError::Config(format!(
            "pipeline parallel size must be at least 1 and pipeline x tensor parallel at most {}, got {p} x {n}",
            tp_comm::MAX_WORLD_SIZE
        )));
    }
    if opts.block_size == 0 || opts.block_size > 1024 {
        return Err(EngineError::Config(format!("block size must be in 1..=1024, got {}", opts.block_size)));
    }
    if opts.max_num_seqs == 0 || opts.max_num_batched_tokens == 0 {
        return Err(EngineError::Config("max-num-seqs and max-num-batched-tokens must be at least 1".into()));
    }
    if let (Some(q), DeviceKind::Cuda) = (opts.kv_cache_dtype, opts.device) {
        return Err(EngineError::Config(format!(
            "--kv-cache-dtype {q}: 8-bit KV caches live in host memory; use --device cpu, or --kv-cache-dtype auto on a GPU"
        )));
    }
    let source = match &opts.source {
        Some(s) => s.clone(),
        None => ModelSource::open(&opts.model_dir)?,
    };
    let config = source.config()?;
    tp_models::partition_layers(config.num_hidden_layers, p, None)
        .map_err(|e| EngineError::Config(format!("--pipeline-parallel-size {p}: {e}")))?;
    let max_model_len = match opts.max_model_len {
        Some(0) => return Err(EngineError::Config("max-model-len must be at least 1".into())),
        Some(l) if l > config.max_position_embeddings => {
            return Err(EngineError::Config(format!(
                "max-model-len {l} exceeds the model's max_position_embeddings {}",
                config.max_position_embeddings
            )));
        }
        Some(l) => l,
        None => config.max_position_embeddings,
    };
    Ok(Settings { source, config, max_model_len })
}

/// What [`checked_settings`] found: the opened model, its config, the longest sequence.
#[derive(Clone)]
struct Settings {
    source: ModelSource,
    config: ModelConfig,
    max_model_len: usize,
}

/// Starts a thread per group of this process (rank 0's among them) and waits until rank 0 has
/// loaded and holds a handle.
fn launch(groups: Vec<RankGroups>, opts: &EngineOptions, settings: &Settings) -> Result<Engine, EngineError> {
    let stats = Arc::new(SharedStats::default());
    let (ready_tx, ready_rx) = mpsc::channel::<Result<(EngineHandle, usize), String>>();
    let mut threads = Vec::with_capacity(groups.len());
    for group in groups {
        let (opts, settings, stats, ready_tx) = (opts.clone(), settings.clone(), stats.clone(), ready_tx.clone());
        let t = std::thread::Builder::new()
            .name(format!("tp-rank-{}", group.world().rank()))
            .spawn(move || rank_main(group, &opts, &settings, stats, ready_tx))
            .map_err(|e| EngineError::Config(format!("cannot start a rank thread: {e}")))?;
        threads.push(t);
    }
    drop(ready_tx);
    match ready_rx.recv() {
        Ok(Ok((handle, num_blocks))) => Ok(Engine { handle, threads, num_blocks }),
        Ok(Err(why)) => Err(first_error(threads).unwrap_or(EngineError::Step(why))),
        Err(_) => Err(first_error(threads).unwrap_or_else(|| EngineError::Step("every rank thread ended".into()))),
    }
}

/// The first error among ended rank threads (waiting for all of them).
fn first_error(threads: Vec<JoinHandle<Result<(), EngineError>>>) -> Option<EngineError> {
    threads.into_iter().filter_map(|t| t.join().ok()).find_map(Result::err)
}

/// One rank thread: load, size the cache (every rank agrees on the block count), then lead or
/// follow.
fn rank_main(
    groups: RankGroups,
    opts: &EngineOptions,
    settings: &Settings,
    stats: Arc<SharedStats>,
    ready: mpsc::Sender<Result<(EngineHandle, usize), String>>,
) -> Result<(), EngineError> {
    let rank = groups.world().rank();
    let (config, max_model_len) = (&settings.config, settings.max_model_len);
    tp_core::cpu::set_batch_invariant(opts.batch_invariant);
    let group = &groups;
    let fail = |e: EngineError, group: &RankGroups| {
        group.abort(&format!("rank {rank} failed to start: {e}"));
        if rank == 0 {
            let _ = ready.send(Err(e.to_string()));
        }
        Err(e)
    };
    let mut mopts = ModelOptions::new().with_max_seq_len(max_model_len).with_expert_parallel(opts.expert_parallel);
    if let Some(d) = opts.dtype {
        mopts = mopts.with_dtype(d);
    }
    let (part, pipeline) = match &groups {
        RankGroups::Tp(_) => (StagePart::whole(config.num_hidden_layers), None),
        RankGroups::Mesh(m) => {
            let parts = match tp_models::stage_parts(config.num_hidden_layers, m.shape().pp, None) {
                Ok(p) => p,
                Err(e) => return fail(e.into(), group),
            };
            let last = m.shape().rank(tp_comm::Coords { dp: 0, pp: m.shape().pp - 1, tp: 0 });
            (parts[m.coords().pp].clone(), Some((m.pp().clone(), last)))
        }
    };
    let mut model = match ParallelCausalLm::load_part_from(&settings.source, config, groups.tp(), &mopts, &part) {
        Ok(m) => m,
        Err(e) => return fail(e.into(), group),
    };
    if opts.prepack_weights
        && let Err(e) = model.pack_host_weights()
    {
        return fail(e.into(), group);
    }
    for (id, adapter) in &opts.lora_adapters {
        if let Err(e) = model.add_adapter(*id, adapter.spec()) {
            return fail(EngineError::Config(format!("LoRA adapter {id}: {e}")), group);
        }
    }
    let num_blocks = match agree_on_blocks(&model, groups.world(), opts, max_model_len) {
        Ok(b) => b,
        Err(e) => return fail(e, group),
    };
    let caches =
        match model.new_paged_caches(num_blocks, opts.block_size, opts.kv_cache_dtype).map_err(EngineError::from) {
            Ok(c) => c,
            Err(e) => return fail(e, group),
        };
    let worker = RankWorker {
        model,
        world: groups.world().clone(),
        pipeline,
        busy_secs: 0.0,
        pipelined: opts.pipelined && matches!(&groups, RankGroups::Mesh(m) if m.shape().pp > 1),
        outbox: Vec::new(),
        stage_stats: match &groups {
            RankGroups::Tp(g) => (g.rank() == 0).then(|| (stats.clone(), 0)),
            RankGroups::Mesh(m) => (m.coords().tp == 0).then(|| (stats.clone(), m.coords().pp)),
        },
        phases: Default::default(),
        routed: Vec::new(),
        caches,
        block_size: opts.block_size,
        seqs: HashMap::new(),
        steps: 0,
        fault: opts.fault,
    };
    // Idle rank 0 speaks at least this often, well inside the other ranks' deadline.
    let heartbeat = (opts.timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(2));
    if rank != 0 {
        return follow(worker);
    }
    let sched = SchedulerConfig {
        max_num_seqs: opts.max_num_seqs,
        max_num_batched_tokens: opts.max_num_batched_tokens,
        max_model_len,
        block_size: opts.block_size,
        num_blocks,
        // Under LongRoPE a block's keys depend on the length of the sequence that computed
        // them, so cached prefixes are not shared.
        enable_prefix_caching: opts.enable_prefix_caching && longrope_switch(config).is_none(),
        max_waiting: opts.max_waiting,
        max_loras: opts.max_loras.max(1),
    };
    let mut scheduler = match Scheduler::new(sched) {
        Ok(s) => s,
        Err(e) => return fail(EngineError::Config(e), group),
    };
    scheduler.set_rope_switch(longrope_switch(config));
    let limits = Limits {
        max_model_len,
        vocab_size: config.vocab_size,
        eos_token_ids: config.eos_token_ids.clone(),
        max_waiting: opts.max_waiting,
        kv_cache_positions: num_blocks.saturating_mul(opts.block_size),
    };
    let (handle, commands) = EngineHandle::channel(limits, stats.clone());
    let eos = config.eos_token_ids.clone();
    let rules = LeaderRules {
        eos,
        max_model_len,
        seed: opts.seed,
        heartbeat,
        step_delay: opts.step_delay,
        speculative: opts.speculative,
    };
    let leader = Leader::new(worker, scheduler, commands, stats, rules);
    let _ = ready.send(Ok((handle, num_blocks)));
    drop(ready);
    leader.run()
}

/// LongRoPE's switch length (`original_max_position_embeddings`), if the model uses it.
fn longrope_switch(config: &ModelConfig) -> Option<usize> {
    match &config.rope_scaling {
        tp_core::RopeScaling::LongRope { original_max_position_embeddings, .. } => {
            Some(*original_max_position_embeddings as usize)
        }
        _ => None,
    }
}

/// Ranks other than 0: run every step rank 0 sends until it says stop.
fn follow(mut worker: RankWorker) -> Result<(), EngineError> {
    loop {
        let msg = match worker.receive() {
            Ok(m) => m,
            Err(e) => {
                worker.abort(&format!("rank {} cannot read rank 0's step: {e}", worker.world.rank()));
                return Err(e);
            }
        };
        match msg.kind {
            StepKind::Stop => return worker.flush(),
            StepKind::Idle => {}
            StepKind::Run => {
                if let Err(e) = worker.execute(&msg, rank::MaskSource::Follower) {
                    worker.abort(&format!("rank {} failed a step: {e}", worker.world.rank()));
                    return Err(e);
                }
            }
        }
    }
}

/// The number of KV-cache blocks every rank allocates: the budget over the largest per-block
/// cost of any rank (ranks holding more KV heads cost more), capped at what `max_num_seqs`
/// sequences of `max_model_len` can use.
fn agree_on_blocks(
    model: &ParallelCausalLm,
    group: &DeviceGroup,
    opts: &EngineOptions,
    max_model_len: usize,
) -> Result<usize, EngineError> {
    let mine = model.kv_bytes_per_block(opts.block_size, opts.kv_cache_dtype)? as i64;
    let t = group.to_local(&Tensor::from_vec(vec![mine], &[1], &Device::Cpu)?)?;
    let per_block = group.all_gather(&t, 0)?.to_i64_vec()?.into_iter().max().unwrap_or(mine).max(1) as usize;
    let fit = opts.kv_cache_memory / per_block;
    let blocks_per_seq = max_model_len.div_ceil(opts.block_size);
    let cap = opts.max_num_seqs.saturating_mul(blocks_per_seq).max(1);
    let blocks = fit.min(cap).min(u32::MAX as usize);
    if blocks == 0 {
        return Err(EngineError::Config(format!(
            "--kv-cache-memory {} bytes holds no block: one block of {} positions costs {per_block} bytes per rank",
            opts.kv_cache_memory, opts.block_size
        )));
    }
    Ok(blocks)
}
