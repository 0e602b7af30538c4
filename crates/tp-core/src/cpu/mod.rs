//! The host backend's compute kernels: GEMM, decode-shaped products, and the thread pool they
//! run on.
//!
//! * [`CpuKernel`]: which instruction-set family runs (detected at run time; `TP_CPU_KERNEL`
//!   caps it; [`with_kernel`] overrides it for one call, for tests and benchmarks).
//! * GEMM (`gemm`): packed panels and register-tiled micro-kernels, threaded over a persistent
//!   pool (`pool`): AVX-512 `f32`, AVX512-BF16 (`vdpbf16ps`), AMX tiles (`amx`), and portable /
//!   AVX2 code for everything else.
//! * Decode (`gemv`): `M <= 8` rows against an `[N, K]` weight, streaming the weight once in its
//!   own dtype at memory bandwidth.

mod amx;
mod amx_model;
mod dispatch;
pub(crate) mod gemm;
pub(crate) mod gemv;
mod pack;
mod pool;
mod ukernel;

pub use dispatch::{CpuKernel, with_kernel};
pub use pool::num_threads;
pub(crate) use pool::par_rows;
