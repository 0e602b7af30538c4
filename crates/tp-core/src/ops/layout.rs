//! `narrow` and `cat`: the host versions of the shard-copy kernels.
//!
//! A contiguous tensor seen around dimension `d` is `outer` blocks of `size` rows of `inner`
//! elements (`Shape::split_at_dim`). `narrow` copies rows `start..start+len` of every block;
//! `cat` appends each input's block in turn, block by block.

use crate::storage::CpuStorage;
use crate::{Element, Error, Result, Shape, Tensor, with_dtype};
use std::borrow::Borrow;

impl Tensor {
    /// Elements `start..start + len` of dimension `dim`, as a new contiguous tensor.
    ///
    /// Errors: [`Error::DimOutOfRange`], [`Error::NarrowOutOfBounds`].
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        let (outer, size, inner) = self.shape().split_at_dim("narrow", dim)?;
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::NarrowOutOfBounds { dim, start, len, size });
        }
        let shape = self.shape().with_dim(dim, len)?;
        let src = self.cpu_storage("narrow")?;
        let out = with_dtype!(src.dtype(), T => {
            let s = src.as_slice::<T>().unwrap_or_default();
            let mut out = Vec::with_capacity(shape.numel());
            for o in 0..outer {
                let from = (o * size + start) * inner;
                out.extend_from_slice(&s[from..from + len * inner]);
            }
            CpuStorage::from_vec(out)
        });
        Ok(Tensor::from_cpu(shape, out))
    }

    /// Concatenates `tensors` along `dim`. All must share dtype, device, number of dimensions,
    /// and every size but `dim`'s.
    ///
    /// Errors: [`Error::CatEmpty`], [`Error::DimOutOfRange`], [`Error::DTypeMismatch`],
    /// [`Error::DeviceMismatch`], [`Error::ShapeMismatch`], [`Error::ShapeOverflow`].
    pub fn cat<T: Borrow<Tensor>>(tensors: &[T], dim: usize) -> Result<Tensor> {
        let first = tensors.first().ok_or(Error::CatEmpty)?.borrow();
        let (outer, _, inner) = first.shape().split_at_dim("cat", dim)?;
        let mut total = 0usize;
        for t in tensors {
            let t = t.borrow();
            super::same_dtype_device("cat", first, t)?;
            let compatible = t.ndim() == first.ndim()
                && t.dims().iter().zip(first.dims()).enumerate().all(|(d, (a, b))| d == dim || a == b);
            if !compatible {
                return Err(Error::ShapeMismatch {
                    op: "cat",
                    lhs: first.dims().to_vec(),
                    rhs: t.dims().to_vec(),
                    why: "every dimension but the cat dimension must match",
                });
            }
            total = total.checked_add(t.dims()[dim]).ok_or_else(|| Error::ShapeOverflow { dims: t.dims().to_vec() })?;
        }
        let shape: Shape = first.shape().with_dim(dim, total)?;
        let out = with_dtype!(first.dtype(), E => CpuStorage::from_vec(cat_blocks::<E, T>(tensors, dim, outer, inner, shape.numel())?));
        Ok(Tensor::from_cpu(shape, out))
    }
}

fn cat_blocks<E: Element, T: Borrow<Tensor>>(
    tensors: &[T],
    dim: usize,
    outer: usize,
    inner: usize,
    numel: usize,
) -> Result<Vec<E>> {
    let parts = tensors
        .iter()
        .map(|t| Ok((t.borrow().as_slice::<E>()?, t.borrow().dims()[dim] * inner)))
        .collect::<Result<Vec<_>>>()?;
    let mut out = Vec::with_capacity(numel);
    for o in 0..outer {
        for &(s, block) in &parts {
            out.extend_from_slice(&s[o * block..(o + 1) * block]);
        }
    }
    Ok(out)
}
