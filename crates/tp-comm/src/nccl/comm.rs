//! [`NcclComm`]: a [`Communicator`] over NCCL for CUDA tensors, one GPU per rank.
//!
//! Stream-ordered: a collective is enqueued on the rank's stream and the call returns; its
//! output is valid for everything later on that stream, and the host waits only where it reads
//! data back (or in [`Work::wait`]). The communicator is non-blocking (`blocking = 0`), so a call
//! may return `ncclInProgress` before its work is on the stream: the call then polls
//! `ncclCommGetAsyncError` until it is, under the deadline, before the work counts as enqueued.
//! Deadlines belong to a watchdog (`watchdog.rs`): past the deadline, or on an asynchronous
//! error, it aborts the communicator, and every later call or wait on this rank fails with the
//! reason; the peers' NCCL operations fail instead of hanging. Every NCCL call holds the
//! handle's lock (`state.rs`), so clones of a group never overlap calls on one communicator and
//! nothing can touch an aborted one. Output buffers are allocated here at exactly the size NCCL
//! writes, and the device buffers' stream-order guards are held until the call has enqueued.

mod p2p;

use super::Nccl;
use super::state::{Handle, Pending, Shared, abort_handle, lock};
use super::sys::{self, ncclDataType_t, ncclRedOp_t, ncclResult_t};
use crate::communicator::{Communicator, ReduceOp};
use crate::error::tensor_err;
use crate::work::{PendingWork, Work};
use crate::{CommError, Result};
use std::os::raw::c_void;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tp_core::{DType, Tensor, TensorShard};
use tp_kernels::Gpu;
use tp_kernels::cudarc::driver::{CudaEvent, CudaSlice, DevicePtr, DevicePtrMut};

/// One rank of an NCCL communicator.
pub struct NcclComm {
    shared: Arc<Shared>,
    rank: usize,
    world: usize,
    watchdog: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclComm(rank {} of {} on {:?})", self.rank, self.world, self.shared.gpu)
    }
}

fn cuda_err(op: &'static str) -> impl Fn(tp_kernels::cudarc::driver::DriverError) -> CommError {
    move |e| CommError::Nccl { op, message: format!("{e:?}") }
}

fn nccl_dtype(d: DType) -> ncclDataType_t::Type {
    match d {
        DType::F32 => ncclDataType_t::ncclFloat32,
        DType::F16 => ncclDataType_t::ncclFloat16,
        DType::BF16 => ncclDataType_t::ncclBfloat16,
        DType::I32 => ncclDataType_t::ncclInt32,
        DType::I64 => ncclDataType_t::ncclInt64,
    }
}

fn nccl_op(op: ReduceOp) -> ncclRedOp_t::Type {
    match op {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
        ReduceOp::Max => ncclRedOp_t::ncclMax,
        ReduceOp::Min => ncclRedOp_t::ncclMin,
        ReduceOp::Avg => ncclRedOp_t::ncclAvg,
    }
}

/// A config with every field "undefined" (NCCL's defaults), as NCCL_CONFIG_INITIALIZER makes it.
fn default_config() -> sys::ncclConfig_t {
    const UNDEF: i32 = i32::MIN; // NCCL_CONFIG_UNDEF_INT
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: sys::NCCL_API_MAGIC,
        version: sys::NCCL_VERSION_CODE,
        blocking: UNDEF,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
        graphStreamOrdering: UNDEF,
        launchOrderImplicit: UNDEF,
        numRmaSig: UNDEF,
        rmaEagerInit: UNDEF,
        hostCftMode: UNDEF,
        nvlsHostMode: UNDEF,
    }
}

impl NcclComm {
    /// Joins communicator `id` as `rank` of `world` on `gpu`, failing (and aborting the
    /// half-made communicator) at `timeout`; starts its watchdog.
    pub fn init(id: [u8; 128], rank: usize, world: usize, gpu: Arc<Gpu>, timeout: Duration) -> Result<NcclComm> {
        let nccl = Nccl::get()?;
        if world == 0 {
            return Err(CommError::ZeroWorldSize { op: "NcclComm::init" });
        }
        if rank >= world {
            return Err(CommError::RankOutOfRange { op: "NcclComm::init", rank, world_size: world });
        }
        gpu.context().bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        let deadline = crate::Deadline::after(timeout).instant();
        let mut config = default_config();
        config.blocking = 0;
        let uid = sys::ncclUniqueId { internal: id.map(|b| b as std::os::raw::c_char) };
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        let (world_i, rank_i) = (to_i32(world)?, to_i32(rank)?);
        // SAFETY: `comm` and `config` are valid for writes/reads for the call; `uid` is passed by
        // value; world and rank fit in i32 (checked by the conversions above).
        let r = unsafe { nccl.lib().ncclCommInitRankConfig(&mut comm, world_i, uid, rank_i, &mut config) };
        if r != ncclResult_t::ncclSuccess && r != ncclResult_t::ncclInProgress {
            let message = nccl.describe(r, comm);
            abort_handle(nccl, &mut Handle(comm));
            return Err(CommError::Nccl { op: "ncclCommInitRankConfig", message });
        }
        let shared = Arc::new(Shared::new(nccl, gpu, timeout, comm));
        {
            let mut h = shared.handle();
            shared.settle(&mut h, "ncclCommInitRankConfig", deadline)?;
        }
        let watchdog = super::watchdog::start(shared.clone()).map_err(|e| {
            let mut h = shared.handle();
            shared.fail(&mut h, "NcclComm::init", format!("cannot start the watchdog thread: {e}"))
        })?;
        Ok(NcclComm { shared, rank, world, watchdog: Some(watchdog) })
    }

    /// Enqueues one NCCL call on the GPU's stream and returns the event recorded right after
    /// it (the watchdog watches it until it completes or passes the deadline). The host does not
    /// wait for the collective.
    fn enqueue(
        &self,
        op: &'static str,
        call: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> ncclResult_t::Type,
    ) -> Result<Arc<CudaEvent>> {
        let sh = &self.shared;
        sh.check_usable(op)?;
        // NCCL enqueues on the calling thread's current device: make it this rank's.
        sh.gpu.context().bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        let stream = sh.gpu.stream();
        let deadline = crate::Deadline::after(sh.timeout).instant();
        {
            let mut h = sh.handle();
            if h.0.is_null() {
                return Err(sh.poisoned(op));
            }
            let r = call(h.0, stream.cu_stream() as sys::cudaStream_t);
            match r {
                ncclResult_t::ncclSuccess => {}
                // Not on the stream yet: wait (briefly, under the deadline) until it is.
                ncclResult_t::ncclInProgress => sh.settle(&mut h, op, deadline)?,
                _ => {
                    let message = sh.nccl.describe(r, h.0);
                    return Err(sh.fail(&mut h, op, message));
                }
            }
        }
        let event = Arc::new(sh.gpu.context().new_event(None).map_err(cuda_err("cuEventCreate"))?);
        event.record(stream).map_err(cuda_err("cuEventRecord"))?;
        let mut q = lock(&sh.pending);
        let was_idle = q.is_empty();
        q.push_back(Pending { event: event.clone(), deadline, op });
        drop(q);
        if was_idle {
            sh.wake.notify_one();
        }
        Ok(event)
    }

    fn alloc(&self, bytes: usize) -> Result<CudaSlice<u8>> {
        self.shared.gpu.alloc(bytes).map_err(|e| CommError::Tensor { op: "alloc", source: e.into() })
    }

    fn wrap(&self, op: &'static str, buf: CudaSlice<u8>, dims: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::from_cuda_buffer(buf, dims, dtype, self.shared.gpu.clone()).map_err(tensor_err(op))
    }

    /// `x`'s device buffer, checked to be on this rank's GPU.
    fn device_input<'a>(&self, op: &'static str, x: &'a Tensor) -> Result<&'a CudaSlice<u8>> {
        match x.cuda_buffer() {
            Some((gpu, buf)) if gpu.ordinal() == self.shared.gpu.ordinal() => Ok(buf),
            _ => Err(CommError::Tensor {
                op,
                source: tp_core::Error::DeviceMismatch {
                    op,
                    lhs: tp_core::Device::Cuda(self.shared.gpu.ordinal()),
                    rhs: x.device(),
                },
            }),
        }
    }

    /// All-reduce of `x` into a new buffer, enqueued.
    fn all_reduce_enqueue(
        &self,
        op: &'static str,
        x: &Tensor,
        red: ReduceOp,
    ) -> Result<(CudaSlice<u8>, Arc<CudaEvent>)> {
        let src = self.device_input(op, x)?;
        let mut out = self.alloc(x.size_in_bytes())?;
        let stream = self.shared.gpu.stream();
        let (s, s_guard) = src.device_ptr(stream);
        let (d, d_guard) = out.device_ptr_mut(stream);
        let (count, dt) = (x.numel(), nccl_dtype(x.dtype()));
        // SAFETY: `src` holds `count` elements of `dt` (a tensor's buffer holds exactly its
        // elements) and `out` was just allocated with the same byte size, so NCCL reads and
        // writes within both. Both stay allocated in stream order: their guards are held until
        // the call has enqueued, and freeing a buffer is itself ordered on this stream.
        let event = self.enqueue(op, |comm, stream| unsafe {
            self.shared.nccl.lib().ncclAllReduce(
                s as usize as *const c_void,
                d as usize as *mut c_void,
                count,
                dt,
                nccl_op(red),
                comm,
                stream,
            )
        })?;
        drop((s_guard, d_guard));
        Ok((out, event))
    }

    /// The all-gather of every rank's `x` along `dim`, rank `r` contributing `lengths[r]` rows
    /// of that dim (its own checked here; the others' trusted: every rank passes the same list).
    fn all_gather_enqueue(&self, x: &Tensor, dim: usize, lengths: &[usize]) -> Result<(Tensor, Arc<CudaEvent>)> {
        const OP: &str = "all_gather";
        let len = x.shape().dim(OP, dim).map_err(tensor_err(OP))?;
        check_lengths(OP, self.rank, self.world, len, lengths)?;
        let total: usize = lengths.iter().sum();
        let dims = x.dims();
        let outer: usize = dims[..dim].iter().product();
        let inner: usize = dims[dim + 1..].iter().product();
        let eb = x.dtype().size_in_bytes();
        let counts: Vec<usize> = lengths.iter().map(|l| outer * l * inner).collect();
        let offsets: Vec<usize> = counts.iter().scan(0, |acc, c| Some(std::mem::replace(acc, *acc + c))).collect();
        let src = self.device_input(OP, x)?;
        let mut buf = self.alloc(outer * total * inner * eb)?;
        let stream = self.shared.gpu.stream();
        let (s_ptr, s_guard) = src.device_ptr(stream);
        let (d_ptr, d_guard) = buf.device_ptr_mut(stream);
        let (s_ptr, d_ptr, dt, me) = (s_ptr as usize, d_ptr as usize, nccl_dtype(x.dtype()), self.rank);
        let event = self.enqueue(OP, |comm, stream| {
            let lib = self.shared.nccl.lib();
            // SAFETY: group calls take no pointers.
            let mut first = unsafe { lib.ncclGroupStart() };
            for r in 0..self.world {
                if counts[r] == 0 {
                    continue;
                }
                let recv = (d_ptr + offsets[r] * eb) as *mut c_void;
                let send = if r == me { s_ptr as *const c_void } else { recv as *const c_void };
                // SAFETY: `recv` is rank r's block of `buf`, counts[r] elements inside its
                // outer*total*inner; on the root, `send` is this rank's input of exactly
                // counts[me] = x.numel() elements (checked by check_lengths); elsewhere NCCL
                // ignores it. Both buffers' guards are held until the group has enqueued.
                let res = unsafe { lib.ncclBroadcast(send, recv, counts[r], dt, to_i32(r).unwrap_or(0), comm, stream) };
                if first == ncclResult_t::ncclSuccess {
                    first = res;
                }
            }
            // SAFETY: closes the group opened above; always called, even after an error.
            let end = unsafe { lib.ncclGroupEnd() };
            if first == ncclResult_t::ncclSuccess { end } else { first }
        })?;
        drop((s_guard, d_guard));
        let mut out_dims = dims.to_vec();
        out_dims[dim] = total;
        if outer == 1 {
            return Ok((self.wrap(OP, buf, &out_dims, x.dtype())?, event));
        }
        // The rank-major buffer (rank, outer, len_r, inner), reordered on the stream.
        let flat = self.wrap(OP, buf, &[outer * total * inner], x.dtype())?;
        let balanced = TensorShard::for_all_ranks(0, total, self.world)
            .map_err(tensor_err(OP))?
            .iter()
            .zip(lengths)
            .all(|(s, &l)| s.len() == l);
        let y = if inner == 1 && balanced {
            flat.interleave_rank_major(outer, total, self.world).and_then(|y| y.reshape(&out_dims))
        } else {
            let parts = (0..self.world)
                .map(|r| {
                    let mut d = dims.to_vec();
                    d[dim] = lengths[r];
                    flat.narrow(0, offsets[r], counts[r])?.reshape(&d)
                })
                .collect::<tp_core::Result<Vec<_>>>();
            parts.and_then(|p| Tensor::cat(&p, dim))
        };
        Ok((y.map_err(tensor_err(OP))?, event))
    }

    /// Every rank's length along the gathered dim (an all-gather of one u32 each, read back: a
    /// host synchronisation; callers that know the lengths use `all_gather_sized`).
    fn exchange_lengths(&self, len: usize) -> Result<Vec<usize>> {
        const OP: &str = "all_gather";
        let len =
            u32::try_from(len).map_err(|_| CommError::Mismatch { op: OP.into(), why: "length exceeds u32".into() })?;
        let gpu = &self.shared.gpu;
        let src = gpu.htod(&len.to_le_bytes()).map_err(|e| CommError::Tensor { op: OP, source: e.into() })?;
        let mut out = self.alloc(4 * self.world)?;
        let stream = gpu.stream();
        let (s, s_guard) = src.device_ptr(stream);
        let (d, d_guard) = out.device_ptr_mut(stream);
        // SAFETY: one 4-byte element per rank in, world of them out; moved as raw 32-bit words
        // (ncclUint32), so no float arithmetic touches the length bits; guards held until enqueued.
        self.enqueue(OP, |comm, stream| unsafe {
            self.shared.nccl.lib().ncclAllGather(
                s as usize as *const c_void,
                d as usize as *mut c_void,
                1,
                ncclDataType_t::ncclUint32,
                comm,
                stream,
            )
        })?;
        drop((s_guard, d_guard));
        let bytes = gpu.dtoh(&out, 4 * self.world).map_err(|e| CommError::Tensor { op: OP, source: e.into() })?;
        self.shared.check_usable(OP)?;
        Ok(bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize).collect())
    }

    fn work(&self, op: &'static str, output: Tensor, event: Arc<CudaEvent>) -> Work {
        let deadline = crate::Deadline::after(self.shared.timeout).instant();
        Work::pending(Box::new(NcclWork { shared: self.shared.clone(), event, output, deadline, op }))
    }
}

/// A collective's output and the event after it, waited for with the deadline.
struct NcclWork {
    shared: Arc<Shared>,
    event: Arc<CudaEvent>,
    output: Tensor,
    deadline: Instant,
    op: &'static str,
}

impl PendingWork for NcclWork {
    fn is_done(&mut self) -> bool {
        self.shared.has_failed() || self.event.try_is_complete().unwrap_or(true)
    }

    fn wait(self: Box<Self>) -> Result<Tensor> {
        tp_kernels::count_host_sync();
        let sh = &self.shared;
        sh.gpu.context().bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        loop {
            sh.check_usable(self.op)?;
            match self.event.try_is_complete() {
                Ok(true) => {
                    sh.check_usable(self.op)?; // completed because the watchdog aborted it?
                    return Ok(self.output);
                }
                Ok(false) => {}
                Err(e) => {
                    let mut h = sh.handle();
                    return Err(sh.fail(&mut h, self.op, format!("cuEventQuery failed: {e:?}")));
                }
            }
            // The watchdog aborts at the deadline; this is the backstop if it could not run.
            if Instant::now() >= crate::Deadline::at(self.deadline).extended(Duration::from_secs(1)).instant() {
                let mut h = sh.handle();
                return Err(sh.fail(&mut h, self.op, format!("not complete within {:?}", sh.timeout)));
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

/// Checks a caller-provided length list against this rank's own length and the world.
fn check_lengths(op: &'static str, rank: usize, world: usize, mine: usize, lengths: &[usize]) -> Result<()> {
    if lengths.len() != world || lengths[rank] != mine {
        return Err(CommError::Mismatch {
            op: op.into(),
            why: format!("rank {rank} has length {mine} but was told lengths {lengths:?} for a world of {world}"),
        });
    }
    lengths
        .iter()
        .try_fold(0usize, |a, &l| a.checked_add(l))
        .map(drop)
        .ok_or_else(|| CommError::Mismatch { op: op.into(), why: "lengths overflow when summed".into() })
}

/// The work of a batch of one operation.
fn one(works: Vec<Work>) -> Result<Work> {
    works
        .into_iter()
        .next()
        .ok_or_else(|| CommError::Nccl { op: "send/recv", message: "no work for the operation".into() })
}

fn to_i32(v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| CommError::Nccl { op: "argument", message: format!("{v} does not fit in an int") })
}

impl Drop for NcclComm {
    /// Never hangs, never panics: the watchdog is stopped; work still outstanding is given
    /// until its deadline (a peer that is gone cannot complete it), then the communicator is
    /// finalised and destroyed, or aborted if anything failed, is late, or does not settle.
    fn drop(&mut self) {
        let sh = &self.shared;
        sh.stop.store(true, Ordering::SeqCst);
        sh.wake.notify_all();
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
        if sh.gpu.context().bind_to_thread().is_err() {
            abort_handle(sh.nccl, &mut sh.handle());
            return;
        }
        let mut h = sh.handle();
        if h.0.is_null() {
            return; // aborted already (which freed it)
        }
        loop {
            let mut q = lock(&sh.pending);
            while q.front().is_some_and(|p| p.event.try_is_complete().unwrap_or(true)) {
                q.pop_front();
            }
            let Some(front) = q.front() else { break };
            let late = Instant::now() >= front.deadline;
            drop(q);
            if late || sh.async_state(&mut h, "drop").is_err() {
                abort_handle(sh.nccl, &mut h);
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        // SAFETY: the handle is live (non-null under the lock) and no work is outstanding.
        let r = unsafe { sh.nccl.lib().ncclCommFinalize(h.0) };
        let settled = match r {
            ncclResult_t::ncclSuccess => true,
            ncclResult_t::ncclInProgress => {
                let deadline = crate::Deadline::after(sh.timeout.min(Duration::from_secs(10))).instant();
                sh.settle(&mut h, "ncclCommFinalize", deadline).is_ok()
            }
            _ => false,
        };
        if settled && !h.0.is_null() {
            // SAFETY: finalised, so destroy only frees resources; the handle is forgotten after.
            unsafe { sh.nccl.lib().ncclCommDestroy(h.0) };
            h.0 = std::ptr::null_mut();
        } else {
            abort_handle(sh.nccl, &mut h);
        }
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    /// `ncclSend` of a header and the payload in one group (the `p2p` module).
    fn send_async(&self, x: &Tensor, dst: usize) -> Result<Work> {
        one(self.batch_enqueue(&[crate::P2p::Send { x, peer: dst }])?)
    }

    /// `ncclRecv` of the header and the payload in one group; the header is checked at the
    /// wait (the `p2p` module).
    fn recv_async(&self, dims: &[usize], dtype: DType, src: usize) -> Result<Work> {
        one(self.batch_enqueue(&[crate::P2p::Recv { dims, dtype, peer: src }])?)
    }

    /// Every send's and receive's header and payload in one NCCL group (the `p2p` module).
    fn send_recv_async(&self, ops: &[crate::P2p<'_>]) -> Result<Vec<Work>> {
        self.batch_enqueue(ops)
    }

    fn world_size(&self) -> usize {
        self.world
    }

    /// An all-gather of arbitrary per-rank lengths (NCCL's own needs equal ones): the lengths
    /// are shared first (one tiny all-gather, read back), then every rank broadcasts its block,
    /// all in one NCCL group, into a rank-major buffer `(rank, outer, len_r, inner)`, with no
    /// padding. Gathering along the outermost non-trivial dim, that buffer is the result; along
    /// the last dim with balanced shards, the gather-interleave kernel makes it `(outer, total)`
    /// in one pass; otherwise each rank's block is placed with device copies.
    fn all_gather(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        let len = x.shape().dim("all_gather", dim).map_err(tensor_err("all_gather"))?;
        let lengths = self.exchange_lengths(len)?;
        Ok(self.all_gather_enqueue(x, dim, &lengths)?.0)
    }

    /// Like `all_gather` with every rank's length given: no exchange, no host synchronisation.
    fn all_gather_sized(&self, x: &Tensor, dim: usize, lengths: &[usize]) -> Result<Tensor> {
        Ok(self.all_gather_enqueue(x, dim, lengths)?.0)
    }

    fn all_gather_async(&self, x: &Tensor, dim: usize) -> Result<Work> {
        let len = x.shape().dim("all_gather", dim).map_err(tensor_err("all_gather"))?;
        let lengths = self.exchange_lengths(len)?;
        let (y, event) = self.all_gather_enqueue(x, dim, &lengths)?;
        Ok(self.work("all_gather", y, event))
    }

    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let (out, _) = self.all_reduce_enqueue("all_reduce", x, op)?;
        self.wrap("all_reduce", out, x.dims(), x.dtype())
    }

    fn all_reduce_async(&self, x: &Tensor, op: ReduceOp) -> Result<Work> {
        let (out, event) = self.all_reduce_enqueue("all_reduce", x, op)?;
        Ok(self.work("all_reduce", self.wrap("all_reduce", out, x.dims(), x.dtype())?, event))
    }

    fn reduce_scatter(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        const OP: &str = "reduce_scatter";
        let len = x.shape().dim(OP, dim).map_err(tensor_err(OP))?;
        if dim == 0 && len % self.world == 0 {
            // NCCL's own reduce-scatter: equal contiguous blocks along the outermost dim.
            let src = self.device_input(OP, x)?;
            let recv = x.numel() / self.world;
            let mut out = self.alloc(recv * x.dtype().size_in_bytes())?;
            let stream = self.shared.gpu.stream();
            let (s, s_guard) = src.device_ptr(stream);
            let (d, d_guard) = out.device_ptr_mut(stream);
            let dt = nccl_dtype(x.dtype());
            // SAFETY: `src` holds world * recv elements; `out` holds recv, what NCCL writes;
            // guards held until enqueued.
            self.enqueue(OP, |comm, stream| unsafe {
                self.shared.nccl.lib().ncclReduceScatter(
                    s as usize as *const c_void,
                    d as usize as *mut c_void,
                    recv,
                    dt,
                    nccl_op(op),
                    comm,
                    stream,
                )
            })?;
            drop((s_guard, d_guard));
            let mut dims = x.dims().to_vec();
            dims[0] = len / self.world;
            return self.wrap(OP, out, &dims, x.dtype());
        }
        // Uneven or inner-dim shards: reduce everything, keep this rank's balanced shard.
        let reduced = self.all_reduce(x, op)?;
        let shard = TensorShard::new(dim, len, self.rank, self.world).map_err(tensor_err(OP))?;
        shard.shard(&reduced).map_err(tensor_err(OP))
    }

    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        const OP: &str = "broadcast";
        if root >= self.world {
            return Err(CommError::RankOutOfRange { op: OP, rank: root, world_size: self.world });
        }
        let src = self.device_input(OP, x)?;
        let mut out = self.alloc(x.size_in_bytes())?;
        let stream = self.shared.gpu.stream();
        let (s, s_guard) = src.device_ptr(stream);
        let (d, d_guard) = out.device_ptr_mut(stream);
        let (dt, count, root_i) = (nccl_dtype(x.dtype()), x.numel(), to_i32(root)?);
        // SAFETY: both buffers hold `count` elements of `dt`; guards held until enqueued.
        self.enqueue(OP, |comm, stream| unsafe {
            self.shared.nccl.lib().ncclBroadcast(
                s as usize as *const c_void,
                d as usize as *mut c_void,
                count,
                dt,
                root_i,
                comm,
                stream,
            )
        })?;
        drop((s_guard, d_guard));
        self.wrap(OP, out, x.dims(), x.dtype())
    }

    /// Returns once every rank has reached it: a one-element all-reduce, waited for.
    fn barrier(&self) -> Result<()> {
        let one = Tensor::zeros(&[1], DType::F32, &tp_core::Device::Cuda(self.shared.gpu.ordinal()))
            .map_err(tensor_err("barrier"))?;
        self.all_reduce_async(&one, ReduceOp::Sum)?.wait().map(drop)
    }

    fn abort(&self, reason: &str) {
        let mut h = self.shared.handle();
        let _ = self.shared.fail(&mut h, "abort", reason.to_string());
    }
}
