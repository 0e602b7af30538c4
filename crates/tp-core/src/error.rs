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
#[allow(missing_docs)] // variant fields: each variant's documentation and message name them
pub enum Error {
    /// The product of the dimensions (or its size in bytes) does not fit in memory addressing,
    /// or the tensor would exceed [`MAX_TENSOR_BYTES`](crate::MAX_TENSOR_BYTES).
    #[error(
        "shape {dims:?} is too large: more than 2^40 bytes (1 TiB) at 4 bytes per element, or a size that does not fit in isize"
    )]
    ShapeOverflow { dims: Vec<usize> },

    /// A host buffer for the result could not be allocated (a shape too large for this
    /// machine's memory).
    #[error("{op}: cannot allocate {bytes} bytes of host memory")]
    OutOfMemory { op: &'static str, bytes: usize },

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

    /// An arithmetic operation was given an integer tensor (integer dtypes hold token ids and
    /// are only copied, sliced, joined and moved).
    #[error("dtype {dtype} is an integer type; this operation needs f32, f16 or bf16")]
    NotFloat { dtype: DType },

    /// An operation that takes integer tensors (token ids) was given another dtype.
    #[error("{op}: expected an integer tensor (i32 or i64), got {dtype}")]
    NotInteger { op: &'static str, dtype: DType },

    /// A token id outside `0..vocab`.
    #[error("{op}: token id {id} at position {position} is out of range for a vocabulary of {vocab}")]
    TokenOutOfRange { op: &'static str, id: i64, position: usize, vocab: usize },

    /// An argument is out of its valid range (a head count of zero, a position past a limit...).
    #[error("{op}: {why}")]
    InvalidArgument { op: &'static str, why: String },

    /// A host kernel family was asked for that this CPU (or OS) cannot run.
    #[error("CPU kernel {kernel} unavailable: {why}")]
    KernelUnavailable { kernel: &'static str, why: String },

    /// A CUDA operation failed (driver error, or a launch refused by its checks).
    #[error("CUDA error: {0}")]
    Cuda(tp_kernels::KernelError),
}

impl From<tp_cpu::Error> for Error {
    fn from(e: tp_cpu::Error) -> Self {
        match e {
            tp_cpu::Error::KernelUnavailable { kernel, why } => Error::KernelUnavailable { kernel, why },
            // tp-core checks shapes before calling the host kernels; should one still refuse,
            // its own message says what.
            other => Error::InvalidArgument { op: "matmul", why: other.to_string() },
        }
    }
}

impl From<tp_kernels::KernelError> for Error {
    fn from(e: tp_kernels::KernelError) -> Self {
        use tp_kernels::KernelError as K;
        match e {
            // Keep the reason alone: the variant's message already says "CUDA unavailable".
            K::CudaUnavailable { reason } => Error::CudaUnavailable { reason },
            K::NoSuchDevice { .. } | K::NotCompiled { .. } => Error::CudaUnavailable { reason: e.to_string() },
            other => Error::Cuda(other),
        }
    }
}
