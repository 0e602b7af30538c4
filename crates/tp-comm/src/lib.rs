//! # tp-comm
//!
//! Collectives for tp.
//!
//! * [`Communicator`]: `all_gather` along a dim (uneven shards exact), `all_reduce` (sum, max,
//!   min, avg), `reduce_scatter`, `broadcast`, `barrier`, and `_into` variants that write into a
//!   caller's tensor.
//! * [`LocalGroup`]: N ranks as threads of one process, host or CUDA tensors (ranks may share a
//!   GPU). A rank that fails, panics or times out poisons the group; no wait is unbounded.
//! * [`DeviceGroup`]: what a layer holds: a communicator and this rank's device.
//!
//! The torchrun-style rendezvous (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) and the
//! NCCL backend (loaded at run time) come next in this crate.

mod communicator;
mod error;
mod group;
mod local;
mod reduce;

pub use communicator::{Communicator, ReduceOp};
pub use error::{CommError, Result};
pub use group::DeviceGroup;
pub use local::{DEFAULT_TIMEOUT, LocalGroup};
pub use tp_core;
