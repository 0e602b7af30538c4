//! The error type of `tp-cpu`.

use crate::element::FloatKind;

/// Result alias of `tp-cpu`.
pub type Result<T> = std::result::Result<T, Error>;

/// What a host kernel call can refuse. No public function panics on its arguments.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A kernel family was asked for that this CPU (or OS) cannot run.
    #[error("CPU kernel {kernel} unavailable: {why}")]
    KernelUnavailable {
        /// The family's `TP_CPU_KERNEL` name.
        kernel: &'static str,
        /// What the CPU or OS lacks.
        why: String,
    },

    /// A buffer's length does not match the product's shape.
    #[error("host matmul: {operand} holds {got} elements, the shape needs {expected}")]
    OperandLength {
        /// `x`, `w`, `bias` or `y`.
        operand: &'static str,
        /// Elements the shape calls for.
        expected: usize,
        /// Elements given.
        got: usize,
    },

    /// A [`crate::PackedWeight`] was used for a product of another element type or shape.
    #[error("host matmul: the packed weight is {packed:?} (dtype, n, k), the product needs {wanted:?}")]
    PackedMismatch {
        /// The packed weight's element type, `n` and `k`.
        packed: (FloatKind, usize, usize),
        /// The product's element type, `n` and `k`.
        wanted: (FloatKind, usize, usize),
    },

    /// A length is not a whole number of blocks of a quantized type ([`crate::quant`]).
    #[error("{ty}: {operand} has {len} {unit}, not a whole number of {block}-{unit} blocks")]
    NotWholeBlocks {
        /// The quantized type's ggml name (`Q4_0`, `Q6_K`, ...).
        ty: &'static str,
        /// `src`, `k`, ...
        operand: &'static str,
        /// The length given.
        len: usize,
        /// The type's block, in `unit`s.
        block: usize,
        /// `bytes` or `elements`.
        unit: &'static str,
    },

    /// A buffer of a quantized product or dequantization ([`crate::quant`]) has the wrong length.
    #[error("{ty}: {operand} holds {got} {unit}, the shape needs {expected}")]
    QuantLength {
        /// The quantized type's ggml name.
        ty: &'static str,
        /// `w`, `dst`, ...
        operand: &'static str,
        /// `bytes` or `elements`.
        unit: &'static str,
        /// What the shape calls for.
        expected: usize,
        /// What was given.
        got: usize,
    },

    /// `m * k`, `n * k` or `m * n` does not fit in `usize`.
    #[error("host matmul: shape m {m}, n {n}, k {k} overflows usize")]
    ShapeOverflow {
        /// Rows of `x` and `y`.
        m: usize,
        /// Columns of `y`.
        n: usize,
        /// The inner dimension.
        k: usize,
    },
}
