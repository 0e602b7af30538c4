//! The launch environment, as torchrun (and SLURM or mpirun wrappers that mimic it) sets it.

use crate::deadline::MAX_TIMEOUT;
use crate::peer_text::peer_text;
use crate::{CommError, Result};
use std::time::Duration;

/// Most ranks in one job, of processes (`WORLD_SIZE`) or of threads (`LocalGroup`): 4096.
/// Rank 0's store serves every rank of a job from one process, with a thread per rank.
pub const MAX_WORLD_SIZE: usize = 4096;

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

/// Longest `TP_TIMEOUT_SECS`: 604800 (7 days, [`MAX_TIMEOUT`]).
pub const MAX_TIMEOUT_SECS: u64 = MAX_TIMEOUT.as_secs();

/// Longest `MASTER_ADDR` (a DNS name is at most 253 characters).
const MAX_ADDR_LEN: usize = 253;

impl LaunchEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the variables through `get` (for tests and for callers with their own config).
    ///
    /// `RANK` and `WORLD_SIZE` are required. `LOCAL_RANK` defaults to `RANK`, `MASTER_ADDR` to
    /// `127.0.0.1`, `MASTER_PORT` to `29500` (torchrun's defaults), `TP_TIMEOUT_SECS` to
    /// [`DEFAULT_TIMEOUT_SECS`].
    ///
    /// Limits, each a [`CommError::Env`] naming the variable: `1 <= WORLD_SIZE <=`
    /// [`MAX_WORLD_SIZE`], `RANK` below `WORLD_SIZE`, `MASTER_PORT` in
    /// `1..=65535`, `1 <= TP_TIMEOUT_SECS <=` [`MAX_TIMEOUT_SECS`], `MASTER_ADDR` a non-empty
    /// host name or address of at most 253 printable characters.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        /// `v` as a number, or an error naming the variable.
        fn parse<T: std::str::FromStr>(name: &str, v: &str) -> Result<T> {
            v.trim()
                .parse()
                .map_err(|_| CommError::Env(format!("{name}=\"{}\" is not a valid number", peer_text(v.as_bytes()))))
        }
        let req = |name: &str| {
            get(name).ok_or_else(|| {
                CommError::Env(format!("{name} is not set (launch with torchrun, srun, or set RANK and WORLD_SIZE)"))
            })
        };
        let world_size: usize = parse("WORLD_SIZE", &req("WORLD_SIZE")?)?;
        if world_size == 0 {
            return Err(CommError::Env("WORLD_SIZE must be at least 1".into()));
        }
        if world_size > MAX_WORLD_SIZE {
            return Err(CommError::Env(format!(
                "WORLD_SIZE={world_size} exceeds the maximum of {MAX_WORLD_SIZE} ranks"
            )));
        }
        let rank: usize = parse("RANK", &req("RANK")?)?;
        if rank >= world_size {
            return Err(CommError::Env(format!("RANK={rank} is not below WORLD_SIZE={world_size}")));
        }
        let local_rank: usize = match get("LOCAL_RANK") {
            Some(v) => parse("LOCAL_RANK", &v)?,
            None => rank,
        };
        let master_addr = get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let master_addr = master_addr.trim().to_string();
        if master_addr.is_empty() {
            return Err(CommError::Env("MASTER_ADDR is empty".into()));
        }
        if master_addr.len() > MAX_ADDR_LEN || master_addr.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(CommError::Env(format!(
                "MASTER_ADDR=\"{}\" is not a host name or address",
                peer_text(master_addr.as_bytes())
            )));
        }
        let master_port: u16 = match get("MASTER_PORT") {
            Some(v) => parse("MASTER_PORT", &v).map_err(|_| {
                CommError::Env(format!("MASTER_PORT=\"{}\" is not a port (1..=65535)", peer_text(v.as_bytes())))
            })?,
            None => 29500,
        };
        if master_port == 0 {
            return Err(CommError::Env("MASTER_PORT=0 is not a port (1..=65535)".into()));
        }
        let timeout = Self::timeout_from_lookup(&get)?;
        Ok(LaunchEnv { rank, world_size, local_rank, master_addr, master_port, timeout })
    }

    /// `TP_TIMEOUT_SECS` through `get` alone (for jobs whose ranks are threads, which need no
    /// other variable): [`DEFAULT_TIMEOUT_SECS`] when unset; `1..=`[`MAX_TIMEOUT_SECS`], else a
    /// [`CommError::Env`] naming the variable.
    pub fn timeout_from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Duration> {
        let secs: u64 = match get("TP_TIMEOUT_SECS") {
            Some(v) => v.trim().parse().map_err(|_| {
                CommError::Env(format!("TP_TIMEOUT_SECS=\"{}\" is not a valid number", peer_text(v.as_bytes())))
            })?,
            None => DEFAULT_TIMEOUT_SECS,
        };
        if secs == 0 {
            return Err(CommError::Env("TP_TIMEOUT_SECS=0: the timeout must be at least 1 second".into()));
        }
        if secs > MAX_TIMEOUT_SECS {
            return Err(CommError::Env(format!(
                "TP_TIMEOUT_SECS={secs} exceeds the maximum of {MAX_TIMEOUT_SECS} (7 days)"
            )));
        }
        Ok(Duration::from_secs(secs))
    }

    /// `MASTER_ADDR:MASTER_PORT` as a socket address string (an IPv6 address in brackets).
    pub fn store_addr(&self) -> String {
        match self.master_addr.parse::<std::net::Ipv6Addr>() {
            Ok(v6) => format!("[{v6}]:{}", self.master_port),
            Err(_) => format!("{}:{}", self.master_addr, self.master_port),
        }
    }
}
