//! # tp-core
//!
//! Tensors and tensor shards for **tp**, a tensor-parallel stack in Rust.
//!
//! * [`DType`] (`f32`, `f16`, `bf16`) and the [`Element`] trait tying Rust types to them.
//! * [`Shape`] with checked arithmetic: an overflowing shape is an error, never a wrap, and no
//!   tensor exceeds [`MAX_TENSOR_BYTES`] (1 TiB); host buffers are reserved fallibly
//!   ([`Error::OutOfMemory`]), so no input aborts the process.
//! * [`Device`] and [`Tensor`]: a contiguous row-major array. Host storage today; CUDA storage
//!   joins behind the same API.
//! * Ops: [`Tensor::matmul_t`] (`y = x W^T`, weight `[N, K]` as checkpoints store it),
//!   [`Tensor::matmul`] (weight `[K, N]`), [`Tensor::linear`] (fused bias), [`Tensor::narrow`],
//!   [`Tensor::cat`], [`Tensor::to_dtype`] (round to nearest even). `f16`/`bf16` products
//!   accumulate in `f32`. The host kernels ([`cpu`]) pick AMX, AVX512-BF16, AVX-512, AVX2 or portable
//!   code at run time and run on a persistent pool over all cores.
//! * [`TensorShard`]: which slice of which dimension a rank holds, under one balanced split
//!   policy, with [`TensorShard::shard`] and [`TensorShard::unshard`] as exact inverses.
//!
//! Every function that takes user input returns [`Result`] with a typed [`Error`]; none panics
//! on bad input. This crate needs no CUDA, nvcc or GPU to build or to test.
//!
//! ```
//! use tp_core::{DType, Device, Tensor, TensorShard};
//! # fn main() -> tp_core::Result<()> {
//! let x = Tensor::rand(&[4, 16], DType::F32, 1, &Device::Cpu)?; // [tokens, in]
//! let w = Tensor::rand(&[10, 16], DType::F32, 2, &Device::Cpu)?; // [out, in]
//! // Column parallelism over 3 ranks: rank r holds rows start..end of W (uneven: 4, 3, 3).
//! let parts = (0..3)
//!     .map(|r| x.matmul_t(&TensorShard::new(0, 10, r, 3)?.shard(&w)?))
//!     .collect::<tp_core::Result<Vec<_>>>()?;
//! let y = TensorShard::unshard(&parts, 1)?; // all-gather along the last dim
//! assert_eq!(y.dims(), &[4, 10]);
//! # Ok(()) }
//! ```

mod alloc;
pub mod cpu;
mod device;
mod dtype;
mod error;
mod ops;
pub mod phase;
pub mod rng;
mod shape;
mod shard;
mod storage;
mod tensor;

pub use device::Device;
pub use dtype::{DType, Element, IntElement, Storable, bf16, f16};
pub use error::{Error, Result};
pub use ops::{
    Activation, AdamwParam, AdamwStep, AttentionSpec, KvBuffer, KvGroups, KvQuant, NormStyle, PackedWeight,
    PagedAttentionSpec, PagedSeq, QuantKvBuffer, QuantWeight, RopeScaling, RotaryEmbedding, RouterKind, Routing,
    WeightLayout, adamw_step,
};
/// LoRA's batched multi-adapter product ([`lora::lora_product`]), each row through the
/// adapter of its slot.
pub mod lora {
    pub use crate::ops::{LoraFactors, lora_product};
}
/// Mixture-of-experts routing ([`moe::route`]), the experts' products in one
/// ([`moe::grouped_linear`]), the combine of their outputs ([`moe::moe_combine`]) and the
/// per-thread routing counts ([`moe::take_routed`]).
pub mod moe {
    pub use crate::ops::{grouped_linear, moe_combine, route, softmax, take_routed};
}
pub use shape::{MAX_TENSOR_BYTES, Shape};
pub use shard::TensorShard;
pub use tensor::Tensor;
/// llama.cpp's quantized block formats: their types, dequantization and the host kernels
/// ([`QuantWeight`] holds a layer's blocks).
pub use tp_cpu::quant;
