//! [`LocalGroup`]: `world_size` ranks as threads of one process.
//!
//! Each collective is one exchange: every rank deposits its tensor in a shared slot; the last to
//! arrive publishes all deposits at once and wakes the others; each rank then takes its result
//! from them (gather = `cat`; a reduction is computed once, in rank order, by the first rank to
//! need it and shared, so all ranks agree bit for bit). Host tensors pass by reference-counted clone; CUDA tensors stay on their device
//! for gathers and broadcasts (ranks may share one GPU: device-to-device copies) and are reduced
//! through the host.
//!
//! Failure: every wait has a deadline ([`LocalGroup::timeout`]). A rank that times out, panics
//! while holding its handle, or calls [`LocalGroup::abort`] poisons the group; every other rank's
//! current and later collectives return [`CommError::Poisoned`] at once, never hang.

use crate::communicator::{Communicator, ReduceOp};
use crate::deadline::{Deadline, MAX_TIMEOUT};
use crate::env::MAX_WORLD_SIZE;
use crate::error::{CommError, Result, tensor_err};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};
use tp_core::{DType, Device, Tensor, TensorShard};

/// Default deadline of every collective.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// What a rank brings to one exchange: which collective (with its arguments) and its tensor.
#[derive(Clone)]
struct Deposit {
    call: String,
    tensor: Tensor,
}

/// One completed exchange: every rank's deposit, and the reduction of them, computed once by
/// whichever rank asks first and shared by the others (all ranks made the same call).
struct Round {
    deposits: Vec<Deposit>,
    reduced: OnceLock<Result<Tensor>>,
}

struct State {
    /// Completed exchanges so far; a waiter knows its round finished when this moves on.
    generation: u64,
    slots: Vec<Option<Deposit>>,
    /// The last completed exchange.
    published: Arc<Round>,
    poisoned: Option<String>,
}

struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    arrived: Condvar,
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
        drop(st);
        self.arrived.notify_all();
    }
}

/// One rank's handle on a group of threads. Create all of them with [`LocalGroup::new`] and move
/// one into each thread.
pub struct LocalGroup {
    rank: usize,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for LocalGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LocalGroup(rank {} of {})", self.rank, self.shared.world)
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
                generation: 0,
                slots: vec![None; world_size],
                published: Arc::new(Round { deposits: Vec::new(), reduced: OnceLock::new() }),
                poisoned: None,
            }),
            arrived: Condvar::new(),
        });
        Ok((0..world_size).map(|rank| LocalGroup { rank, shared: shared.clone() }).collect())
    }

    /// The deadline of every collective.
    pub fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    /// Deposits `tensor` for collective `call` and returns every rank's deposit once all have
    /// arrived, or an error at the deadline or when the group is poisoned.
    fn exchange(&self, op: &'static str, call: String, tensor: Tensor) -> Result<Arc<Round>> {
        let sh = &self.shared;
        let deadline = Deadline::after(sh.timeout).instant();
        let mut st = sh.lock();
        if let Some(reason) = &st.poisoned {
            return Err(CommError::Poisoned { op: op.into(), reason: reason.clone() });
        }
        if st.slots[self.rank].is_some() {
            return Err(CommError::Mismatch {
                op: op.into(),
                why: format!("rank {} entered a collective twice at once (one handle used by two threads?)", self.rank),
            });
        }
        st.slots[self.rank] = Some(Deposit { call, tensor });
        let generation = st.generation;
        if st.slots.iter().all(Option::is_some) {
            let all: Vec<Deposit> = st.slots.iter_mut().filter_map(Option::take).collect();
            st.published = Arc::new(Round { deposits: all, reduced: OnceLock::new() });
            st.generation += 1;
            let published = st.published.clone();
            drop(st);
            sh.arrived.notify_all();
            return Ok(published);
        }
        loop {
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> =
                    st.slots.iter().enumerate().filter(|(_, s)| s.is_none()).map(|(r, _)| r).collect();
                let reason = format!(
                    "rank {} timed out after {:?} in {op} waiting for rank(s) {missing:?}",
                    self.rank, sh.timeout
                );
                st.poisoned.get_or_insert(reason);
                drop(st);
                sh.arrived.notify_all();
                return Err(CommError::Timeout { op: op.into(), rank: self.rank, missing, waited: sh.timeout });
            }
            st = sh.arrived.wait_timeout(st, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
            if st.generation != generation {
                return Ok(st.published.clone());
            }
            if let Some(reason) = &st.poisoned {
                return Err(CommError::Poisoned { op: op.into(), reason: reason.clone() });
            }
        }
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

    /// The round's reduction, computed by the first rank to ask.
    fn reduced(op: &'static str, round: &Round, red: ReduceOp) -> Result<Tensor> {
        round
            .reduced
            .get_or_init(|| {
                let parts: Vec<&Tensor> = round.deposits.iter().map(|d| &d.tensor).collect();
                crate::reduce::reduce(op, &parts, red)
            })
            .clone()
    }

    /// `t` on `device` (a cheap clone when already there).
    fn on(op: &'static str, t: &Tensor, device: Device) -> Result<Tensor> {
        t.to_device(&device).map_err(tensor_err(op))
    }
}

impl Drop for LocalGroup {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.shared.poison(format!("rank {} panicked", self.rank));
        }
    }
}

impl Communicator for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_gather(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        const OP: &str = "all_gather";
        let round = self.collective(OP, format!("all_gather(dim {dim}, {})", x.dtype()), x)?;
        let device = x.device();
        let parts = round.deposits.iter().map(|d| Self::on(OP, &d.tensor, device)).collect::<Result<Vec<_>>>()?;
        Tensor::cat(&parts, dim).map_err(|e| CommError::Mismatch { op: OP.into(), why: e.to_string() })
    }

    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        const OP: &str = "all_reduce";
        let round = self.collective(OP, format!("all_reduce({op:?})"), x)?;
        Self::on(OP, &Self::reduced(OP, &round, op)?, x.device())
    }

    fn reduce_scatter(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        const OP: &str = "reduce_scatter";
        let round = self.collective(OP, format!("reduce_scatter(dim {dim}, {op:?})"), x)?;
        let reduced = Self::reduced(OP, &round, op)?;
        let len = reduced.shape().dim(OP, dim).map_err(tensor_err(OP))?;
        let shard = TensorShard::new(dim, len, self.rank, self.shared.world).map_err(tensor_err(OP))?;
        Self::on(OP, &shard.shard(&reduced).map_err(tensor_err(OP))?, x.device())
    }

    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        const OP: &str = "broadcast";
        if root >= self.shared.world {
            return Err(CommError::RankOutOfRange { op: OP, rank: root, world_size: self.shared.world });
        }
        let call = format!("broadcast(root {root}, {:?} {})", x.dims(), x.dtype());
        let round = self.collective(OP, call, x)?;
        Self::on(OP, &round.deposits[root].tensor, x.device())
    }

    fn abort(&self, reason: &str) {
        self.shared.poison(format!("rank {} aborted: {reason}", self.rank));
    }

    fn barrier(&self) -> Result<()> {
        let token = Tensor::zeros(&[0], DType::F32, &Device::Cpu).map_err(tensor_err("barrier"))?;
        self.collective("barrier", "barrier".into(), &token).map(drop)
    }
}
