//! Matrix products against a 2-D weight, on the host backend.
//!
//! `x` is `[.., M, K]` (any number of leading dims, flattened into `M`; a 1-D `x` is one row).
//! The weight is either `[N, K]`, the PyTorch / Hugging Face `nn.Linear` layout, giving
//! `y = x W^T`, or `[K, N]`, giving `y = x W`. `y` is `[.., M, N]` in `x`'s dtype.
//! `f16`/`bf16` operands are widened to `f32`, multiplied with `f32` accumulation, and the
//! result rounded once (nearest even) back to the dtype.

use crate::alloc::{with_capacity, zeroed};
use crate::storage::{CpuStorage, CudaStorage, Storage};
use crate::{DType, Element, Error, Result, Tensor, with_dtype};
use std::borrow::Cow;
use tp_cpu::par_rows;

/// How a 2-D weight is laid out in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightLayout {
    /// `[N, K]` row-major (`nn.Linear`, checkpoints): `y = x W^T`.
    Nk,
    /// `[K, N]` row-major: `y = x W`.
    Kn,
}

const OP: &str = "matmul";

/// A host `[N, K]` weight packed once into the GEMM's panels ([`Tensor::pack_weight`]); cheap to
/// clone (shared).
#[derive(Debug, Clone)]
pub struct PackedWeight {
    inner: std::sync::Arc<tp_cpu::PackedWeight>,
    dtype: DType,
    dims: [usize; 2],
}

impl PackedWeight {
    /// Bytes of the packed panels.
    pub fn bytes(&self) -> usize {
        self.inner.bytes()
    }
}

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

    /// `x · op(W)` ([`matmul_layout`](Self::matmul_layout) without a bias) with the result kept
    /// in f32: 16-bit operands are multiplied as they are (exactly, accumulating in f32) and
    /// the sums are not rounded back to their dtype. Training's data gradients `dX = dY W` of
    /// a bf16 model take this (torch rounds them to bf16; tp keeps the f32 sums). On a GPU it
    /// is the product in the dtype, widened.
    pub fn matmul_f32(&self, w: &Tensor, layout: WeightLayout) -> Result<Tensor> {
        if self.dtype() == DType::F32 || !matches!(self.storage(), Storage::Cpu(_)) {
            return self.matmul_layout(w, layout, None)?.to_dtype(DType::F32);
        }
        self.require_float()?;
        super::same_dtype_device(OP, self, w)?;
        let (&k, lead) = self.dims().split_last().ok_or(Error::RankMismatch {
            op: OP,
            expected: "at least 1 (x: [.., M, K])",
            dims: self.dims().to_vec(),
        })?;
        let &[w0, w1] = w.dims() else {
            return Err(Error::RankMismatch { op: OP, expected: "2 (weight)", dims: w.dims().to_vec() });
        };
        let (wk, n, cpu_layout) = match layout {
            WeightLayout::Nk => (w1, w0, tp_cpu::Layout::Nk),
            WeightLayout::Kn => (w0, w1, tp_cpu::Layout::Kn),
        };
        if wk != k {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.dims().to_vec(),
                rhs: w.dims().to_vec(),
                why: "x's last dim (K) must equal the weight's inner dim",
            });
        }
        let m = lead.iter().product::<usize>();
        let mut dims = lead.to_vec();
        dims.push(n);
        let (xs, ws) = (self.cpu_storage(OP)?, w.cpu_storage(OP)?);
        let mut y: Vec<f32> = with_capacity(OP, m * n)?;
        with_dtype!(self.dtype(), T => {
            let (x, wv) = (xs.as_slice::<T>().unwrap_or_default(), ws.as_slice::<T>().unwrap_or_default());
            tp_cpu::matmul(x, wv, cpu_layout, None, tp_cpu::GemmShape { m, n, k }, &mut y.spare_capacity_mut()[..m * n])?;
        });
        // SAFETY: `tp_cpu::matmul` succeeded, so it wrote every one of the `m * n` outputs (its contract).
        unsafe { y.set_len(m * n) };
        Tensor::from_vec(y, &dims, &crate::Device::Cpu)
    }

    /// The general form behind [`matmul`](Self::matmul), [`matmul_t`](Self::matmul_t) and
    /// [`linear`](Self::linear).
    pub fn matmul_layout(&self, w: &Tensor, layout: WeightLayout, bias: Option<&Tensor>) -> Result<Tensor> {
        self.matmul_with(w, layout, bias, None)
    }

    /// `y = x W^T + b` ([`linear`](Self::linear)) with `packed`, the form
    /// [`pack_weight`](Self::pack_weight) made of this very `w`: on the host, products of more
    /// rows than the decode path takes read W's panels from it instead of packing W again (the
    /// same numbers, bitwise); elsewhere (a CUDA `x`, few rows) it is `linear`.
    ///
    /// Errors: as `linear`; `packed` made from a weight of another dtype or shape.
    pub fn linear_packed(&self, w: &Tensor, packed: &PackedWeight, bias: Option<&Tensor>) -> Result<Tensor> {
        if packed.dtype != w.dtype() || packed.dims != w.dims() {
            return Err(Error::InvalidArgument {
                op: OP,
                why: format!(
                    "the packed weight is {:?} {}, the weight {:?} {}",
                    packed.dims,
                    packed.dtype,
                    w.dims(),
                    w.dtype()
                ),
            });
        }
        self.matmul_with(w, WeightLayout::Nk, bias, Some(packed))
    }

    /// This `[N, K]` host weight packed once into the host GEMM's panels, for
    /// [`linear_packed`](Self::linear_packed) (as much memory again as the weight).
    ///
    /// Errors: a CUDA tensor, an integer dtype, not 2-D, or memory that cannot be had.
    pub fn pack_weight(&self) -> Result<PackedWeight> {
        const PACK: &str = "pack_weight";
        self.require_float()?;
        let &[n, k] = self.dims() else {
            return Err(Error::RankMismatch { op: PACK, expected: "2 (weight [N, K])", dims: self.dims().to_vec() });
        };
        let s = self.cpu_storage(PACK)?;
        let inner =
            with_dtype!(s.dtype(), T => tp_cpu::PackedWeight::new(s.as_slice::<T>().unwrap_or_default(), n, k)?);
        Ok(PackedWeight { inner: std::sync::Arc::new(inner), dtype: self.dtype(), dims: [n, k] })
    }

    fn matmul_with(
        &self,
        w: &Tensor,
        layout: WeightLayout,
        bias: Option<&Tensor>,
        packed: Option<&PackedWeight>,
    ) -> Result<Tensor> {
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
            return Ok(Tensor::from_cuda(
                out_shape,
                super::cuda::matmul(xs, ws, bs, tp_kernels::GemmShape { m, n, k }, layout)?,
            ));
        }
        let x_s = self.cpu_storage(OP)?;
        let w_s = w.cpu_storage(OP)?;
        let b_s = bias.map(|b| b.cpu_storage(OP)).transpose()?;
        let out = with_dtype!(x_s.dtype(), T => {
            let b = b_s.map(|b| b.as_slice::<T>().unwrap_or_default());
            let x = x_s.as_slice::<T>().unwrap_or_default();
            let w = w_s.as_slice::<T>().unwrap_or_default();
            let shape = tp_cpu::GemmShape { m, n, k };
            let y = crate::phase::timed(crate::phase::Phase::Gemm, || host_matmul::<T>(x, w, b, shape, layout, packed));
            CpuStorage::from_vec(y?)
        });
        Ok(Tensor::from_cpu(out_shape, out))
    }
}

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

/// The host product ([`tp_cpu::matmul`]: decode shapes stream the weight, everything else runs
/// the packed GEMM, on the kernel family [`CpuKernel::current`](crate::cpu::CpuKernel::current)
/// picks for the dtype), rounded once to `T` (by the GEMM itself for f16/bf16,
/// [`tp_cpu::matmul_rounded`]).
fn host_matmul<T: Element>(
    x: &[T],
    w: &[T],
    bias: Option<&[T]>,
    shape: tp_cpu::GemmShape,
    layout: WeightLayout,
    packed: Option<&PackedWeight>,
) -> Result<Vec<T>> {
    let tp_cpu::GemmShape { m, n, k } = shape;
    let bias = bias.map(widen).transpose()?;
    if k == 0 {
        // The output alone: with K = 0 it can be far larger than both operands.
        let mut y = zeroed::<f32>(OP, m * n)?;
        if let Some(b) = &bias {
            y.chunks_exact_mut(n.max(1)).for_each(|row| row.copy_from_slice(b));
        }
        return narrow_output(y);
    }
    let layout = match layout {
        WeightLayout::Nk => tp_cpu::Layout::Nk,
        WeightLayout::Kn => tp_cpu::Layout::Kn,
    };
    if T::DTYPE != DType::F32 {
        // Rounded by the GEMM itself, panel by panel: no f32 copy of the product.
        let mut y: Vec<T> = with_capacity(OP, m * n)?;
        let out = &mut y.spare_capacity_mut()[..m * n];
        match packed {
            Some(p) if layout == tp_cpu::Layout::Nk => {
                tp_cpu::matmul_packed_rounded(x, w, &p.inner, bias.as_deref(), shape, out)?
            }
            _ => tp_cpu::matmul_rounded(x, w, layout, bias.as_deref(), shape, out)?,
        }
        // SAFETY: the rounded product succeeded, so it wrote every one of the `m * n` elements
        // (its contract).
        unsafe { y.set_len(m * n) };
        return Ok(y);
    }
    let mut y: Vec<f32> = with_capacity(OP, m * n)?;
    let out = &mut y.spare_capacity_mut()[..m * n];
    match packed {
        Some(p) if layout == tp_cpu::Layout::Nk => tp_cpu::matmul_packed(x, w, &p.inner, bias.as_deref(), shape, out)?,
        _ => tp_cpu::matmul(x, w, layout, bias.as_deref(), shape, out)?,
    }
    // SAFETY: `tp_cpu::matmul` (or `matmul_packed`, the same contract) succeeded, so it wrote every one of the `m * n` elements (its
    // contract): the first `m * n` are initialised.
    unsafe { y.set_len(m * n) };
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
