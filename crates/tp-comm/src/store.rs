//! A small TCP key-value store for rendezvous, in the spirit of torch.distributed's TCPStore.
//!
//! Rank 0 serves it at `MASTER_ADDR:MASTER_PORT`; every rank (rank 0 included) talks to it as a
//! client. Requests and replies are frames: magic `TPS1`, an op byte, a length-prefixed key and a
//! length-prefixed value (little-endian u32 lengths; keys up to 4 KiB, values up to 16 MiB).
//! Anything else on the socket is a protocol error: the server drops that connection and keeps
//! serving; a client returns [`CommError::Rendezvous`]. Every client call has a deadline.

use crate::{CommError, Result};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const MAGIC: &[u8; 4] = b"TPS1";
const MAX_KEY: usize = 4096;
const MAX_VALUE: usize = 16 << 20;

const OP_SET: u8 = 1;
const OP_GET: u8 = 2; // value: u64 LE milliseconds to wait for the key
const OP_CLAIM: u8 = 3; // set if absent
const R_OK: u8 = 10;
const R_VALUE: u8 = 11;
const R_MISSING: u8 = 12;
const R_EXISTS: u8 = 13;

fn protocol(why: impl std::fmt::Display) -> CommError {
    CommError::Rendezvous(format!("protocol error: {why}"))
}

fn write_frame(s: &mut TcpStream, op: u8, key: &[u8], value: &[u8]) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(13 + key.len() + value.len());
    buf.extend_from_slice(MAGIC);
    buf.push(op);
    buf.extend_from_slice(&(key.len() as u32).to_le_bytes());
    buf.extend_from_slice(key);
    buf.extend_from_slice(&(value.len() as u32).to_le_bytes());
    buf.extend_from_slice(value);
    s.write_all(&buf)
}

/// One decoded frame: op, key, value.
type Frame = (u8, Vec<u8>, Vec<u8>);

/// Reads one frame. `Ok(None)` on a clean close before the first byte.
fn read_frame(s: &mut TcpStream) -> std::result::Result<Option<Frame>, String> {
    let mut head = [0u8; 5];
    match s.read(&mut head[..1]) {
        Ok(0) => return Ok(None),
        Ok(_) => {}
        Err(e) => return Err(format!("read failed: {e}")),
    }
    s.read_exact(&mut head[1..]).map_err(|e| format!("truncated frame: {e}"))?;
    if &head[..4] != MAGIC {
        return Err(format!("bad magic {:02x?} (not a tp rendezvous peer?)", &head[..4]));
    }
    let mut read_blob = |limit: usize, what: &str| -> std::result::Result<Vec<u8>, String> {
        let mut len = [0u8; 4];
        s.read_exact(&mut len).map_err(|e| format!("truncated {what} length: {e}"))?;
        let len = u32::from_le_bytes(len) as usize;
        if len > limit {
            return Err(format!("{what} of {len} bytes exceeds the {limit}-byte limit"));
        }
        let mut v = vec![0u8; len];
        s.read_exact(&mut v).map_err(|e| format!("truncated {what}: {e}"))?;
        Ok(v)
    };
    let key = read_blob(MAX_KEY, "key")?;
    let value = read_blob(MAX_VALUE, "value")?;
    Ok(Some((head[4], key, value)))
}

#[derive(Default)]
struct Table {
    map: Mutex<HashMap<Vec<u8>, Vec<u8>>>,
    changed: Condvar,
}

/// The store's server: a listening socket and a thread per connection. Stops accepting when
/// dropped.
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl StoreServer {
    /// Binds `addr` and serves in background threads.
    ///
    /// Errors: [`CommError::Rendezvous`] naming the address when it is in use or cannot be bound.
    pub fn start(addr: &str) -> Result<StoreServer> {
        let listener = TcpListener::bind(addr).map_err(|e| {
            let hint = if e.kind() == std::io::ErrorKind::AddrInUse {
                " (port in use: another job or a stale rank 0? pick another MASTER_PORT)"
            } else {
                ""
            };
            CommError::Rendezvous(format!("cannot listen on {addr}: {e}{hint}"))
        })?;
        let local = listener.local_addr().map_err(|e| CommError::Rendezvous(format!("local_addr: {e}")))?;
        listener.set_nonblocking(true).map_err(|e| CommError::Rendezvous(format!("set_nonblocking: {e}")))?;
        let stop = Arc::new(AtomicBool::new(false));
        let table = Arc::new(Table::default());
        let stop2 = stop.clone();
        std::thread::Builder::new()
            .name("tp-store-accept".into())
            .spawn(move || accept_loop(listener, table, stop2))
            .map_err(|e| CommError::Rendezvous(format!("cannot start the store thread: {e}")))?;
        Ok(StoreServer { addr: local, stop })
    }

    /// The bound address (useful with port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn accept_loop(listener: TcpListener, table: Arc<Table>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((conn, _)) => {
                let table = table.clone();
                let _ = std::thread::Builder::new().name("tp-store-conn".into()).spawn(move || serve(conn, table));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(5)),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Serves one connection until it closes or misbehaves.
fn serve(mut conn: TcpStream, table: Arc<Table>) {
    let _ = conn.set_nonblocking(false);
    let _ = conn.set_nodelay(true);
    loop {
        let (op, key, value) = match read_frame(&mut conn) {
            Ok(Some(f)) => f,
            Ok(None) | Err(_) => return, // closed, or garbage: drop this connection only
        };
        let reply = match op {
            OP_SET => {
                table.map.lock().unwrap_or_else(|e| e.into_inner()).insert(key, value);
                table.changed.notify_all();
                (R_OK, Vec::new())
            }
            OP_CLAIM => {
                let mut map = table.map.lock().unwrap_or_else(|e| e.into_inner());
                let reply = match map.get(&key) {
                    Some(existing) => (R_EXISTS, existing.clone()),
                    None => {
                        map.insert(key, value);
                        (R_OK, Vec::new())
                    }
                };
                drop(map);
                table.changed.notify_all();
                reply
            }
            OP_GET => {
                let wait_ms = value.get(..8).and_then(|b| b.try_into().ok()).map_or(0, u64::from_le_bytes);
                let deadline = Instant::now() + Duration::from_millis(wait_ms.min(24 * 3600 * 1000));
                let mut map = table.map.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if let Some(v) = map.get(&key) {
                        break (R_VALUE, v.clone());
                    }
                    let now = Instant::now();
                    if now >= deadline {
                        break (R_MISSING, Vec::new());
                    }
                    map = table.changed.wait_timeout(map, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
                }
            }
            _ => return, // unknown op: a protocol violation
        };
        if write_frame(&mut conn, reply.0, &[], &reply.1).is_err() {
            return;
        }
    }
}

/// A client connection to the store.
pub struct StoreClient {
    conn: TcpStream,
    addr: String,
}

/// What `claim` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The key was free and now holds our value.
    Won,
    /// The key was already held, with this value.
    Taken(Vec<u8>),
}

impl StoreClient {
    /// Connects to `addr`, retrying until `deadline` (rank 0 may not be listening yet).
    pub fn connect(addr: &str, deadline: Instant) -> Result<StoreClient> {
        let mut last = String::from("no attempt");
        loop {
            let resolved: Vec<SocketAddr> = addr.to_socket_addrs().map(|a| a.collect()).unwrap_or_default();
            if resolved.is_empty() {
                return Err(CommError::Rendezvous(format!("cannot resolve {addr}")));
            }
            for a in &resolved {
                let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10));
                match TcpStream::connect_timeout(a, left.min(Duration::from_secs(5))) {
                    Ok(conn) => {
                        let _ = conn.set_nodelay(true);
                        return Ok(StoreClient { conn, addr: addr.to_string() });
                    }
                    Err(e) => last = e.to_string(),
                }
            }
            if Instant::now() >= deadline {
                return Err(CommError::Rendezvous(format!(
                    "cannot reach the store at {addr} before the deadline ({last}); is rank 0 running?"
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn request(&mut self, op: u8, key: &str, value: &[u8], deadline: Instant) -> Result<(u8, Vec<u8>)> {
        if key.len() > MAX_KEY || value.len() > MAX_VALUE {
            return Err(CommError::Rendezvous(format!("key or value too large for the store ({key:?})")));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        // The server answers a GET at its own deadline; leave the socket a margin beyond it.
        let io_timeout = left + Duration::from_secs(5);
        let io = |e: std::io::Error| CommError::Rendezvous(format!("store at {}: {e}", self.addr));
        self.conn.set_read_timeout(Some(io_timeout)).map_err(io)?;
        self.conn.set_write_timeout(Some(io_timeout)).map_err(io)?;
        write_frame(&mut self.conn, op, key.as_bytes(), value).map_err(io)?;
        match read_frame(&mut self.conn) {
            Ok(Some((op, _, v))) => Ok((op, v)),
            Ok(None) => Err(CommError::Rendezvous(format!("store at {} closed the connection", self.addr))),
            Err(why) => Err(protocol(format!("from {}: {why}", self.addr))),
        }
    }

    /// Sets `key` to `value`.
    pub fn set(&mut self, key: &str, value: &[u8], deadline: Instant) -> Result<()> {
        match self.request(OP_SET, key, value, deadline)? {
            (R_OK, _) => Ok(()),
            (op, _) => Err(protocol(format!("unexpected reply {op} to set"))),
        }
    }

    /// Sets `key` only if it is absent.
    pub fn claim(&mut self, key: &str, value: &[u8], deadline: Instant) -> Result<Claim> {
        match self.request(OP_CLAIM, key, value, deadline)? {
            (R_OK, _) => Ok(Claim::Won),
            (R_EXISTS, v) => Ok(Claim::Taken(v)),
            (op, _) => Err(protocol(format!("unexpected reply {op} to claim"))),
        }
    }

    /// The value of `key`, waiting for it until `deadline`; `Ok(None)` if it never appeared.
    pub fn get(&mut self, key: &str, deadline: Instant) -> Result<Option<Vec<u8>>> {
        let wait = deadline.saturating_duration_since(Instant::now()).as_millis() as u64;
        match self.request(OP_GET, key, &wait.to_le_bytes(), deadline)? {
            (R_VALUE, v) => Ok(Some(v)),
            (R_MISSING, _) => Ok(None),
            (op, _) => Err(protocol(format!("unexpected reply {op} to get"))),
        }
    }
}
