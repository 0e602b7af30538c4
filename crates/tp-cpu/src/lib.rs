//! # tp-cpu
//!
//! tp's host compute kernels, below `tp-core` (which turns tensors into the slices these take):
//!
//! * [`CpuKernel`]: which instruction-set family runs, detected at run time (`features`;
//!   `TP_CPU_KERNEL` caps it; [`with_kernel`] overrides it for one call, for tests and
//!   benchmarks). `dispatch` maps a family and an element type to a micro-kernel.
//! * [`matmul()`]: `y = x W^T + bias` or `y = x W + bias` with `f32` accumulation, over `f32`,
//!   `f16` and `bf16` ([`Float`]). Few rows against an `[N, K]` weight run the decode kernel
//!   (`gemv`: the weight streamed once, in its own dtype, at memory bandwidth); everything else
//!   the packed GEMM (`gemm`: panels from `pack`, register-tiled micro-kernels in `ukernel`:
//!   AVX-512 `f32`, AVX512-BF16 `vdpbf16ps`, portable / AVX2; AMX tiles in `amx`, written
//!   against the instruction interface of `tiles`, with a software model of the instructions
//!   in `amx_model` so machines without AMX test the AMX code).
//! * [`PackedWeight`] and [`matmul_packed()`]: a weight packed once (`packed`) and multiplied
//!   many times (decode steps against the same model weights) without packing it on each call,
//!   bitwise the same as [`matmul()`].
//! * [`num_threads`], [`par_rows`] and [`par_row_groups`]: the persistent thread pool (`pool`) every kernel runs on.
//! * [`WeightBuf`] (`weight_buf`): weight bytes on 2 MiB transparent huge pages, which decode
//!   streams with far fewer TLB misses.
//! * [`quant`]: weights in llama.cpp's ggml block formats ([`quant::QuantType`]: Q4_0 .. Q8_0,
//!   Q2_K .. Q6_K, and the float types): [`quant::dequantize`], bit-exact with ggml, and
//!   [`quant::quant_matmul`]: for decode and small batches, `x` quantized once to 8-bit blocks
//!   (Q8_0 / Q8_K) and each weight row streamed once through integer dot products (AVX512-VNNI
//!   `vpdpbusd`, AVX2 `vpmaddubsw`, or portable); for prefill, tiles of the weight dequantized to
//!   `bf16` for the packed GEMM.
//!
//! Every `unsafe` here is SIMD (`std::arch` intrinsics behind run-time feature checks, with the
//! raw block reads of the quantized kernels after their length checks), inline assembly (AMX, the
//! `arch_prctl` system call), the allocation and `madvise` of [`WeightBuf`], or raw pointers handed to the pool's tasks for disjoint parts of
//! one output; each block states its conditions in a `SAFETY` comment.
//!
//! Module dependencies, acyclic (besides the leaves `element`, `error` and `shape`, which any
//! module may use): `matmul` → `gemm`, `gemv`, `dispatch`, `packed`; `packed` → `gemm`,
//! `dispatch`; `gemm` → `amx`, `pack`, `ukernel`, `pool`, `dispatch`, `tiles`; `gemv` →
//! `dispatch`, `pool`; `pack` → `dispatch`; `amx` → `amx_model`, `tiles`; `amx_model` →
//! `tiles`; `dispatch` → `features`, `tiles`; `quant` → `gemm`, `matmul` (the batch-invariant
//! setting), `gemv` (its pairwise lane sum), `dispatch`, `pool`; `features`, `tiles`, `pool` and `ukernel` use no other module.

mod amx;
mod amx_model;
mod dispatch;
mod element;
mod error;
mod features;
mod gemm;
mod gemv;
mod matmul;
mod pack;
mod packed;
mod pool;
pub mod quant;
mod shape;
mod tiles;
mod transpose;
mod ukernel;
mod weight_buf;

pub use dispatch::{CpuKernel, with_kernel};
pub use element::{Float, FloatKind, bf16_rounded};
pub use error::{Error, Result};
pub use matmul::{
    batch_invariant, matmul, matmul_packed, matmul_packed_rounded, matmul_rounded, matmul_tn, matmul_tn_acc,
    set_batch_invariant,
};
pub use packed::PackedWeight;
pub use pool::{num_threads, par_row_groups, par_rows, par_tasks};
pub use shape::{GemmShape, Layout};
pub use weight_buf::WeightBuf;
