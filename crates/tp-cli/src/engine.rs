//! Starting the engine: [`start_engine`] maps `tp serve`'s flags onto `tp_engine`'s options and
//! loads the model on its ranks.

use crate::args::{BackendArg, DTypeArg, DeviceArg, EngineArgs};
use crate::error::CliError;
use std::time::Instant;
use tp_core::DType;
use tp_engine::api::EngineHandle;
use tp_engine::{DeviceKind, EngineOptions};

/// Stops a started engine: asks it to end and waits until the deadline.
pub type Join = Box<dyn FnOnce(Instant) -> Result<(), String> + Send>;

/// A running engine: the server's handle and how to stop it.
pub struct StartedEngine {
    /// Submit, abort, stats, limits, begin_shutdown.
    pub handle: EngineHandle,
    /// Ends the engine and waits for its ranks until the deadline.
    pub join: Join,
}

/// The engine's options for `args`. The collectives' deadline is `TP_TIMEOUT_SECS` (as for every
/// tp job; default 300 s): a rank that dies or hangs fails the engine within it.
/// `TP_DEBUG_STEP_DELAY_MS` pauses after each step (for tests; at most 10 s).
pub fn engine_options(args: &EngineArgs) -> Result<EngineOptions, CliError> {
    let mut o = EngineOptions::new(&args.model_dir);
    o.tensor_parallel_size = args.tensor_parallel_size;
    o.pipeline_parallel_size = args.pipeline_parallel_size;
    o.dtype = match args.dtype {
        DTypeArg::Auto => None,
        DTypeArg::F32 => Some(DType::F32),
        DTypeArg::F16 => Some(DType::F16),
        DTypeArg::Bf16 => Some(DType::BF16),
    };
    o.device = match args.device {
        DeviceArg::Cpu => DeviceKind::Cpu,
        DeviceArg::Cuda => DeviceKind::Cuda,
    };
    o.max_num_seqs = args.max_num_seqs;
    o.max_num_batched_tokens = args.max_num_batched_tokens;
    o.max_model_len = args.max_model_len;
    o.block_size = args.block_size;
    if let Some(b) = args.kv_cache_memory {
        o.kv_cache_memory =
            usize::try_from(b).map_err(|_| CliError::Engine(format!("--kv-cache-memory {b} is too large")))?;
    }
    o.kv_cache_dtype = args.kv_cache_dtype.quant();
    o.enable_prefix_caching = args.enable_prefix_caching;
    o.seed = args.seed;
    o.max_waiting = args.max_waiting;
    o.batch_invariant = args.batch_invariant;
    o.expert_parallel = args.expert_parallel;
    o.prepack_weights = args.prepack_weights;
    o.speculative = args.speculative;
    o.max_loras = args.lora.max_loras.max(1);
    if !args.lora.modules.is_empty() {
        let config = tp_models::ModelSource::open(&args.model_dir)
            .and_then(|s| s.config())
            .map_err(|e| CliError::Model(e.to_string()))?;
        o.lora_adapters = args.lora.load(config.num_hidden_layers)?;
    }
    o.timeout = tp_comm::LaunchEnv::timeout_from_lookup(|k| std::env::var(k).ok())
        .map_err(|e| CliError::Engine(e.to_string()))?;
    // For measuring what pipelining gains: TP_PIPELINE_TURNS=1 runs one step at a time.
    o.pipelined = std::env::var_os("TP_PIPELINE_TURNS").is_none();
    // For tests that need requests to stay open: a pause after each engine step.
    if let Some(ms) = std::env::var("TP_DEBUG_STEP_DELAY_MS").ok().and_then(|v| v.trim().parse::<u64>().ok()) {
        o.step_delay = std::time::Duration::from_millis(ms.min(10_000));
    }
    // For tests of a dying or hung rank: TP_DEBUG_FAULT=RANK:STEP[:HANG_SECS].
    if let Ok(v) = std::env::var("TP_DEBUG_FAULT") {
        let parts: Vec<&str> = v.trim().split(':').collect();
        let num = |i: usize| parts.get(i).and_then(|p| p.parse::<u64>().ok());
        match (num(0), num(1), parts.len()) {
            (Some(rank), Some(step), 2 | 3) => {
                let hang = num(2).map(|s| std::time::Duration::from_secs(s.min(3600)));
                o.fault = Some(tp_engine::Fault { rank: rank as usize, step, hang });
            }
            _ => return Err(CliError::Engine(format!("TP_DEBUG_FAULT={v:?}: expected RANK:STEP[:HANG_SECS]"))),
        }
    }
    Ok(o)
}

/// Where a mixture-of-experts model's experts go over the tensor-parallel group (`None` for a
/// dense model, or a config that does not read: the engine's start says why).
fn expert_placement(args: &EngineArgs, source: Option<&tp_models::ModelSource>) -> Option<String> {
    let config = match source {
        Some(s) => s.config().ok()?,
        None => tp_models::ModelConfig::from_dir(&args.model_dir).ok()?,
    };
    let moe = config.moe?;
    let p =
        tp_models::tp_layers::ExpertPlacement::new(moe.num_experts, args.tensor_parallel_size, args.expert_parallel);
    p.ok().map(|p| p.describe())
}

/// Loads the model and starts the engine with `args`: ranks as threads (`--backend local`), or
/// this process as rank 0 of one process per GPU (`--backend nccl`; see [`nccl_follower`]). `source`:
/// the model already opened (its GGUF file is then not opened again); `None` opens `args.model_dir`.
pub fn start_engine(args: &EngineArgs, source: Option<tp_models::ModelSource>) -> Result<StartedEngine, CliError> {
    let mut opts = engine_options(args)?;
    let placement = expert_placement(args, source.as_ref());
    opts.source = source;
    let (engine, children) = match args.backend {
        BackendArg::Local => {
            crate::launch::refuse_local_under_launcher()?;
            (tp_engine::start(&opts).map_err(|e| CliError::Engine(e.to_string()))?, Children(Vec::new()))
        }
        BackendArg::Nccl => start_nccl_leader(args, &opts)?,
        BackendArg::Mpi => {
            check_host_device(args)?;
            match tp_engine::start_process_mesh(&opts, mpi_mesh(&opts)?).map_err(|e| CliError::Engine(e.to_string()))? {
                tp_engine::ProcessRank::Leader(engine) => (engine, Children(Vec::new())),
                tp_engine::ProcessRank::Follower => {
                    return Err(CliError::Engine("MPI rank 0 did not lead the engine".into()));
                }
            }
        }
    };
    tracing::info!(
        "engine ready: {} rank(s) ({} pipeline stage(s)), {} KV-cache blocks of {} positions per rank ({})",
        opts.tensor_parallel_size * opts.pipeline_parallel_size,
        opts.pipeline_parallel_size,
        engine.num_blocks,
        opts.block_size,
        opts.kv_cache_dtype.map_or("keys and values in the model dtype", |q| match q {
            tp_core::KvQuant::Fp8E4M3 => "keys and values in fp8 e4m3",
            tp_core::KvQuant::Q8_0 => "keys and values in q8_0 blocks",
        })
    );
    if let Some(p) = placement {
        tracing::info!("experts: {p}");
    }
    let handle = engine.handle();
    let join: Join = Box::new(move |deadline| {
        engine.handle().begin_shutdown();
        let r = match engine.join(deadline) {
            Ok(true) => Ok(()),
            Ok(false) => Err("the engine's ranks did not stop by the deadline".into()),
            Err(e) => Err(e.to_string()),
        };
        children.wait(deadline);
        r
    });
    Ok(StartedEngine { handle, join })
}

/// Whether this process is a rank other than 0 of a `--backend nccl` job (started by torchrun,
/// srun or mpirun, or by `tp serve` itself, with a rank other than 0): then it runs its part of the engine here, serving
/// no HTTP, until rank 0 stops the engine, and the result is returned. `None` otherwise.
pub fn nccl_follower(args: &EngineArgs) -> Option<Result<(), CliError>> {
    if args.backend == BackendArg::Mpi {
        return mpi_follower(args);
    }
    if args.backend != BackendArg::Nccl {
        return None;
    }
    // Any launcher's rank (torchrun's RANK, srun's SLURM_PROCID, mpirun's
    // OMPI_COMM_WORLD_RANK): rank 0 serves HTTP, every other process follows.
    let launched = launched_rank()?;
    if launched == 0 {
        return None;
    }
    ignore_stop_signals();
    Some((|| {
        let opts = engine_options(args)?;
        check_nccl_device(args)?;
        let group = tp_comm::DeviceGroup::from_env().map_err(|e| CliError::Engine(e.to_string()))?;
        match tp_engine::start_process_rank(&opts, group).map_err(|e| CliError::Engine(e.to_string()))? {
            tp_engine::ProcessRank::Follower => Ok(()),
            tp_engine::ProcessRank::Leader(_) => Err(CliError::Engine("RANK is not 0 but this process leads".into())),
        }
    })())
}

/// [`nccl_follower`] for `--backend mpi`: every process of the job but rank 0 (MPI's own
/// numbering) runs its part of the engine here until rank 0 stops it, then ends MPI.
fn mpi_follower(args: &EngineArgs) -> Option<Result<(), CliError>> {
    let world = match crate::launch::mpi_world() {
        Ok(w) => w,
        Err(e) => return Some(Err(e)),
    };
    use tp_comm::Communicator;
    if world.rank() == 0 {
        return None;
    }
    drop(world);
    ignore_stop_signals();
    Some((|| {
        check_host_device(args)?;
        let opts = engine_options(args)?;
        match tp_engine::start_process_mesh(&opts, mpi_mesh(&opts)?).map_err(|e| CliError::Engine(e.to_string()))? {
            tp_engine::ProcessRank::Follower => crate::launch::mpi_finalize(),
            tp_engine::ProcessRank::Leader(_) => Err(CliError::Engine("an MPI rank other than 0 leads".into())),
        }
    })())
}

/// A following rank leaves when rank 0 stops the engine (or fails), not on a signal of its
/// own: a launcher that passes SIGTERM or SIGINT to every process (`srun`, `mpirun`) would
/// otherwise end the followers before rank 0 has finished its requests and told them.
fn ignore_stop_signals() {
    #[cfg(target_os = "linux")]
    // SAFETY: installs the ignore disposition for two signals, before any thread of this
    // process depends on them; no memory is touched.
    unsafe {
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
        libc::signal(libc::SIGINT, libc::SIG_IGN);
    }
}

/// The MPI job as the engine's `1 × pp × tp` mesh (its size checked against the flags).
fn mpi_mesh(opts: &EngineOptions) -> Result<tp_comm::Mesh, CliError> {
    let (p, n) = (opts.pipeline_parallel_size, opts.tensor_parallel_size);
    let shape = tp_comm::MeshShape::new(1, p, n).map_err(|e| CliError::Engine(e.to_string()))?;
    let world = crate::launch::mpi_world()?;
    use tp_comm::Communicator;
    if world.world_size() != p * n {
        return Err(CliError::Engine(format!(
            "the MPI job has {} processes but --pipeline-parallel-size {p} x --tensor-parallel-size {n} needs {}",
            world.world_size(),
            p * n
        )));
    }
    tp_comm::Mesh::from_mpi(shape, world.timeout()).map_err(|e| CliError::Engine(format!("--backend mpi: {e}")))
}

fn check_host_device(args: &EngineArgs) -> Result<(), CliError> {
    if args.device != DeviceArg::Cpu {
        return Err(CliError::Engine(
            "--backend mpi runs processes on the host: use --device cpu (--backend nccl for GPUs)".into(),
        ));
    }
    Ok(())
}

fn check_nccl_device(args: &EngineArgs) -> Result<(), CliError> {
    if args.device != DeviceArg::Cuda {
        return Err(CliError::Engine(
            "--backend nccl runs one process per GPU: it needs --device cuda (use --backend local on the CPU)".into(),
        ));
    }
    Ok(())
}

/// This process's rank when a launcher (torchrun, srun, mpirun, or `tp serve` itself through
/// `RANK`) started it as one of several processes; `None` otherwise.
fn launched_rank() -> Option<usize> {
    let env = tp_comm::LaunchEnv::from_env().ok()?;
    (env.world_size > 1 || std::env::var_os("RANK").is_some()).then_some(env.rank)
}

/// The ranks `tp serve` started itself; killed if still running when dropped.
struct Children(Vec<std::process::Child>);

impl Children {
    /// Waits for every child until `deadline`, then kills those still running.
    fn wait(mut self, deadline: Instant) {
        for c in &mut self.0 {
            while Instant::now() < deadline && matches!(c.try_wait(), Ok(None)) {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
            }
            let _ = c.wait();
        }
    }
}

/// Rank 0 of a `--backend nccl` job. Under a launcher (torchrun, srun or mpirun with several
/// processes, or `RANK` set) the other ranks are its processes; otherwise `tp serve` starts ranks `1..N` itself (this program with the same
/// arguments and `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR=127.0.0.1` and a free
/// `MASTER_PORT`), each on GPU `LOCAL_RANK`, and stops them when it stops.
fn start_nccl_leader(args: &EngineArgs, opts: &EngineOptions) -> Result<(tp_engine::Engine, Children), CliError> {
    check_nccl_device(args)?;
    let n = opts.tensor_parallel_size;
    let (env, children) = if launched_rank().is_some() || std::env::var_os("RANK").is_some() {
        (tp_comm::LaunchEnv::from_env().map_err(|e| CliError::Engine(e.to_string()))?, Children(Vec::new()))
    } else {
        let port =
            tp_comm::free_local_port().ok_or_else(|| CliError::Engine("no free loopback port for the ranks".into()))?;
        let exe = std::env::current_exe().map_err(|e| CliError::Engine(format!("cannot find this program: {e}")))?;
        let mut children = Children(Vec::new());
        for r in 1..n {
            let child = std::process::Command::new(&exe)
                .args(std::env::args_os().skip(1))
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .stdin(std::process::Stdio::null())
                .spawn()
                .map_err(|e| CliError::Engine(format!("cannot start rank {r}: {e}")))?;
            children.0.push(child);
        }
        let env = tp_comm::LaunchEnv::from_lookup(|k| match k {
            "RANK" | "LOCAL_RANK" => Some("0".into()),
            "WORLD_SIZE" => Some(n.to_string()),
            "MASTER_ADDR" => Some("127.0.0.1".into()),
            "MASTER_PORT" => Some(port.to_string()),
            k => std::env::var(k).ok(),
        })
        .map_err(|e| CliError::Engine(e.to_string()))?;
        (env, children)
    };
    let group = tp_comm::DeviceGroup::from_launch_env(&env).map_err(|e| CliError::Engine(e.to_string()))?;
    match tp_engine::start_process_rank(opts, group).map_err(|e| CliError::Engine(e.to_string()))? {
        tp_engine::ProcessRank::Leader(engine) => Ok((engine, children)),
        tp_engine::ProcessRank::Follower => Err(CliError::Engine("rank 0 did not lead the engine".into())),
    }
}
