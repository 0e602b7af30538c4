//! The error type of `tp-comm`.

use std::time::Duration;

/// Everything a collective, a group or a rendezvous can fail with. No call in this crate
/// blocks past its deadline: a missing or failed peer becomes one of these.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
#[allow(missing_docs)] // variant fields: each variant's documentation and message name them
pub enum CommError {
    /// The group was created with no ranks.
    #[error("{op}: world_size must be at least 1")]
    ZeroWorldSize { op: &'static str },

    /// A rank number is not below the world size.
    #[error("{op}: rank {rank} is out of range for world_size {world_size}")]
    RankOutOfRange { op: &'static str, rank: usize, world_size: usize },

    /// Some ranks did not reach the collective before the deadline.
    #[error("{op}: rank {rank} waited {waited:?} but rank(s) {missing:?} never arrived")]
    Timeout { op: String, rank: usize, missing: Vec<usize>, waited: Duration },

    /// Another rank failed, panicked or timed out, and the group can no longer be used.
    #[error("{op}: the group is poisoned: {reason}")]
    Poisoned { op: String, reason: String },

    /// Ranks called different collectives, or the same one with incompatible arguments.
    #[error("{op}: ranks disagree: {why}")]
    Mismatch { op: String, why: String },

    /// A tensor operation inside a collective failed (shapes, dtypes, devices).
    #[error("{}", with_op(.op, .source))]
    Tensor { op: &'static str, source: tp_core::Error },

    /// An argument is beyond a documented limit (world size, timeout), or the threads of a
    /// group could not be started.
    #[error("{op}: {why}")]
    Limit { op: &'static str, why: String },

    /// The launch environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) is missing or invalid.
    #[error("launch environment: {0}")]
    Env(String),

    /// The rendezvous store failed: connection, bind, duplicate rank, protocol.
    #[error("rendezvous: {0}")]
    Rendezvous(String),

    /// The NCCL library could not be loaded or used.
    #[error("NCCL unavailable: {0}")]
    NcclUnavailable(String),

    /// An NCCL call failed; the text carries ncclGetErrorString and ncclGetLastError.
    #[error("NCCL error in {op}: {message}")]
    Nccl { op: &'static str, message: String },

    /// The MPI library could not be loaded or initialised.
    #[error("MPI unavailable: {0}")]
    MpiUnavailable(String),

    /// An MPI call failed; the text carries MPI_Error_string.
    #[error("MPI error in {op}: {message}")]
    Mpi { op: &'static str, message: String },
}

/// `source`'s message, prefixed with `op` unless it already begins with it (so a chain says
/// each thing once: "all_gather: dim 3 out of range", not "all_gather: all_gather: ...").
fn with_op(op: &str, source: &impl std::fmt::Display) -> String {
    let msg = source.to_string();
    match msg.strip_prefix(op) {
        Some(rest) if rest.starts_with(':') => msg,
        _ => format!("{op}: {msg}"),
    }
}

/// Result alias of `tp-comm`.
pub type Result<T> = std::result::Result<T, CommError>;

/// Wraps a `tp_core` error with the collective it happened in.
pub(crate) fn tensor_err(op: &'static str) -> impl Fn(tp_core::Error) -> CommError {
    move |source| CommError::Tensor { op, source }
}

/// A `tp_core` error raised outside any one collective's bookkeeping (e.g. an integer tensor
/// given to a reduction).
impl From<tp_core::Error> for CommError {
    fn from(source: tp_core::Error) -> Self {
        CommError::Tensor { op: "tensor", source }
    }
}
