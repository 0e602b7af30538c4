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
//! * [`VocabParallelEmbedding`] (rows of the table per rank, masked lookup + all-reduce) and
//!   [`ParallelLmHead`] (logits gathered exactly, or a greedy argmax that gathers only each
//!   rank's maximum); tied embeddings share the shard.
//! * [`RmsNorm`] (replicated), [`ParallelAttention`] (heads per rank, RoPE, GQA attention over
//!   a per-rank [`KvCache`], head-aligned row-parallel output projection), [`DecoderLayer`].
//! * [`Checkpoint`]: memory-mapped safetensors (single file or index), reading only a rank's
//!   bytes of each tensor, and [`Loader`]: the checkpoint seen from one rank, scoped to a
//!   prefix (`ld.pp("mlp")`). Every layer loads with `load(&loader, ..)`: rank, world size and
//!   device come from the group it will run on, which the layer keeps; `forward` takes only
//!   the inputs. Fused checkpoint tensors (Phi-3's `qkv_proj`, `gate_up_proj`) are split by
//!   [`Projections`], each part sharded on its own.
//! * [`PagedKvCache`] and [`TokenBatch`]: several sequences' next tokens as one flat batch
//!   over a block-table KV cache ([`ParallelAttention::forward_batch`],
//!   [`Block::forward_batch`]; one all-reduce per layer part for the whole batch).
//! * [`Block`]: a model is a list of blocks ([`DecoderLayer`]: attention and MLP with up to
//!   four norms, q/k norms, SwiGLU or GeGLU).
//!
//! Every rank uses `tp_core::TensorShard`'s balanced split, so shards may be uneven.
//!
//! ```
//! use std::time::Duration;
//! use tp_comm::DeviceGroup;
//! use tp_core::{DType, Device, Tensor};
//! use tp_layers::{ColumnParallel, Linear};
//! # fn main() -> tp_layers::Result<()> {
//! let cpu = Device::Cpu;
//! // A full [out = 10, in = 8] layer; 3 ranks hold 4, 3 and 3 of its output rows.
//! let full = Linear::new(Tensor::rand(&[10, 8], DType::F32, 1, &cpu)?, Some(Tensor::rand(&[10], DType::F32, 2, &cpu)?))?;
//! let x = Tensor::rand(&[5, 8], DType::F32, 3, &cpu)?;
//! let groups = DeviceGroup::local(3, Duration::from_secs(10), |_| cpu)?;
//! let outputs = std::thread::scope(|s| {
//!     let handles: Vec<_> = groups
//!         .into_iter()
//!         .map(|g| {
//!             let (full, x) = (&full, &x);
//!             s.spawn(move || -> tp_layers::Result<Tensor> {
//!                 let layer = ColumnParallel::from_full(full, &g)?; // keeps g
//!                 assert_eq!(layer.forward(x)?.dims(), &[5, layer.shard().len()]); // local block
//!                 layer.forward_gathered(x) // all ranks get the full [5, 10]
//!             })
//!         })
//!         .collect();
//!     handles.into_iter().map(|h| h.join().expect("rank thread")).collect::<Vec<_>>()
//! });
//! let want = full.forward(&x)?.to_f64_vec()?;
//! for y in outputs {
//!     let got = y?.to_f64_vec()?;
//!     assert!(got.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-5));
//! }
//! # Ok(()) }
//! ```

mod attention;
mod batch;
mod checkpoint;
mod column;
mod decoder;
mod embedding;
mod error;
mod files;
mod gguf_tensors;
mod grad;
mod kv_cache;
mod linear;
mod lm_head;
mod loader;
pub mod lora;
mod loss;
mod merged;
mod mlp;
mod moe;
mod moe_dispatch;
mod mxfp4;
mod norm;
mod options;
mod paged_cache;
mod parts;
mod qkv;
mod row;
mod seq_batch;
mod text;
mod weight;

pub use attention::{AttentionConfig, AttentionNames, AttentionSaved, ParallelAttention, QkNorm, QkNormSpan};
pub use batch::{BatchSeq, TokenBatch};
pub use checkpoint::{Checkpoint, save};
pub use column::ColumnParallel;
pub use decoder::{Block, BlockNorms, BlockSaved, DecoderConfig, DecoderLayer, DecoderNames, FeedForward};
pub use embedding::VocabParallelEmbedding;
pub use error::{LayerError, Result};
pub use gguf_tensors::{GgufPart, GgufTensor, RowOrder};
pub use grad::{
    Gather, Grad, NORM_CHUNK, Param, Placement, defer_weight_grads, gather_blocks, gather_full, local_from_full,
    owned_chunk_squares, owned_sum_squares, sum_chunks, sync_partial_grads,
};
pub use kv_cache::KvCache;
pub use linear::Linear;
pub use lm_head::ParallelLmHead;
pub use loader::Loader;
pub use loss::LossOutput;
pub use merged::MergedColumnParallel;
pub use mlp::{MlpNames, MlpSaved, ParallelMlp};
pub use moe::{ExpertPlacement, FusedExperts, MoeConfig, MoeNames, MoeSaved, ParallelMoe, RouterStats};
pub use norm::RmsNorm;
pub use options::LoadOptions;
pub use paged_cache::PagedKvCache;
pub use parts::Projections;
pub use qkv::{AttentionHeads, QkvLayout, QkvParallel};
pub use row::RowParallel;
pub use seq_batch::SeqBatch;
pub use text::quote_text;
pub use tp_comm;
pub use weight::Weight;

/// The contents of the file `path`, as UTF-8, if it is (after following symlinks) a regular file
/// of at most `limit` bytes: what tp reads from a model folder besides the safetensors files
/// (configs, tokenizers). A named pipe or a device is an error at once, never a blocked `open`.
pub fn read_text_file(path: &std::path::Path, limit: u64) -> Result<String> {
    files::read_text(path, limit)
}
pub use tp_core;
