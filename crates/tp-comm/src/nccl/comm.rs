//! [`NcclComm`]: a [`Communicator`] over NCCL for CUDA tensors, one GPU per rank.
//!
//! Deadlines everywhere: the communicator is created non-blocking (`ncclCommInitRankConfig`
//! with `blocking = 0`) and polled; every collective is enqueued, then its completion is polled
//! together with `ncclCommGetAsyncError`. A deadline passed or an asynchronous error aborts the
//! communicator (`ncclCommAbort`), so the other ranks' NCCL calls fail instead of hanging, and
//! the group stays failed. Output buffers are allocated here at exactly the size NCCL writes.

use super::Nccl;
use super::sys::{self, ncclDataType_t, ncclRedOp_t, ncclResult_t};
use crate::communicator::{Communicator, ReduceOp};
use crate::error::tensor_err;
use crate::{CommError, Result};
use std::os::raw::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tp_core::{DType, Tensor, TensorShard};
use tp_kernels::Gpu;
use tp_kernels::cudarc::driver::{CudaSlice, DevicePtr};

/// One rank of an NCCL communicator.
pub struct NcclComm {
    nccl: &'static Nccl,
    /// The handle; NCCL calls on one communicator are serialised through this lock.
    comm: Mutex<sys::ncclComm_t>,
    rank: usize,
    world: usize,
    gpu: Arc<Gpu>,
    timeout: Duration,
    failed: AtomicBool,
    reason: Mutex<Option<String>>,
}

// SAFETY: the raw communicator handle is only used under `comm`'s mutex, one call at a time,
// which is how NCCL allows a communicator to be shared between threads. Everything else is Sync.
unsafe impl Send for NcclComm {}
// SAFETY: as above.
unsafe impl Sync for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclComm(rank {} of {} on {:?})", self.rank, self.world, self.gpu)
    }
}

fn nccl_dtype(d: DType) -> ncclDataType_t::Type {
    match d {
        DType::F32 => ncclDataType_t::ncclFloat32,
        DType::F16 => ncclDataType_t::ncclFloat16,
        DType::BF16 => ncclDataType_t::ncclBfloat16,
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
    /// half-made communicator) at `timeout`.
    pub fn init(id: [u8; 128], rank: usize, world: usize, gpu: Arc<Gpu>, timeout: Duration) -> Result<NcclComm> {
        let nccl = Nccl::get()?;
        if world == 0 {
            return Err(CommError::ZeroWorldSize { op: "NcclComm::init" });
        }
        if rank >= world {
            return Err(CommError::RankOutOfRange { op: "NcclComm::init", rank, world_size: world });
        }
        gpu.context()
            .bind_to_thread()
            .map_err(|e| CommError::Nccl { op: "cuCtxSetCurrent", message: format!("{e:?}") })?;
        let deadline = crate::Deadline::after(timeout).instant();
        let mut config = default_config();
        config.blocking = 0;
        let uid = sys::ncclUniqueId { internal: id.map(|b| b as std::os::raw::c_char) };
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` and `config` are valid for writes/reads for the call; `uid` is passed by
        // value; world and rank fit in i32 (checked below by the conversions).
        let r =
            unsafe { nccl.lib().ncclCommInitRankConfig(&mut comm, to_i32(world)?, uid, to_i32(rank)?, &mut config) };
        if r != ncclResult_t::ncclSuccess && r != ncclResult_t::ncclInProgress {
            let message = nccl.describe(r, comm);
            abort_raw(nccl, comm);
            return Err(CommError::Nccl { op: "ncclCommInitRankConfig", message });
        }
        let this = NcclComm {
            nccl,
            comm: Mutex::new(comm),
            rank,
            world,
            gpu,
            timeout,
            failed: AtomicBool::new(false),
            reason: Mutex::new(None),
        };
        this.wait_ready("ncclCommInitRankConfig", deadline, || Ok(true))?;
        Ok(this)
    }

    fn handle(&self) -> std::sync::MutexGuard<'_, sys::ncclComm_t> {
        self.comm.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Polls until `done()` and the communicator has no pending or failed async state; aborts
    /// the communicator at the deadline or on an error.
    fn wait_ready(&self, op: &'static str, deadline: Instant, mut done: impl FnMut() -> Result<bool>) -> Result<()> {
        loop {
            let comm = *self.handle();
            let mut state: ncclResult_t::Type = ncclResult_t::ncclSuccess;
            // SAFETY: `comm` is this communicator's live handle; `state` is a valid out-pointer.
            let r = unsafe { self.nccl.lib().ncclCommGetAsyncError(comm, &mut state) };
            if r != ncclResult_t::ncclSuccess {
                return Err(self.fail(op, self.nccl.describe(r, comm)));
            }
            if state != ncclResult_t::ncclSuccess && state != ncclResult_t::ncclInProgress {
                return Err(self.fail(op, self.nccl.describe(state, comm)));
            }
            if state == ncclResult_t::ncclSuccess && done()? {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let e = self.fail(op, format!("no completion within {:?} (a peer is missing or stuck)", self.timeout));
                return Err(e);
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Aborts the communicator and records why; returns the error to hand back.
    fn fail(&self, op: &'static str, message: String) -> CommError {
        if !self.failed.swap(true, Ordering::SeqCst) {
            *self.reason.lock().unwrap_or_else(|e| e.into_inner()) = Some(format!("{op}: {message}"));
            abort_raw(self.nccl, *self.handle());
        }
        CommError::Nccl { op, message }
    }

    fn check_usable(&self, op: &'static str) -> Result<()> {
        if self.failed.load(Ordering::SeqCst) {
            let reason = self.reason.lock().unwrap_or_else(|e| e.into_inner()).clone().unwrap_or_default();
            return Err(CommError::Poisoned { op: op.into(), reason });
        }
        Ok(())
    }

    /// `x`'s device buffer, checked to be on this rank's GPU.
    fn device_input<'a>(&self, op: &'static str, x: &'a Tensor) -> Result<&'a CudaSlice<u8>> {
        match x.cuda_buffer() {
            Some((gpu, buf)) if gpu.ordinal() == self.gpu.ordinal() => Ok(buf),
            _ => Err(CommError::Tensor {
                op,
                source: tp_core::Error::DeviceMismatch {
                    op,
                    lhs: tp_core::Device::Cuda(self.gpu.ordinal()),
                    rhs: x.device(),
                },
            }),
        }
    }

    /// Enqueues one NCCL call on the GPU's stream and waits for it with the deadline.
    fn run(
        &self,
        op: &'static str,
        call: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> ncclResult_t::Type,
    ) -> Result<()> {
        self.check_usable(op)?;
        // NCCL enqueues on the calling thread's current device: make it this rank's.
        self.gpu
            .context()
            .bind_to_thread()
            .map_err(|e| CommError::Nccl { op: "cuCtxSetCurrent", message: format!("{e:?}") })?;
        let deadline = crate::Deadline::after(self.timeout).instant();
        let stream = self.gpu.stream();
        let raw_stream = stream.cu_stream() as sys::cudaStream_t;
        {
            let comm = *self.handle();
            let r = call(comm, raw_stream);
            if r != ncclResult_t::ncclSuccess && r != ncclResult_t::ncclInProgress {
                return Err(self.fail(op, self.nccl.describe(r, comm)));
            }
        }
        let ctx = self.gpu.context();
        let event =
            ctx.new_event(None).map_err(|e| CommError::Nccl { op: "cuEventCreate", message: format!("{e:?}") })?;
        event.record(stream).map_err(|e| CommError::Nccl { op: "cuEventRecord", message: format!("{e:?}") })?;
        self.wait_ready(op, deadline, || {
            event.try_is_complete().map_err(|e| CommError::Nccl { op: "cuEventQuery", message: format!("{e:?}") })
        })
    }

    fn alloc(&self, bytes: usize) -> Result<CudaSlice<u8>> {
        self.gpu.alloc(bytes).map_err(|e| CommError::Tensor { op: "alloc", source: e.into() })
    }

    fn wrap(&self, op: &'static str, buf: CudaSlice<u8>, dims: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::from_cuda_buffer(buf, dims, dtype, self.gpu.clone()).map_err(tensor_err(op))
    }

    /// Device pointer of a buffer for an NCCL call on the GPU's stream.
    fn ptr(&self, buf: &CudaSlice<u8>) -> *const c_void {
        let (p, _sync) = buf.device_ptr(self.gpu.stream());
        p as usize as *const c_void
    }

    /// All-reduce of a raw buffer of `count` elements into a new buffer.
    fn all_reduce_raw(&self, op: &'static str, x: &Tensor, red: ReduceOp) -> Result<CudaSlice<u8>> {
        let src = self.device_input(op, x)?;
        let bytes = x.size_in_bytes();
        let out = self.alloc(bytes)?;
        let (s, d) = (self.ptr(src), self.ptr(&out) as *mut c_void);
        let (count, dt) = (x.numel(), nccl_dtype(x.dtype()));
        // SAFETY: `src` holds `count` elements of `dt` (a tensor's buffer holds exactly its
        // elements) and `out` was just allocated with the same byte size, so NCCL reads and
        // writes within both; both live until `run` has waited for completion.
        self.run(op, |comm, stream| unsafe {
            self.nccl.lib().ncclAllReduce(s, d, count, dt, nccl_op(red), comm, stream)
        })?;
        Ok(out)
    }
}

fn to_i32(v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| CommError::Nccl { op: "argument", message: format!("{v} does not fit in an int") })
}

fn abort_raw(nccl: &Nccl, comm: sys::ncclComm_t) {
    if !comm.is_null() {
        // SAFETY: `comm` is a communicator handle NCCL returned; abort is valid in any state and
        // makes peers' pending operations fail.
        unsafe { nccl.lib().ncclCommAbort(comm) };
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let comm = *self.handle();
        if comm.is_null() || self.failed.load(Ordering::SeqCst) {
            return; // already aborted (which also frees it)
        }
        // Errors here are recorded nowhere to panic from: destroy is best effort at teardown.
        // SAFETY: the handle is live and no call is in flight (we own `self` exclusively).
        unsafe { self.nccl.lib().ncclCommDestroy(comm) };
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    /// An all-gather of arbitrary per-rank lengths (NCCL's own needs equal ones): the lengths
    /// are shared first, then every rank broadcasts its block, all in one NCCL group, into a
    /// rank-major buffer `(rank, outer, len_r, inner)`, with no padding. Gathering along the
    /// outermost non-trivial dim, that buffer is the result; along the last dim with balanced
    /// shards, the gather-interleave kernel makes it `(outer, total)` in one pass; otherwise
    /// each rank's block is placed with device copies.
    fn all_gather(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        const OP: &str = "all_gather";
        let len = x.shape().dim(OP, dim).map_err(tensor_err(OP))?;
        let lens = self.all_gather_lengths(len)?;
        let total: usize = lens.iter().sum();
        let dims = x.dims();
        let outer: usize = dims[..dim].iter().product();
        let inner: usize = dims[dim + 1..].iter().product();
        let eb = x.dtype().size_in_bytes();
        let counts: Vec<usize> = lens.iter().map(|l| outer * l * inner).collect();
        let offsets: Vec<usize> = counts.iter().scan(0, |acc, c| Some(std::mem::replace(acc, *acc + c))).collect();
        let src = self.device_input(OP, x)?;
        let buf = self.alloc(outer * total * inner * eb)?;
        let (s_ptr, d_ptr, dt) = (self.ptr(src) as usize, self.ptr(&buf) as usize, nccl_dtype(x.dtype()));
        let me = self.rank;
        self.run(OP, |comm, stream| {
            let lib = self.nccl.lib();
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
                // counts[me] = x.numel() elements (the shared lengths say so); elsewhere NCCL
                // ignores it. Both buffers live until `run` has waited for completion.
                let res = unsafe { lib.ncclBroadcast(send, recv, counts[r], dt, to_i32(r).unwrap_or(0), comm, stream) };
                if first == ncclResult_t::ncclSuccess {
                    first = res;
                }
            }
            // SAFETY: closes the group opened above; always called, even after an error.
            let end = unsafe { lib.ncclGroupEnd() };
            if first == ncclResult_t::ncclSuccess { end } else { first }
        })?;
        let mut out_dims = dims.to_vec();
        out_dims[dim] = total;
        if outer == 1 {
            return self.wrap(OP, buf, &out_dims, x.dtype());
        }
        let flat = self.wrap(OP, buf, &[outer * total * inner], x.dtype())?;
        let balanced = tp_core::TensorShard::for_all_ranks(0, total, self.world)
            .map_err(tensor_err(OP))?
            .iter()
            .zip(&lens)
            .all(|(s, &l)| s.len() == l);
        if inner == 1 && balanced {
            let y = flat.interleave_rank_major(outer, total, self.world).map_err(tensor_err(OP))?;
            return y.reshape(&out_dims).map_err(tensor_err(OP));
        }
        let parts = (0..self.world)
            .map(|r| {
                let mut d = dims.to_vec();
                d[dim] = lens[r];
                flat.narrow(0, offsets[r], counts[r])?.reshape(&d)
            })
            .collect::<tp_core::Result<Vec<_>>>()
            .map_err(tensor_err(OP))?;
        Tensor::cat(&parts, dim).map_err(tensor_err(OP))
    }

    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let out = self.all_reduce_raw("all_reduce", x, op)?;
        self.wrap("all_reduce", out, x.dims(), x.dtype())
    }

    fn reduce_scatter(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        const OP: &str = "reduce_scatter";
        let len = x.shape().dim(OP, dim).map_err(tensor_err(OP))?;
        if dim == 0 && len % self.world == 0 {
            // NCCL's own reduce-scatter: equal contiguous blocks along the outermost dim.
            let src = self.device_input(OP, x)?;
            let recv = x.numel() / self.world;
            let out = self.alloc(recv * x.dtype().size_in_bytes())?;
            let (s, d, dt) = (self.ptr(src), self.ptr(&out) as *mut c_void, nccl_dtype(x.dtype()));
            // SAFETY: `src` holds world * recv elements; `out` holds recv, what NCCL writes.
            self.run(OP, |comm, stream| unsafe {
                self.nccl.lib().ncclReduceScatter(s, d, recv, dt, nccl_op(op), comm, stream)
            })?;
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
        let out = self.alloc(x.size_in_bytes())?;
        let (s, d, dt, count) = (self.ptr(src), self.ptr(&out) as *mut c_void, nccl_dtype(x.dtype()), x.numel());
        let root_i = to_i32(root)?;
        // SAFETY: both buffers hold `count` elements of `dt`.
        self.run(OP, |comm, stream| unsafe { self.nccl.lib().ncclBroadcast(s, d, count, dt, root_i, comm, stream) })?;
        self.wrap(OP, out, x.dims(), x.dtype())
    }

    fn barrier(&self) -> Result<()> {
        let one = Tensor::zeros(&[1], DType::F32, &tp_core::Device::Cuda(self.gpu.ordinal()))
            .map_err(tensor_err("barrier"))?;
        self.all_reduce_raw("barrier", &one, ReduceOp::Sum).map(drop)
    }

    fn abort(&self, reason: &str) {
        let _ = self.fail("abort", reason.to_string());
    }
}

impl NcclComm {
    /// Every rank's length along the gathered dim (an 8-byte all-gather), checked for sanity.
    fn all_gather_lengths(&self, len: usize) -> Result<Vec<usize>> {
        const OP: &str = "all_gather";
        let len =
            u32::try_from(len).map_err(|_| CommError::Mismatch { op: OP.into(), why: "length exceeds u32".into() })?;
        let src = self.gpu.htod(&len.to_le_bytes()).map_err(|e| CommError::Tensor { op: OP, source: e.into() })?;
        let out = self.alloc(4 * self.world)?;
        let (s, d) = (self.ptr(&src), self.ptr(&out) as *mut c_void);
        // SAFETY: one 4-byte element per rank in, world of them out; moved as raw 32-bit words
        // (ncclUint32), so no float arithmetic touches the length bits.
        self.run(OP, |comm, stream| unsafe {
            self.nccl.lib().ncclAllGather(s, d, 1, ncclDataType_t::ncclUint32, comm, stream)
        })?;
        let bytes = self.gpu.dtoh(&out, 4 * self.world).map_err(|e| CommError::Tensor { op: OP, source: e.into() })?;
        Ok(bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize).collect())
    }
}
