//! `narrow` and `cat`: the host versions of the shard-copy kernels.
//!
//! A contiguous tensor seen around dimension `d` is `outer` blocks of `size` rows of `inner`
//! elements (`Shape::split_at_dim`). `narrow` copies rows `start..start+len` of every block;
//! `cat` appends each input's block in turn, block by block.

use crate::storage::{CpuStorage, Storage};
use crate::{Device, Error, Result, Shape, Storable, Tensor, with_storable};
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
        if let Storage::Cuda(s) = self.storage() {
            return Ok(Tensor::from_cuda(shape, super::cuda::narrow(s, (outer, size, inner), start, len)?));
        }
        let src = self.cpu_storage("narrow")?;
        let out = with_storable!(src.dtype(), T => {
            let s = src.as_slice::<T>().unwrap_or_default();
            let mut out = crate::alloc::with_capacity("narrow", shape.numel())?;
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
        if let Storage::Cuda(_) = first.storage() {
            let parts = tensors
                .iter()
                .map(|t| match t.borrow().storage() {
                    Storage::Cuda(s) => Ok((s, t.borrow().dims()[dim])),
                    Storage::Cpu(_) => Err(Error::DeviceMismatch { op: "cat", lhs: first.device(), rhs: Device::Cpu }),
                })
                .collect::<Result<Vec<_>>>()?;
            return Ok(Tensor::from_cuda(shape, super::cuda::cat(&parts, outer, inner, total)?));
        }
        let out = with_storable!(first.dtype(), E => CpuStorage::from_vec(cat_blocks::<E, T>(tensors, dim, outer, inner, shape.numel())?));
        Ok(Tensor::from_cpu(shape, out))
    }
}

fn cat_blocks<E: Storable, T: Borrow<Tensor>>(
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
    let mut out = crate::alloc::with_capacity("cat", numel)?;
    for o in 0..outer {
        for &(s, block) in &parts {
            out.extend_from_slice(&s[o * block..(o + 1) * block]);
        }
    }
    Ok(out)
}

impl Tensor {
    /// Interleaves a rank-major all-gather buffer into the gathered tensor.
    ///
    /// `self` holds, rank after rank, each rank's `[rows, cols_r]` block (any shape with
    /// `rows * cols` elements), where `cols_r` is rank `r`'s length under `TensorShard`'s balanced
    /// split of `cols` over `world`. The result is `[rows, cols]` with rank `r`'s block in columns
    /// `start_r..start_r + cols_r`: what an all-gather along the last dimension must return. On a
    /// GPU this is one pass of the gather-interleave kernel.
    ///
    /// Errors: [`Error::ZeroWorldSize`], [`Error::ElementCountMismatch`].
    pub fn interleave_rank_major(&self, rows: usize, cols: usize, world: usize) -> Result<Tensor> {
        const OP: &str = "interleave_rank_major";
        if world == 0 {
            return Err(Error::ZeroWorldSize { op: OP });
        }
        let shape = Shape::new(&[rows, cols])?;
        if shape.numel() != self.numel() {
            return Err(Error::ElementCountMismatch {
                op: OP,
                dims: vec![rows, cols],
                expected: shape.numel(),
                got: self.numel(),
            });
        }
        if let Storage::Cuda(s) = self.storage() {
            return Ok(Tensor::from_cuda(shape, super::cuda::interleave(s, rows, cols, world)?));
        }
        let shards = crate::TensorShard::for_all_ranks(1, cols, world)?;
        let src = self.cpu_storage(OP)?;
        let out = with_storable!(src.dtype(), T => {
            let v = src.as_slice::<T>().unwrap_or_default();
            let mut out = crate::alloc::with_capacity(OP, rows * cols)?;
            for row in 0..rows {
                for s in &shards {
                    let block = rows * s.start() + row * s.len();
                    out.extend_from_slice(&v[block..block + s.len()]);
                }
            }
            CpuStorage::from_vec(out)
        });
        Ok(Tensor::from_cpu(shape, out))
    }
}

impl Tensor {
    /// Writes `src` into elements `start..start + len` of dimension `dim` of `self`, in place
    /// (`len` is `src`'s size in `dim`; every other dim must match): the inverse of
    /// [`narrow`](Self::narrow), and how a KV cache appends. Host and device elements are
    /// overwritten where this tensor owns them alone, copied first if shared.
    ///
    /// Errors: [`Error::DimOutOfRange`], [`Error::NarrowOutOfBounds`], [`Error::ShapeMismatch`],
    /// dtype/device mismatches; `self` is unchanged on error.
    pub fn slice_set(&mut self, src: &Tensor, dim: usize, start: usize) -> Result<()> {
        const OP: &str = "slice_set";
        super::same_dtype_device(OP, self, src)?;
        let (outer, size, inner) = self.shape().split_at_dim(OP, dim)?;
        let len = src.shape().dim(OP, dim)?;
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::NarrowOutOfBounds { dim, start, len, size });
        }
        let fits = src.ndim() == self.ndim()
            && src.dims().iter().zip(self.dims()).enumerate().all(|(d, (a, b))| d == dim || a == b);
        if !fits {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.dims().to_vec(),
                rhs: src.dims().to_vec(),
                why: "every dimension but the written one must match",
            });
        }
        if let Storage::Cuda(s) = src.storage() {
            return super::cuda::slice_set(self.cuda_storage_mut(OP)?, s, (outer, size, inner), start, len);
        }
        let from = src.cpu_storage(OP)?;
        with_storable!(self.dtype(), T => {
            let s = from.as_slice::<T>().unwrap_or_default();
            let d = self.as_mut_slice::<T>()?;
            let block = len * inner;
            for o in 0..outer {
                let at = (o * size + start) * inner;
                d[at..at + block].copy_from_slice(&s[o * block..(o + 1) * block]);
            }
        });
        Ok(())
    }
}
