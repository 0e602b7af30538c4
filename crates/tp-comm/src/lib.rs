//! # tp-comm
//!
//! Collectives for tp. This crate will hold the `Communicator` trait (`all_gather` along a dim
//! with uneven shards, `all_reduce`, `reduce_scatter`, `broadcast`, `barrier`), `LocalGroup`
//! (ranks as threads of one process), the NCCL backend (`libnccl.so.2` loaded at run time), the
//! torchrun-style rendezvous (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) and
//! `DeviceGroup`, the user-facing group. Every wait will carry a deadline.
//!
//! It is empty until the collectives issue lands; today it only re-exports `tp-core`, on which
//! it builds.

pub use tp_core;
