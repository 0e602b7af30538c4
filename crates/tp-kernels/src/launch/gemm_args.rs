//! The arguments every GEMM launcher takes, [`GemmArgs`] with its [`GemmShape`] in `(m, n, k)`
//! order, and the buffer checks they share.

use super::{ElemType, invalid, span};
use crate::error::Result;
use cudarc::driver::CudaSlice;

/// The sizes of `C[m x n] = A[m x k] · op(B)`, in the order `(m, n, k)` used by every GEMM
/// interface of tp (these launchers, tp-core's CUDA ops, the host kernels).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GemmShape {
    /// Rows of `A` and `C`.
    pub m: usize,
    /// Columns of `C` (rows of an `[N, K]` `B`).
    pub n: usize,
    /// The inner (reduced) dimension.
    pub k: usize,
}

/// One GEMM `C = A op(B) + bias`: the buffers (row-major, all of element type `ty`), the shape
/// and the type. `A` is `m x k`; `B` is `n x k` for the `[N, K]` (nn.Linear) layout every
/// launcher but [`Gpu::gemm_simt_f32`](crate::Gpu::gemm_simt_f32) takes, which also takes
/// `k x n`; `bias` has `n` entries; `C` is `m x n` and is the only buffer written.
#[derive(Debug)]
pub struct GemmArgs<'a> {
    /// The output, `m x n`.
    pub c: &'a mut CudaSlice<u8>,
    /// The activations, `m x k`.
    pub a: &'a CudaSlice<u8>,
    /// The weight, `n x k` (or `k x n` for the SIMT kernel's `[K, N]` variant).
    pub b: &'a CudaSlice<u8>,
    /// The bias, `n` entries, added to every row of `C`.
    pub bias: Option<&'a CudaSlice<u8>>,
    /// `(m, n, k)`.
    pub shape: GemmShape,
    /// The element type of every buffer.
    pub ty: ElemType,
}

impl GemmArgs<'_> {
    /// Checks that every buffer holds what the shape needs, at `ty`'s element size.
    pub(super) fn check_buffers(&self, kernel: &'static str) -> Result<()> {
        let GemmShape { m, n, k } = self.shape;
        let elem = self.ty.size();
        let need = |rows: usize, cols: usize| span(kernel, rows, cols, 0).and_then(|x| span(kernel, x, elem, 0));
        let buffers =
            [("A", self.a.len(), need(m, k)?), ("B", self.b.len(), need(n, k)?), ("C", self.c.len(), need(m, n)?)];
        for (what, have, want) in buffers {
            if have < want {
                return Err(invalid(kernel, format!("{what} holds {have} bytes, needs {want}")));
            }
        }
        if let Some(bias) = self.bias
            && bias.len() < need(1, n)?
        {
            return Err(invalid(kernel, format!("bias holds {} bytes, needs {}", bias.len(), n * elem)));
        }
        Ok(())
    }
}
