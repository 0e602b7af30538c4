//! # tp-engine
//!
//! Serving many requests at once on a tensor-parallel model.
//!
//! * [`blocks`]: the paged KV cache's block accounting: fixed-size blocks of positions, a block
//!   table per sequence, a free pool, and prefix caching (full blocks keyed by a hash of their
//!   tokens and their prefix, shared by reference count, evicted least recently used). Every
//!   rank holds the same block ids for its own KV heads.
//! * [`scheduler`]: continuous batching: each step admits work under a token budget (chunked
//!   prefill) and a sequence cap, running decodes first, then waiting requests first come first
//!   served; out of blocks, the newest running sequence is preempted and recomputed later.
//! * [`sampling`]: greedy, temperature, top-k, top-p, min-p, penalties, seeds and logprobs,
//!   computed from each rank's columns of the logits with a few small collectives, exactly as
//!   the same sampler computes on the full logits.
//! * [`api`]: requests, events and the handle a server holds; [`start`] loads a model on its
//!   ranks and returns the running [`Engine`].

pub mod api;
pub mod blocks;
mod engine;
pub mod sampling;
pub mod scheduler;
pub mod spec;

pub use blocks::{BlockId, BlockPool};
pub use engine::{
    DeviceKind, Engine, EngineError, EngineOptions, Fault, ProcessRank, start, start_process_mesh, start_process_rank,
};
pub use scheduler::{ScheduledSeq, Scheduler, SchedulerConfig, StepPlan};
