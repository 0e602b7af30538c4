//! [`MpiComm`]: a [`Communicator`] over MPI point-to-point messages.
//!
//! Messages of each call (every collective starts with every rank sending its header to every
//! other rank, and checking all of them; see `mod.rs`):
//!
//! * `all_gather`: every rank sends its tensor to every other; each concatenates in rank order.
//! * `all_reduce` of fewer than [`SPLIT_MIN_BYTES`] (or fewer elements than ranks): every rank
//!   sends its tensor to every other and reduces all of them itself. Larger ones: the flat
//!   tensor is cut into one balanced chunk per rank; chunk `j` of every rank goes to rank `j`,
//!   which reduces it (a reduce-scatter), then sends the reduced chunk to every rank (an
//!   all-gather), `2 (W - 1) / W` of the tensor in and out per rank, as a ring moves.
//! * `reduce_scatter`: rank `j`'s shard (the balanced `TensorShard` along the dim) of every
//!   rank's tensor goes to rank `j`, which reduces them.
//! * `broadcast`: the root sends its tensor to every other rank.
//! * `all_to_all`: the headers carry every rank's send counts, so each rank knows what it
//!   receives; then each rank sends rank `j` only its chunk for `j` (no row moves twice).
//! * `barrier`: the headers alone.
//! * `send`/`recv`: a header then the payload on their own tags, matched in call order per pair
//!   of ranks (MPI's non-overtaking rule); the receiver posts both receives at its call, sized
//!   from the dims and dtype it expects, and a header that disagrees is a
//!   [`CommError::Mismatch`] naming both shapes, after which the receiver aborts the group (the
//!   sender's waits then fail with the reason). A send's work completes once MPI has taken
//!   its buffer (for small messages that is before the receiver has them).
//!
//! Every reduction folds each element in rank order in `f32` (`reduce.rs`), so results are
//! bit-identical on every rank and to the thread backend's.

use super::Mpi;
use super::inner::{Handle, Inner};
use super::round::{Owned, Round};
use super::sys;
use super::wire::{Header, Op, Words, reduce_arg};
use crate::communicator::{Communicator, ReduceOp};
use crate::deadline::Deadline;
use crate::error::tensor_err;
use crate::work::{PendingWork, Work};
use crate::{CommError, Result};
use std::os::raw::c_int;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tp_core::{DType, Device, Tensor, TensorShard};

/// All-reduces of fewer bytes go whole to every rank (one step of messages instead of two).
const SPLIT_MIN_BYTES: usize = 64 << 10;
/// Tags: collective headers and data, point-to-point headers and data (abort notices have
/// theirs in `inner.rs`).
const TAG_HEADER: c_int = 0x7401;
const TAG_DATA: c_int = 0x7402;
const TAG_P2P_HEADER: c_int = 0x7403;
const TAG_P2P_DATA: c_int = 0x7404;

/// One rank's handle on an MPI communicator (the world, or a split of it).
#[derive(Clone)]
pub struct MpiComm {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MpiComm(rank {} of {})", self.inner.rank, self.inner.size)
    }
}

impl MpiComm {
    /// Every process of the job (`MPI_COMM_WORLD`), every wait bounded by `timeout`. Loads and
    /// initialises MPI on first use.
    ///
    /// Errors: [`CommError::MpiUnavailable`]; [`CommError::Limit`] for a timeout past
    /// [`MAX_TIMEOUT`](crate::MAX_TIMEOUT).
    pub fn world(timeout: Duration) -> Result<MpiComm> {
        if timeout > crate::MAX_TIMEOUT {
            let why = format!("timeout {timeout:?} exceeds {:?}", crate::MAX_TIMEOUT);
            return Err(CommError::Limit { op: "MpiComm::world", why });
        }
        let mpi = Mpi::get()?;
        Self::wrap(mpi, Handle(mpi.lib().comm_world), timeout)
    }

    fn wrap(mpi: &'static Mpi, comm: Handle, timeout: Duration) -> Result<MpiComm> {
        let (mut rank, mut size) = (0, 0);
        let _guard = mpi.lock();
        // SAFETY: a live communicator; each call writes one int.
        let (a, b) =
            unsafe { ((mpi.lib().MPI_Comm_rank)(comm.0, &mut rank), (mpi.lib().MPI_Comm_size)(comm.0, &mut size)) };
        mpi.check("MPI_Comm_rank", a)?;
        mpi.check("MPI_Comm_size", b)?;
        let (rank, size) = (usize::try_from(rank).unwrap_or(0), usize::try_from(size).unwrap_or(0));
        if size == 0 || size > crate::MAX_WORLD_SIZE {
            return Err(CommError::Limit {
                op: "MpiComm",
                why: format!("MPI reports {size} processes (1..={} supported)", crate::MAX_WORLD_SIZE),
            });
        }
        let inner = Inner {
            mpi,
            comm,
            rank,
            size,
            timeout,
            seq: AtomicU64::new(0),
            poisoned: Mutex::new(None),
            pool: Mutex::new(Vec::new()),
        };
        Ok(MpiComm { inner: Arc::new(inner) })
    }

    /// The sub-communicator of the ranks that pass the same `color`, ordered by `key`
    /// (`MPI_Comm_split`; collective over this communicator, every rank calling it alike).
    ///
    /// Errors: [`CommError::Mpi`]; a color or key past `i32::MAX` is [`CommError::Limit`].
    pub fn split(&self, color: usize, key: usize) -> Result<MpiComm> {
        let inner = &self.inner;
        inner.check_poisoned("MPI_Comm_split")?;
        let (color, key) = match (c_int::try_from(color), c_int::try_from(key)) {
            (Ok(c), Ok(k)) => (c, k),
            _ => {
                return Err(CommError::Limit {
                    op: "MPI_Comm_split",
                    why: format!("color {color} or key {key} too large"),
                });
            }
        };
        let mut out: sys::MPI_Comm = std::ptr::null_mut();
        // MPI_Comm_split blocks inside MPI (it is collective); it runs after the headers'
        // barrier below has shown that every rank is here, so it does not wait for a dead one.
        self.barrier()?;
        let code = inner.call("MPI_Comm_split", |lib| {
            // SAFETY: a live communicator; the new handle is written through a valid pointer.
            unsafe {
                let c = (lib.MPI_Comm_split)(inner.comm.0, color, key, &mut out);
                if c == sys::MPI_SUCCESS { (lib.MPI_Comm_set_errhandler)(out, lib.errors_return) } else { c }
            }
        })?;
        inner.mpi.check("MPI_Comm_split", code)?;
        Self::wrap(inner.mpi, Handle(out), inner.timeout)
    }

    /// The deadline of every wait.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    fn next_seq(&self) -> u64 {
        self.inner.seq.fetch_add(1, Ordering::Relaxed)
    }

    /// Step one of every collective: this rank's header to every other rank, theirs back, all
    /// checked against this rank's with `compatible`; returns the headers in rank order.
    fn exchange_headers(
        &self,
        name: &'static str,
        mine: Header,
        deadline: Deadline,
        compatible: impl Fn(&Header, &Header) -> bool,
    ) -> Result<Vec<Header>> {
        let inner = &self.inner;
        inner.check_poisoned(name)?;
        if inner.size == 1 {
            return Ok(vec![mine]);
        }
        let words = std::mem::size_of::<Words>();
        let mut round = Round::new(inner, name);
        let out = round.keep(Owned::Words(Box::new(mine.encode())));
        let mut slots = vec![usize::MAX; inner.size];
        for peer in (0..inner.size).filter(|&p| p != inner.rank) {
            slots[peer] = round.keep(Owned::Words(Box::new([0; 16])));
            round.recv(peer, TAG_HEADER, slots[peer], 0..words)?;
            round.send(peer, TAG_HEADER, out, 0..words)?;
        }
        round.wait(deadline)?;
        let mut headers = Vec::with_capacity(inner.size);
        for (peer, &slot) in slots.iter().enumerate() {
            if peer == inner.rank {
                headers.push(mine.clone());
                continue;
            }
            let Owned::Words(w) = round.owned(slot) else { unreachable!("header slots hold words") };
            let h = Header::decode(name, peer, w)?;
            if h.op != mine.op || h.seq != mine.seq || !compatible(&mine, &h) {
                let err = CommError::Mismatch {
                    op: name.into(),
                    why: format!(
                        "rank {} called {} but rank {peer} called {}",
                        inner.rank,
                        mine.describe(),
                        h.describe()
                    ),
                };
                *inner.poisoned.lock().unwrap_or_else(|p| p.into_inner()) = Some(err.to_string());
                return Err(err);
            }
            headers.push(h);
        }
        Ok(headers)
    }

    fn deadline(&self) -> Deadline {
        Deadline::after(self.inner.timeout)
    }

    fn host(op: &'static str, x: &Tensor) -> Result<()> {
        if x.device() != Device::Cpu {
            return Err(CommError::Tensor { op, source: tp_core::Error::UnsupportedDevice { op, device: x.device() } });
        }
        Ok(())
    }

    /// Sends `x` whole to every other rank and receives a tensor of `dims[r]` from every rank
    /// `r` (in rank order; this rank's entry is `x` itself).
    fn swap_whole(
        &self,
        name: &'static str,
        x: &Tensor,
        dims: &[Vec<usize>],
        deadline: Deadline,
    ) -> Result<Vec<Tensor>> {
        let inner = &self.inner;
        let mut round = Round::new(inner, name);
        let out = round.keep(Owned::Tensor(x.clone()));
        let mut slots = vec![usize::MAX; inner.size];
        for peer in (0..inner.size).filter(|&p| p != inner.rank) {
            let t = Tensor::zeros(&dims[peer], x.dtype(), &Device::Cpu).map_err(tensor_err(name))?;
            let bytes = t.size_in_bytes();
            slots[peer] = round.keep(Owned::Tensor(t));
            round.recv(peer, TAG_DATA, slots[peer], 0..bytes)?;
            round.send(peer, TAG_DATA, out, 0..x.size_in_bytes())?;
        }
        round.wait(deadline)?;
        (0..inner.size)
            .map(|p| {
                if p == inner.rank {
                    Ok(x.clone())
                } else {
                    round
                        .take_tensor(slots[p])
                        .ok_or_else(|| CommError::Mpi { op: name, message: "internal: buffer".into() })
                }
            })
            .collect()
    }

    /// The element ranges of the ranks' chunks of `n` elements: all of `0..n` for every rank
    /// when whole tensors go to every rank (small ones), else balanced chunks.
    fn ranges(&self, x: &Tensor) -> Result<(bool, Vec<std::ops::Range<usize>>)> {
        let (n, w) = (x.numel(), self.inner.size);
        if x.size_in_bytes() < SPLIT_MIN_BYTES || n < w {
            return Ok((true, vec![0..n; w]));
        }
        let shards = TensorShard::for_all_ranks(0, n, w).map_err(tensor_err("all_reduce"))?;
        Ok((false, shards.iter().map(|s| s.start()..s.start() + s.len()).collect()))
    }

    /// Step 1 of an all-reduce: sends each peer its range of `x` (a handle on the caller's
    /// tensor, released before `reduce` runs) and receives this rank's range of every peer's
    /// into pooled buffers, then calls `reduce` with those (rank order, this rank left out).
    fn reduce_my_range<T: tp_core::Element>(
        &self,
        x: Tensor,
        ranges: &[std::ops::Range<usize>],
        deadline: Deadline,
        reduce: impl FnOnce(&[&[T]]) -> Result<()>,
    ) -> Result<()> {
        const NAME: &str = "all_reduce";
        let inner = &self.inner;
        let (w, me) = (inner.size, inner.rank);
        let esize = std::mem::size_of::<T>();
        let mine = ranges[me].clone();
        let mut round = Round::new(inner, NAME);
        let src = round.keep(Owned::Tensor(x));
        let mut slots = vec![usize::MAX; w];
        for peer in (0..w).filter(|&p| p != me) {
            slots[peer] = round.keep(Owned::Scratch(inner.scratch(mine.len() * esize), mine.len() * esize));
            round.recv(peer, TAG_DATA, slots[peer], 0..mine.len() * esize)?;
            let r = &ranges[peer];
            round.send(peer, TAG_DATA, src, r.start * esize..r.end * esize)?;
        }
        round.wait(deadline)?;
        // The sends are done: the caller's tensor has one owner again.
        drop(round.take_tensor(src));
        {
            let others: Vec<&[T]> = (0..w)
                .filter(|&p| p != me)
                .map(|p| {
                    let words = round.scratch(slots[p]).ok_or_else(internal)?;
                    // SAFETY: the buffer is 8-byte aligned and holds at least `mine.len()`
                    // elements of `T` (f32, f16 or bf16: 2 or 4 bytes, every bit pattern a
                    // valid value), written by the completed receive; it is borrowed from
                    // `round`, which outlives `others`.
                    Ok(unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<T>(), mine.len()) })
                })
                .collect::<Result<_>>()?;
            reduce(&others)?;
        }
        for p in (0..w).filter(|&p| p != me) {
            if let Some(buf) = round.take_scratch(slots[p]) {
                inner.give_back(buf);
            }
        }
        Ok(())
    }

    /// The reduction of every rank's `x` as a new tensor (see the module docs): the result is
    /// assembled in place, this rank's range reduced straight into it and the others' received
    /// into it.
    fn all_reduce_t<T: tp_core::Element + Send + 'static>(
        &self,
        x: &Tensor,
        op: ReduceOp,
        deadline: Deadline,
    ) -> Result<Tensor> {
        const NAME: &str = "all_reduce";
        let (n, me) = (x.numel(), self.inner.rank);
        let esize = std::mem::size_of::<T>();
        let (whole, ranges) = self.ranges(x)?;
        let mine = ranges[me].clone();
        let mut out: Vec<T> = Vec::with_capacity(n);
        huge_pages(&mut out);
        let dst = &mut out.spare_capacity_mut()[mine.clone()];
        self.reduce_my_range::<T>(x.clone(), &ranges, deadline, |others| {
            let own = &x.as_slice::<T>().map_err(tensor_err(NAME))?[mine.clone()];
            let mut parts = others.to_vec();
            parts.insert(me, own);
            crate::reduce::reduce_range(&parts, 0..dst.len(), op, dst);
            Ok(())
        })?;
        if whole {
            // SAFETY: `reduce_range` initialised all `n` elements (`mine` is `0..n`).
            unsafe { out.set_len(n) };
            return Tensor::from_vec(out, x.dims(), &Device::Cpu).map_err(tensor_err(NAME));
        }
        // Step 2: every rank's reduced range into every rank's result.
        let mut round = Round::new(&self.inner, NAME);
        let ptr = out.as_mut_ptr().cast::<u8>();
        let res = round.keep(Owned::Out(Box::new(out), ptr, n * esize));
        self.share_ranges(&mut round, res, &ranges, esize)?;
        round.wait(deadline)?;
        let mut out = round.take_out(res).and_then(|b| b.downcast::<Vec<T>>().ok()).ok_or_else(internal)?;
        // SAFETY: this rank's range was written by `reduce_range`, every other rank's range by
        // its completed receive; the ranges cover `0..n`.
        unsafe { out.set_len(n) };
        Tensor::from_vec(*out, x.dims(), &Device::Cpu).map_err(tensor_err(NAME))
    }

    /// Step 2 of a split all-reduce: posts this rank's range of buffer `buf` to every peer and
    /// the receive of every peer's range into it.
    fn share_ranges(
        &self,
        round: &mut Round,
        buf: usize,
        ranges: &[std::ops::Range<usize>],
        esize: usize,
    ) -> Result<()> {
        let me = self.inner.rank;
        let mine = &ranges[me];
        for peer in (0..self.inner.size).filter(|&p| p != me) {
            let r = &ranges[peer];
            round.recv(peer, TAG_DATA, buf, r.start * esize..r.end * esize)?;
            round.send(peer, TAG_DATA, buf, mine.start * esize..mine.end * esize)?;
        }
        Ok(())
    }

    /// The all-reduce into `x` itself (what torch.distributed's `all_reduce` does): this
    /// rank's range is reduced into a pooled buffer and copied into `x`, the others' ranges are
    /// received into `x`. No new buffer of `x`'s size (whose pages a large collective would
    /// otherwise fault in on every call).
    fn all_reduce_into_t<T: tp_core::Element>(&self, x: &mut Tensor, op: ReduceOp, deadline: Deadline) -> Result<()> {
        const NAME: &str = "all_reduce_into";
        let me = self.inner.rank;
        let esize = std::mem::size_of::<T>();
        let (_, ranges) = self.ranges(x)?;
        let mine = ranges[me].clone();
        // This rank's range is reduced over itself (the sends from `x` are done by then).
        let send_from = x.clone();
        self.reduce_my_range::<T>(send_from, &ranges, deadline, |others| {
            let own = &mut x.as_mut_slice::<T>().map_err(tensor_err(NAME))?[mine.clone()];
            crate::reduce::reduce_in_place(own, me, others, op);
            Ok(())
        })?;
        if ranges[me] == (0..x.numel()) {
            return Ok(());
        }
        let dims = x.dims().to_vec();
        let taken = std::mem::replace(x, Tensor::zeros(&[0], x.dtype(), &Device::Cpu).map_err(tensor_err(NAME))?);
        let mut round = Round::new(&self.inner, NAME);
        let buf = round.keep(Owned::Tensor(taken));
        self.share_ranges(&mut round, buf, &ranges, esize)?;
        let waited = round.wait(deadline);
        match round.take_tensor(buf) {
            Some(t) => *x = t,
            // Still in MPI's hands (the round failed): `x` becomes zeros of its shape.
            None => *x = Tensor::zeros(&dims, x.dtype(), &Device::Cpu).map_err(tensor_err(NAME))?,
        }
        waited
    }
}

/// Asks the kernel for huge pages under a large fresh result buffer (`MADV_HUGEPAGE`): a
/// result of tens of MiB is otherwise faulted in 4 KiB at a time on every call, which costs as
/// much as moving it. A refusal (huge pages off) changes nothing.
fn huge_pages<T>(v: &mut Vec<T>) {
    const HUGE: usize = 2 << 20;
    let bytes = v.capacity() * std::mem::size_of::<T>();
    if bytes < 4 * HUGE {
        return;
    }
    let start = v.as_mut_ptr() as usize;
    let (lo, hi) = (start.next_multiple_of(HUGE), (start + bytes) / HUGE * HUGE);
    if hi > lo {
        // SAFETY: madvise only advises on pages inside this Vec's own allocation (rounded
        // inward to 2 MiB); no memory is read or written, and a failure is ignored.
        unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE) };
    }
}

fn internal() -> CommError {
    CommError::Mpi { op: "MpiComm", message: "internal: a round's buffer is missing".into() }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.inner.rank
    }

    fn world_size(&self) -> usize {
        self.inner.size
    }

    fn all_gather(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        const NAME: &str = "all_gather";
        Self::host(NAME, x)?;
        x.shape().dim(NAME, dim).map_err(tensor_err(NAME))?;
        let deadline = self.deadline();
        let mine = Header::new(
            NAME,
            Op::AllGather,
            self.next_seq(),
            self.inner.rank,
            Some((x.dtype(), x.dims())),
            dim as u64,
        )?;
        let headers = self.exchange_headers(NAME, mine, deadline, |a, b| {
            a.dtype == b.dtype
                && a.arg == b.arg
                && a.dims.len() == b.dims.len()
                && a.dims.iter().zip(&b.dims).enumerate().all(|(d, (p, q))| d == dim || p == q)
        })?;
        let dims: Vec<Vec<usize>> = headers.iter().map(|h| h.dims.clone()).collect();
        let parts = self.swap_whole(NAME, x, &dims, deadline)?;
        Tensor::cat(&parts, dim).map_err(tensor_err(NAME))
    }

    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        const NAME: &str = "all_reduce";
        let deadline = self.begin_all_reduce(x, op)?;
        if self.inner.size == 1 {
            return crate::reduce::reduce(NAME, &[x], op);
        }
        tp_core::with_dtype!(x.dtype(), T => self.all_reduce_t::<T>(x, op, deadline))
    }

    fn all_reduce_into(&self, x: &mut Tensor, op: ReduceOp) -> Result<()> {
        const NAME: &str = "all_reduce";
        // The same header as `all_reduce`: ranks may mix the two forms.
        let deadline = self.begin_all_reduce(x, op)?;
        if self.inner.size == 1 {
            *x = crate::reduce::reduce(NAME, &[x], op)?;
            return Ok(());
        }
        tp_core::with_dtype!(x.dtype(), T => self.all_reduce_into_t::<T>(x, op, deadline))
    }

    fn reduce_scatter(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        const NAME: &str = "reduce_scatter";
        Self::host(NAME, x)?;
        if !x.dtype().is_float() {
            return Err(CommError::Tensor { op: NAME, source: tp_core::Error::NotFloat { dtype: x.dtype() } });
        }
        let len = x.shape().dim(NAME, dim).map_err(tensor_err(NAME))?;
        let deadline = self.deadline();
        let arg = reduce_arg(op) << 32 | dim as u64;
        let mine =
            Header::new(NAME, Op::ReduceScatter, self.next_seq(), self.inner.rank, Some((x.dtype(), x.dims())), arg)?;
        self.exchange_headers(NAME, mine, deadline, |a, b| a.dtype == b.dtype && a.dims == b.dims && a.arg == b.arg)?;
        let (w, me) = (self.inner.size, self.inner.rank);
        let shards = TensorShard::for_all_ranks(dim, len, w).map_err(tensor_err(NAME))?;
        let piece = |j: usize| x.narrow(dim, shards[j].start(), shards[j].len()).map_err(tensor_err(NAME));
        let own = piece(me)?;
        let mut round = Round::new(&self.inner, NAME);
        let mut slots = vec![usize::MAX; w];
        for peer in (0..w).filter(|&p| p != me) {
            let t = Tensor::zeros(own.dims(), x.dtype(), &Device::Cpu).map_err(tensor_err(NAME))?;
            slots[peer] = round.keep(Owned::Tensor(t));
            round.recv(peer, TAG_DATA, slots[peer], 0..own.size_in_bytes())?;
            let out = piece(peer)?;
            let bytes = out.size_in_bytes();
            let i = round.keep(Owned::Tensor(out));
            round.send(peer, TAG_DATA, i, 0..bytes)?;
        }
        round.wait(deadline)?;
        let parts: Vec<Tensor> = (0..w)
            .map(|p| if p == me { Ok(own.clone()) } else { round.take_tensor(slots[p]).ok_or_else(internal) })
            .collect::<Result<_>>()?;
        let refs: Vec<&Tensor> = parts.iter().collect();
        crate::reduce::reduce(NAME, &refs, op)
    }

    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        const NAME: &str = "broadcast";
        Self::host(NAME, x)?;
        let (w, me) = (self.inner.size, self.inner.rank);
        if root >= w {
            return Err(CommError::RankOutOfRange { op: NAME, rank: root, world_size: w });
        }
        let deadline = self.deadline();
        let mine = Header::new(NAME, Op::Broadcast, self.next_seq(), me, Some((x.dtype(), x.dims())), root as u64)?;
        self.exchange_headers(NAME, mine, deadline, |a, b| a.dtype == b.dtype && a.dims == b.dims && a.arg == b.arg)?;
        if w == 1 {
            return Ok(x.clone());
        }
        let mut round = Round::new(&self.inner, NAME);
        let bytes = x.size_in_bytes();
        let slot = if me == root {
            let i = round.keep(Owned::Tensor(x.clone()));
            for peer in (0..w).filter(|&p| p != me) {
                round.send(peer, TAG_DATA, i, 0..bytes)?;
            }
            i
        } else {
            let t = Tensor::zeros(x.dims(), x.dtype(), &Device::Cpu).map_err(tensor_err(NAME))?;
            let i = round.keep(Owned::Tensor(t));
            round.recv(root, TAG_DATA, i, 0..bytes)?;
            i
        };
        round.wait(deadline)?;
        round.take_tensor(slot).ok_or_else(internal)
    }

    fn all_to_all(&self, x: &Tensor, send_counts: &[usize]) -> Result<(Tensor, Vec<usize>)> {
        const NAME: &str = "all_to_all";
        Self::host(NAME, x)?;
        let (w, me) = (self.inner.size, self.inner.rank);
        let rows = x
            .dims()
            .first()
            .copied()
            .ok_or_else(|| CommError::Mismatch { op: NAME.into(), why: "a scalar has no rows to send".into() })?;
        if send_counts.len() != w || send_counts.iter().sum::<usize>() != rows {
            return Err(CommError::Mismatch {
                op: NAME.into(),
                why: format!(
                    "rank {me} sends {rows} rows split as {send_counts:?}: needs {w} counts summing to the rows"
                ),
            });
        }
        let deadline = self.deadline();
        let row_dims = &x.dims()[1..];
        let mine = Header::new(NAME, Op::AllToAll, self.next_seq(), me, Some((x.dtype(), x.dims())), 0)?;
        // Every rank's counts, as an all-gather of them (the headers check dtypes and row dims).
        let counts = Tensor::from_vec(send_counts.iter().map(|&c| c as i64).collect::<Vec<i64>>(), &[w], &Device::Cpu)
            .map_err(tensor_err(NAME))?;
        self.exchange_headers(NAME, mine, deadline, |a, b| {
            a.dtype == b.dtype && a.dims.len() == b.dims.len() && a.dims[1..] == b.dims[1..]
        })?;
        let matrix = self.all_gather(&counts, 0)?.to_i64_vec().map_err(tensor_err(NAME))?;
        let from: Vec<usize> = (0..w).map(|r| matrix[r * w + me].max(0) as usize).collect();
        let row_bytes = row_dims.iter().product::<usize>() * x.dtype().size_in_bytes();
        let starts: Vec<usize> = send_counts.iter().scan(0, |at, &c| Some(std::mem::replace(at, *at + c))).collect();
        let total: usize = from.iter().sum();
        let mut out_dims = vec![total];
        out_dims.extend_from_slice(row_dims);
        let mut round = Round::new(&self.inner, NAME);
        let src = round.keep(Owned::Tensor(x.clone()));
        let out =
            round.keep(Owned::Tensor(Tensor::zeros(&out_dims, x.dtype(), &Device::Cpu).map_err(tensor_err(NAME))?));
        let mut at = 0;
        for (r, &n) in from.iter().enumerate() {
            if r != me && n > 0 {
                round.recv(r, TAG_DATA, out, at * row_bytes..(at + n) * row_bytes)?;
            }
            at += n;
        }
        for (peer, (&start, &n)) in starts.iter().zip(send_counts).enumerate() {
            if peer != me && n > 0 {
                round.send(peer, TAG_DATA, src, start * row_bytes..(start + n) * row_bytes)?;
            }
        }
        round.wait(deadline)?;
        let mut result = round.take_tensor(out).ok_or_else(internal)?;
        // This rank's own chunk, copied in place.
        let own_at: usize = from[..me].iter().sum();
        let own = x.as_bytes().map_err(tensor_err(NAME))?
            [starts[me] * row_bytes..(starts[me] + send_counts[me]) * row_bytes]
            .to_vec();
        result.as_bytes_mut().map_err(tensor_err(NAME))?[own_at * row_bytes..(own_at + send_counts[me]) * row_bytes]
            .copy_from_slice(&own);
        Ok((result, from))
    }

    fn barrier(&self) -> Result<()> {
        const NAME: &str = "barrier";
        let mine = Header::new(NAME, Op::Barrier, self.next_seq(), self.inner.rank, None, 0)?;
        self.exchange_headers(NAME, mine, self.deadline(), |_, _| true).map(drop)
    }

    fn abort(&self, reason: &str) {
        self.inner.abort_with(reason);
    }

    fn send_async(&self, x: &Tensor, dst: usize) -> Result<Work> {
        const NAME: &str = "send";
        Self::host(NAME, x)?;
        self.peer_check(NAME, dst)?;
        self.inner.check_poisoned(NAME)?;
        let header = Header::new(NAME, Op::Send, 0, self.inner.rank, Some((x.dtype(), x.dims())), 0)?;
        let mut round = Round::new(&self.inner, NAME);
        let h = round.keep(Owned::Words(Box::new(header.encode())));
        let d = round.keep(Owned::Tensor(x.clone()));
        round.send(dst, TAG_P2P_HEADER, h, 0..std::mem::size_of::<Words>())?;
        round.send(dst, TAG_P2P_DATA, d, 0..x.size_in_bytes())?;
        Ok(Work::pending(Box::new(P2p {
            comm: self.inner.clone(),
            round,
            deadline: self.deadline(),
            result: d,
            expect: None,
        })))
    }

    fn recv_async(&self, dims: &[usize], dtype: DType, src: usize) -> Result<Work> {
        const NAME: &str = "recv";
        self.peer_check(NAME, src)?;
        self.inner.check_poisoned(NAME)?;
        let expect = Header::new(NAME, Op::Send, 0, src, Some((dtype, dims)), 0)?;
        let t = Tensor::zeros(dims, dtype, &Device::Cpu).map_err(tensor_err(NAME))?;
        let bytes = t.size_in_bytes();
        let mut round = Round::new(&self.inner, NAME);
        let h = round.keep(Owned::Words(Box::new([0; 16])));
        let d = round.keep(Owned::Tensor(t));
        round.recv(src, TAG_P2P_HEADER, h, 0..std::mem::size_of::<Words>())?;
        round.recv(src, TAG_P2P_DATA, d, 0..bytes)?;
        Ok(Work::pending(Box::new(P2p {
            comm: self.inner.clone(),
            round,
            deadline: self.deadline(),
            result: d,
            expect: Some((h, expect)),
        })))
    }
}

impl MpiComm {
    /// The checks and the header exchange of an all-reduce (either form); its deadline.
    fn begin_all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Deadline> {
        const NAME: &str = "all_reduce";
        Self::host(NAME, x)?;
        if !x.dtype().is_float() {
            return Err(CommError::Tensor { op: NAME, source: tp_core::Error::NotFloat { dtype: x.dtype() } });
        }
        let deadline = self.deadline();
        let (seq, rank) = (self.next_seq(), self.inner.rank);
        let mine = Header::new(NAME, Op::AllReduce, seq, rank, Some((x.dtype(), x.dims())), reduce_arg(op))?;
        self.exchange_headers(NAME, mine, deadline, |a, b| a.dtype == b.dtype && a.dims == b.dims && a.arg == b.arg)?;
        Ok(deadline)
    }

    fn peer_check(&self, op: &'static str, peer: usize) -> Result<()> {
        let (w, me) = (self.inner.size, self.inner.rank);
        if peer >= w {
            return Err(CommError::RankOutOfRange { op, rank: peer, world_size: w });
        }
        if peer == me {
            return Err(CommError::Mismatch {
                op: op.into(),
                why: format!("rank {me} cannot send to or receive from itself"),
            });
        }
        Ok(())
    }
}

/// A posted send or receive: its round, and for a receive the header it expects.
struct P2p {
    comm: Arc<Inner>,
    round: Round,
    deadline: Deadline,
    result: usize,
    expect: Option<(usize, Header)>,
}

impl PendingWork for P2p {
    fn is_done(&mut self) -> bool {
        self.round.test().unwrap_or(true)
    }

    fn wait(mut self: Box<Self>) -> Result<Tensor> {
        let waited = self.round.wait(self.deadline);
        // A wrong-sized payload is an MPI truncation error; the header says what was sent.
        if let Some((h, expect)) = &self.expect {
            let got = match self.round.owned(*h) {
                Owned::Words(w) if w[0] != 0 => Some(Header::decode("recv", expect.from, w)),
                _ => None,
            };
            match got {
                Some(Ok(got)) if got.dtype != expect.dtype || got.dims != expect.dims => {
                    let err = CommError::Mismatch {
                        op: "recv".into(),
                        why: format!(
                            "rank {} expected {:?} {} from rank {} but it sent {:?} {}",
                            self.comm.rank,
                            expect.dims,
                            expect.dtype.map_or("?".into(), |d| d.to_string()),
                            expect.from,
                            got.dims,
                            got.dtype.map_or("?".into(), |d| d.to_string()),
                        ),
                    };
                    self.comm.abort_with(&err.to_string());
                    return Err(err);
                }
                Some(Err(e)) => return Err(e),
                _ => {}
            }
        }
        waited?;
        self.round.take_tensor(self.result).ok_or_else(internal)
    }
}
