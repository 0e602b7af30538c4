//! Rendezvous the way torchrun does it: rank 0 serves a TCP store at `MASTER_ADDR:MASTER_PORT`,
//! every rank registers there, and opaque blobs (the NCCL unique id) are published through it.
//!
//! Checks, each a clear [`CommError::Rendezvous`] before any deadline passes unnoticed: a rank
//! that never arrives (the others name it), two processes claiming one rank, a `WORLD_SIZE` that
//! differs from rank 0's, a port already in use, something other than a tp store on the port.
//!
//! Deadlines: each call ([`Rendezvous::join`], [`barrier`](Rendezvous::barrier), ...) has one
//! deadline, `timeout` after it starts, shared by every step inside it, and its error reaches
//! every rank within `timeout +` [`DEADLINE_SLACK`]: a rank whose peers or whose rank 0 are
//! missing, dead or stopped fails then; when rank 0 gives up, it tells the others at once why.
//! A stopped and resumed process (SIGSTOP/SIGCONT, a debugger, SLURM suspend) carries on.

use crate::deadline::{DEADLINE_SLACK, Deadline};
use crate::env::LaunchEnv;
use crate::peer_text::peer_text;
use crate::store::{Claim, StoreClient, StoreLimits, StoreServer};
use crate::{CommError, Result};

/// A joined rendezvous.
///
/// Dropping it leaves the job: a rank other than 0 just closes its connection (no request, no
/// wait). Rank 0's store then stops waiting for missing keys (the others learn that rank 0 left)
/// and stays up until every other rank has disconnected, so no rank loses the store while it
/// still reads from it: at most `timeout` after a healthy run, at most [`DEADLINE_SLACK`] after
/// a call of this rendezvous failed.
pub struct Rendezvous {
    env: LaunchEnv,
    client: StoreClient,
    server: Option<StoreServer>,
    /// Why a call failed, if one did: rank 0 passes it on, and its drop does not wait.
    failed: Option<String>,
}

/// The text of a rendezvous error, without the variant's own prefix.
fn reason(e: &CommError) -> String {
    match e {
        CommError::Rendezvous(m) => m.clone(),
        other => other.to_string(),
    }
}

/// Closes rank 0's store with the reason rank 0 gave up, and gives the others
/// [`DEADLINE_SLACK`] to hear it and disconnect (stray connections that never claimed a rank
/// are not waited for).
fn give_up(server: &StoreServer, why: &str, own_connections: usize) {
    let reason = if why.starts_with("rank 0 ") { why.to_string() } else { format!("rank 0 gave up: {why}") };
    server.close(&reason);
    server.wait_for_rank_connections(own_connections, Deadline::after(DEADLINE_SLACK));
}

impl Drop for Rendezvous {
    fn drop(&mut self) {
        self.client.close();
        let Some(server) = &self.server else { return };
        match &self.failed {
            Some(why) => give_up(server, why, 0),
            None => {
                server.close("rank 0 has left the rendezvous");
                server.wait_for_rank_connections(0, Deadline::after(self.env.timeout));
            }
        }
    }
}

impl std::fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Rendezvous(rank {} of {} at {})", self.env.rank, self.env.world_size, self.env.store_addr())
    }
}

/// `pid N on HOST`, to name a process in errors.
fn identity() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| peer_text(h.trim().as_bytes()));
    format!("pid {} on {}", std::process::id(), host.unwrap_or_else(|_| "unknown host".into()))
}

impl Rendezvous {
    /// Joins the job described by `env`: rank 0 starts the store, every rank registers, and the
    /// call returns once all `world_size` ranks have, or fails by `env.timeout` (plus
    /// [`DEADLINE_SLACK`]).
    pub fn join(env: &LaunchEnv) -> Result<Rendezvous> {
        let deadline = Deadline::after(env.timeout);
        let addr = env.store_addr();
        // No request of this job waits longer than its timeout, whatever a client asks for.
        let limits = StoreLimits { max_wait: env.timeout, ..StoreLimits::for_world(env.world_size) };
        let server = if env.rank == 0 { Some(StoreServer::start_with(&addr, limits)?) } else { None };
        match Self::register(env, &addr, deadline) {
            Ok(client) => Ok(Rendezvous { env: env.clone(), client, server, failed: None }),
            Err(e) => {
                if let Some(server) = &server {
                    give_up(server, &reason(&e), 0);
                }
                Err(e)
            }
        }
    }

    /// Connects, checks `WORLD_SIZE` against rank 0's, claims this rank and waits for the others.
    fn register(env: &LaunchEnv, addr: &str, deadline: Deadline) -> Result<StoreClient> {
        let mut client = StoreClient::connect(addr, deadline)?;
        let world = env.world_size.to_string();
        if env.rank == 0 {
            client.set("world_size", world.as_bytes(), deadline)?;
        } else {
            let theirs = client.get("world_size", deadline)?.ok_or_else(|| {
                CommError::Rendezvous(format!("rank 0 never published WORLD_SIZE at {addr} before the deadline"))
            })?;
            if theirs != world.as_bytes() {
                return Err(CommError::Rendezvous(format!(
                    "WORLD_SIZE mismatch: rank {} has {world}, rank 0 has {}",
                    env.rank,
                    peer_text(&theirs)
                )));
            }
        }
        let me = identity();
        if let Claim::Taken(other) = client.claim(&format!("rank/{}", env.rank), me.as_bytes(), deadline)? {
            return Err(CommError::Rendezvous(format!(
                "two processes claim rank {}: {} and {me} (check RANK)",
                env.rank,
                peer_text(&other)
            )));
        }
        Self::wait_for_all(&mut client, env, "rank", deadline)?;
        Ok(client)
    }

    /// The environment this rendezvous was joined with.
    pub fn env(&self) -> &LaunchEnv {
        &self.env
    }

    /// Waits until `{prefix}/{r}` exists for every rank (one request); names the missing ranks
    /// at the deadline.
    fn wait_for_all(client: &mut StoreClient, env: &LaunchEnv, prefix: &str, deadline: Deadline) -> Result<()> {
        let missing = client.wait_all(prefix, env.world_size, deadline)?;
        if missing.is_empty() {
            return Ok(());
        }
        Err(CommError::Rendezvous(format!(
            "rank {} waited {:?} at {prefix} but rank(s) {missing} never arrived",
            env.rank, env.timeout
        )))
    }

    /// Marks this rendezvous failed (for a failure outside it, e.g. creating the NCCL
    /// communicator): when dropped, rank 0 tells the others `why` and waits for nobody.
    pub fn abort(&mut self, why: &str) {
        self.failed.get_or_insert_with(|| why.to_string());
    }

    /// Runs one call with a fresh deadline, remembering a failure.
    fn call<T>(&mut self, f: impl FnOnce(&mut Self, Deadline) -> Result<T>) -> Result<T> {
        let out = f(self, Deadline::after(self.env.timeout));
        if let Err(e) = &out {
            self.failed.get_or_insert_with(|| reason(e));
        }
        out
    }

    /// Publishes `blob` from `root` (pass `Some` there, `None` elsewhere) and returns it on every
    /// rank: how rank 0's NCCL unique id reaches the others.
    pub fn broadcast_bytes(&mut self, key: &str, root: usize, blob: Option<&[u8]>) -> Result<Vec<u8>> {
        self.call(|rdv, deadline| {
            let key = format!("bcast/{key}");
            if rdv.env.rank == root {
                let blob = blob.ok_or_else(|| CommError::Rendezvous("the root must provide the blob".into()))?;
                rdv.client.set(&key, blob, deadline)?;
                return Ok(blob.to_vec());
            }
            rdv.client.get(&key, deadline)?.ok_or_else(|| {
                CommError::Rendezvous(format!("rank {root} never published {key:?} before the deadline"))
            })
        })
    }

    /// Every rank's `mine` under `key`, in rank order (for small blobs: device ids, addresses).
    pub fn all_gather_bytes(&mut self, key: &str, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.call(|rdv, deadline| {
            let prefix = format!("gather/{key}");
            rdv.client.set(&format!("{prefix}/{}", rdv.env.rank), mine, deadline)?;
            let missing = rdv.client.wait_all(&prefix, rdv.env.world_size, deadline)?;
            if !missing.is_empty() {
                return Err(CommError::Rendezvous(format!("rank(s) {missing} never published {key:?}")));
            }
            // Every value is there now: each get answers at once.
            (0..rdv.env.world_size)
                .map(|r| {
                    let k = format!("{prefix}/{r}");
                    rdv.client.get(&k, deadline)?.ok_or_else(|| CommError::Rendezvous(format!("{k:?} vanished")))
                })
                .collect()
        })
    }

    /// Returns once every rank has reached the barrier `name` (each name used once per job).
    pub fn barrier(&mut self, name: &str) -> Result<()> {
        self.call(|rdv, deadline| {
            let prefix = format!("barrier/{name}");
            rdv.client.set(&format!("{prefix}/{}", rdv.env.rank), b"1", deadline)?;
            Self::wait_for_all(&mut rdv.client, &rdv.env, &prefix, deadline)
        })
    }
}
