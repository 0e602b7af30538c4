//! [`StoreClient`]: one connection to the store, every call bounded by the caller's deadline.

use super::frame::{
    FrameError, OP_CLAIM, OP_GET, OP_SET, OP_WAIT_ALL, R_ERROR, R_EXISTS, R_MISSING, R_OK, R_VALUE, read_frame,
    write_frame,
};
use super::{MAX_KEY_BYTES, MAX_NAMED_MISSING, MAX_VALUE_BYTES};
use crate::deadline::{DEADLINE_SLACK, Deadline};
use crate::env::MAX_WORLD_SIZE;
use crate::peer_text::peer_text;
use crate::{CommError, Result};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

fn protocol(why: impl std::fmt::Display) -> CommError {
    CommError::Rendezvous(format!("protocol error: {why}"))
}

/// What `claim` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The key was free and now holds our value.
    Won,
    /// The key was already held, with this value.
    Taken(Vec<u8>),
}

/// The ranks whose keys [`StoreClient::wait_all`] did not find by its deadline.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Missing {
    /// How many were missing.
    pub count: usize,
    /// The first of them (at most 32), in rank order.
    pub ranks: Vec<usize>,
}

impl Missing {
    /// Whether every key was there.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }
}

impl std::fmt::Display for Missing {
    /// `[1, 2]`, or `[1, 2, ...] (4000 in all)` when only the first ones are named.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.count <= self.ranks.len() {
            return write!(f, "{:?}", self.ranks);
        }
        let named: Vec<String> = self.ranks.iter().map(usize::to_string).collect();
        write!(f, "[{}, ...] ({} in all)", named.join(", "), self.count)
    }
}

/// Resolves `addr` by `deadline`. Numeric addresses need no lookup; a host name is looked up
/// on a helper thread, so a slow DNS server cannot hold the caller past its deadline.
fn resolve(addr: &str, deadline: Deadline) -> Result<Vec<SocketAddr>> {
    if let Ok(a) = addr.parse::<SocketAddr>() {
        return Ok(vec![a]);
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let name = addr.to_string();
    std::thread::Builder::new()
        .name("tp-store-resolve".into())
        .spawn(move || {
            let _ = tx.send(name.to_socket_addrs().map(|a| a.collect::<Vec<_>>()));
        })
        .map_err(|e| CommError::Rendezvous(format!("cannot start a thread to resolve {addr}: {e}")))?;
    match rx.recv_timeout(deadline.remaining()) {
        Ok(Ok(a)) if !a.is_empty() => Ok(a),
        Ok(Ok(_)) => Err(CommError::Rendezvous(format!("cannot resolve {addr}: no addresses"))),
        Ok(Err(e)) => Err(CommError::Rendezvous(format!("cannot resolve {addr}: {e}"))),
        Err(_) => Err(CommError::Rendezvous(format!("cannot resolve {addr} before the deadline"))),
    }
}

/// A client connection to the store.
pub struct StoreClient {
    conn: TcpStream,
    addr: String,
}

impl std::fmt::Debug for StoreClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StoreClient({})", self.addr)
    }
}

impl StoreClient {
    /// Connects to `addr`, retrying until `deadline` (rank 0 may not be listening yet).
    pub fn connect(addr: &str, deadline: impl Into<Deadline>) -> Result<StoreClient> {
        let deadline = deadline.into();
        let resolved = resolve(addr, deadline)?;
        let mut last = String::from("no attempt");
        loop {
            for a in &resolved {
                let left = deadline.remaining().clamp(Duration::from_millis(10), Duration::from_secs(5));
                // connect_timeout retries EINTR itself, with the time left.
                match TcpStream::connect_timeout(a, left) {
                    Ok(conn) => {
                        let _ = conn.set_nodelay(true);
                        return Ok(StoreClient { conn, addr: addr.to_string() });
                    }
                    Err(e) => last = e.to_string(),
                }
            }
            if deadline.has_passed() {
                return Err(CommError::Rendezvous(format!(
                    "cannot reach the store at {addr} before the deadline ({last}); is rank 0 running?"
                )));
            }
            std::thread::sleep(Duration::from_millis(50).min(deadline.remaining()));
        }
    }

    /// Closes the connection now (the server sees this client leave).
    pub fn close(&mut self) {
        let _ = self.conn.shutdown(Shutdown::Both);
    }

    /// One request and its reply. The server answers a waiting request at `deadline`; the reply
    /// may take [`DEADLINE_SLACK`] more to arrive, and no longer.
    fn request(&mut self, what: &str, op: u8, key: &str, value: &[u8], deadline: Deadline) -> Result<(u8, Vec<u8>)> {
        if key.len() > MAX_KEY_BYTES || value.len() > MAX_VALUE_BYTES {
            return Err(CommError::Rendezvous(format!(
                "{what} of a {}-byte key and a {}-byte value: the store takes keys up to {MAX_KEY_BYTES} bytes and \
                 values up to {MAX_VALUE_BYTES}",
                key.len(),
                value.len()
            )));
        }
        let io_deadline = deadline.extended(DEADLINE_SLACK);
        let addr = &self.addr;
        let late = || {
            CommError::Rendezvous(format!(
                "the store at {addr} did not answer {what} {key:?} before the deadline (is rank 0 stopped or \
                 overloaded?)"
            ))
        };
        let failed = |e: std::io::Error| match e.kind() {
            std::io::ErrorKind::TimedOut => late(),
            _ => CommError::Rendezvous(format!("store at {addr}: {what} {key:?}: {e}")),
        };
        write_frame(&mut self.conn, op, key.as_bytes(), value, io_deadline).map_err(failed)?;
        match read_frame(&mut self.conn, Some(io_deadline), || io_deadline, MAX_VALUE_BYTES, None) {
            Ok(Some(f)) if f.op == R_ERROR => {
                Err(CommError::Rendezvous(format!("{what} {key:?} at {addr}: {}", peer_text(&f.value))))
            }
            Ok(Some(f)) => Ok((f.op, f.value)),
            Ok(None) => Err(CommError::Rendezvous(format!(
                "store at {addr} closed the connection during {what} {key:?} (rank 0 exited, or the store \
                 refused this connection)"
            ))),
            Err(FrameError::TimedOut) => Err(late()),
            Err(FrameError::Io(e)) => Err(failed(e)),
            Err(FrameError::Protocol(why) | FrameError::Refused(why)) => Err(protocol(format!("from {addr}: {why}"))),
        }
    }

    /// Sets `key` to `value`.
    pub fn set(&mut self, key: &str, value: &[u8], deadline: impl Into<Deadline>) -> Result<()> {
        match self.request("set", OP_SET, key, value, deadline.into())? {
            (R_OK, _) => Ok(()),
            (op, _) => Err(protocol(format!("unexpected reply {op} to set"))),
        }
    }

    /// Sets `key` only if it is absent.
    pub fn claim(&mut self, key: &str, value: &[u8], deadline: impl Into<Deadline>) -> Result<Claim> {
        match self.request("claim", OP_CLAIM, key, value, deadline.into())? {
            (R_OK, _) => Ok(Claim::Won),
            (R_EXISTS, v) => Ok(Claim::Taken(v)),
            (op, _) => Err(protocol(format!("unexpected reply {op} to claim"))),
        }
    }

    /// The value of `key`, waiting for it until `deadline`; `Ok(None)` if it never appeared.
    pub fn get(&mut self, key: &str, deadline: impl Into<Deadline>) -> Result<Option<Vec<u8>>> {
        let deadline = deadline.into();
        let wait = deadline.remaining().as_millis() as u64;
        match self.request("get", OP_GET, key, &wait.to_le_bytes(), deadline)? {
            (R_VALUE, v) => Ok(Some(v)),
            (R_MISSING, _) => Ok(None),
            (op, _) => Err(protocol(format!("unexpected reply {op} to get"))),
        }
    }

    /// Waits until `{prefix}/{r}` exists for every `r` in `0..count` (one request, however
    /// large `count`), at most until `deadline`; returns the ranks still missing then (empty if
    /// none). `count` is at most [`MAX_WORLD_SIZE`].
    pub fn wait_all(&mut self, prefix: &str, count: usize, deadline: impl Into<Deadline>) -> Result<Missing> {
        if count > MAX_WORLD_SIZE {
            return Err(CommError::Rendezvous(format!("cannot wait for {count} keys (at most {MAX_WORLD_SIZE})")));
        }
        let deadline = deadline.into();
        let mut value = (deadline.remaining().as_millis() as u64).to_le_bytes().to_vec();
        value.extend_from_slice(&(count as u64).to_le_bytes());
        match self.request("wait_all", OP_WAIT_ALL, prefix, &value, deadline)? {
            (R_OK, _) => Ok(Missing::default()),
            (R_MISSING, v) => decode_missing(&v, count),
            (op, _) => Err(protocol(format!("unexpected reply {op} to wait_all"))),
        }
    }
}

/// Checks and decodes a WAIT_ALL reply: u64 count, then u32 ranks, each below `world`.
fn decode_missing(v: &[u8], world: usize) -> Result<Missing> {
    let bad = || protocol(format!("malformed wait_all reply of {} bytes", v.len()));
    let (head, rest) = v.split_at_checked(8).ok_or_else(bad)?;
    let count = u64::from_le_bytes(head.try_into().map_err(|_| bad())?);
    let count = usize::try_from(count).ok().filter(|&c| c >= 1 && c <= world).ok_or_else(bad)?;
    if rest.len() % 4 != 0 || rest.len() / 4 != count.min(MAX_NAMED_MISSING) {
        return Err(bad());
    }
    let ranks: Vec<usize> =
        rest.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize).collect();
    if ranks.iter().any(|&r| r >= world) || ranks.windows(2).any(|w| w[0] >= w[1]) {
        return Err(bad());
    }
    Ok(Missing { count, ranks })
}
