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
    o.enable_prefix_caching = args.enable_prefix_caching;
    o.seed = args.seed;
    o.max_waiting = args.max_waiting;
    let env = tp_comm::LaunchEnv::from_lookup(|k| match k {
        "RANK" => Some("0".into()),
        "WORLD_SIZE" => Some("1".into()),
        k => std::env::var(k).ok(),
    })
    .map_err(|e| CliError::Engine(e.to_string()))?;
    o.timeout = env.timeout;
    // For tests that need requests to stay open: a pause after each engine step.
    if let Some(ms) = std::env::var("TP_DEBUG_STEP_DELAY_MS").ok().and_then(|v| v.trim().parse::<u64>().ok()) {
        o.step_delay = std::time::Duration::from_millis(ms.min(10_000));
    }
    Ok(o)
}

/// Loads the model and starts the engine with `args`.
pub fn start_engine(args: &EngineArgs) -> Result<StartedEngine, CliError> {
    if args.backend == BackendArg::Nccl {
        return Err(CliError::Engine(
            "--backend nccl is not available yet: use --backend local (ranks as threads; with --device cuda they share the GPUs round-robin)".into(),
        ));
    }
    let opts = engine_options(args)?;
    let engine = tp_engine::start(&opts).map_err(|e| CliError::Engine(e.to_string()))?;
    tracing::info!(
        "engine ready: {} rank(s), {} KV-cache blocks of {} positions per rank",
        opts.tensor_parallel_size,
        engine.num_blocks,
        opts.block_size
    );
    let handle = engine.handle();
    let join: Join = Box::new(move |deadline| {
        engine.handle().begin_shutdown();
        match engine.join(deadline) {
            Ok(true) => Ok(()),
            Ok(false) => Err("the engine's ranks did not stop by the deadline".into()),
            Err(e) => Err(e.to_string()),
        }
    });
    Ok(StartedEngine { handle, join })
}
