//! The launch environment, as torchrun (and SLURM or mpirun wrappers that mimic it) sets it.

use crate::{CommError, Result};
use std::time::Duration;

/// Where this process sits in the job: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
/// `MASTER_PORT`, plus tp's own `TP_TIMEOUT_SECS` (deadline of rendezvous and collectives).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of processes in the job.
    pub world_size: usize,
    /// Rank among the processes on this machine: the CUDA device this process should use.
    pub local_rank: usize,
    /// Host of rank 0's rendezvous store.
    pub master_addr: String,
    /// Port of rank 0's rendezvous store.
    pub master_port: u16,
    /// Deadline of the rendezvous and of every collective.
    pub timeout: Duration,
}

/// Default deadline when `TP_TIMEOUT_SECS` is unset.
pub const DEFAULT_TIMEOUT_SECS: u64 = 300;

impl LaunchEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the variables through `get` (for tests and for callers with their own config).
    ///
    /// `RANK` and `WORLD_SIZE` are required. `LOCAL_RANK` defaults to `RANK`, `MASTER_ADDR` to
    /// `127.0.0.1`, `MASTER_PORT` to `29500` (torchrun's defaults).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        fn parse<T: std::str::FromStr>(name: &str, v: &str) -> Result<T> {
            v.trim().parse().map_err(|_| CommError::Env(format!("{name}={v:?} is not a valid number")))
        }
        let req = |name: &str| {
            get(name).ok_or_else(|| {
                CommError::Env(format!("{name} is not set (launch with torchrun, srun, or set RANK and WORLD_SIZE)"))
            })
        };
        let rank: usize = parse("RANK", &req("RANK")?)?;
        let world_size: usize = parse("WORLD_SIZE", &req("WORLD_SIZE")?)?;
        if world_size == 0 {
            return Err(CommError::Env("WORLD_SIZE must be at least 1".into()));
        }
        if rank >= world_size {
            return Err(CommError::Env(format!("RANK={rank} is not below WORLD_SIZE={world_size}")));
        }
        let local_rank = match get("LOCAL_RANK") {
            Some(v) => parse("LOCAL_RANK", &v)?,
            None => rank,
        };
        let master_addr = get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        if master_addr.trim().is_empty() {
            return Err(CommError::Env("MASTER_ADDR is empty".into()));
        }
        let master_port: u16 = match get("MASTER_PORT") {
            Some(v) => parse("MASTER_PORT", &v)?,
            None => 29500,
        };
        let secs: u64 = match get("TP_TIMEOUT_SECS") {
            Some(v) => parse("TP_TIMEOUT_SECS", &v)?,
            None => DEFAULT_TIMEOUT_SECS,
        };
        Ok(LaunchEnv { rank, world_size, local_rank, master_addr, master_port, timeout: Duration::from_secs(secs) })
    }
}
