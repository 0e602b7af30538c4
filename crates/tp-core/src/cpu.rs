//! The host kernels as tp-core's users see them. The kernels themselves (GEMM, decode-shaped
//! products, the thread pool, run-time ISA dispatch) live in the `tp-cpu` crate; this module
//! re-exports what benchmarks and tests choose and query.
//!
//! * [`CpuKernel`]: which instruction-set family runs (detected at run time; `TP_CPU_KERNEL`
//!   caps it; [`with_kernel`] overrides it for one call, for tests and benchmarks).
//! * [`num_threads`]: the threads of the persistent pool every host kernel runs on.
//! * [`set_batch_invariant`]: this thread's products give each row the same bits whatever the
//!   number of rows (the packed GEMM only), and paged attention computes prefill rows one by one
//!   as decode rows (not through score tiles).

pub use tp_cpu::{CpuKernel, batch_invariant, num_threads, set_batch_invariant};

/// Runs `f` with `kernel` as this thread's host kernel family (the threads a product fans out to
/// follow the calling thread's choice). For tests and benchmarks that compare paths.
///
/// Errors: [`Error::KernelUnavailable`](crate::Error::KernelUnavailable) if this CPU cannot run
/// `kernel`.
pub fn with_kernel<R>(kernel: CpuKernel, f: impl FnOnce() -> R) -> crate::Result<R> {
    Ok(tp_cpu::with_kernel(kernel, f)?)
}
