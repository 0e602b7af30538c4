//! Matrix products against a 2-D weight, on the host backend.
//!
//! `x` is `[.., M, K]` (any number of leading dims, flattened into `M`; a 1-D `x` is one row).
//! The weight is either `[N, K]`, the PyTorch / Hugging Face `nn.Linear` layout, giving
//! `y = x W^T`, or `[K, N]`, giving `y = x W`. `y` is `[.., M, N]` in `x`'s dtype.
//! `f16`/`bf16` operands are widened to `f32`, multiplied with `f32` accumulation, and the
//! result rounded once (nearest even) back to the dtype.

use crate::alloc::zeroed;
use crate::cpu_gemm::{MatRef, par_rows, sgemm};
use crate::cpu_gemv;
use crate::storage::{CpuStorage, CudaStorage, Storage};
use crate::{DType, Element, Error, Result, Tensor, with_dtype};
use std::borrow::Cow;

/// How a 2-D weight is laid out in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightLayout {
    /// `[N, K]` row-major (`nn.Linear`, checkpoints): `y = x W^T`.
    Nk,
    /// `[K, N]` row-major: `y = x W`.
    Kn,
}

const OP: &str = "matmul";

impl Tensor {
    /// `y = x W^T` for `x: [.., M, K]`, `w: [N, K]`; `y: [.., M, N]`.
    pub fn matmul_t(&self, w: &Tensor) -> Result<Tensor> {
        self.matmul_layout(w, WeightLayout::Nk, None)
    }

    /// `y = x W` for `x: [.., M, K]`, `w: [K, N]`; `y: [.., M, N]`.
    pub fn matmul(&self, w: &Tensor) -> Result<Tensor> {
        self.matmul_layout(w, WeightLayout::Kn, None)
    }

    /// `y = x W^T + b` for `x: [.., M, K]`, `w: [N, K]`, `b: [N]`: `nn.Linear`'s forward. The
    /// bias is fused: it seeds the accumulator, so no second pass runs over `y`.
    pub fn linear(&self, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        self.matmul_layout(w, WeightLayout::Nk, bias)
    }

    /// The general form behind [`matmul`](Self::matmul), [`matmul_t`](Self::matmul_t) and
    /// [`linear`](Self::linear).
    pub fn matmul_layout(&self, w: &Tensor, layout: WeightLayout, bias: Option<&Tensor>) -> Result<Tensor> {
        self.require_float()?;
        super::same_dtype_device(OP, self, w)?;
        let mismatch = |why| Error::ShapeMismatch { op: OP, lhs: self.dims().to_vec(), rhs: w.dims().to_vec(), why };
        let (&k, lead) = self.dims().split_last().ok_or(Error::RankMismatch {
            op: OP,
            expected: "at least 1 (x: [.., M, K])",
            dims: self.dims().to_vec(),
        })?;
        let &[w0, w1] = w.dims() else {
            return Err(Error::RankMismatch { op: OP, expected: "2 (weight)", dims: w.dims().to_vec() });
        };
        let (wk, n) = match layout {
            WeightLayout::Nk => (w1, w0),
            WeightLayout::Kn => (w0, w1),
        };
        if wk != k {
            return Err(mismatch(match layout {
                WeightLayout::Nk => "x's last dim (K) must equal the weight's dim 1 ([N, K] layout)",
                WeightLayout::Kn => "x's last dim (K) must equal the weight's dim 0 ([K, N] layout)",
            }));
        }
        if let Some(b) = bias {
            super::same_dtype_device(OP, self, b)?;
            if b.dims() != [n] {
                return Err(Error::ShapeMismatch {
                    op: OP,
                    lhs: w.dims().to_vec(),
                    rhs: b.dims().to_vec(),
                    why: "bias must be [N]",
                });
            }
        }
        let mut out_dims = lead.to_vec();
        out_dims.push(n);
        let out_shape = crate::Shape::new(&out_dims)?;
        let m = lead.iter().product::<usize>();

        if let Storage::Cuda(xs) = self.storage() {
            fn cuda<'t>(x: &Tensor, t: &'t Tensor) -> Result<&'t CudaStorage> {
                match t.storage() {
                    Storage::Cuda(s) => Ok(s),
                    Storage::Cpu(_) => Err(Error::DeviceMismatch { op: "matmul", lhs: x.device(), rhs: t.device() }),
                }
            }
            let (ws, bs) = (cuda(self, w)?, bias.map(|b| cuda(self, b)).transpose()?);
            return Ok(Tensor::from_cuda(out_shape, super::cuda::matmul(xs, ws, bs, (m, k, n), layout)?));
        }
        let x_s = self.cpu_storage(OP)?;
        let w_s = w.cpu_storage(OP)?;
        let b_s = bias.map(|b| b.cpu_storage(OP)).transpose()?;
        let out = with_dtype!(x_s.dtype(), T => {
            let b = b_s.map(|b| b.as_slice::<T>().unwrap_or_default());
            let x = x_s.as_slice::<T>().unwrap_or_default();
            let w = w_s.as_slice::<T>().unwrap_or_default();
            CpuStorage::from_vec(host_matmul::<T>(x, w, b, m, k, n, layout)?)
        });
        Ok(Tensor::from_cpu(out_shape, out))
    }
}

/// Depth of one widened weight block for f16/bf16 products: as deep as fits `WIDE_BUDGET`
/// f32 elements (16 MiB), between 256 (matrixmultiply's own KC) and 2048. Fewer, deeper blocks
/// mean fewer GEMM calls; the budget bounds the buffer for very wide weights.
const K_BLOCK_MAX: usize = 2048;
const K_BLOCK_MIN: usize = 256;
const WIDE_BUDGET: usize = 4 << 20;

/// Granule of the threaded whole-buffer conversions (elements).
const CONVERT_ROWS: usize = 4096;

/// Widens to `f32` without copying when the data already is `f32`.
fn widen<T: Element>(s: &[T]) -> Result<Cow<'_, [f32]>> {
    match bytemuck::try_cast_slice::<T, f32>(s) {
        Ok(f) if T::DTYPE == DType::F32 => Ok(Cow::Borrowed(f)),
        _ => {
            let mut v = zeroed::<f32>(OP, s.len())?;
            par_rows(&mut v, CONVERT_ROWS, |r0, dst| {
                T::slice_to_f32(&s[r0 * CONVERT_ROWS..r0 * CONVERT_ROWS + dst.len()], dst)
            });
            Ok(Cow::Owned(v))
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn host_matmul<T: Element>(
    x: &[T],
    w: &[T],
    bias: Option<&[T]>,
    m: usize,
    k: usize,
    n: usize,
    layout: WeightLayout,
) -> Result<Vec<T>> {
    // The output first: with K = 0 it can be far larger than both operands.
    let mut y = zeroed::<f32>(OP, m * n)?;
    if layout == WeightLayout::Nk && m <= cpu_gemv::MAX_ROWS {
        let x = widen(x)?;
        let bias = bias.map(widen).transpose()?;
        cpu_gemv::skinny_nk(&x, w, bias.as_deref(), m, k, n, &mut y);
        return narrow_output(y);
    }
    let x = widen(x)?;
    let mut beta = match bias {
        Some(bias) => {
            let bias = widen(bias)?;
            y.chunks_exact_mut(n.max(1)).for_each(|row| row.copy_from_slice(&bias));
            1.0
        }
        None => 0.0,
    };
    if T::DTYPE == DType::F32 {
        let w = widen(w)?; // borrowed, no copy
        let b = match layout {
            WeightLayout::Nk => MatRef::new(&w, k, n, 1, k),
            WeightLayout::Kn => MatRef::new(&w, k, n, n, 1),
        };
        sgemm(MatRef::new(&x, m, k, k, 1), b, beta, &mut y);
        return narrow_output(y);
    }
    // f16/bf16: widen the weight one K-block at a time into a buffer that stays in cache, and
    // accumulate the blocks' products into y (beta = 1 after the first). Widening the whole
    // weight at once would cost a pass over memory and a fresh N·K·4-byte allocation per call.
    let kb = (WIDE_BUDGET / n.max(1)).clamp(K_BLOCK_MIN, K_BLOCK_MAX).min(k).max(1);
    let mut wide = zeroed::<f32>(OP, n * kb)?;
    for k0 in (0..k).step_by(kb) {
        let kc = kb.min(k - k0);
        let b = match layout {
            WeightLayout::Nk => {
                par_rows(&mut wide[..n * kc], kc, |j0, rows| {
                    for (j, dst) in (j0..).zip(rows.chunks_exact_mut(kc)) {
                        T::slice_to_f32(&w[j * k + k0..j * k + k0 + kc], dst);
                    }
                });
                MatRef::new(&wide, kc, n, 1, kc)
            }
            WeightLayout::Kn => {
                par_rows(&mut wide[..kc * n], n, |r0, rows| {
                    T::slice_to_f32(&w[(k0 + r0) * n..(k0 + r0) * n + rows.len()], rows);
                });
                MatRef::new(&wide, kc, n, n, 1)
            }
        };
        sgemm(MatRef::new(&x[k0..], m, kc, k, 1), b, beta, &mut y);
        beta = 1.0;
    }
    if k == 0 {
        sgemm(MatRef::new(&x, m, 0, 0, 1), MatRef::new(&wide, 0, n, n, 1), beta, &mut y);
    }
    narrow_output(y)
}

/// The f32 result in the output dtype (rounded once, to nearest even).
fn narrow_output<T: Element>(y: Vec<f32>) -> Result<Vec<T>> {
    if T::DTYPE == DType::F32 {
        return Ok(bytemuck::allocation::cast_vec(y)); // f32 -> f32: a move, not a copy
    }
    let mut out = zeroed::<T>(OP, y.len())?;
    par_rows(&mut out, CONVERT_ROWS, |r0, dst| {
        T::slice_from_f32(&y[r0 * CONVERT_ROWS..r0 * CONVERT_ROWS + dst.len()], dst)
    });
    Ok(out)
}
