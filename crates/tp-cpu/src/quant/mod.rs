//! Quantized weights in llama.cpp's ggml block formats ([`QuantType`]): [`dequantize`] (bit-exact
//! with ggml) and [`quant_matmul`] (`y = x W^T` with integer dot products for decode and the
//! packed GEMM on dequantized tiles or, on AVX512-VNNI for Q4_0 / Q4_K / Q6_K, an integer GEMM
//! for prefill).
//!
//! Files: `types` ([`QuantType`]), `blocks` (the byte layouts, a scalar block decoder),
//! `dequant` ([`dequantize`]), `act` (activation quantization to Q8_0 / Q8_K), `dot_portable`
//! (scalar integer dots), `simd` (the x86 dot-product instructions and helpers), `dot_legacy` and
//! `dot_kquant` (the x86 kernels of the 32- and 256-element formats), `dot_x86` (their
//! `#[target_feature]` entry points, AVX2 and AVX512-VNNI), `matmul` ([`quant_matmul`]: checks,
//! the decode paths, the split over the pool), `igemm` (its integer GEMM for prefill on
//! AVX512-VNNI), `prefill` (its dequantizing GEMM path), `interleave` (Q4_0,
//! Q4_K and Q6_K rows eight at a time, [`RowLayout`]) and `dot_q4x8`, `dot_q4kx8`, `dot_q6kx8`
//! (their decode kernels).

mod act;
mod blocks;
mod dequant;
mod dot_portable;
mod interleave;
mod matmul;
mod prefill;
mod types;

#[cfg(target_arch = "x86_64")]
mod dot_kquant;
#[cfg(target_arch = "x86_64")]
mod dot_legacy;
#[cfg(target_arch = "x86_64")]
mod dot_q4kx8;
#[cfg(target_arch = "x86_64")]
mod dot_q4x8;
#[cfg(target_arch = "x86_64")]
mod dot_q6kx8;
#[cfg(target_arch = "x86_64")]
mod dot_x86;
#[cfg(target_arch = "x86_64")]
mod igemm;
#[cfg(target_arch = "x86_64")]
mod simd;

pub use dequant::{dequantize, dequantize_part};
pub use interleave::{RowLayout, to_layout};
pub use matmul::{PairEpilogue, QuantPart, quant_matmul, quant_matmul_paired, quant_matmul_parts};
pub use types::QuantType;
