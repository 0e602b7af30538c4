//! A small TCP key-value store for rendezvous, in the spirit of torch.distributed's TCPStore.
//!
//! Rank 0 serves it at `MASTER_ADDR:MASTER_PORT` ([`StoreServer`]); every rank (rank 0
//! included) talks to it as a client ([`StoreClient`]). Requests and replies are frames: magic
//! `TPS1`, an op byte, a length-prefixed key and a length-prefixed value (little-endian u32
//! lengths). Anything else on the socket is a protocol error: the server drops that connection
//! and keeps serving; a client returns [`CommError::Rendezvous`](crate::CommError::Rendezvous).
//!
//! Every client call has a deadline, and the reply to a waiting request arrives by the
//! deadline plus [`DEADLINE_SLACK`](crate::DEADLINE_SLACK), or the call fails. Socket calls
//! retry on `EINTR` with the time left.
//!
//! The server is bounded, so a hostile or broken client cannot exhaust rank 0's memory or
//! threads ([`StoreLimits`]): keys up to [`MAX_KEY_BYTES`], values up to [`MAX_VALUE_BYTES`],
//! at most [`MAX_KEYS`] keys and [`MAX_STORE_BYTES`] bytes held, [`MAX_IN_FLIGHT_BYTES`] of
//! values being received at once, and [`MAX_CONNECTIONS`] connections (each a thread with a
//! small stack). A request past a limit is answered with an error naming it. A request, once
//! begun, must arrive within [`FRAME_TIMEOUT`], as must a new connection's first request; a
//! client that stalls mid-request, or never speaks, is disconnected.
//!
//! Connections give way to ranks. A connection becomes a rank's when it wins the claim of
//! `rank/{r}` for a rank `r` of the job (below [`StoreLimits::world_size`], written as the
//! rendezvous writes it), as each rank does on joining; any other request (a get, a set, a claim
//! of another key) does not make it one, so a client that keeps talking is no rank for that.
//! When a new connection arrives at the limit, the oldest connection that is not a rank's is
//! evicted: shut down, any wait it is in ended, its thread gone before the newcomer's starts
//! (which waits for that at most a second). The newcomer is refused (an error frame, then a
//! close) only when every open connection is a rank's. Since one key per rank exists, at most
//! `world_size` connections are ranks', and a store of [`StoreLimits::for_world`] always has 64
//! connections that can give way: a flood of connections, idle or busy, cannot keep a rank out,
//! and connections and threads stay bounded all the same. A rank joining the job registers
//! within moments of connecting, so it would take 64 more connections arriving within those
//! moments to evict it.

mod client;
mod frame;
mod server;

pub use client::{Claim, Missing, StoreClient};
pub use server::StoreServer;

use std::time::Duration;

/// Longest key, in bytes.
pub const MAX_KEY_BYTES: usize = 4096;
/// Longest value, in bytes (1 MiB; rendezvous values are ids and names of a few hundred bytes).
pub const MAX_VALUE_BYTES: usize = 1 << 20;
/// Most keys one store holds (a barrier or gather adds one per rank).
pub const MAX_KEYS: usize = 1 << 18;
/// Most bytes one store holds: keys, values and 64 bytes of bookkeeping per key (64 MiB).
pub const MAX_STORE_BYTES: usize = 64 << 20;
/// Most value bytes the server receives at once over all connections (64 MiB).
pub const MAX_IN_FLIGHT_BYTES: usize = 64 << 20;
/// Most open connections to one store: one per rank at [`MAX_WORLD_SIZE`](crate::MAX_WORLD_SIZE),
/// plus 64 (at the limit, a connection that is not a rank's gives way to a newcomer).
pub const MAX_CONNECTIONS: usize = crate::env::MAX_WORLD_SIZE + 64;
/// How long a request may take to arrive once begun, and a new connection to send its first.
pub const FRAME_TIMEOUT: Duration = Duration::from_secs(10);
/// Most missing ranks one `wait_all` reply names (it always says how many there are).
const MAX_NAMED_MISSING: usize = 32;

/// The bounds of one [`StoreServer`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreLimits {
    /// Longest value (at most [`MAX_VALUE_BYTES`]).
    pub max_value_bytes: usize,
    /// Most keys held.
    pub max_keys: usize,
    /// Most bytes held (keys, values, 64 bytes per key).
    pub max_bytes: usize,
    /// Most value bytes received at once.
    pub max_in_flight_bytes: usize,
    /// Most open connections.
    pub max_connections: usize,
    /// The job's number of ranks ([`MAX_WORLD_SIZE`](crate::MAX_WORLD_SIZE) by default): a
    /// connection that wins the claim of `rank/{r}` for an `r` below it is a rank's, and never
    /// gives way to a newcomer.
    pub world_size: usize,
    /// How long a request may take to arrive once begun, and a new connection to send its
    /// first ([`FRAME_TIMEOUT`]).
    pub frame_timeout: Duration,
    /// Longest a get or wait_all may wait, whatever it asks for ([`MAX_TIMEOUT`](crate::MAX_TIMEOUT);
    /// a rendezvous sets its own timeout).
    pub max_wait: Duration,
}

impl Default for StoreLimits {
    /// The documented maxima.
    fn default() -> Self {
        StoreLimits {
            max_value_bytes: MAX_VALUE_BYTES,
            max_keys: MAX_KEYS,
            max_bytes: MAX_STORE_BYTES,
            max_in_flight_bytes: MAX_IN_FLIGHT_BYTES,
            max_connections: MAX_CONNECTIONS,
            world_size: crate::env::MAX_WORLD_SIZE,
            frame_timeout: FRAME_TIMEOUT,
            max_wait: crate::MAX_TIMEOUT,
        }
    }
}

impl StoreLimits {
    /// The defaults for a job of `world_size` ranks, with connections limited to what it
    /// needs: one per rank, plus 64 for late duplicates and probes.
    pub fn for_world(world_size: usize) -> Self {
        StoreLimits {
            max_connections: world_size.saturating_add(64).min(MAX_CONNECTIONS),
            world_size,
            ..Self::default()
        }
    }
}
