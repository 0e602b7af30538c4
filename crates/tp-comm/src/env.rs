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
//! both and their values (a stale `RANK` exported into every task of an `srun` is caught so).
//!
//! Two exceptions, where one launcher runs inside another and the outer one's variables
//! describe something other than this process:
//!
//! * torchrun inside an allocation (`srun torchrun ...`, `mpirun torchrun ...`): torchrun always
//!   sets `TORCHELASTIC_RUN_ID` beside its variables, and then its set describes the worker
//!   while SLURM's or MPI's describe torchrun's agent; torchrun's set is taken and the others
//!   are not read at all.
//! * mpirun inside a SLURM allocation (`sbatch`/`salloc`, then `mpirun`): the batch step's
//!   `SLURM_PROCID=0` and `SLURM_NTASKS` (or those of mpirun's daemons) are inherited by every
//!   MPI process, while Open MPI's variables are set per process by the launcher that started
//!   it; Open MPI's set is taken and SLURM's not read. (The reverse nesting does not occur:
//!   a process started by `srun` directly has no `OMPI_COMM_WORLD_*` before `MPI_Init`.)
//!
//! The store's host is `MASTER_ADDR`, or, without it, when SLURM's set was taken (alone or
//! agreeing with another), the first host of the step's node list (`SLURM_STEP_NODELIST`, else
//! `SLURM_JOB_NODELIST`, else `SLURM_NODELIST`): task 0 of an `srun` step runs on its step's
//! first node, which is the job's first node unless the step uses part of the allocation.

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

/// Whether torchrun's agent serves its store on `MASTER_PORT` (`TORCHELASTIC_USE_AGENT_STORE`
/// true, as torchrun sets it for its workers).
fn agent_store(get: &impl Fn(&str) -> Option<String>) -> bool {
    get("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "true" | "1"))
}

/// The error for a launch variable that is not set.
fn missing(name: &str) -> CommError {
    CommError::Env(format!("{name} is not set (launch with torchrun, srun or mpirun, or set RANK and WORLD_SIZE)"))
}

/// The first host of a SLURM hostlist (`node[01-04,07],login5` -> `node01`;
/// `gpu-a[1-2]-b[3-4]` -> `gpu-a1-b3`): the first comma-separated entry outside brackets, each
/// bracket replaced by the first number of its first range (zero padding kept). The whole list
/// is checked, not only its first entry.
///
/// Errors, each a [`CommError::Env`] naming `SLURM_JOB_NODELIST`: an empty list or an empty
/// entry (`a,,b`), unbalanced or nested brackets, empty brackets (`node[]`), a bracket entry
/// that is not a number or a `lo-hi` range of numbers, a range that runs backwards, a space or
/// control character inside a host name.
pub fn first_host(list: &str) -> Result<String> {
    first_host_of("SLURM_JOB_NODELIST", list)
}

/// [`first_host`], its errors naming `var`.
fn first_host_of(var: &str, list: &str) -> Result<String> {
    let bad = |why: &str| CommError::Env(format!("{var}=\"{}\" is not a host list: {why}", peer_text(list.as_bytes())));
    let mut rest = list.trim();
    let mut first: Option<String> = None;
    loop {
        // One entry: text and bracketed ranges up to the next comma outside brackets.
        let mut host = String::new();
        let mut empty = true;
        while let Some(c) = rest.chars().next() {
            match c {
                ',' => break,
                '[' => {
                    let close = rest.find(']').ok_or_else(|| bad("a '[' without its ']'"))?;
                    let inner = &rest[1..close];
                    if inner.contains('[') {
                        return Err(bad("nested brackets"));
                    }
                    host.push_str(first_of_ranges(inner).map_err(|why| bad(&why))?);
                    rest = &rest[close + 1..];
                }
                ']' => return Err(bad("a ']' without its '['")),
                c if c.is_whitespace() || c.is_control() => {
                    return Err(bad("a space or control character in a host name"));
                }
                c => {
                    host.push(c);
                    rest = &rest[c.len_utf8()..];
                }
            }
            empty = false;
        }
        if empty {
            return Err(bad("no host (an empty entry)"));
        }
        first.get_or_insert(host);
        match rest.strip_prefix(',') {
            Some(r) => rest = r,
            None => break,
        }
    }
    first.ok_or_else(|| bad("no host"))
}

/// The first number of a bracket's contents `01-04,07` (as written: `01`), after checking every
/// range in it.
fn first_of_ranges(inner: &str) -> std::result::Result<&str, String> {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let shown = || peer_text(inner.as_bytes());
    let mut first = None;
    for range in inner.split(',') {
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        if !digits(lo) || !digits(hi) {
            return Err(format!("[{}] is not a list of numbers or ranges", shown()));
        }
        let too_large = |_| format!("[{}] holds a number too large", shown());
        let (a, b): (u64, u64) = (lo.parse().map_err(too_large)?, hi.parse().map_err(too_large)?);
        if b < a {
            return Err(format!("the range {range} runs backwards"));
        }
        first.get_or_insert(lo);
    }
    first.ok_or_else(|| format!("[{}] is not a list of numbers or ranges", shown()))
}

impl LaunchEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the variables through `get` (for tests and for callers with their own config).
    ///
    /// One launcher's rank and world size are required (see the module docs for the three
    /// launchers, partial and conflicting sets, and the two nestings where one launcher's set
    /// wins). The local rank defaults to the rank, `MASTER_ADDR` to `127.0.0.1` (under SLURM:
    /// the first host of the step's node list, see the module docs),
    /// `MASTER_PORT` to `29500` (torchrun's defaults), `TP_TIMEOUT_SECS` to
    /// [`DEFAULT_TIMEOUT_SECS`]. The store's port is `TP_MASTER_PORT` when set, else
    /// `MASTER_PORT`, except under a torchrun whose agent already serves its own store there
    /// (`TORCHELASTIC_USE_AGENT_STORE=True`, torchrun's default since torch 2.4): then the next
    /// port, `MASTER_PORT + 1`, the same on every rank.
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
        /// One launcher's set: `None` when neither its rank nor its size is set.
        fn read_set(get: &impl Fn(&str) -> Option<String>, launcher: Launcher) -> Result<Option<Coordinates>> {
            let (who, rank_var, size_var, local_var) = launcher.vars();
            let partial = |missing: &str, present: &str| {
                CommError::Env(format!(
                    "{missing} is not set but {present} is: {who} variables are a partial set (launch with \
                     torchrun, srun or mpirun, or set RANK and WORLD_SIZE)"
                ))
            };
            let (rank, size) = match (get(rank_var), get(size_var)) {
                (None, None) => return Ok(None),
                (Some(_), None) => return Err(partial(size_var, rank_var)),
                (None, Some(_)) => return Err(partial(rank_var, size_var)),
                (Some(r), Some(w)) => (r, w),
            };
            let world_size: usize = parse(size_var, &size)?;
            let rank: usize = parse(rank_var, &rank)?;
            let local_rank = get(local_var).map(|v| parse::<usize>(local_var, &v)).transpose()?;
            Ok(Some(Coordinates { launcher, rank, world_size, local_rank }))
        }
        let torchrun = read_set(&get, Launcher::Torchrun)?;
        let sets: Vec<Coordinates> = match torchrun {
            // torchrun nested in an allocation: the others describe its agents (module docs).
            Some(t) if get("TORCHELASTIC_RUN_ID").is_some() => vec![t],
            _ => {
                let ompi = read_set(&get, Launcher::OpenMpi)?;
                // mpirun inside a SLURM allocation: SLURM's describe the batch step (module docs).
                let slurm = if ompi.is_some() { None } else { read_set(&get, Launcher::Slurm)? };
                [torchrun, slurm, ompi].into_iter().flatten().collect()
            }
        };
        let Some(&chosen) = sets.first() else {
            return Err(missing("RANK"));
        };
        if let Some(other) = sets[1..].iter().find(|o| !chosen.agrees(o)) {
            return Err(CommError::Env(format!(
                "{} and {} disagree; launch with one launcher, or unset the other's variables",
                chosen.describe(),
                other.describe()
            )));
        }
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
        let node_list = || {
            ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"]
                .into_iter()
                .find_map(|var| get(var).map(|list| (var, list)))
        };
        // SLURM's set taken (alone, or agreeing with torchrun's exported by a wrapper script).
        let under_srun = sets.iter().any(|s| s.launcher == Launcher::Slurm);
        let master_addr = match get("MASTER_ADDR") {
            Some(a) => a,
            None => match node_list().filter(|_| under_srun) {
                Some((var, list)) => first_host_of(var, &list)?,
                None => "127.0.0.1".into(),
            },
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
        let port = |name: &str| -> Result<Option<u16>> {
            match get(name) {
                Some(v) => match parse::<u16>(name, &v) {
                    Ok(0) => Err(CommError::Env(format!("{name}=0 is not a port (1..=65535)"))),
                    Ok(p) => Ok(Some(p)),
                    Err(_) => {
                        Err(CommError::Env(format!("{name}=\"{}\" is not a port (1..=65535)", peer_text(v.as_bytes()))))
                    }
                },
                None => Ok(None),
            }
        };
        let master_port = match (port("TP_MASTER_PORT")?, port("MASTER_PORT")?) {
            (Some(p), _) => p,
            // torchrun's agent serves its own store on MASTER_PORT and tells its workers so:
            // tp's store takes the next port.
            (None, Some(p)) if chosen.launcher == Launcher::Torchrun && agent_store(&get) => {
                p.checked_add(1).ok_or_else(|| {
                    CommError::Env(format!(
                        "MASTER_PORT={p} is torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE) and tp's store \
                         takes the next port, past 65535: set TP_MASTER_PORT"
                    ))
                })?
            }
            (None, Some(p)) => p,
            (None, None) => 29500,
        };
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
