//! The one error type of `tp-core`.
//!
//! Every variant carries the operation that failed and the values that made it fail (shapes,
//! dtypes, dims, ranks), so a message is enough to find the bad input without a debugger.

use crate::{DType, Device};

/// Result alias used throughout `tp-core`.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything that can go wrong in `tp-core`. No public function panics on user input; it returns
/// one of these instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The product of the dimensions (or its size in bytes) does not fit in memory addressing.
    #[error("shape {dims:?} overflows: its element count or byte size does not fit in isize")]
    ShapeOverflow { dims: Vec<usize> },

    /// A buffer's length does not match the element count of the shape it was given.
    #[error("{op}: shape {dims:?} holds {expected} elements but {got} were given")]
    ElementCountMismatch { op: &'static str, dims: Vec<usize>, expected: usize, got: usize },

    /// Two operands have different dtypes where the operation needs them equal.
    #[error("{op}: dtype mismatch, {lhs} vs {rhs}")]
    DTypeMismatch { op: &'static str, lhs: DType, rhs: DType },

    /// Two operands live on different devices.
    #[error("{op}: device mismatch, {lhs} vs {rhs}")]
    DeviceMismatch { op: &'static str, lhs: Device, rhs: Device },

    /// Two shapes that must agree do not (matmul inner dims, cat's other dims, a bias length...).
    #[error("{op}: shape mismatch, {lhs:?} vs {rhs:?}: {why}")]
    ShapeMismatch { op: &'static str, lhs: Vec<usize>, rhs: Vec<usize>, why: &'static str },

    /// A tensor has fewer (or more) dimensions than the operation accepts.
    #[error("{op}: expected {expected} dimensions, got shape {dims:?}")]
    RankMismatch { op: &'static str, expected: &'static str, dims: Vec<usize> },

    /// A dimension index is not below the tensor's number of dimensions.
    #[error("{op}: dim {dim} out of range for a tensor with {ndim} dimensions")]
    DimOutOfRange { op: &'static str, dim: usize, ndim: usize },

    /// `narrow(dim, start, len)` asked for elements past the end of the dimension.
    #[error("narrow: start {start} + len {len} exceeds size {size} of dim {dim}")]
    NarrowOutOfBounds { dim: usize, start: usize, len: usize, size: usize },

    /// `cat` was given no tensors.
    #[error("cat: needs at least one tensor")]
    CatEmpty,

    /// The world size of a sharded group is zero.
    #[error("{op}: world_size must be at least 1")]
    ZeroWorldSize { op: &'static str },

    /// A rank is not below the world size.
    #[error("{op}: rank {rank} is out of range for world_size {world_size}")]
    RankOutOfRange { op: &'static str, rank: usize, world_size: usize },

    /// A shard does not belong to the tensor or the group it is used with.
    #[error("{op}: {why}")]
    ShardMismatch { op: &'static str, why: String },

    /// The tensor is not in host memory, or the operation is not available on its device.
    #[error("{op}: not supported on device {device}")]
    UnsupportedDevice { op: &'static str, device: Device },

    /// CUDA was asked for but cannot be used (no driver, no such device, or kernels not built).
    #[error("CUDA unavailable: {reason}")]
    CudaUnavailable { reason: String },

    /// A host kernel family was asked for that this CPU (or OS) cannot run.
    #[error("CPU kernel {kernel} unavailable: {why}")]
    KernelUnavailable { kernel: &'static str, why: String },

    /// A CUDA operation failed (driver error, or a launch refused by its checks).
    #[error("CUDA error: {0}")]
    Cuda(tp_kernels::KernelError),
}

impl From<tp_kernels::KernelError> for Error {
    fn from(e: tp_kernels::KernelError) -> Self {
        use tp_kernels::KernelError as K;
        match e {
            K::CudaUnavailable { .. } | K::NoSuchDevice { .. } | K::NotCompiled { .. } => {
                Error::CudaUnavailable { reason: e.to_string() }
            }
            other => Error::Cuda(other),
        }
    }
}
