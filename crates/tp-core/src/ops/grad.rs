//! Building blocks of the backward passes on the host: every gradient is computed and returned
//! in f32, whatever the dtype of the forward's tensors (bf16 activations are widened once).
//!
//! * [`Tensor::t_matmul`]: `A^T B`, the weight gradient `dW = dY^T X` of `Y = X W^T`.
//! * [`Tensor::transpose2d`]: a 2-D transpose.
//! * [`Tensor::sum_rows`]: the column sums of `[.., N]`, a bias gradient `db = Σ_t dY[t]`.
//!
//! (The data gradient `dX = dY W` of a linear layer is [`Tensor::matmul`] against the
//! `[out, in]` weight read as `[K, N]`.)

use crate::{DType, Error, Result, Tensor};

/// The host elements of `t` as an f32 tensor (a shared clone when already f32).
pub(crate) fn f32_host(op: &'static str, t: &Tensor) -> Result<Tensor> {
    t.require_float()?;
    if t.device() != crate::Device::Cpu {
        return Err(Error::UnsupportedDevice { op, device: t.device() });
    }
    t.to_dtype(DType::F32)
}

/// The `[rows, cols]` view of a tensor of at least one dim (`rows` the product of the leading
/// dims).
pub(crate) fn rows_cols(op: &'static str, t: &Tensor) -> Result<(usize, usize)> {
    let (&cols, lead) =
        t.dims().split_last().ok_or(Error::RankMismatch { op, expected: "at least 1", dims: vec![] })?;
    Ok((lead.iter().product(), cols))
}

/// `src: [rows, cols]` transposed into `[cols, rows]`, in blocks that stay in cache.
pub(crate) fn transpose_f32(src: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    const B: usize = 32;
    let mut out = vec![0f32; rows * cols];
    for r0 in (0..rows).step_by(B) {
        for c0 in (0..cols).step_by(B) {
            for r in r0..(r0 + B).min(rows) {
                for c in c0..(c0 + B).min(cols) {
                    out[c * rows + r] = src[r * cols + c];
                }
            }
        }
    }
    out
}

impl Tensor {
    /// The transpose of a 2-D host tensor, `[R, C] -> [C, R]`, in f32.
    ///
    /// Errors: [`Error::RankMismatch`] unless 2-D, [`Error::UnsupportedDevice`] off the host,
    /// [`Error::NotFloat`].
    pub fn transpose2d(&self) -> Result<Tensor> {
        const OP: &str = "transpose2d";
        let &[r, c] = self.dims() else {
            return Err(Error::RankMismatch { op: OP, expected: "2", dims: self.dims().to_vec() });
        };
        let x = f32_host(OP, self)?;
        Tensor::from_vec(transpose_f32(x.as_slice::<f32>()?, r, c), &[c, r], &crate::Device::Cpu)
    }

    /// `self^T · b` for `self: [.., M]` and `b: [.., K]` with the same leading dims (flattened
    /// into `T` rows): `[M, K]` in f32, `out[m][k] = Σ_t self[t][m] · b[t][k]`. The weight
    /// gradient of `Y = X W^T` is `dY.t_matmul(X)`.
    ///
    /// Errors: [`Error::ShapeMismatch`] when the row counts differ, [`Error::UnsupportedDevice`]
    /// off the host, [`Error::NotFloat`].
    pub fn t_matmul(&self, b: &Tensor) -> Result<Tensor> {
        const OP: &str = "t_matmul";
        let ((t, m), (tb, k)) = (rows_cols(OP, self)?, rows_cols(OP, b)?);
        if t != tb {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.dims().to_vec(),
                rhs: b.dims().to_vec(),
                why: "both operands need the same leading dims (the rows summed over)",
            });
        }
        let (a, b) = (f32_host(OP, self)?, f32_host(OP, b)?);
        let cpu = crate::Device::Cpu;
        let at = Tensor::from_vec(transpose_f32(a.as_slice::<f32>()?, t, m), &[m, t], &cpu)?;
        at.matmul(&b.reshape(&[t, k])?)
    }

    /// The sums over every row of `self: [.., N]`: `[N]` in f32 (accumulated in f64), the
    /// gradient of a bias broadcast over the rows.
    ///
    /// Errors: [`Error::RankMismatch`] for a scalar, [`Error::UnsupportedDevice`] off the host,
    /// [`Error::NotFloat`].
    pub fn sum_rows(&self) -> Result<Tensor> {
        const OP: &str = "sum_rows";
        let (_, n) = rows_cols(OP, self)?;
        let x = f32_host(OP, self)?;
        let mut acc = vec![0f64; n];
        for row in x.as_slice::<f32>()?.chunks_exact(n.max(1)) {
            acc.iter_mut().zip(row).for_each(|(a, &v)| *a += f64::from(v));
        }
        Tensor::from_vec(acc.into_iter().map(|v| v as f32).collect::<Vec<f32>>(), &[n], &crate::Device::Cpu)
    }
}
