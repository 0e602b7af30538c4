//! Rendezvous the way torchrun does it: rank 0 serves a TCP store at `MASTER_ADDR:MASTER_PORT`,
//! every rank registers there, and opaque blobs (the NCCL unique id) are published through it.
//!
//! Checks, each a clear [`CommError::Rendezvous`] before any deadline passes unnoticed: a rank
//! that never arrives (the others name it), two processes claiming one rank, a `WORLD_SIZE` that
//! differs from rank 0's, a port already in use, something other than a tp store on the port.

use crate::env::LaunchEnv;
use crate::store::{Claim, StoreClient, StoreServer};
use crate::{CommError, Result};
use std::time::Instant;

/// A joined rendezvous.
///
/// Dropping it signs this rank off; rank 0's drop waits (at most `min(timeout, 30 s)`) until every
/// other rank has signed off before its store stops serving, so no rank loses the store while it
/// is still reading from it.
pub struct Rendezvous {
    env: LaunchEnv,
    client: StoreClient,
    _server: Option<StoreServer>,
}

impl Drop for Rendezvous {
    fn drop(&mut self) {
        let grace = self.env.timeout.min(std::time::Duration::from_secs(30));
        let deadline = Instant::now() + grace;
        let _ = self.client.set(&format!("finished/{}", self.env.rank), b"1", deadline);
        if self.env.rank == 0 {
            for r in 1..self.env.world_size {
                // Best effort: a peer that died never signs off; the grace period bounds the wait.
                if !matches!(self.client.get(&format!("finished/{r}"), deadline), Ok(Some(_))) {
                    break;
                }
            }
        }
    }
}

impl std::fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Rendezvous(rank {} of {} at {}:{})",
            self.env.rank, self.env.world_size, self.env.master_addr, self.env.master_port
        )
    }
}

/// `pid N on HOST`, to name a process in errors.
fn identity() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string());
    format!("pid {} on {}", std::process::id(), host.unwrap_or_else(|_| "unknown host".into()))
}

impl Rendezvous {
    /// Joins the job described by `env`: rank 0 starts the store, every rank registers, and the
    /// call returns once all `world_size` ranks have, or fails at `env.timeout`.
    pub fn join(env: &LaunchEnv) -> Result<Rendezvous> {
        let deadline = Instant::now() + env.timeout;
        let addr = format!("{}:{}", env.master_addr, env.master_port);
        let server = if env.rank == 0 { Some(StoreServer::start(&addr)?) } else { None };
        let mut client = StoreClient::connect(&addr, deadline)?;
        let world = env.world_size.to_string();
        if env.rank == 0 {
            client.set("world_size", world.as_bytes(), deadline)?;
        } else {
            let theirs = client.get("world_size", deadline)?.ok_or_else(|| {
                CommError::Rendezvous(format!("rank 0 never published WORLD_SIZE at {addr} before the deadline"))
            })?;
            let theirs = String::from_utf8_lossy(&theirs).to_string();
            if theirs != world {
                return Err(CommError::Rendezvous(format!(
                    "WORLD_SIZE mismatch: rank {} has {world}, rank 0 has {theirs}",
                    env.rank
                )));
            }
        }
        let me = identity();
        if let Claim::Taken(other) = client.claim(&format!("rank/{}", env.rank), me.as_bytes(), deadline)? {
            return Err(CommError::Rendezvous(format!(
                "two processes claim rank {}: {} and {me} (check RANK)",
                env.rank,
                String::from_utf8_lossy(&other)
            )));
        }
        let mut rdv = Rendezvous { env: env.clone(), client, _server: server };
        rdv.wait_for_all("rank", deadline)?;
        Ok(rdv)
    }

    /// The environment this rendezvous was joined with.
    pub fn env(&self) -> &LaunchEnv {
        &self.env
    }

    /// Waits until `{prefix}/{r}` exists for every rank; names every missing rank on timeout.
    fn wait_for_all(&mut self, prefix: &str, deadline: Instant) -> Result<()> {
        let mut missing = Vec::new();
        for r in 0..self.env.world_size {
            // After the first miss the deadline has passed: the rest are only looked up.
            if self.client.get(&format!("{prefix}/{r}"), deadline)?.is_none() {
                missing.push(r);
            }
        }
        if missing.is_empty() {
            return Ok(());
        }
        Err(CommError::Rendezvous(format!(
            "rank {} waited {:?} at {prefix} but rank(s) {missing:?} never arrived",
            self.env.rank, self.env.timeout
        )))
    }

    /// Publishes `blob` from `root` (pass `Some` there, `None` elsewhere) and returns it on every
    /// rank: how rank 0's NCCL unique id reaches the others.
    pub fn broadcast_bytes(&mut self, key: &str, root: usize, blob: Option<&[u8]>) -> Result<Vec<u8>> {
        let deadline = Instant::now() + self.env.timeout;
        let key = format!("bcast/{key}");
        if self.env.rank == root {
            let blob = blob.ok_or_else(|| CommError::Rendezvous("the root must provide the blob".into()))?;
            self.client.set(&key, blob, deadline)?;
            return Ok(blob.to_vec());
        }
        self.client
            .get(&key, deadline)?
            .ok_or_else(|| CommError::Rendezvous(format!("rank {root} never published {key:?} before the deadline")))
    }

    /// Every rank's `mine` under `key`, in rank order (for small blobs: device ids, addresses).
    pub fn all_gather_bytes(&mut self, key: &str, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let deadline = Instant::now() + self.env.timeout;
        self.client.set(&format!("gather/{key}/{}", self.env.rank), mine, deadline)?;
        let mut out = Vec::with_capacity(self.env.world_size);
        let mut missing = Vec::new();
        for r in 0..self.env.world_size {
            match self.client.get(&format!("gather/{key}/{r}"), deadline)? {
                Some(v) => out.push(v),
                None => missing.push(r),
            }
        }
        if !missing.is_empty() {
            return Err(CommError::Rendezvous(format!("rank(s) {missing:?} never published {key:?}")));
        }
        Ok(out)
    }

    /// Returns once every rank has reached the barrier `name` (each name used once per job).
    pub fn barrier(&mut self, name: &str) -> Result<()> {
        let deadline = Instant::now() + self.env.timeout;
        self.client.set(&format!("barrier/{name}/{}", self.env.rank), b"1", deadline)?;
        self.wait_for_all(&format!("barrier/{name}"), deadline)
    }
}
