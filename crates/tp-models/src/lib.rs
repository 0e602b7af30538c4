//! # tp-models
//!
//! Whole tensor-parallel causal language models built from `tp-layers`: a Hugging Face
//! checkpoint folder (`config.json` plus safetensors) to tokens at any world size.
//!
//! * [`ModelConfig`]: `config.json` of the families in the architecture table
//!   ([`Architecture`]: Llama, Qwen2, Qwen3, Mistral, Gemma 3, Phi-3, OLMo 2), in the
//!   transformers 4 and 5 forms, validated field by field.
//! * [`ParallelCausalLm`]: each rank loads only its shards of every tensor;
//!   [`prefill`](ParallelCausalLm::prefill) (logits of every prompt position),
//!   [`decode_step`](ParallelCausalLm::decode_step) (the next position's) and
//!   [`generate`](ParallelCausalLm::generate) (greedy, through the KV caches; every rank gets
//!   the same tokens).
//! * Continuous batching: [`forward_batch`](ParallelCausalLm::forward_batch) runs one step of
//!   several sequences as a flat token batch over paged KV caches
//!   ([`new_paged_caches`](ParallelCausalLm::new_paged_caches)) and returns this rank's
//!   vocabulary columns of the chosen rows' logits ([`vocab_shard`](ParallelCausalLm::vocab_shard)).
//!
//! ```no_run
//! use std::time::Duration;
//! use tp_comm::DeviceGroup;
//! use tp_core::Device;
//! use tp_models::{GenerateOptions, ModelOptions, ParallelCausalLm};
//! # fn main() -> tp_models::Result<()> {
//! // Two ranks as threads on the CPU; every rank runs the same program on its own group.
//! let groups = DeviceGroup::local(2, Duration::from_secs(60), |_| Device::Cpu)?;
//! std::thread::scope(|s| {
//!     for g in groups {
//!         s.spawn(move || -> tp_models::Result<()> {
//!             let mut lm = ParallelCausalLm::load("path/to/TinyLlama", &g, &ModelOptions::new())?;
//!             let out = lm.generate(&[1, 415, 2936], 16, &GenerateOptions::new())?;
//!             println!("rank {}: {:?}", g.rank(), out.tokens);
//!             Ok(())
//!         });
//!     }
//! });
//! # Ok(()) }
//! ```

pub mod adapter;
mod arch;
mod blocks;
mod checkpoint_layout;
mod config;
mod error;
mod fields;
pub mod gguf;
#[cfg(feature = "tokenizers")]
pub mod gguf_tokenizer;
mod model;
mod moe_config;
mod rope_config;
mod rope_kinds;
mod source;
mod tensors;

pub use arch::Architecture;
pub use checkpoint_layout::to_checkpoint_layout;
pub use config::{LayerType, MAX_CONFIG_BYTES, ModelConfig};
pub use error::{ModelError, Result};
pub use model::{
    BlockHook, GenerateOptions, Generation, Handoff, INITIAL_CACHE_POSITIONS, MicroBatch, MicroBatchLoss, ModelOptions,
    ParallelCausalLm, Recompute, StageForward, StageOutput, StagePart, StageSaved, TrainRow, parse_layer_partition,
    partition_layers, stage_parts,
};
pub use moe_config::MoeSettings;
pub use rope_kinds::{RopeKindError, rope_scaling_from_kind};
pub use source::ModelSource;
pub use tensors::expected_tensors;
pub use tp_comm;
pub use tp_core;
pub use tp_layers;
