//! [`StoreServer`]: rank 0's side of the store. A listening socket, a thread per connection
//! (bounded in number, small stacks), and one table under a mutex, bounded in keys and bytes.
//!
//! At the connection limit a newcomer is not refused while some open connection is not a rank's:
//! the oldest such connection is evicted instead (see the [module](super) docs).

use super::frame::{
    FrameError, InFlight, OP_CLAIM, OP_GET, OP_SET, OP_WAIT_ALL, R_ERROR, R_EXISTS, R_MISSING, R_OK, R_VALUE,
    frame_head, read_frame, write_frame,
};
use super::{MAX_NAMED_MISSING, StoreLimits};
use crate::deadline::Deadline;
use crate::env::MAX_WORLD_SIZE;
use crate::{CommError, Result};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// Stack of a connection thread: `serve` needs a few KiB; the default 2 MiB would let a
/// connection flood reserve gigabytes.
const CONN_STACK: usize = 256 << 10;

/// Bytes a key costs beyond its key and value bytes (map entry, allocations), for the
/// store's byte limit.
const ENTRY_OVERHEAD: usize = 64;

/// The table and why it stopped waiting, if it did.
struct State {
    map: HashMap<Vec<u8>, Arc<[u8]>>,
    /// Key and value bytes plus [`ENTRY_OVERHEAD`] per key.
    bytes: usize,
    /// Set by [`StoreServer::close`]: waits for missing keys answer this instead.
    closed: Option<String>,
}

/// How long a newcomer at the connection limit waits for the connection it evicted to end.
const EVICT_WAIT: Duration = Duration::from_secs(1);

/// One open connection.
struct Conn {
    /// To shut it down when it is evicted or the server stops.
    handle: TcpStream,
    /// It won the claim of a rank's key ([`is_rank_key`]): it is never evicted.
    rank: bool,
    /// Set when it is evicted: its thread stops at its next step, and a wait it is in ends.
    evicted: Arc<AtomicBool>,
}

/// Open connections by id, that is in order of arrival.
struct Conns {
    next_id: u64,
    open: BTreeMap<u64, Conn>,
}

struct Shared {
    limits: StoreLimits,
    state: Mutex<State>,
    changed: Condvar,
    in_flight: InFlight,
    conns: Mutex<Conns>,
    conns_changed: Condvar,
    stop: AtomicBool,
}

/// Locks `m`; the data under these locks stays consistent if a holder panics, so recover it.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

type Reply = (u8, Arc<[u8]>);

fn empty() -> Arc<[u8]> {
    Arc::from(&[][..])
}

fn error_reply(why: impl std::fmt::Display) -> Reply {
    (R_ERROR, Arc::from(why.to_string().into_bytes()))
}

fn cost(key: &[u8], value: &[u8]) -> usize {
    key.len() + value.len() + ENTRY_OVERHEAD
}

/// The little-endian u64 at `at` in `v`, if there is one.
fn u64_at(v: &[u8], at: usize) -> Option<u64> {
    v.get(at..at + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes)
}

/// Whether `key` is `rank/{r}` for a rank `r` below `world_size`, written as the rendezvous
/// writes it (no sign, no leading zero): one key per rank, so at most `world_size` connections
/// ever win one.
fn is_rank_key(key: &[u8], world_size: usize) -> bool {
    let Some(digits) = key.strip_prefix(b"rank/") else { return false };
    std::str::from_utf8(digits)
        .ok()
        .and_then(|d| d.parse::<usize>().ok())
        .is_some_and(|r| r < world_size && r.to_string().as_bytes() == digits)
}

/// The reply to a request of a connection that was evicted while it waited.
fn evicted_reply() -> Reply {
    error_reply("this connection was closed to make room for another (the store's connections were full)")
}

/// How long a request asked the server to wait, at most `max`.
fn wait_of(value: &[u8], max: Duration) -> Deadline {
    Deadline::after(Duration::from_millis(u64_at(value, 0).unwrap_or(0)).min(max))
}

impl Shared {
    fn table(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    fn full(&self, st: &State) -> Reply {
        error_reply(format!(
            "the store is full: it holds {} keys in {} bytes (limits: {} keys, {} bytes)",
            st.map.len(),
            st.bytes,
            self.limits.max_keys,
            self.limits.max_bytes
        ))
    }

    /// SET (`overwrite`) or CLAIM, within the key and byte limits.
    fn put(&self, key: Vec<u8>, value: Vec<u8>, overwrite: bool) -> Reply {
        let mut st = self.table();
        let bytes = match st.map.get(&key) {
            Some(old) if !overwrite => return (R_EXISTS, old.clone()),
            Some(old) => st.bytes - cost(&key, old) + cost(&key, &value),
            None if st.map.len() >= self.limits.max_keys => return self.full(&st),
            None => st.bytes + cost(&key, &value),
        };
        if bytes > self.limits.max_bytes {
            return self.full(&st);
        }
        st.bytes = bytes;
        st.map.insert(key, Arc::from(value));
        drop(st);
        self.changed.notify_all();
        (R_OK, empty())
    }

    /// GET: the value, once it exists, until `deadline`, until the store is closed, or until
    /// this connection is `evicted`.
    fn get(&self, key: &[u8], deadline: Deadline, evicted: &AtomicBool) -> Reply {
        let mut st = self.table();
        loop {
            if let Some(v) = st.map.get(key) {
                return (R_VALUE, v.clone());
            }
            if let Some(reason) = &st.closed {
                return error_reply(reason);
            }
            if evicted.load(Ordering::Relaxed) {
                return evicted_reply();
            }
            let left = deadline.remaining();
            if left.is_zero() {
                return (R_MISSING, empty());
            }
            st = self.changed.wait_timeout(st, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// WAIT_ALL: waits until `{prefix}/{r}` exists for every `r < count`; at the deadline,
    /// answers how many are missing and which (the first [`MAX_NAMED_MISSING`]). Ends early when
    /// the store is closed or this connection `evicted`.
    fn wait_all(&self, prefix: &[u8], count: usize, deadline: Deadline, evicted: &AtomicBool) -> Reply {
        if count > MAX_WORLD_SIZE {
            return error_reply(format!("cannot wait for {count} keys (at most {MAX_WORLD_SIZE})"));
        }
        let mut key = prefix.to_vec();
        key.push(b'/');
        let base = key.len();
        let mut key_of = |r: usize| -> Vec<u8> {
            key.truncate(base);
            let _ = write!(key, "{r}");
            key.clone()
        };
        // Keys are never removed, so every rank below `next` is known present.
        let mut next = 0;
        let mut st = self.table();
        loop {
            while next < count && st.map.contains_key(&key_of(next)) {
                next += 1;
            }
            if next == count {
                return (R_OK, empty());
            }
            if let Some(reason) = &st.closed {
                return error_reply(reason);
            }
            if evicted.load(Ordering::Relaxed) {
                return evicted_reply();
            }
            let left = deadline.remaining();
            if left.is_zero() {
                let missing: Vec<usize> = (next..count).filter(|&r| !st.map.contains_key(&key_of(r))).collect();
                let mut v = (missing.len() as u64).to_le_bytes().to_vec();
                for &r in missing.iter().take(MAX_NAMED_MISSING) {
                    v.extend_from_slice(&(r as u32).to_le_bytes());
                }
                return (R_MISSING, Arc::from(v));
            }
            st = self.changed.wait_timeout(st, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// The reply to one request of connection `id`; `None` for an unknown op (the connection
    /// is dropped). A claim won of a rank's key makes the connection a rank's.
    fn handle(&self, id: u64, op: u8, key: Vec<u8>, value: Vec<u8>, evicted: &AtomicBool) -> Option<Reply> {
        Some(match op {
            OP_SET => self.put(key, value, true),
            OP_CLAIM if is_rank_key(&key, self.limits.world_size) => self.claim_rank(id, key, value),
            OP_CLAIM => self.put(key, value, false),
            OP_GET => self.get(&key, wait_of(&value, self.limits.max_wait), evicted),
            OP_WAIT_ALL => {
                let count = u64_at(&value, 8).and_then(|c| usize::try_from(c).ok())?;
                self.wait_all(&key, count, wait_of(&value, self.limits.max_wait), evicted)
            }
            _ => return None,
        })
    }

    /// A claim of a rank's key by connection `id`: the claim and the marking of the connection
    /// as a rank's are one step under the connections' lock (taken before the table's, as in
    /// [`make_room`](Self::make_room)), so a connection is never evicted between winning its
    /// rank and being counted as one; an evicted connection claims nothing.
    fn claim_rank(&self, id: u64, key: Vec<u8>, value: Vec<u8>) -> Reply {
        let mut conns = lock(&self.conns);
        match conns.open.get_mut(&id) {
            Some(c) if !c.evicted.load(Ordering::Relaxed) => {
                let reply = self.put(key, value, false);
                if reply.0 == R_OK {
                    c.rank = true;
                }
                reply
            }
            _ => error_reply("this connection was closed to make room for a rank's; connect again"),
        }
    }

    fn forget(&self, id: u64) {
        lock(&self.conns).open.remove(&id);
        self.conns_changed.notify_all();
    }

    /// Makes room for one more connection. Below the limit there is room; at it, the oldest
    /// connection that is not a rank's is evicted (shut down, its waits ended) and this waits,
    /// at most [`EVICT_WAIT`], for its thread to end. Else why there is no room: every
    /// connection is a rank's, or the room did not come in time.
    fn make_room(&self) -> std::result::Result<(), String> {
        let limit = self.limits.max_connections;
        let deadline = Deadline::after(EVICT_WAIT);
        let mut conns = lock(&self.conns);
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return Err("the store has stopped".into());
            }
            if conns.open.len() < limit {
                return Ok(());
            }
            // One eviction at a time: the evicted thread leaves within moments.
            if !conns.open.values().any(|c| c.evicted.load(Ordering::Relaxed)) {
                let Some(victim) = conns.open.values().find(|c| !c.rank) else {
                    return Err(format!("the store has too many connections (limit {limit}), every one a rank's"));
                };
                victim.evicted.store(true, Ordering::Relaxed);
                let _ = victim.handle.shutdown(Shutdown::Both);
                // Taking the table's lock orders the flag before any wait that checks it under
                // that lock, so the notification below cannot be missed.
                drop(self.table());
                self.changed.notify_all();
            }
            let left = deadline.remaining();
            if left.is_zero() {
                return Err(format!("the store has too many connections (limit {limit}) and none left in time"));
            }
            conns = self.conns_changed.wait_timeout(conns, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

/// The store's server. Dropping it stops accepting, answers every waiting request and closes
/// every connection.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StoreServer({}, {} connections)", self.addr, self.connections())
    }
}

impl StoreServer {
    /// Binds `addr` and serves in background threads, with the default [`StoreLimits`].
    ///
    /// Errors: [`CommError::Rendezvous`] naming the address when it is in use or cannot be bound.
    pub fn start(addr: &str) -> Result<StoreServer> {
        Self::start_with(addr, StoreLimits::default())
    }

    /// [`start`](Self::start) with explicit limits.
    pub fn start_with(addr: &str, limits: StoreLimits) -> Result<StoreServer> {
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
        let shared = Arc::new(Shared {
            in_flight: InFlight::new(limits.max_in_flight_bytes),
            limits,
            state: Mutex::new(State { map: HashMap::new(), bytes: 0, closed: None }),
            changed: Condvar::new(),
            conns: Mutex::new(Conns { next_id: 0, open: BTreeMap::new() }),
            conns_changed: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let sh = shared.clone();
        std::thread::Builder::new()
            .name("tp-store-accept".into())
            .spawn(move || accept_loop(listener, sh))
            .map_err(|e| CommError::Rendezvous(format!("cannot start the store thread: {e}")))?;
        Ok(StoreServer { addr: local, shared })
    }

    /// The bound address (useful with port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops waiting: every waiting and later request for a key that does not exist is answered
    /// with `reason` at once (keys that exist are still served). Rank 0 calls this when it gives
    /// up or leaves, so that the others learn why without waiting for their own deadlines.
    pub fn close(&self, reason: &str) {
        self.shared.table().closed.get_or_insert_with(|| reason.to_string());
        self.shared.changed.notify_all();
    }

    /// Number of open client connections.
    pub fn connections(&self) -> usize {
        lock(&self.shared.conns).open.len()
    }

    /// Number of open connections that are ranks': each won the claim of `rank/{r}` for a rank
    /// `r` below [`StoreLimits::world_size`].
    pub fn rank_connections(&self) -> usize {
        lock(&self.shared.conns).open.values().filter(|c| c.rank).count()
    }

    /// Waits until at most `n` client connections are open, or until `deadline`; returns
    /// whether that happened.
    pub fn wait_for_connections(&self, n: usize, deadline: impl Into<Deadline>) -> bool {
        self.wait_until(deadline.into(), |conns| conns.open.len() <= n)
    }

    /// Waits until at most `n` ranks' connections ([`rank_connections`](Self::rank_connections))
    /// are open, or until `deadline`; returns whether that happened. Other connections (a
    /// stray client's) do not hold it up.
    pub fn wait_for_rank_connections(&self, n: usize, deadline: impl Into<Deadline>) -> bool {
        self.wait_until(deadline.into(), |conns| conns.open.values().filter(|c| c.rank).count() <= n)
    }

    fn wait_until(&self, deadline: Deadline, done: impl Fn(&Conns) -> bool) -> bool {
        let mut conns = lock(&self.shared.conns);
        loop {
            if done(&conns) {
                return true;
            }
            let left = deadline.remaining();
            if left.is_zero() {
                return false;
            }
            conns = self.shared.conns_changed.wait_timeout(conns, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.close("the store has stopped (rank 0 left the rendezvous)");
        self.shared.stop.store(true, Ordering::Relaxed);
        for conn in lock(&self.shared.conns).open.values() {
            let _ = conn.handle.shutdown(Shutdown::Both);
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    while !shared.stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((conn, _)) => admit(conn, &shared),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(5)),
            // Out of descriptors, or an aborted connection: keep serving the others.
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Tells a connection it is refused (one non-blocking write of an error frame) and closes it.
fn refuse(conn: &TcpStream, why: &str) {
    if conn.set_nonblocking(true).is_ok()
        && let Ok(frame) = frame_head(R_ERROR, &[], why.as_bytes(), true)
    {
        let _ = (&*conn).write(&frame);
    }
    let _ = conn.shutdown(Shutdown::Write);
}

/// Starts serving `conn` on its own thread, within the connection limit: at the limit, the
/// oldest connection that is not a rank's gives way ([`Shared::make_room`]); when all are
/// ranks', `conn` is refused.
/// Removes connection `id` from the open ones when dropped.
struct Forget<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        self.shared.forget(self.id);
    }
}

fn admit(conn: TcpStream, shared: &Arc<Shared>) {
    let _ = conn.set_nonblocking(false);
    let _ = conn.set_nodelay(true);
    if let Err(why) = shared.make_room() {
        return refuse(&conn, &why);
    }
    let mut conns = lock(&shared.conns);
    // The server is being dropped: its sweep of the connections (under this lock, after `stop`
    // is set) may already have run, so a connection added now would outlive it.
    if shared.stop.load(Ordering::Relaxed) {
        drop(conns);
        return refuse(&conn, "the store has stopped");
    }
    // Only this thread adds connections, so the room made is still there; checked all the same.
    if conns.open.len() >= shared.limits.max_connections {
        drop(conns);
        return refuse(&conn, &format!("the store has too many connections (limit {})", shared.limits.max_connections));
    }
    let Ok(handle) = conn.try_clone() else {
        drop(conns);
        return refuse(&conn, "the store cannot take another connection");
    };
    let id = conns.next_id;
    conns.next_id += 1;
    let evicted = Arc::new(AtomicBool::new(false));
    conns.open.insert(id, Conn { handle, rank: false, evicted: evicted.clone() });
    drop(conns);
    let sh = shared.clone();
    let spawned = std::thread::Builder::new().name("tp-store-conn".into()).stack_size(CONN_STACK).spawn(move || {
        // Forgotten however `serve` ends, a panic included (a rank's connection left behind
        // would make rank 0's exit wait out its timeout).
        let _forget = Forget { shared: &sh, id };
        serve(conn, &sh, id, &evicted);
    });
    if spawned.is_err() {
        // The closure, and with it the connection, is gone; tell the client through the handle.
        if let Some(c) = lock(&shared.conns).open.remove(&id) {
            refuse(&c.handle, "the store cannot start a thread for another connection");
        }
        shared.conns_changed.notify_all();
    }
}

/// Serves connection `id` until it closes, misbehaves or is `evicted`. A new connection must
/// send its first request within the frame timeout ([`StoreLimits::frame_timeout`]); afterwards
/// it may idle, but each request, once begun, must arrive within it, and each reply must be
/// taken within it.
fn serve(mut conn: TcpStream, sh: &Shared, id: u64, evicted: &AtomicBool) {
    let within = sh.limits.frame_timeout;
    let mut start_by = Some(Deadline::after(within));
    loop {
        let frame =
            read_frame(&mut conn, start_by, || Deadline::after(within), sh.limits.max_value_bytes, Some(&sh.in_flight));
        start_by = None;
        if evicted.load(Ordering::Relaxed) {
            return;
        }
        let (op, value) = match frame {
            Ok(Some(f)) => match sh.handle(id, f.op, f.key, f.value, evicted) {
                Some(reply) => reply,
                None => return, // an unknown op: not a tp client
            },
            Err(FrameError::Refused(why)) => error_reply(why),
            // Closed, timed out, or garbage: drop this connection only.
            Ok(None) | Err(_) => return,
        };
        if write_frame(&mut conn, op, &[], &value, Deadline::after(within)).is_err() {
            return;
        }
    }
}
