//! # tp-layers
//!
//! The crate users depend on: Megatron-style tensor-parallel layers over `tp-core` tensors and
//! `tp-comm` collectives, and sharded loading from Hugging Face safetensors checkpoints.
//!
//! * [`Linear`]: `y = x W^T + b`, `W: [out, in]`.
//! * [`ColumnParallel`]: `W` split by rows (output features); forward is local; outputs joined by
//!   `DeviceGroup::all_gather` when needed.
//! * [`RowParallel`]: `W` split by columns (input features); local GEMM, one all-reduce, bias
//!   once after it.
//! * [`MergedColumnParallel`] (gate and up in one GEMM) and [`QkvParallel`] (whole heads, KV heads
//!   replicated past their count).
//! * [`ParallelMlp`]: SwiGLU, `down(silu(gate(x)) * up(x))`, one all-reduce per forward.
//! * [`Checkpoint`]: memory-mapped safetensors (single file or index), reading only a rank's
//!   bytes of each tensor.
//!
//! Every rank uses `tp_core::TensorShard`'s balanced split, so shards may be uneven.

mod checkpoint;
mod column;
mod error;
pub mod example_mlp;
mod linear;
mod merged;
mod mlp;
mod qkv;
mod row;

pub use checkpoint::{Checkpoint, save};
pub use column::ColumnParallel;
pub use error::{LayerError, Result};
pub use linear::Linear;
pub use merged::MergedColumnParallel;
pub use mlp::ParallelMlp;
pub use qkv::{QkvLayout, QkvParallel};
pub use row::RowParallel;
pub use tp_comm;
pub use tp_core;
