//! Building blocks of the backward passes: every gradient is computed and returned in f32,
//! whatever the dtype of the forward's tensors (bf16 activations are widened once). Each runs
//! on the host or, for tensors on a GPU, on its CUDA kernel (`kernels/grad.cu`,
//! `kernels/loss.cu`, `kernels/optim.cu`, the GEMMs), with the same formulas; sums accumulate
//! in f64 on the host and in f32 on the GPU (in a fixed order: deterministic).
//!
//! * [`Tensor::t_matmul`]: `A^T B`, the weight gradient `dW = dY^T X` of `Y = X W^T`, and
//!   [`Tensor::add_t_matmul`], the same added into an f32 gradient in place (on the GPU inside
//!   the GEMM's epilogue, beta = 1).
//! * [`Tensor::transpose2d`]: a 2-D transpose.
//! * [`Tensor::sum_rows`]: the column sums of `[.., N]`, a bias gradient `db = Σ_t dY[t]`.
//! * [`adamw_step`] and [`Tensor::adamw_step_`]: torch's AdamW step over f32 master weights
//!   (tp-train's formulas), multi-tensor on the GPU.
//!
//! (The data gradient `dX = dY W` of a linear layer is [`Tensor::matmul`] against the
//! `[out, in]` weight read as `[K, N]`: on the GPU, the `kn` GEMMs.)

use crate::storage::{CudaStorage, Storage};
use crate::{DType, Error, Result, Tensor, with_dtype};

/// The host elements of `t` as an f32 tensor (a shared clone when already f32).
pub(crate) fn f32_host(op: &'static str, t: &Tensor) -> Result<Tensor> {
    t.require_float()?;
    if t.device() != crate::Device::Cpu {
        return Err(Error::UnsupportedDevice { op, device: t.device() });
    }
    t.to_dtype(DType::F32)
}

/// The device storage of `t`, an operand of an op whose first operand `lead` is on a GPU:
/// [`Error::DeviceMismatch`] unless `t` is on that GPU too.
pub(crate) fn cuda_operand<'t>(op: &'static str, lead: &Tensor, t: &'t Tensor) -> Result<&'t CudaStorage> {
    match t.storage() {
        Storage::Cuda(s) if t.device() == lead.device() => Ok(s),
        _ => Err(Error::DeviceMismatch { op, lhs: lead.device(), rhs: t.device() }),
    }
}

/// [`cuda_operand`] for a float operand.
pub(crate) fn cuda_float<'t>(op: &'static str, lead: &Tensor, t: &'t Tensor) -> Result<&'t CudaStorage> {
    t.require_float()?;
    cuda_operand(op, lead, t)
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
    /// The transpose of a 2-D tensor, `[R, C] -> [C, R]`, in f32.
    ///
    /// Errors: [`Error::RankMismatch`] unless 2-D, [`Error::NotFloat`].
    pub fn transpose2d(&self) -> Result<Tensor> {
        const OP: &str = "transpose2d";
        let &[r, c] = self.dims() else {
            return Err(Error::RankMismatch { op: OP, expected: "2", dims: self.dims().to_vec() });
        };
        if let Storage::Cuda(x) = self.storage() {
            self.require_float()?;
            return Ok(Tensor::from_cuda(crate::Shape::new(&[c, r])?, super::cuda::transpose2d(x, r, c)?));
        }
        let x = f32_host(OP, self)?;
        Tensor::from_vec(transpose_f32(x.as_slice::<f32>()?, r, c), &[c, r], &crate::Device::Cpu)
    }

    /// `self^T · b` for `self: [.., M]` and `b: [.., K]` with the same leading dims (flattened
    /// into `T` rows): `[M, K]` in f32, `out[m][k] = Σ_t self[t][m] · b[t][k]`. The weight
    /// gradient of `Y = X W^T` is `dY.t_matmul(X)`.
    ///
    /// On a GPU, two bf16 (or two f16) operands run on the tensor-core GEMM's `tn` layout and
    /// anything else in f32 on the SIMT one (an operand of another dtype widened first), both
    /// accumulating in f32.
    ///
    /// Errors: [`Error::ShapeMismatch`] when the row counts differ, [`Error::DeviceMismatch`]
    /// for operands on different devices, [`Error::NotFloat`].
    pub fn t_matmul(&self, b: &Tensor) -> Result<Tensor> {
        const OP: &str = "t_matmul";
        let (t, m, k) = t_matmul_shapes(OP, self, b)?;
        if let Storage::Cuda(a) = self.storage() {
            self.require_float()?;
            let bs = cuda_float(OP, self, b)?;
            return Ok(Tensor::from_cuda(crate::Shape::new(&[m, k])?, super::cuda::t_matmul(a, bs, (t, m, k))?));
        }
        // One dtype: the host GEMM reads both as they are (bf16 pairs on AVX512-BF16 or AMX),
        // packing `a`'s panels from its columns (no transposed copy); mixed: both widened.
        let (a, b) =
            if self.dtype() == b.dtype() { (self.clone(), b.clone()) } else { (f32_host(OP, self)?, f32_host(OP, b)?) };
        let (ah, bh) = (a.cpu_storage(OP)?, b.cpu_storage(OP)?);
        let shape = tp_cpu::GemmShape { m, n: k, k: t };
        let mut y: Vec<f32> = crate::alloc::with_capacity(OP, m * k)?;
        with_dtype!(a.dtype(), T => {
            let (av, bv) = (ah.as_slice::<T>().unwrap_or_default(), bh.as_slice::<T>().unwrap_or_default());
            tp_cpu::matmul_tn(av, bv, tp_cpu::Layout::Kn, None, shape, &mut y.spare_capacity_mut()[..m * k])?;
        });
        // SAFETY: `matmul_tn` succeeded, so it wrote every one of the `m * k` outputs (its contract).
        unsafe { y.set_len(m * k) };
        Tensor::from_vec(y, &[m, k], &crate::Device::Cpu)
    }

    /// `self += a^T · b` in place for an f32 `self: [M, K]` (a gradient accumulated over
    /// micro-batches), `a: [.., M]` and `b: [.., K]` as for [`t_matmul`](Tensor::t_matmul). On a
    /// GPU the product is added in the GEMM's epilogue (beta = 1): no `[M, K]` temporary.
    ///
    /// Errors: as [`t_matmul`](Tensor::t_matmul); `self` not f32 `[M, K]` on the operands'
    /// device. On error `self` is unchanged.
    pub fn add_t_matmul(&mut self, a: &Tensor, b: &Tensor) -> Result<()> {
        const OP: &str = "add_t_matmul";
        let (t, m, k) = t_matmul_shapes(OP, a, b)?;
        if self.dtype() != DType::F32 || self.dims() != [m, k] {
            return Err(Error::InvalidArgument {
                op: OP,
                why: format!("the accumulator must be f32 [{m}, {k}], got {} {:?}", self.dtype(), self.dims()),
            });
        }
        if self.device() != a.device() {
            return Err(Error::DeviceMismatch { op: OP, lhs: self.device(), rhs: a.device() });
        }
        if let Storage::Cuda(asg) = a.storage() {
            a.require_float()?;
            let bs = cuda_float(OP, a, b)?;
            return super::cuda::add_t_matmul(self.cuda_storage_mut(OP)?, asg, bs, (t, m, k));
        }
        // The host GEMM adds into the accumulator itself (no `[M, K]` temporary), both operands
        // in one dtype as `t_matmul` reads them.
        let (a, b) = if a.dtype() == b.dtype() { (a.clone(), b.clone()) } else { (f32_host(OP, a)?, f32_host(OP, b)?) };
        let (ah, bh) = (a.cpu_storage(OP)?, b.cpu_storage(OP)?);
        let shape = tp_cpu::GemmShape { m, n: k, k: t };
        let acc = self.as_mut_slice::<f32>()?;
        with_dtype!(a.dtype(), T => {
            let (av, bv) = (ah.as_slice::<T>().unwrap_or_default(), bh.as_slice::<T>().unwrap_or_default());
            tp_cpu::matmul_tn_acc(av, bv, tp_cpu::Layout::Kn, shape, acc)?;
        });
        Ok(())
    }

    /// The sums over every row of `self: [.., N]`: `[N]` in f32 (accumulated in f64 on the
    /// host; on a GPU in f32, in a fixed order of row chunks), the gradient of a bias broadcast
    /// over the rows.
    ///
    /// Errors: [`Error::RankMismatch`] for a scalar, [`Error::NotFloat`].
    pub fn sum_rows(&self) -> Result<Tensor> {
        const OP: &str = "sum_rows";
        let (rows, n) = rows_cols(OP, self)?;
        if let Storage::Cuda(x) = self.storage() {
            self.require_float()?;
            return Ok(Tensor::from_cuda(crate::Shape::new(&[n])?, super::cuda::sum_rows(x, rows, n)?));
        }
        let x = f32_host(OP, self)?;
        let x = x.as_slice::<f32>()?;
        Tensor::from_vec(super::par::col_sums(rows, n, |r, c| f64::from(x[r * n + c])), &[n], &crate::Device::Cpu)
    }
}

/// `(T, M, K)` of `a^T b` for `a: [.., M]` and `b: [.., K]` with the same `T` rows.
fn t_matmul_shapes(op: &'static str, a: &Tensor, b: &Tensor) -> Result<(usize, usize, usize)> {
    let ((t, m), (tb, k)) = (rows_cols(op, a)?, rows_cols(op, b)?);
    if t != tb {
        return Err(Error::ShapeMismatch {
            op,
            lhs: a.dims().to_vec(),
            rhs: b.dims().to_vec(),
            why: "both operands need the same leading dims (the rows summed over)",
        });
    }
    Ok((t, m, k))
}

/// AdamW's hyperparameters for one step over f32 master weights: torch.optim.AdamW's
/// (single-tensor, non-fused) semantics, as tp-train's optimizer computes them (its `optim.rs`):
///
/// ```text
/// g  <- g * clip                           (torch's clip_grad_norm_ coefficient; 1: none)
/// p  <- p * (1 - lr * weight_decay)        (decayed parameters only, when weight_decay != 0)
/// m  <- m + (g - m) * (1 - beta1)
/// v  <- v * beta2 + (1 - beta2) * g * g
/// p  <- p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
/// ```
///
/// The scalar factors are computed in f64 and rounded to f32; the element arithmetic is f32,
/// rounded in that order, identically on the host and the GPU (bit for bit).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamwStep {
    /// The learning rate (finite, >= 0).
    pub lr: f64,
    /// First-moment decay, in `[0, 1)`.
    pub beta1: f64,
    /// Second-moment decay, in `[0, 1)`.
    pub beta2: f64,
    /// Added to the denominator (finite, >= 0).
    pub eps: f64,
    /// Decoupled weight decay (finite, >= 0).
    pub weight_decay: f64,
    /// The step number `t`, counted from 1.
    pub step: u64,
    /// The factor every gradient is multiplied by first (finite, >= 0; 1: no clipping).
    pub clip: f32,
}

impl AdamwStep {
    fn validate(&self, op: &'static str) -> Result<()> {
        let bad = |why: String| Err(Error::InvalidArgument { op, why });
        for (name, beta) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return bad(format!("{name} must be in [0, 1), got {beta}"));
            }
        }
        for (name, v) in [("lr", self.lr), ("eps", self.eps), ("weight_decay", self.weight_decay)] {
            if !(v.is_finite() && v >= 0.0) {
                return bad(format!("{name} must be finite and >= 0, got {v}"));
            }
        }
        if !(self.clip.is_finite() && self.clip >= 0.0) {
            return bad(format!("the clip coefficient must be finite and >= 0, got {}", self.clip));
        }
        if self.step == 0 {
            return bad("steps are counted from 1".into());
        }
        Ok(())
    }

    /// The f32 factors, each computed in f64 and rounded once (tp-train's `AdamW::step`).
    fn factors(&self) -> tp_kernels::AdamwFactors {
        let t = self.step as f64; // beta^t in f64 as Python's `beta ** step`
        let (bc1, bc2) = (1.0 - self.beta1.powf(t), 1.0 - self.beta2.powf(t));
        tp_kernels::AdamwFactors {
            keep: (1.0 - self.lr * self.weight_decay) as f32,
            w1: (1.0 - self.beta1) as f32,
            b2: self.beta2 as f32,
            w2: (1.0 - self.beta2) as f32,
            step_size: (self.lr / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps: self.eps as f32,
            clip: self.clip,
        }
    }
}

/// One parameter of an [`adamw_step`]: its f32 master weights and moments (updated in place),
/// its f32 gradient (read), all of one shape on one device, and whether it takes weight decay
/// (transformers: not biases and norm weights).
#[derive(Debug)]
pub struct AdamwParam<'a> {
    /// The weights, f32, updated in place.
    pub param: &'a mut Tensor,
    /// The gradient, f32, shaped as `param`.
    pub grad: &'a Tensor,
    /// The first moment, f32, updated in place.
    pub m: &'a mut Tensor,
    /// The second moment, f32, updated in place.
    pub v: &'a mut Tensor,
    /// Whether the weight decay applies.
    pub decay: bool,
}

/// One AdamW step ([`AdamwStep`]'s formulas) over every parameter of `params`, in place: on the
/// host, element by element; on a GPU, in multi-tensor launches of `kernels/optim.cu` (up to 32
/// tensors each, no host synchronisation). Host and GPU results are identical bit for bit.
///
/// Errors: [`Error::InvalidArgument`] for hyperparameters out of range or a tensor that is not
/// f32 or not shaped as its parameter, [`Error::DeviceMismatch`] unless every tensor is on one
/// device. Everything is checked before anything changes.
pub fn adamw_step(params: &mut [AdamwParam<'_>], hyper: &AdamwStep) -> Result<()> {
    const OP: &str = "adamw_step";
    hyper.validate(OP)?;
    let Some(device) = params.first().map(|p| p.param.device()) else { return Ok(()) };
    for (i, p) in params.iter().enumerate() {
        for (what, t) in [("param", &*p.param), ("grad", p.grad), ("m", &*p.m), ("v", &*p.v)] {
            if t.dtype() != DType::F32 || t.dims() != p.param.dims() {
                return Err(Error::InvalidArgument {
                    op: OP,
                    why: format!(
                        "parameter {i}: {what} must be f32 {:?}, got {} {:?}",
                        p.param.dims(),
                        t.dtype(),
                        t.dims()
                    ),
                });
            }
            if t.device() != device {
                return Err(Error::DeviceMismatch { op: OP, lhs: device, rhs: t.device() });
            }
        }
    }
    let f = hyper.factors();
    let decays = |p: &AdamwParam<'_>| p.decay && hyper.weight_decay != 0.0;
    if device != crate::Device::Cpu {
        let mut list = Vec::with_capacity(params.len());
        for p in params.iter_mut() {
            let (n, decay) = (p.param.numel(), decays(p));
            let g = cuda_operand(OP, &*p.param, p.grad)?;
            let ps = p.param.cuda_storage_mut(OP)?;
            let ms = p.m.cuda_storage_mut(OP)?;
            let vs = p.v.cuda_storage_mut(OP)?;
            list.push((ps, g, ms, vs, n, decay));
        }
        return super::cuda::adamw(list, f);
    }
    for p in params.iter_mut() {
        let decay = decays(p);
        let g = p.grad.as_slice::<f32>()?;
        let (w, m, v) = (p.param.as_mut_slice::<f32>()?, p.m.as_mut_slice::<f32>()?, p.v.as_mut_slice::<f32>()?);
        host_adamw(w, g, m, v, decay, &f);
    }
    Ok(())
}

/// The element-wise AdamW update on the host, in the kernel's (and tp-train's) order.
fn host_adamw(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], decay: bool, f: &tp_kernels::AdamwFactors) {
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let g = g * f.clip;
        if decay {
            *p *= f.keep;
        }
        *m += (g - *m) * f.w1;
        *v = *v * f.b2 + f.w2 * g * g;
        let denom = v.sqrt() / f.bc2_sqrt + f.eps;
        *p -= f.step_size * *m / denom;
    }
}

impl Tensor {
    /// One AdamW step of this f32 parameter with `grad`, updating it and its moments `m`, `v` in
    /// place: [`adamw_step`] with one parameter.
    pub fn adamw_step_(
        &mut self,
        grad: &Tensor,
        m: &mut Tensor,
        v: &mut Tensor,
        decay: bool,
        hyper: &AdamwStep,
    ) -> Result<()> {
        adamw_step(&mut [AdamwParam { param: self, grad, m, v, decay }], hyper)
    }
}
