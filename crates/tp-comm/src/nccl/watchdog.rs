//! The watchdog of one NCCL communicator (PyTorch's ProcessGroupNCCL model): a thread that
//! watches the enqueued work and `ncclCommGetAsyncError`. When the oldest work is still running
//! past its deadline, or NCCL reports an asynchronous error, it aborts the communicator; the
//! error then surfaces at the next call or wait on this rank, and the abort makes the peers'
//! NCCL operations fail instead of hanging. The host never waits inside a collective.

use super::state::{Shared, lock};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// How often pending work is checked.
const POLL: Duration = Duration::from_millis(1);
/// How long the idle watchdog sleeps between checks of the stop flag.
const IDLE: Duration = Duration::from_millis(100);

/// Starts the watchdog of `shared`; it returns once `shared.stop` is set.
pub(super) fn start(shared: Arc<Shared>) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name("tp-nccl-watchdog".into()).spawn(move || run(&shared))
}

/// What one look at the queue found.
enum Verdict {
    Fine,
    /// Querying an event failed (a sticky CUDA error).
    QueryFailed(String),
    /// The oldest work, of this collective, passed its deadline.
    Late(&'static str),
}

fn run(shared: &Shared) {
    // Event queries need this rank's context current on this thread.
    if let Err(e) = shared.gpu.context().bind_to_thread() {
        let mut h = shared.handle();
        let _ = shared.fail(&mut h, "watchdog", format!("cannot bind the CUDA context: {e:?}"));
        return;
    }
    loop {
        let verdict = {
            let mut q = lock(&shared.pending);
            while q.is_empty() && !shared.stop.load(Ordering::SeqCst) {
                q = shared.wake.wait_timeout(q, IDLE).unwrap_or_else(|e| e.into_inner()).0;
            }
            if shared.stop.load(Ordering::SeqCst) {
                return; // the communicator is closing; its Drop settles what is left
            }
            // One stream: work completes in the order it was enqueued.
            let mut query_error = None;
            while let Some(front) = q.front() {
                match front.event.try_is_complete() {
                    Ok(true) => {
                        q.pop_front();
                    }
                    Ok(false) => break,
                    Err(e) => {
                        query_error = Some(format!("cuEventQuery failed: {e:?}"));
                        break;
                    }
                }
            }
            let late = q.front().filter(|p| Instant::now() >= p.deadline).map(|p| p.op);
            match (query_error, late) {
                (Some(e), _) => Verdict::QueryFailed(e),
                (None, Some(op)) => Verdict::Late(op),
                (None, None) => Verdict::Fine,
            }
        };
        // The pending lock is released before the handle's is taken (lock order: handle first).
        let mut h = shared.handle();
        match verdict {
            Verdict::QueryFailed(e) => {
                let _ = shared.fail(&mut h, "watchdog", e);
            }
            Verdict::Late(op) => {
                let why = format!("not complete within {:?} (a peer is missing, stuck or dead)", shared.timeout);
                let _ = shared.fail(&mut h, op, why);
            }
            Verdict::Fine if !h.0.is_null() => {
                let _ = shared.async_state(&mut h, "watchdog"); // fails the communicator on an async error
            }
            Verdict::Fine => {}
        }
        drop(h);
        std::thread::sleep(POLL);
    }
}
