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
//! * [`set_prefill_attention_gemms`]: this thread's prefill attention as GEMMs over score tiles
//!   or row by row, instead of the machine's choice (for tests that cover both paths).

pub use tp_cpu::{CpuKernel, batch_invariant, num_threads, set_batch_invariant};

/// Runs `f` with `kernel` as this thread's host kernel family (the threads a product fans out to
/// follow the calling thread's choice). For tests and benchmarks that compare paths.
///
/// Errors: [`Error::KernelUnavailable`](crate::Error::KernelUnavailable) if this CPU cannot run
/// `kernel`.
pub fn with_kernel<R>(kernel: CpuKernel, f: impl FnOnce() -> R) -> crate::Result<R> {
    Ok(tp_cpu::with_kernel(kernel, f)?)
}

thread_local! {
    static ATTENTION_GEMMS: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// This thread's prefill attention (the single-sequence op from 8 queries, the paged op's long
/// chunks): `Some(true)` as GEMMs over score tiles, `Some(false)` row by row, `None` the
/// machine's choice ([`prefill_attention_as_gemms`]). Both compute the same f32 math to within
/// rounding; for tests and benchmarks that compare the paths.
pub fn set_prefill_attention_gemms(choice: Option<bool>) {
    ATTENTION_GEMMS.with(|c| c.set(choice));
}

/// Whether this thread's prefill attention runs as GEMMs: as set by
/// [`set_prefill_attention_gemms`], else not on AVX-512 machines, where the rows of a GQA group
/// go through 16-lane vectors together and measured faster at every prompt length tried (Zen 4,
/// 2 threads, TinyLlama's heads, bf16: 128 tokens 2.1-2.6 ms against 2.2-3.1, 512 tokens 19-23
/// against 36-44, 2048 tokens 237-247 against 282-323), and as GEMMs elsewhere.
pub fn prefill_attention_as_gemms() -> bool {
    ATTENTION_GEMMS.with(|c| c.get()).unwrap_or_else(|| {
        #[cfg(target_arch = "x86_64")]
        {
            !(std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma"))
        }
        #[cfg(not(target_arch = "x86_64"))]
        true
    })
}
