//! The launch environment, as torchrun, SLURM's `srun` or Open MPI's `mpirun` sets it.
//!
//! | launcher | rank | world size | local rank |
//! |---|---|---|---|
//! | torchrun | `RANK` | `WORLD_SIZE` | `LOCAL_RANK` |
//! | srun | `SLURM_PROCID` | `SLURM_NTASKS` | `SLURM_LOCALID` |
//! | mpirun (Open MPI) | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` |
//!
//! Any of them gives the same coordinates. A set with its rank but not its size (or the
//! reverse) is refused, naming the missing variable; two sets that disagree are refused naming
//! both. The one exception is a torchrun inside an allocation (`srun torchrun ...`): torchrun
//! sets `TORCHELASTIC_RUN_ID` beside its variables, and then its set describes the worker while
//! SLURM's or MPI's describe torchrun's agent, so torchrun's is taken and the others ignored.
//! The store's host is `MASTER_ADDR`, or under SLURM without it the first host of
//! `SLURM_JOB_NODELIST`.

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
    /// The launcher whose variables gave the coordinates.
    pub launcher: Launcher,
}

/// The launchers whose variables [`LaunchEnv`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Launcher {
    /// `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (torchrun, or set by hand).
    Torchrun,
    /// `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID` (srun).
    Slurm,
    /// `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK` (mpirun).
    OpenMpi,
}

impl Launcher {
    /// `(name, rank variable, size variable, local-rank variable)`.
    fn vars(self) -> (&'static str, &'static str, &'static str, &'static str) {
        match self {
            Launcher::Torchrun => ("torchrun's", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
            Launcher::Slurm => ("SLURM's", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
            Launcher::OpenMpi => {
                ("Open MPI's", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")
            }
        }
    }
}

/// One launcher's coordinates as read.
#[derive(Debug, Clone, Copy)]
struct Coordinates {
    launcher: Launcher,
    rank: usize,
    world_size: usize,
    local_rank: Option<usize>,
}

impl Coordinates {
    fn describe(&self) -> String {
        let (who, r, w, l) = self.launcher.vars();
        let local = self.local_rank.map_or(String::new(), |x| format!(" {l}={x}"));
        format!("{who} {r}={} {w}={}{local}", self.rank, self.world_size)
    }
    fn agrees(&self, o: &Coordinates) -> bool {
        self.rank == o.rank
            && self.world_size == o.world_size
            && (self.local_rank.is_none() || o.local_rank.is_none() || self.local_rank == o.local_rank)
    }
}

/// Default deadline when `TP_TIMEOUT_SECS` is unset.
pub const DEFAULT_TIMEOUT_SECS: u64 = 300;

/// Longest `TP_TIMEOUT_SECS`: 604800 (7 days, [`MAX_TIMEOUT`]).
pub const MAX_TIMEOUT_SECS: u64 = MAX_TIMEOUT.as_secs();

/// Longest `MASTER_ADDR` (a DNS name is at most 253 characters).
const MAX_ADDR_LEN: usize = 253;

/// The error for a launch variable that is not set.
fn missing(name: &str) -> CommError {
    CommError::Env(format!("{name} is not set (launch with torchrun, srun or mpirun, or set RANK and WORLD_SIZE)"))
}

/// The first host of a SLURM hostlist (`node[01-04,07],login5` -> `node01`;
/// `gpu-a[1-2]-b[3-4]` -> `gpu-a1-b3`): the first comma-separated entry outside brackets, each
/// bracket replaced by the first number of its first range (zero padding kept).
///
/// Errors: an empty list, unbalanced or empty brackets, a range that is not numbers or runs
/// backwards; each naming `SLURM_JOB_NODELIST`.
pub fn first_host(list: &str) -> Result<String> {
    let bad = |why: &str| {
        CommError::Env(format!("SLURM_JOB_NODELIST=\"{}\" is not a host list: {why}", peer_text(list.as_bytes())))
    };
    let list = list.trim();
    let mut depth = 0usize;
    let mut end = list.len();
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.checked_sub(1).ok_or_else(|| bad("a ']' without its '['"))?,
            ',' if depth == 0 => {
                end = i;
                break;
            }
            _ => {}
        }
    }
    let entry = &list[..end];
    if entry.is_empty() {
        return Err(bad("no host"));
    }
    let mut host = String::new();
    let mut rest = entry;
    while let Some(open) = rest.find('[') {
        host.push_str(&rest[..open]);
        let close = rest[open..].find(']').ok_or_else(|| bad("a '[' without its ']'"))? + open;
        let inner = &rest[open + 1..close];
        if inner.contains('[') {
            return Err(bad("nested brackets"));
        }
        let first = inner.split(',').next().unwrap_or("").trim();
        let (lo, hi) = first.split_once('-').unwrap_or((first, first));
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(lo) || !digits(hi) {
            return Err(bad(&format!("[{inner}] is not a list of numbers or ranges")));
        }
        let (a, b): (u64, u64) =
            (lo.parse().map_err(|_| bad("a number too large"))?, hi.parse().map_err(|_| bad("a number too large"))?);
        if b < a {
            return Err(bad(&format!("the range {first} runs backwards")));
        }
        host.push_str(lo);
        rest = &rest[close + 1..];
    }
    if rest.contains(']') {
        return Err(bad("a ']' without its '['"));
    }
    host.push_str(rest);
    Ok(host)
}

impl LaunchEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the variables through `get` (for tests and for callers with their own config).
    ///
    /// One launcher's rank and world size are required (see the module docs for the three
    /// launchers, partial and conflicting sets). The local rank defaults to the rank,
    /// `MASTER_ADDR` to `127.0.0.1` (under SLURM: the first host of `SLURM_JOB_NODELIST`),
    /// `MASTER_PORT` to `29500` (torchrun's defaults), `TP_TIMEOUT_SECS` to
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
        let mut sets = Vec::new();
        for launcher in [Launcher::Torchrun, Launcher::Slurm, Launcher::OpenMpi] {
            let (_, rank_var, size_var, local_var) = launcher.vars();
            let (rank, size) = match (get(rank_var), get(size_var)) {
                (None, None) => continue,
                (Some(_), None) => return Err(missing(size_var)),
                (None, Some(_)) => return Err(missing(rank_var)),
                (Some(r), Some(w)) => (r, w),
            };
            let world_size: usize = parse(size_var, &size)?;
            let rank: usize = parse(rank_var, &rank)?;
            let local_rank = get(local_var).map(|v| parse::<usize>(local_var, &v)).transpose()?;
            sets.push(Coordinates { launcher, rank, world_size, local_rank });
        }
        let nested_torchrun = get("TORCHELASTIC_RUN_ID").is_some();
        let chosen = match sets.first() {
            None => return Err(missing("RANK")),
            Some(first) if first.launcher == Launcher::Torchrun && nested_torchrun => *first,
            Some(first) => {
                if let Some(other) = sets[1..].iter().find(|o| !first.agrees(o)) {
                    return Err(CommError::Env(format!(
                        "{} and {} disagree; launch with one launcher, or unset the other's variables",
                        first.describe(),
                        other.describe()
                    )));
                }
                *first
            }
        };
        let (_, rank_var, size_var, _) = chosen.launcher.vars();
        let (rank, world_size) = (chosen.rank, chosen.world_size);
        if world_size == 0 {
            return Err(CommError::Env(format!("{size_var} must be at least 1")));
        }
        if world_size > MAX_WORLD_SIZE {
            return Err(CommError::Env(format!(
                "{size_var}={world_size} exceeds the maximum of {MAX_WORLD_SIZE} ranks"
            )));
        }
        if rank >= world_size {
            return Err(CommError::Env(format!("{rank_var}={rank} is not below {size_var}={world_size}")));
        }
        let local_rank = chosen.local_rank.unwrap_or(rank);
        let master_addr = match (get("MASTER_ADDR"), chosen.launcher, get("SLURM_JOB_NODELIST")) {
            (Some(a), _, _) => a,
            (None, Launcher::Slurm, Some(list)) => first_host(&list)?,
            _ => "127.0.0.1".into(),
        };
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
        Ok(LaunchEnv { rank, world_size, local_rank, master_addr, master_port, timeout, launcher: chosen.launcher })
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
