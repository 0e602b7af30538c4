//! Where a thread's host time goes: the seconds the calling thread spent in matrix products
//! ([`Phase::Gemm`]: dense and quantized) and in attention ([`Phase::Attention`]: the paged and
//! single-sequence kernels and the writes of keys and values into a cache), summed per thread
//! until [`take`] reads and resets them. A serving engine takes them around each step's forward
//! pass: what the forward spent outside both is its element-wise work (norms, residuals, RoPE,
//! activations, embedding, copies).
//!
//! Only the outermost timed call of a thread counts, so a product inside another timed op is
//! never counted twice. The cost is two clock reads per timed op.

use std::cell::Cell;
use std::time::{Duration, Instant};

/// A kind of host work that is timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Matrix products (`matmul`, `linear`, quantized products).
    Gemm,
    /// Attention and cache writes.
    Attention,
}

/// Seconds spent per [`Phase`] by one thread since its last [`take`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PhaseTimes {
    /// In matrix products.
    pub gemm: Duration,
    /// In attention and cache writes.
    pub attention: Duration,
}

thread_local! {
    static SPENT: Cell<PhaseTimes> = const { Cell::new(PhaseTimes { gemm: Duration::ZERO, attention: Duration::ZERO }) };
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Runs `f`, adding its time to `phase` of this thread unless a timed call is already running
/// on it.
pub(crate) fn timed<R>(phase: Phase, f: impl FnOnce() -> R) -> R {
    let depth = DEPTH.with(|d| d.replace(d.get() + 1));
    let start = (depth == 0).then(Instant::now);
    let r = f();
    DEPTH.with(|d| d.set(depth));
    if let Some(start) = start {
        let spent = start.elapsed();
        SPENT.with(|s| {
            let mut t = s.get();
            match phase {
                Phase::Gemm => t.gemm += spent,
                Phase::Attention => t.attention += spent,
            }
            s.set(t);
        });
    }
    r
}

/// This thread's times since its last call, reset to zero.
pub fn take() -> PhaseTimes {
    SPENT.with(|s| s.replace(PhaseTimes::default()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_calls_count_once_and_take_resets() {
        let _ = take();
        let pause = Duration::from_millis(5);
        timed(Phase::Gemm, || {
            std::thread::sleep(pause);
            timed(Phase::Attention, || std::thread::sleep(pause));
        });
        timed(Phase::Attention, || std::thread::sleep(pause));
        let t = take();
        assert!(t.gemm >= 2 * pause, "{t:?}");
        assert!(t.attention >= pause && t.attention < 2 * pause, "{t:?}");
        assert_eq!(take(), PhaseTimes::default());
    }
}
