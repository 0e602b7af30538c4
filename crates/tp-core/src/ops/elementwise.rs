//! Element-wise ops between GEMMs: SwiGLU on a merged `[gate | up]` output, a row-broadcast
//! bias add, and the residual add. All compute in f32 and round to the dtype at the points
//! PyTorch does: once per op (SwiGLU is two ops there, `silu(gate)` then `* up`, so it rounds
//! twice, as Hugging Face's MLP does).

use crate::storage::{CpuStorage, Storage};
use crate::{Element, Error, Result, Shape, Tensor, with_dtype};

impl Tensor {
    /// `silu(gate) * up` where the last dim of `self` is `[gate | up]` (even length `2I`):
    /// `[.., 2I] -> [.., I]`, `silu(g) = g / (1 + e^-g)`. The activation of a SwiGLU MLP after a
    /// merged gate/up projection.
    ///
    /// Errors: [`Error::RankMismatch`] for a scalar, [`Error::ShapeMismatch`] for an odd last dim.
    pub fn swiglu(&self) -> Result<Tensor> {
        const OP: &str = "swiglu";
        self.require_float()?;
        let (&two_i, lead) = self.dims().split_last().ok_or(Error::RankMismatch {
            op: OP,
            expected: "at least 1",
            dims: self.dims().to_vec(),
        })?;
        if two_i % 2 != 0 {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.dims().to_vec(),
                rhs: vec![two_i / 2, two_i / 2],
                why: "the last dim must be an even [gate | up] pair",
            });
        }
        let inner = two_i / 2;
        let rows: usize = lead.iter().product();
        let mut dims = lead.to_vec();
        dims.push(inner);
        let shape = Shape::new(&dims)?;
        if let Storage::Cuda(s) = self.storage() {
            return Ok(Tensor::from_cuda(shape, super::cuda::swiglu(s, rows, inner)?));
        }
        let src = self.cpu_storage(OP)?;
        let out = with_dtype!(src.dtype(), T => CpuStorage::from_vec(host_swiglu::<T>(src.as_slice::<T>().unwrap_or_default(), rows, inner)?));
        Ok(Tensor::from_cpu(shape, out))
    }

    /// `self + bias`, `bias` of shape `[N]` broadcast over the rows of `self: [.., N]`.
    ///
    /// Errors: dtype/device mismatch, [`Error::ShapeMismatch`] if `bias` is not `[N]`.
    pub fn add_row(&self, bias: &Tensor) -> Result<Tensor> {
        const OP: &str = "add_row";
        self.require_float()?;
        super::same_dtype_device(OP, self, bias)?;
        let n = *self.dims().last().ok_or(Error::RankMismatch { op: OP, expected: "at least 1", dims: vec![] })?;
        if bias.dims() != [n] {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.dims().to_vec(),
                rhs: bias.dims().to_vec(),
                why: "bias must be [N] for a [.., N] tensor",
            });
        }
        let rows = self.numel().checked_div(n).unwrap_or(0);
        if let (Storage::Cuda(s), Storage::Cuda(b)) = (self.storage(), bias.storage()) {
            return Ok(Tensor::from_cuda(self.shape().clone(), super::cuda::add_row(s, b, rows, n)?));
        }
        let (x, b) = (self.cpu_storage(OP)?, bias.cpu_storage(OP)?);
        let out = with_dtype!(x.dtype(), T => {
            let (xs, bs) = (x.as_slice::<T>().unwrap_or_default(), b.as_slice::<T>().unwrap_or_default());
            let v = xs.iter().enumerate().map(|(i, v)| T::from_f32(v.to_f32() + bs[i % n.max(1)].to_f32()));
            CpuStorage::from_vec(crate::alloc::collect(OP, xs.len(), v)?)
        });
        Ok(Tensor::from_cpu(self.shape().clone(), out))
    }
}

impl Tensor {
    /// `self + other`, element by element (same shape, dtype and device): the residual add.
    ///
    /// Errors: dtype/device mismatch, [`Error::ShapeMismatch`], [`Error::NotFloat`].
    pub fn add(&self, other: &Tensor) -> Result<Tensor> {
        let mut out = self.clone();
        out.add_assign(other)?;
        Ok(out)
    }

    /// `self += other` in place: the elements are overwritten where this tensor is their only
    /// owner (host or device); shared elements are copied first, as for every in-place write.
    ///
    /// Errors: as [`add`](Self::add); on error `self` is unchanged.
    pub fn add_assign(&mut self, other: &Tensor) -> Result<()> {
        const OP: &str = "add";
        self.require_float()?;
        super::same_dtype_device(OP, self, other)?;
        if self.dims() != other.dims() {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.dims().to_vec(),
                rhs: other.dims().to_vec(),
                why: "element-wise add needs equal shapes",
            });
        }
        let n = self.numel();
        if let Storage::Cuda(o) = other.storage() {
            return super::cuda::add_assign(self.cuda_storage_mut(OP)?, o, n);
        }
        let o = other.cpu_storage(OP)?;
        with_dtype!(self.dtype(), T => {
            let theirs = o.as_slice::<T>().unwrap_or_default();
            let mine = self.as_mut_slice::<T>()?;
            for (a, b) in mine.iter_mut().zip(theirs) {
                *a = T::from_f32(a.to_f32() + b.to_f32());
            }
        });
        Ok(())
    }
}

fn host_swiglu<T: Element>(x: &[T], rows: usize, inner: usize) -> Result<Vec<T>> {
    let mut out = crate::alloc::with_capacity("swiglu", rows * inner)?;
    for r in 0..rows {
        let row = &x[r * 2 * inner..(r + 1) * 2 * inner];
        let (gate, up) = row.split_at(inner);
        out.extend(gate.iter().zip(up).map(|(g, u)| {
            let g = g.to_f32();
            let silu = T::from_f32(g / (1.0 + (-g).exp())); // rounded, as torch's silu output
            T::from_f32(silu.to_f32() * u.to_f32())
        }));
    }
    Ok(out)
}
