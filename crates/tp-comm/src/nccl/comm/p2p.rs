//! Point-to-point on NCCL: `ncclSend` / `ncclRecv` between pipeline stages.
//!
//! Every message is a small header (the dtype and up to [`MAX_DIMS`] dims, as `i64`s) followed
//! by the payload. The receiver knows the dims and dtype it expects, so it posts the header's
//! receive and the payload's together; nothing waits on the host at the call. A batch
//! ([`Communicator::send_recv_async`](crate::Communicator::send_recv_async)) is one NCCL group
//! holding every send's header and payload and every receive's header and payload, in the
//! order given, so neighbours that both send to each other before receiving (1F1B) progress
//! together instead of each stream waiting behind its own send: that is why the check cannot
//! happen before the payload is posted.
//!
//! The receiver checks the header when its work is waited for. A mismatch aborts the
//! communicator with a message naming both shapes: the receiver's wait returns a
//! [`CommError::Mismatch`] and every later call on it the reason. Where the two sides' payloads
//! differ in size, NCCL does not complete the transfer, and the watchdog fails it at the
//! deadline instead; the receive buffer is exactly the expected size and NCCL writes no more
//! than the receive's count into it. The sender's wait fails at its deadline (NCCL does not
//! tell peers that a communicator was aborted). Messages between two ranks are matched in the
//! order they are posted, as NCCL matches them; one batch is one enqueue under the handle's
//! lock, so another thread's operations never come between its calls.
//!
//! This path has not run on a GPU yet: it compiles and is reasoned about, not tested (NCCL
//! refuses two ranks of one communicator on one GPU, and the machines lent so far have one).

use super::*;
use crate::P2p;

/// Most dims a message may have.
pub(super) const MAX_DIMS: usize = 8;
/// Header words: the dtype, the number of dims, the dims.
const HEADER: usize = 2 + MAX_DIMS;

fn dtype_code(d: DType) -> i64 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::I32 => 3,
        DType::I64 => 4,
    }
}

fn header_of(op: &'static str, dims: &[usize], dtype: DType) -> Result<Vec<i64>> {
    if dims.len() > MAX_DIMS {
        return Err(CommError::Limit {
            op,
            why: format!("{} dims; point-to-point takes at most {MAX_DIMS}", dims.len()),
        });
    }
    let mut h = vec![0i64; HEADER];
    h[0] = dtype_code(dtype);
    h[1] = dims.len() as i64;
    for (i, &d) in dims.iter().enumerate() {
        h[2 + i] = i64::try_from(d).map_err(|_| CommError::Limit { op, why: "a dim past i64".into() })?;
    }
    Ok(h)
}

fn describe(h: &[i64]) -> String {
    let n = usize::try_from(h[1]).unwrap_or(0).min(MAX_DIMS);
    let dtype = ["f32", "f16", "bf16", "i32", "i64"].get(usize::try_from(h[0]).unwrap_or(99)).copied().unwrap_or("?");
    format!("{:?} {dtype}", &h[2..2 + n])
}

/// One operation of a batch, checked and with its buffers ready.
enum Prepared<'a> {
    Send {
        peer: i32,
        x: &'a Tensor,
        head: CudaSlice<u8>,
        src: &'a CudaSlice<u8>,
        count: usize,
        dt: ncclDataType_t::Type,
    },
    Recv {
        peer: i32,
        src: usize,
        want: Vec<i64>,
        head: CudaSlice<u8>,
        out: CudaSlice<u8>,
        dims: Vec<usize>,
        dtype: DType,
    },
}

impl NcclComm {
    fn check_peer(&self, op: &'static str, peer: usize) -> Result<i32> {
        if peer >= self.world {
            return Err(CommError::RankOutOfRange { op, rank: peer, world_size: self.world });
        }
        if peer == self.rank {
            return Err(CommError::Mismatch {
                op: op.into(),
                why: format!("rank {peer} cannot send to or receive from itself"),
            });
        }
        to_i32(peer)
    }

    /// Checks one operation and makes its buffers: a send's header on the device; a receive's
    /// header and payload buffers, the payload exactly `dims` of `dtype`.
    fn prepare<'a>(&self, op: &P2p<'a>) -> Result<Prepared<'a>> {
        match *op {
            P2p::Send { x, peer: dst } => {
                const OP: &str = "send";
                let peer = self.check_peer(OP, dst)?;
                let src = self.device_input(OP, x)?;
                let header = header_of(OP, x.dims(), x.dtype())?;
                let bytes: Vec<u8> = header.iter().flat_map(|v| v.to_le_bytes()).collect();
                let head = self.shared.gpu.htod(&bytes).map_err(|e| CommError::Tensor { op: OP, source: e.into() })?;
                Ok(Prepared::Send { peer, x, head, src, count: x.numel(), dt: nccl_dtype(x.dtype()) })
            }
            P2p::Recv { dims, dtype, peer: src } => {
                const OP: &str = "recv";
                let peer = self.check_peer(OP, src)?;
                let want = header_of(OP, dims, dtype)?;
                let bytes = dims.iter().try_fold(dtype.size_in_bytes(), |a, &d| a.checked_mul(d)).ok_or_else(|| {
                    CommError::Limit { op: OP, why: format!("a {dims:?} {dtype} tensor overflows usize") }
                })?;
                let head = self.alloc(HEADER * 8)?;
                let out = self.alloc(bytes)?;
                Ok(Prepared::Recv { peer, src, want, head, out, dims: dims.to_vec(), dtype })
            }
        }
    }

    /// Posts `ops` as one NCCL group on the rank's stream (see the module docs); one work per
    /// operation, in order: a send's returns its tensor, a receive's the payload once its
    /// header has been checked.
    pub(super) fn batch_enqueue(&self, ops: &[P2p<'_>]) -> Result<Vec<Work>> {
        const OP: &str = "send/recv";
        let mut prepared = ops.iter().map(|op| self.prepare(op)).collect::<Result<Vec<_>>>()?;
        let stream = self.shared.gpu.stream();
        // Every buffer's (pointer, element count, dtype, peer, is_send), its guard held alongside.
        let mut calls = Vec::with_capacity(2 * prepared.len());
        let mut guards = Vec::with_capacity(2 * prepared.len());
        for p in prepared.iter_mut() {
            match p {
                Prepared::Send { peer, head, src, count, dt, .. } => {
                    let (h, g) = head.device_ptr(stream);
                    calls.push((h as usize, HEADER, ncclDataType_t::ncclInt64, *peer, true));
                    guards.push(g);
                    if *count > 0 {
                        let (s, g) = src.device_ptr(stream);
                        calls.push((s as usize, *count, *dt, *peer, true));
                        guards.push(g);
                    }
                }
                Prepared::Recv { peer, head, out, dims, dtype, .. } => {
                    let count: usize = dims.iter().product();
                    let (h, g) = head.device_ptr_mut(stream);
                    calls.push((h as usize, HEADER, ncclDataType_t::ncclInt64, *peer, false));
                    guards.push(g);
                    if count > 0 {
                        let (d, g) = out.device_ptr_mut(stream);
                        calls.push((d as usize, count, nccl_dtype(*dtype), *peer, false));
                        guards.push(g);
                    }
                }
            }
        }
        let event = self.enqueue(OP, |comm, stream| {
            let lib = self.shared.nccl.lib();
            // SAFETY: group calls take no pointers.
            let mut first = unsafe { lib.ncclGroupStart() };
            for &(ptr, count, dt, peer, is_send) in &calls {
                // SAFETY: each pointer is a live device buffer of at least `count` elements of
                // `dt`: a send's header (HEADER i64 words, just copied) or its tensor's buffer
                // (exactly its elements), a receive's header or payload (allocated above at
                // exactly that size). Their guards are held until the group has enqueued, and
                // freeing any of them is ordered on this stream after the group.
                let r = unsafe {
                    if is_send {
                        lib.ncclSend(ptr as *const c_void, count, dt, peer, comm, stream)
                    } else {
                        lib.ncclRecv(ptr as *mut c_void, count, dt, peer, comm, stream)
                    }
                };
                if first == ncclResult_t::ncclSuccess {
                    first = r;
                }
            }
            // SAFETY: closes the group opened above; always called, even after an error.
            let end = unsafe { lib.ncclGroupEnd() };
            if first == ncclResult_t::ncclSuccess { end } else { first }
        })?;
        drop(guards);
        let deadline = crate::Deadline::after(self.shared.timeout).instant();
        let mut works = Vec::with_capacity(prepared.len());
        for p in prepared {
            match p {
                Prepared::Send { x, head, .. } => {
                    drop(head); // freed in stream order, after the send
                    works.push(self.work("send", x.clone(), event.clone()));
                }
                Prepared::Recv { src, want, head, out, dims, dtype, .. } => {
                    let payload = NcclWork {
                        shared: self.shared.clone(),
                        event: event.clone(),
                        output: self.wrap("recv", out, &dims, dtype)?,
                        deadline,
                        op: "recv",
                    };
                    let head = self.wrap("recv", head, &[HEADER], DType::I64)?;
                    works.push(Work::pending(Box::new(CheckedRecv { payload, head, want, src, rank: self.rank })));
                }
            }
        }
        Ok(works)
    }
}

/// A posted receive: the payload's work, and the header to check against `want` at the wait.
struct CheckedRecv {
    payload: NcclWork,
    head: Tensor,
    want: Vec<i64>,
    src: usize,
    rank: usize,
}

impl PendingWork for CheckedRecv {
    fn is_done(&mut self) -> bool {
        self.payload.is_done()
    }

    fn wait(self: Box<Self>) -> Result<Tensor> {
        const OP: &str = "recv";
        let CheckedRecv { payload, head, want, src, rank } = *self;
        let shared = payload.shared.clone();
        let out = Box::new(payload).wait()?;
        let got = head.to_device(&tp_core::Device::Cpu).and_then(|t| t.to_i64_vec()).map_err(tensor_err(OP))?;
        if got != want {
            let why = format!("rank {src} sent {} but rank {rank} expected {}", describe(&got), describe(&want));
            let mut hdl = shared.handle();
            // Aborted with the reason (later calls return it), reported as the thread backend does.
            let _ = shared.fail(&mut hdl, OP, why.clone());
            return Err(CommError::Mismatch { op: "send/recv".into(), why });
        }
        Ok(out)
    }
}
