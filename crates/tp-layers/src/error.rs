//! The error type of `tp-layers`.

use tp_core::DType;

/// Everything building, loading or running a layer can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
#[allow(missing_docs)] // variant fields: each variant's documentation and message name them
pub enum LayerError {
    /// A tensor operation failed (shapes, dtypes, devices).
    #[error(transparent)]
    Tensor(#[from] tp_core::Error),

    /// A collective failed (peer missing, timeout, mismatch).
    #[error(transparent)]
    Comm(#[from] tp_comm::CommError),

    /// A checkpoint file or index could not be read or is malformed.
    #[error("checkpoint {path}: {why}")]
    Checkpoint { path: String, why: String },

    /// An output file could not be written (or is not a regular file).
    #[error("cannot write {path}: {why}")]
    Write { path: String, why: String },

    /// The checkpoint has no tensor of this name.
    #[error("checkpoint {path}: no tensor named {name:?}")]
    MissingTensor { path: String, name: String },

    /// A checkpoint tensor has a dtype tp cannot use, or not the one required.
    #[error("checkpoint tensor {name:?} has dtype {found}, expected {expected}")]
    WrongDtype { name: String, found: String, expected: String },

    /// A checkpoint tensor has another shape than the layer needs.
    #[error("checkpoint tensor {name:?} has shape {found:?}, expected {expected:?}")]
    WrongShape { name: String, found: Vec<usize>, expected: Vec<usize> },

    /// Layer dimensions or parallel settings that cannot work together.
    #[error("{0}")]
    Config(String),

    /// Appending to a KV cache would pass the positions it may hold.
    #[error("KV cache full: it holds {len} of at most {capacity} positions and cannot take {adding} more")]
    CacheFull { capacity: usize, len: usize, adding: usize },

    /// A KV cache could not grow to the positions a sequence needs.
    #[error("KV cache: cannot allocate {positions} positions ({bytes} bytes of keys and values for this layer): {why}")]
    CacheAlloc { positions: usize, bytes: usize, why: String },

    /// A KV cache used with a layer it was not made for (another layer, or another shape).
    #[error("KV cache mismatch: {0}")]
    CacheMismatch(String),
}

/// Result alias of `tp-layers`.
pub type Result<T> = std::result::Result<T, LayerError>;

pub(crate) fn dtype_name(d: DType) -> String {
    d.to_string()
}
