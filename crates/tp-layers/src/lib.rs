//! # tp-layers
//!
//! The crate users depend on. It will compose `tp-core` tensors and `tp-comm` collectives into
//! Megatron-style layers: `Linear` (weight `[out, in]`, `y = x W^T + b`), `ColumnParallel` (rank
//! `r` holds rows `start..end` of `W` under `TensorShard`'s balanced policy, forward is a local
//! GEMM, outputs joined by `DeviceGroup::all_gather`), `RowParallel` (a block of input columns,
//! local GEMM, then an all-reduce, bias once after it), merged gate/up and QKV layers, the SwiGLU
//! `ParallelMlp`, and sharded safetensors loading.
//!
//! It is empty until the layers issue lands; today it re-exports the lower crates.

pub use tp_comm;
pub use tp_core;
