//! # tp-train
//!
//! Training a tensor-parallel model: the optimizer ([`optim`]: AdamW with torch's semantics over
//! fp32 master weights), the learning-rate schedules ([`schedule`]: transformers' constant,
//! linear and cosine with warmup), and the data reader ([`data`]: JSONL rows of token ids and
//! labels, text, or chat messages), and the distributed optimizer ([`zero`]: ZeRO stage 1 over the
//! data-parallel replicas).

mod error;

pub mod checkpoint;
pub mod data;
pub mod optim;
pub mod pipeline;
mod run;
pub mod schedule;
mod trainer;
pub mod zero;

pub use error::{Result, TrainError};
pub use run::{RunOptions, run, run_stages};
pub use trainer::{
    Accumulated, ExpertGroups, ParamState, StepGroups, StepLog, TrainConfig, Trainer, is_routed_expert_name,
};
