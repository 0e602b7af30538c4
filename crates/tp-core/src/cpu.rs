//! The host kernels as tp-core's users see them. The kernels themselves (GEMM, decode-shaped
//! products, the thread pool, run-time ISA dispatch) live in the `tp-cpu` crate; this module
//! re-exports what benchmarks and tests choose and query.
//!
//! * [`CpuKernel`]: which instruction-set family runs (detected at run time; `TP_CPU_KERNEL`
//!   caps it; [`with_kernel`] overrides it for one call, for tests and benchmarks).
//! * [`num_threads`]: the threads of the persistent pool every host kernel runs on;
//!   [`par_tasks`] runs independent tasks on it, each task's products on its own thread.
//! * [`set_batch_invariant`]: this thread's products give each row the same bits whatever the
//!   number of rows (the packed GEMM only), and paged attention computes prefill rows one by one
//!   as decode rows (not through score tiles).
//! * [`set_prefill_attention_gemms`]: this thread's prefill attention as GEMMs over score tiles
//!   or row by row, instead of the machine's choice (for tests that cover both paths).

pub use tp_cpu::{CpuKernel, batch_invariant, num_threads, par_tasks, set_batch_invariant};

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

/// Keys up to which AVX-512 machines attend row by row: at 4096 keys the two paths measured
/// alike (1006 against 1079 ms for a 4096-token prompt), at 8192 the score tiles win (4.6 s
/// against 6.2: each row reads all its keys again, and they no longer stay in cache).
const ROWS_MAX_KEYS: usize = 4096;

/// Whether this thread's prefill attention over `keys` keys runs as GEMMs: as set by
/// [`set_prefill_attention_gemms`]; else on AVX-512 machines only past 4096 keys (below, the
/// rows of a GQA group go through 16-lane vectors together and measured faster: Zen 4, 2
/// threads, TinyLlama's heads, bf16: 128 tokens 2.1-2.6 ms against 2.2-3.1, 512 tokens 19-23
/// against 36-44, 2048 tokens 237-252 against 282-323), and always elsewhere.
pub fn prefill_attention_as_gemms(keys: usize) -> bool {
    ATTENTION_GEMMS.with(|c| c.get()).unwrap_or_else(|| {
        #[cfg(target_arch = "x86_64")]
        {
            keys > ROWS_MAX_KEYS
                || !(std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma"))
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = keys;
            true
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_attention_takes_the_gemms_past_the_rows_limit_and_as_set() {
        #[cfg(target_arch = "x86_64")]
        let avx512 = std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma");
        #[cfg(not(target_arch = "x86_64"))]
        let avx512 = false;
        assert_eq!(prefill_attention_as_gemms(ROWS_MAX_KEYS), !avx512);
        assert!(prefill_attention_as_gemms(ROWS_MAX_KEYS + 1));
        for choice in [true, false] {
            set_prefill_attention_gemms(Some(choice));
            assert_eq!(prefill_attention_as_gemms(1), choice);
            assert_eq!(prefill_attention_as_gemms(1 << 20), choice);
        }
        set_prefill_attention_gemms(None);
        // Another thread keeps the machine's choice.
        set_prefill_attention_gemms(Some(avx512));
        let other = std::thread::spawn(|| prefill_attention_as_gemms(16)).join().unwrap();
        assert_eq!(other, !avx512);
        set_prefill_attention_gemms(None);
    }
}
