//! Point-to-point on NCCL: `ncclSend` / `ncclRecv` between pipeline stages.
//!
//! Every message is a small header (the dtype and up to [`MAX_DIMS`] dims, as `i64`s) followed
//! by the payload, both sent in one NCCL group on the rank's stream. The receiver takes the
//! header first and reads it on the host (a synchronisation: it waits until the sender has
//! posted), checks it against the dims and dtype it expects, then posts the payload's receive.
//! A mismatch aborts the communicator with a message naming both shapes: the receiver's call
//! returns a [`CommError::Mismatch`] and every later call on it the reason. The sender's
//! payload send can then never complete, so its work fails too, but only at its deadline
//! (through the watchdog): NCCL does not tell peers that a communicator was aborted. Messages
//! between two ranks are matched in the order they are posted, as NCCL matches them; a lock
//! keeps one receive's header and payload together when clones of a group receive from
//! several threads.
//!
//! Ordering hazard: every operation of a rank runs in order on its one stream, and a receive
//! waits on the host for its header. So two ranks that each post a send to the other before
//! their receives (a ring of `send_async` then `recv`, or 1F1B's neighbours sending an
//! activation and a gradient to each other) can each wait for the other's stream: the sends
//! may complete on their own while they fit in NCCL's buffers, otherwise both sides fail at
//! the deadline. NCCL's answer is to group such a send with its receive, which the header's
//! host check rules out; callers order them instead (one side receives first).
//!
//! This path has not run on a GPU yet: it compiles and is reasoned about, not tested.

use super::*;

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

    /// Header and payload of `x` to `dst`, in one group; the work completes (with `x`) once
    /// both are received.
    pub(super) fn send_enqueue(&self, x: &Tensor, dst: usize) -> Result<Work> {
        const OP: &str = "send";
        let peer = self.check_peer(OP, dst)?;
        let src = self.device_input(OP, x)?;
        let header = header_of(OP, x.dims(), x.dtype())?;
        let bytes: Vec<u8> = header.iter().flat_map(|v| v.to_le_bytes()).collect();
        let gpu = &self.shared.gpu;
        let head = gpu.htod(&bytes).map_err(|e| CommError::Tensor { op: OP, source: e.into() })?;
        let stream = gpu.stream();
        let (h, h_guard) = head.device_ptr(stream);
        let (s, s_guard) = src.device_ptr(stream);
        let (count, dt) = (x.numel(), nccl_dtype(x.dtype()));
        let event = self.enqueue(OP, |comm, stream| {
            let lib = self.shared.nccl.lib();
            // SAFETY: group calls take no pointers.
            let mut first = unsafe { lib.ncclGroupStart() };
            // SAFETY: `head` holds HEADER i64 words and `src` exactly `count` elements of `dt`
            // (a tensor's buffer holds its elements); both guards are held until the group has
            // enqueued, and freeing either is ordered on this stream after the sends.
            let r = unsafe {
                lib.ncclSend(h as usize as *const c_void, HEADER, ncclDataType_t::ncclInt64, peer, comm, stream)
            };
            if first == ncclResult_t::ncclSuccess {
                first = r;
            }
            if count > 0 {
                // SAFETY: as above.
                let r = unsafe { lib.ncclSend(s as usize as *const c_void, count, dt, peer, comm, stream) };
                if first == ncclResult_t::ncclSuccess {
                    first = r;
                }
            }
            // SAFETY: closes the group opened above; always called.
            let end = unsafe { lib.ncclGroupEnd() };
            if first == ncclResult_t::ncclSuccess { end } else { first }
        })?;
        drop((h_guard, s_guard));
        drop(head); // freed in stream order, after the send
        Ok(self.work(OP, x.clone(), event))
    }

    /// Takes the header from `src` (waiting for it on the host), checks it, then posts the
    /// payload's receive; the work returns the tensor.
    pub(super) fn recv_enqueue(&self, dims: &[usize], dtype: DType, src: usize) -> Result<Work> {
        const OP: &str = "recv";
        let peer = self.check_peer(OP, src)?;
        let want = header_of(OP, dims, dtype)?;
        let bytes = dims
            .iter()
            .try_fold(dtype.size_in_bytes(), |a, &d| a.checked_mul(d))
            .ok_or_else(|| CommError::Limit { op: OP, why: format!("a {dims:?} {dtype} tensor overflows usize") })?;
        // The header's receive and the payload's are posted back to back: another thread's
        // receive on a clone of this communicator must not come between them.
        let _order = lock(&self.shared.recv_order);
        let mut head = self.alloc(HEADER * 8)?;
        let stream = self.shared.gpu.stream();
        let (h, h_guard) = head.device_ptr_mut(stream);
        // SAFETY: `head` was just allocated with HEADER i64 words; its guard is held until the
        // receive has enqueued.
        let event = self.enqueue(OP, |comm, stream| unsafe {
            self.shared.nccl.lib().ncclRecv(
                h as usize as *mut c_void,
                HEADER,
                ncclDataType_t::ncclInt64,
                peer,
                comm,
                stream,
            )
        })?;
        drop(h_guard);
        let head = self.work(OP, self.wrap(OP, head, &[HEADER], DType::I64)?, event).wait()?;
        let got = head.to_device(&tp_core::Device::Cpu).and_then(|t| t.to_i64_vec()).map_err(tensor_err(OP))?;
        if got != want {
            let why = format!("rank {src} sent {} but rank {} expected {}", describe(&got), self.rank, describe(&want));
            let mut hdl = self.shared.handle();
            // Aborted with the reason (later calls return it), reported as the thread backend does.
            let _ = self.shared.fail(&mut hdl, OP, why.clone());
            return Err(CommError::Mismatch { op: "send/recv".into(), why });
        }
        let count: usize = dims.iter().product();
        let mut out = self.alloc(bytes)?;
        if count == 0 {
            return Ok(Work::done(self.wrap(OP, out, dims, dtype)));
        }
        let (d, d_guard) = out.device_ptr_mut(stream);
        let dt = nccl_dtype(dtype);
        // SAFETY: `out` was just allocated with `count` elements of `dt`, the count the sender's
        // header announced; its guard is held until the receive has enqueued.
        let event = self.enqueue(OP, |comm, stream| unsafe {
            self.shared.nccl.lib().ncclRecv(d as usize as *mut c_void, count, dt, peer, comm, stream)
        })?;
        drop(d_guard);
        Ok(self.work(OP, self.wrap(OP, out, dims, dtype)?, event))
    }
}
