//! [`LocalGroup`]: `world_size` ranks as threads of one process.
//!
//! Each collective is one exchange: every rank deposits its tensor in a shared slot; the last to
//! arrive publishes all deposits at once and wakes the others (a waiting rank spins briefly
//! before it parks, so small collectives never wait for a thread wake-up); each rank then takes
//! its result from them (gather = `cat`). Host tensors pass by reference-counted clone; CUDA
//! tensors stay on their device for gathers and broadcasts (ranks may share one GPU:
//! device-to-device copies) and are reduced through the host.
//!
//! Reductions of host tensors run on all the ranks' threads at once: the output is cut into
//! chunks that the ranks claim (a reduce-scatter), each chunk reduced in rank order as
//! [`crate::reduce`] defines, into one shared buffer that every rank then receives (the
//! all-gather is the sharing of that buffer). Small ones are reduced whole by every rank on its
//! own, with no second synchronisation. Either way every element is computed in the same fixed
//! order, so all ranks agree bit for bit.
//!
//! Failure: every wait has a deadline ([`LocalGroup::timeout`]). A rank that times out, panics
//! while holding its handle, or calls [`LocalGroup::abort`] poisons the group; every other rank's
//! current and later collectives return [`CommError::Poisoned`] at once, never hang.

use crate::communicator::{Communicator, ReduceOp};
use crate::deadline::{Deadline, MAX_TIMEOUT};
use crate::env::MAX_WORLD_SIZE;
use crate::error::{CommError, Result, tensor_err};
use crate::work::{PendingWork, Work};
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};
use tp_core::{DType, Device, Element, Tensor, TensorShard};

mod finish;
mod p2p;
use finish::Finish;

/// Default deadline of every collective.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// How long a waiting rank spins (busy, then yielding its core) before it parks on the
/// condition variable; busy only while there are no more ranks than cores.
const SPIN: Duration = Duration::from_micros(50);
const SPIN_BUSY: Duration = Duration::from_micros(10);
/// Reductions of fewer bytes are computed whole by every rank (no second synchronisation).
const SPLIT_MIN_BYTES: usize = 128 << 10;
/// Bytes of output per claimed chunk of a split reduction.
const CHUNK_BYTES: usize = 64 << 10;

/// What a rank brings to one exchange: which collective (with its arguments) and its tensor.
#[derive(Clone)]
struct Deposit {
    call: String,
    tensor: Tensor,
}

/// One completed exchange: every rank's deposit, and the reduction of them (all ranks made the
/// same call): shared by the ranks that compute it together (host tensors) or computed once by
/// whichever rank asks first (device tensors).
struct Round {
    deposits: Vec<Deposit>,
    reduced: OnceLock<Result<Tensor>>,
    split: OnceLock<Split>,
}

impl Round {
    fn new(deposits: Vec<Deposit>) -> Round {
        Round { deposits, reduced: OnceLock::new(), split: OnceLock::new() }
    }
}

/// A reduction computed by all ranks together: an output buffer of `n` elements of `dtype`
/// (allocated, not yet initialised), cut into `chunks` chunks of `chunk` elements that ranks
/// claim through `next` and count in `done` once written. The rank that writes the last chunk
/// turns the buffer into the result tensor.
struct Split {
    dtype: DType,
    n: usize,
    chunk: usize,
    chunks: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    buf: *mut u8,
    cap: usize,
    /// Set when `buf` became the result's storage (so `Drop` must not free it).
    taken: AtomicBool,
    result: OnceLock<Result<Tensor>>,
}

// SAFETY: `buf` is written only through disjoint chunks, each claimed by exactly one rank
// through `next`, and read (turned into the result) only by the rank whose `done` increment
// completes the count, after every writer's Release increment; everything else is atomics and
// a `OnceLock`.
unsafe impl Send for Split {}
// SAFETY: as above.
unsafe impl Sync for Split {}

impl Split {
    fn new<T: tp_core::Storable>(n: usize) -> Split {
        let chunk = (CHUNK_BYTES / std::mem::size_of::<T>()).max(1);
        let mut v = std::mem::ManuallyDrop::new(Vec::<T>::with_capacity(n));
        Split {
            dtype: T::DTYPE,
            n,
            chunk,
            chunks: n.div_ceil(chunk),
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            buf: v.as_mut_ptr().cast(),
            cap: v.capacity(),
            taken: AtomicBool::new(false),
            result: OnceLock::new(),
        }
    }
}

impl Drop for Split {
    fn drop(&mut self) {
        if !*self.taken.get_mut() {
            tp_core::with_storable!(self.dtype, T => {
                // SAFETY: `buf`/`cap` came from a `Vec<T>` of this dtype that was never handed
                // on (`taken` is false); length 0 drops no (possibly uninitialised) element.
                drop(unsafe { Vec::<T>::from_raw_parts(self.buf.cast(), 0, self.cap) });
            });
        }
    }
}

/// An exchange still being filled, or complete and not yet taken by every rank.
struct Open {
    slots: Vec<Option<Deposit>>,
    filled: usize,
    done: Option<Arc<Round>>,
    /// Ranks that have taken `done` (or dropped their claim on it).
    taken: usize,
}

struct State {
    /// `rounds[i]` is exchange number `base + i`. Rank `r`'s next collective goes into exchange
    /// `next[r]`, so a rank may have several in flight (async work) and they pair up across
    /// ranks in issue order. Exchanges complete in order: the `n`-th needs every rank's `n`-th
    /// deposit, which each rank makes after its earlier ones.
    base: u64,
    rounds: std::collections::VecDeque<Open>,
    next: Vec<u64>,
    poisoned: Option<String>,
    /// Ranks parked on `arrived` (so a publisher knows whether it must wake anyone).
    sleepers: usize,
}

struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    arrived: Condvar,
    /// Exchanges completed so far (in order), readable without the lock by spinning ranks.
    completed: AtomicU64,
    /// Whether `State::poisoned` is set, readable without the lock.
    poisoned: AtomicBool,
    /// Point-to-point messages ([`p2p`]), apart from the collectives' exchanges.
    mailboxes: p2p::Mailboxes,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock can only come from this module's own code; the state
        // stays consistent, so recover it rather than propagate the panic.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn poison(&self, reason: String) {
        let mut st = self.lock();
        st.poisoned.get_or_insert(reason);
        self.poisoned.store(true, Ordering::Release);
        drop(st);
        self.arrived.notify_all();
        self.mailboxes.wake();
    }

    /// Wakes the parked ranks, if any.
    fn wake(&self) {
        let st = self.lock();
        if st.sleepers > 0 {
            drop(st);
            self.arrived.notify_all();
        }
    }

    /// Spins for up to [`SPIN`] until `done()` or the group is poisoned; returns `done()`.
    /// The first [`SPIN_BUSY`] keeps the core when every rank can have one; the rest yields it
    /// between checks, so ranks that outnumber the cores still get to run.
    fn spin(&self, done: impl Fn() -> bool) -> bool {
        let start = Instant::now();
        let busy = if self.world <= cores() { SPIN_BUSY } else { Duration::ZERO };
        for i in 0u32.. {
            if done() {
                return true;
            }
            if self.poisoned.load(Ordering::Acquire) {
                return done();
            }
            if i % 32 == 0 {
                let t = start.elapsed();
                if t > SPIN {
                    return done();
                }
                if t > busy {
                    std::thread::yield_now();
                    continue;
                }
            }
            std::hint::spin_loop();
        }
        done()
    }
}

/// Takes completed exchange `ticket` (counting this rank as having taken it) and frees the
/// exchanges every rank has taken.
fn take(st: &mut State, ticket: u64) -> Option<Arc<Round>> {
    let world = st.next.len();
    let index = usize::try_from(ticket.checked_sub(st.base)?).ok()?;
    let open = st.rounds.get_mut(index)?;
    let round = open.done.clone()?;
    open.taken += 1;
    collect(st, world);
    Some(round)
}

/// Drops the oldest exchanges once all `world` ranks have taken them.
fn collect(st: &mut State, world: usize) {
    while st.rounds.front().is_some_and(|o| o.done.is_some() && o.taken >= world) {
        st.rounds.pop_front();
        st.base += 1;
    }
}

/// The machine's cores (available parallelism), read once.
fn cores() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// One rank's handle on a group of threads. Create all of them with [`LocalGroup::new`] and move
/// one into each thread.
pub struct LocalGroup {
    m: Member,
}

/// One rank's view of the shared state: what a [`LocalGroup`] handle and its pending
/// [`Work`] use.
#[derive(Clone)]
struct Member {
    rank: usize,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for LocalGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LocalGroup(rank {} of {})", self.m.rank, self.m.shared.world)
    }
}

impl LocalGroup {
    /// Handles for ranks `0..world_size`, in rank order, with the default deadline.
    pub fn new(world_size: usize) -> Result<Vec<LocalGroup>> {
        Self::with_timeout(world_size, DEFAULT_TIMEOUT)
    }

    /// Handles for ranks `0..world_size`; every collective fails after `timeout` if some rank
    /// has not arrived.
    ///
    /// Errors: [`CommError::ZeroWorldSize`]; [`CommError::Limit`] for more than
    /// [`MAX_WORLD_SIZE`](crate::MAX_WORLD_SIZE) ranks or a timeout over
    /// [`MAX_TIMEOUT`](crate::MAX_TIMEOUT).
    pub fn with_timeout(world_size: usize, timeout: Duration) -> Result<Vec<LocalGroup>> {
        const OP: &str = "LocalGroup::new";
        if world_size == 0 {
            return Err(CommError::ZeroWorldSize { op: OP });
        }
        if world_size > MAX_WORLD_SIZE {
            let why = format!("world_size {world_size} exceeds the maximum of {MAX_WORLD_SIZE} ranks");
            return Err(CommError::Limit { op: OP, why });
        }
        if timeout > MAX_TIMEOUT {
            let why = format!("timeout {timeout:?} exceeds the maximum of {MAX_TIMEOUT:?} (7 days)");
            return Err(CommError::Limit { op: OP, why });
        }
        let shared = Arc::new(Shared {
            world: world_size,
            timeout,
            state: Mutex::new(State {
                base: 0,
                rounds: std::collections::VecDeque::new(),
                next: vec![0; world_size],
                poisoned: None,
                sleepers: 0,
            }),
            arrived: Condvar::new(),
            completed: AtomicU64::new(0),
            poisoned: AtomicBool::new(false),
            mailboxes: p2p::Mailboxes::default(),
        });
        Ok((0..world_size).map(|rank| LocalGroup { m: Member { rank, shared: shared.clone() } }).collect())
    }

    /// The deadline of every collective.
    pub fn timeout(&self) -> Duration {
        self.m.shared.timeout
    }
}

impl Member {
    /// Deposits `tensor` for collective `call` into this rank's next exchange and returns its
    /// number; publishes the exchange when this deposit completes it.
    fn deposit(&self, op: &'static str, call: String, tensor: Tensor) -> Result<u64> {
        let sh = &self.shared;
        let mut st = sh.lock();
        if let Some(reason) = &st.poisoned {
            return Err(CommError::Poisoned { op: op.into(), reason: reason.clone() });
        }
        let ticket = st.next[self.rank];
        st.next[self.rank] += 1;
        let index = (ticket - st.base) as usize;
        while st.rounds.len() <= index {
            let world = sh.world;
            st.rounds.push_back(Open { slots: vec![None; world], filled: 0, done: None, taken: 0 });
        }
        let open = &mut st.rounds[index];
        open.slots[self.rank] = Some(Deposit { call, tensor });
        open.filled += 1;
        if open.filled == sh.world {
            let all: Vec<Deposit> = open.slots.iter_mut().filter_map(Option::take).collect();
            open.done = Some(Arc::new(Round::new(all)));
            // Exchanges complete in order (see `State`), so this one is number `completed`.
            sh.completed.store(ticket + 1, Ordering::Release);
            if st.sleepers > 0 {
                drop(st);
                sh.arrived.notify_all();
            }
        }
        Ok(ticket)
    }

    /// Exchange `ticket` once every rank has deposited into it, or an error at `deadline` or
    /// when the group is poisoned. Taking it releases this rank's claim on it.
    fn await_round(&self, op: &'static str, ticket: u64, deadline: Instant) -> Result<Arc<Round>> {
        let sh = &self.shared;
        // Spin without the lock first: the others usually arrive within microseconds.
        sh.spin(|| sh.completed.load(Ordering::Acquire) > ticket);
        let mut st = sh.lock();
        loop {
            if sh.completed.load(Ordering::Acquire) > ticket {
                // A completed exchange stays until every rank has taken it, this one included.
                return take(&mut st, ticket).ok_or_else(|| CommError::Mismatch {
                    op: op.into(),
                    why: format!("rank {}: exchange {ticket} was already taken", self.rank),
                });
            }
            if let Some(reason) = &st.poisoned {
                return Err(CommError::Poisoned { op: op.into(), reason: reason.clone() });
            }
            let now = Instant::now();
            if now >= deadline {
                let index = ticket.saturating_sub(st.base) as usize;
                let missing: Vec<usize> = match st.rounds.get(index) {
                    Some(open) => open.slots.iter().enumerate().filter(|(_, s)| s.is_none()).map(|(r, _)| r).collect(),
                    None => Vec::new(),
                };
                let reason = format!(
                    "rank {} timed out after {:?} in {op} waiting for rank(s) {missing:?}",
                    self.rank, sh.timeout
                );
                st.poisoned.get_or_insert(reason);
                sh.poisoned.store(true, Ordering::Release);
                drop(st);
                sh.arrived.notify_all();
                sh.mailboxes.wake();
                return Err(CommError::Timeout { op: op.into(), rank: self.rank, missing, waited: sh.timeout });
            }
            st.sleepers += 1;
            st = sh.arrived.wait_timeout(st, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
            st.sleepers -= 1;
        }
    }

    /// Gives up this rank's claim on exchange `ticket` without taking it (a dropped `Work`).
    fn release(&self, ticket: u64) {
        let mut st = self.shared.lock();
        if ticket >= st.base {
            let index = (ticket - st.base) as usize;
            if let Some(open) = st.rounds.get_mut(index) {
                open.taken += 1;
            }
            collect(&mut st, self.shared.world);
        }
    }

    /// A deposit and the wait for its exchange: one blocking collective's rendezvous.
    fn exchange(&self, op: &'static str, call: String, tensor: Tensor) -> Result<Arc<Round>> {
        let deadline = Deadline::after(self.shared.timeout).instant();
        let ticket = self.deposit(op, call, tensor)?;
        self.await_round(op, ticket, deadline)
    }

    /// Runs one exchange and checks that every rank called the same thing.
    fn collective(&self, op: &'static str, call: String, tensor: &Tensor) -> Result<Arc<Round>> {
        let round = self.exchange(op, call, tensor.clone())?;
        let all = &round.deposits;
        if let Some((r, d)) = all.iter().enumerate().find(|(_, d)| d.call != all[0].call) {
            return Err(CommError::Mismatch {
                op: op.into(),
                why: format!("rank 0 called {} but rank {r} called {}", all[0].call, d.call),
            });
        }
        Ok(round)
    }

    /// The round's reduction: host tensors on every rank's thread at once (see the module docs),
    /// device tensors through the host, computed by the first rank to ask.
    fn reduced(&self, op: &'static str, round: &Round, red: ReduceOp) -> Result<Tensor> {
        let parts: Vec<&Tensor> = round.deposits.iter().map(|d| &d.tensor).collect();
        if parts.iter().any(|p| p.device() != Device::Cpu) {
            return round.reduced.get_or_init(|| crate::reduce::reduce(op, &parts, red)).clone();
        }
        crate::reduce::check(op, &parts)?;
        if parts.len() == 1 {
            return Ok(parts[0].clone()); // x op nothing = x, exactly
        }
        let (n, dtype) = (parts[0].numel(), parts[0].dtype());
        if n * dtype.size_in_bytes() < SPLIT_MIN_BYTES {
            return crate::reduce::reduce(op, &parts, red);
        }
        let split = round.split.get_or_init(|| tp_core::with_storable!(dtype, T => Split::new::<T>(n)));
        tp_core::with_dtype!(dtype, T => self.reduce_chunks::<T>(op, &parts, split, red))?;
        self.wait_result(op, split)
    }

    /// Claims and reduces chunks of `split` until none is left; the rank that completes the last
    /// one publishes the result.
    fn reduce_chunks<T: Element>(
        &self,
        op: &'static str,
        parts: &[&Tensor],
        split: &Split,
        red: ReduceOp,
    ) -> Result<()> {
        let inputs = parts.iter().map(|p| p.as_slice::<T>()).collect::<tp_core::Result<Vec<&[T]>>>();
        let inputs = inputs.map_err(tensor_err(op))?;
        loop {
            let c = split.next.fetch_add(1, Ordering::Relaxed);
            if c >= split.chunks {
                return Ok(());
            }
            let range = c * split.chunk..((c + 1) * split.chunk).min(split.n);
            // SAFETY: chunk `c` (claimed by this rank alone through `next`) is the elements
            // `range` of the `n`-element buffer; it is written here as uninitialised memory and
            // read by nobody until every chunk is done.
            let out = unsafe {
                std::slice::from_raw_parts_mut(split.buf.cast::<MaybeUninit<T>>().add(range.start), range.len())
            };
            crate::reduce::reduce_range(&inputs, range, red, out);
            if split.done.fetch_add(1, Ordering::AcqRel) + 1 == split.chunks {
                split.taken.store(true, Ordering::Relaxed);
                // SAFETY: every chunk's writer incremented `done` (Release) after writing, and
                // this rank's AcqRel increment completed the count: all `n` elements are
                // initialised and no one writes them again. `buf`/`cap` are the `Vec<T>`'s own,
                // handed on exactly once (`taken`).
                let v = unsafe { Vec::<T>::from_raw_parts(split.buf.cast(), split.n, split.cap) };
                let _ = split.result.set(Tensor::from_vec(v, parts[0].dims(), &Device::Cpu).map_err(tensor_err(op)));
                self.shared.wake();
            }
        }
    }

    /// Waits (spinning first) until the rank that wrote the last chunk has published the result.
    fn wait_result(&self, op: &'static str, split: &Split) -> Result<Tensor> {
        let sh = &self.shared;
        if !sh.spin(|| split.result.get().is_some()) {
            let deadline = Instant::now() + sh.timeout;
            let mut st = sh.lock();
            while split.result.get().is_none() {
                if let Some(reason) = &st.poisoned {
                    return Err(CommError::Poisoned { op: op.into(), reason: reason.clone() });
                }
                let now = Instant::now();
                if now >= deadline {
                    let reason = format!(
                        "rank {} timed out after {:?} in {op} waiting for the reduction",
                        self.rank, sh.timeout
                    );
                    st.poisoned.get_or_insert(reason.clone());
                    sh.poisoned.store(true, Ordering::Release);
                    drop(st);
                    sh.arrived.notify_all();
                    sh.mailboxes.wake();
                    return Err(CommError::Poisoned { op: op.into(), reason });
                }
                st.sleepers += 1;
                st = sh.arrived.wait_timeout(st, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
                st.sleepers -= 1;
            }
        }
        match split.result.get() {
            Some(r) => r.clone(),
            None => Err(CommError::Poisoned { op: op.into(), reason: "a rank failed during the reduction".into() }),
        }
    }

    /// `t` on `device` (a cheap clone when already there).
    fn on(op: &'static str, t: &Tensor, device: Device) -> Result<Tensor> {
        t.to_device(&device).map_err(tensor_err(op))
    }
}

impl Drop for LocalGroup {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.m.shared.poison(format!("rank {} panicked", self.m.rank));
        }
    }
}

impl Communicator for LocalGroup {
    fn rank(&self) -> usize {
        self.m.rank
    }

    fn world_size(&self) -> usize {
        self.m.shared.world
    }

    fn all_gather(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        self.m.run("all_gather", format!("all_gather(dim {dim}, {})", x.dtype()), x, Finish::Gather { dim })
    }

    fn all_gather_async(&self, x: &Tensor, dim: usize) -> Result<Work> {
        self.m.run_async("all_gather", format!("all_gather(dim {dim}, {})", x.dtype()), x, Finish::Gather { dim })
    }

    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.m.run("all_reduce", format!("all_reduce({op:?})"), x, Finish::Reduce { op })
    }

    fn all_reduce_async(&self, x: &Tensor, op: ReduceOp) -> Result<Work> {
        self.m.run_async("all_reduce", format!("all_reduce({op:?})"), x, Finish::Reduce { op })
    }

    fn reduce_scatter(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        self.m.run("reduce_scatter", format!("reduce_scatter(dim {dim}, {op:?})"), x, Finish::ReduceScatter { dim, op })
    }

    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        const OP: &str = "broadcast";
        let world = self.m.shared.world;
        if root >= world {
            return Err(CommError::RankOutOfRange { op: OP, rank: root, world_size: world });
        }
        let call = format!("broadcast(root {root}, {:?} {})", x.dims(), x.dtype());
        self.m.run(OP, call, x, Finish::Broadcast { root })
    }

    fn abort(&self, reason: &str) {
        self.m.shared.poison(format!("rank {} aborted: {reason}", self.m.rank));
    }

    fn send_async(&self, x: &Tensor, dst: usize) -> Result<Work> {
        Ok(Work::pending(Box::new(self.m.send(x, dst)?)))
    }

    fn recv_async(&self, dims: &[usize], dtype: DType, src: usize) -> Result<Work> {
        Ok(Work::pending(Box::new(self.m.recv(dims, dtype, src)?)))
    }

    fn barrier(&self) -> Result<()> {
        let token = Tensor::zeros(&[0], DType::F32, &Device::Cpu).map_err(tensor_err("barrier"))?;
        self.m.collective("barrier", "barrier".into(), &token).map(drop)
    }
}
