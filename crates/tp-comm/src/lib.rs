//! # tp-comm
//!
//! Collectives for tp.
//!
//! * [`Communicator`]: `all_gather` along a dim (uneven shards exact), `all_reduce` (sum, max,
//!   min, avg), `reduce_scatter`, `broadcast`, `barrier`, and `_into` variants that write into a
//!   caller's tensor.
//! * [`LocalGroup`]: N ranks as threads of one process, host or CUDA tensors (ranks may share a
//!   GPU). A rank that fails, panics or times out poisons the group; no wait is unbounded.
//! * [`DeviceGroup`]: what a layer holds: a communicator and this rank's device. Point-to-point
//!   `send_async` / `recv` between pipeline stages (ordered per pair of ranks, shapes checked
//!   on both sides, every wait with the deadline), and `send_recv_async` for exchanges that
//!   must progress together (one NCCL group).
//! * [`Mesh`]: a world of `dp × pp × tp` ranks (Megatron's order) and a group per axis.
//!
//! * [`LaunchEnv`] and [`Rendezvous`]: torchrun-style launching (`RANK`, `WORLD_SIZE`,
//!   `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`); rank 0 serves a small, bounded TCP store
//!   ([`store`]) through which ranks register and opaque ids travel. Each step has one
//!   [`Deadline`], and its error reaches every rank within the timeout plus
//!   [`DEADLINE_SLACK`]. Limits: [`MAX_WORLD_SIZE`] ranks, [`MAX_TIMEOUT`]; text from other
//!   processes reaches messages only through [`peer_text`]. [`free_local_port`] picks a
//!   `MASTER_PORT` for a job launched on this machine.
//!
//! * [`nccl`]: the NCCL backend, `libnccl.so.2` loaded at run time ([`nccl::Nccl`]) and a
//!   [`Communicator`] over it ([`nccl::NcclComm`]); [`DeviceGroup::from_env`] sets it all up the
//!   torchrun way.
//! * [`mpi`]: the MPI backend, Open MPI loaded at run time ([`mpi::Mpi`]) and a
//!   [`Communicator`] over it ([`mpi::MpiComm`]): ranks as processes of `mpirun` or `srun`, on
//!   machines without GPUs; [`Mesh::from_mpi`] makes every group of a mesh from it.

//! ```
//! use std::time::Duration;
//! use tp_comm::{DeviceGroup, ReduceOp};
//! use tp_core::{DType, Device, Tensor};
//! // Four ranks as threads; each contributes [r, r] and receives the sum [6, 6].
//! let groups = DeviceGroup::local(4, Duration::from_secs(10), |_| Device::Cpu).unwrap();
//! std::thread::scope(|s| {
//!     for g in groups {
//!         s.spawn(move || {
//!             let x = Tensor::from_vec(vec![g.rank() as f32; 2], &[2], &Device::Cpu).unwrap();
//!             let y = g.all_reduce(&x, ReduceOp::Sum).unwrap();
//!             assert_eq!(y.to_vec::<f32>().unwrap(), vec![6.0, 6.0]);
//!         });
//!     }
//! });
//! ```

mod all_to_all;
mod communicator;
mod deadline;
mod env;
mod error;
mod group;
mod local;
mod mesh;
pub mod mpi;
pub mod nccl;
mod peer_text;
mod port;
mod reduce;
mod rendezvous;
pub mod store;
mod work;

pub use communicator::{Communicator, P2p, ReduceOp};
pub use deadline::{DEADLINE_SLACK, Deadline, MAX_TIMEOUT};
pub use env::{DEFAULT_TIMEOUT_SECS, LaunchEnv, Launcher, MAX_TIMEOUT_SECS, MAX_WORLD_SIZE, first_host};
pub use error::{CommError, Result};
pub use group::DeviceGroup;
pub use local::{DEFAULT_TIMEOUT, LocalGroup};
pub use mesh::{Axis, Coords, Mesh, MeshShape};
pub use peer_text::{MAX_PEER_TEXT_CHARS, peer_text};
pub use port::free_local_port;
pub use rendezvous::Rendezvous;
pub use tp_core;
pub use work::Work;
