//! The shape of a host product and the layout of its weight.

/// How a 2-D weight is laid out in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Layout {
    /// `[N, K]` row-major (`nn.Linear`, checkpoints): `y = x W^T`.
    Nk,
    /// `[K, N]` row-major: `y = x W`.
    Kn,
}

/// The sizes of `y[m x n] = x[m x k] · op(W)`, in the order `(m, n, k)` used across tp's GEMM
/// interfaces (host and CUDA alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GemmShape {
    /// Rows of `x` and `y`.
    pub m: usize,
    /// Columns of `y` (rows of an `[N, K]` weight).
    pub n: usize,
    /// The inner (reduced) dimension.
    pub k: usize,
}
