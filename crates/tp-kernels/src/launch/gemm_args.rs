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

/// One weight-gradient GEMM `C (+)= A^T B` (`dW = dY^T X`): `A` is `k x m` and `B` `k x n`
/// (row-major, element type `ty`; the `k` rows are typically tokens), `C` is `m x n` **f32** and
/// the only buffer written: overwritten, or added to when `accumulate` (beta = 1, a gradient
/// accumulated over micro-batches).
#[derive(Debug)]
pub struct GemmTnArgs<'a> {
    /// The f32 output, `m x n`.
    pub c: &'a mut CudaSlice<u8>,
    /// The left operand, stored `k x m` (its transpose multiplies).
    pub a: &'a CudaSlice<u8>,
    /// The right operand, stored `k x n`.
    pub b: &'a CudaSlice<u8>,
    /// `(m, n, k)`: `C` is `m x n`, the product sums over `k`.
    pub shape: GemmShape,
    /// The element type of `A` and `B` (`C` is f32).
    pub ty: ElemType,
    /// `C += A^T B` instead of `C = A^T B`.
    pub accumulate: bool,
}

impl GemmTnArgs<'_> {
    /// Checks that every buffer holds what the shape needs: `A` `k*m` and `B` `k*n` elements of
    /// `ty`, `C` `m*n` f32.
    pub(super) fn check_buffers(&self, kernel: &'static str) -> Result<()> {
        let GemmShape { m, n, k } = self.shape;
        let need =
            |rows: usize, cols: usize, elem: usize| span(kernel, rows, cols, 0).and_then(|x| span(kernel, x, elem, 0));
        let t = self.ty.size();
        let buffers = [
            ("A", self.a.len(), need(k, m, t)?),
            ("B", self.b.len(), need(k, n, t)?),
            ("C", self.c.len(), need(m, n, 4)?),
        ];
        for (what, have, want) in buffers {
            if have < want {
                return Err(invalid(kernel, format!("{what} holds {have} bytes, needs {want}")));
            }
        }
        Ok(())
    }
}
