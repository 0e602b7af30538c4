//! The two ops at the ends of a language model, where token ids meet vectors: the embedding
//! lookup (ids to rows of a table, vocab-parallel aware) and the greedy argmax (logits to ids).

use crate::storage::{CpuStorage, Storage};
use crate::{DType, Device, Element, Error, IntElement, Result, Shape, Tensor, with_dtype};

impl Tensor {
    /// Rows of the embedding table `self: [V_r, H]` for token `ids` (an `i32` or `i64` tensor
    /// of any shape `[..]`), as `[.., H]`: `out[i] = self[ids[i] - row_offset]` when
    /// `row_offset <= ids[i] < row_offset + V_r`, and a row of zeros otherwise.
    ///
    /// This is the local half of a vocab-parallel lookup: rank `r` holds rows
    /// `[v_r, v_{r+1})` of the full `[V, H]` table, looks up with `row_offset = v_r`, and an
    /// all-reduce (sum) of the ranks' outputs gives the full lookup exactly, since every id has
    /// its row on exactly one rank. Range checks against the full vocabulary are the caller's
    /// (ids outside every rank's rows would give zeros).
    ///
    /// Errors: [`Error::RankMismatch`] unless the table is 2-D, [`Error::NotInteger`] for float
    /// ids, [`Error::DeviceMismatch`], [`Error::NotFloat`] for an integer table.
    pub fn embedding(&self, ids: &Tensor, row_offset: usize) -> Result<Tensor> {
        const OP: &str = "embedding";
        self.require_float()?;
        let &[rows, h] = self.dims() else {
            return Err(Error::RankMismatch {
                op: OP,
                expected: "2 (table: [rows, hidden])",
                dims: self.dims().to_vec(),
            });
        };
        if ids.dtype().is_float() {
            return Err(Error::NotInteger { op: OP, dtype: ids.dtype() });
        }
        if ids.device() != self.device() {
            return Err(Error::DeviceMismatch { op: OP, lhs: self.device(), rhs: ids.device() });
        }
        let mut dims = ids.dims().to_vec();
        dims.push(h);
        let shape = Shape::new(&dims)?;
        let offset = i64::try_from(row_offset)
            .map_err(|_| Error::InvalidArgument { op: OP, why: format!("row_offset {row_offset} exceeds i64") })?;
        if let (Storage::Cuda(t), Storage::Cuda(i)) = (self.storage(), ids.storage()) {
            return Ok(Tensor::from_cuda(shape, super::cuda::embedding(t, i, ids.numel(), (rows, h), offset)?));
        }
        let (table, ids_s) = (self.cpu_storage(OP)?, ids.cpu_storage(OP)?);
        let out = with_dtype!(table.dtype(), T => {
            let t = table.as_slice::<T>().unwrap_or_default();
            CpuStorage::from_vec(match ids_s.dtype() {
                DType::I32 => gather::<T, i32>(t, ids_s.as_slice().unwrap_or_default(), rows, h, offset),
                _ => gather::<T, i64>(t, ids_s.as_slice().unwrap_or_default(), rows, h, offset),
            })
        });
        Ok(Tensor::from_cpu(shape, out))
    }

    /// The index of the largest element of each row of the last dim, as an `i64` tensor of the
    /// leading dims (`[.., N] -> [..]`): the greedy choice over logits. Ties go to the lowest
    /// index and NaN counts as the largest value (as `torch.argmax`).
    ///
    /// Errors: [`Error::InvalidArgument`] for an empty last dim, [`Error::RankMismatch`] for a
    /// scalar, [`Error::NotFloat`].
    pub fn argmax(&self) -> Result<Tensor> {
        Ok(self.max_with_index()?.1)
    }

    /// Each row's largest value (widened exactly to `f32`) and its index (`i64`), both shaped
    /// as the leading dims: what a vocab-parallel argmax exchanges between ranks. Same ties and
    /// NaN rule as [`argmax`](Self::argmax).
    pub fn max_with_index(&self) -> Result<(Tensor, Tensor)> {
        const OP: &str = "argmax";
        self.require_float()?;
        let (&n, lead) =
            self.dims().split_last().ok_or(Error::RankMismatch { op: OP, expected: "at least 1", dims: vec![] })?;
        if n == 0 {
            return Err(Error::InvalidArgument { op: OP, why: format!("the last dim of {:?} is empty", self.dims()) });
        }
        let rows: usize = lead.iter().product();
        if let Storage::Cuda(x) = self.storage() {
            let (vals, idx) = super::cuda::max_with_index(x, rows, n)?;
            let shape = Shape::new(lead)?;
            return Ok((Tensor::from_cuda(shape.clone(), vals), Tensor::from_cuda(shape, idx)));
        }
        let x = self.cpu_storage(OP)?;
        let (vals, idx): (Vec<f32>, Vec<i64>) = with_dtype!(x.dtype(), T => {
            x.as_slice::<T>().unwrap_or_default().chunks_exact(n).map(row_max::<T>).unzip()
        });
        Ok((Tensor::from_vec(vals, lead, &Device::Cpu)?, Tensor::from_vec(idx, lead, &Device::Cpu)?))
    }
}

fn gather<T: Element, I: IntElement>(table: &[T], ids: &[I], rows: usize, h: usize, offset: i64) -> Vec<T> {
    let mut out = Vec::with_capacity(ids.len() * h);
    let zero = T::from_f32(0.0);
    for id in ids {
        match id.to_i64().checked_sub(offset) {
            Some(local) if (0..rows as i64).contains(&local) => {
                let r = local as usize;
                out.extend_from_slice(&table[r * h..(r + 1) * h]);
            }
            _ => out.extend(std::iter::repeat_n(zero, h)),
        }
    }
    out
}

/// `(max, first index of it)` of a non-empty row; NaN beats every number.
fn row_max<T: Element>(row: &[T]) -> (f32, i64) {
    let mut best = (row[0].to_f32(), 0usize);
    for (i, v) in row.iter().enumerate().skip(1) {
        let v = v.to_f32();
        if best.0.is_nan() {
            break;
        }
        if v > best.0 || v.is_nan() {
            best = (v, i);
        }
    }
    (best.0, best.1 as i64)
}

impl Tensor {
    /// The gradient of the local table in [`embedding`](Tensor::embedding)`(ids, row_offset)`:
    /// `self = dy: [.., H]` (one row per id) scatter-added into `[rows, H]` f32, row
    /// `ids[i] - row_offset` receiving `dy[i]` for every id this table holds (ids elsewhere, on
    /// other ranks' rows, add nothing). Repeated ids add up.
    ///
    /// On a GPU (`kernels/grad.cu`) each row is summed by one block in ascending `i`, as on the
    /// host: the results are identical, bit for bit, and deterministic (no atomics).
    ///
    /// Errors: [`Error::NotInteger`] for float ids, `dy` not `[ids.., H]`, operands on
    /// different devices.
    pub fn embedding_backward(&self, ids: &Tensor, rows: usize, row_offset: usize) -> Result<Tensor> {
        const OP: &str = "embedding_backward";
        if ids.dtype().is_float() {
            return Err(Error::NotInteger { op: OP, dtype: ids.dtype() });
        }
        let (n, h) = super::grad::rows_cols(OP, self)?;
        if n != ids.numel() {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.dims().to_vec(),
                rhs: ids.dims().to_vec(),
                why: "needs one gradient row per id",
            });
        }
        if let Storage::Cuda(d) = self.storage() {
            self.require_float()?;
            let i = super::grad::cuda_operand(OP, self, ids)?;
            let Ok(offset) = i64::try_from(row_offset) else {
                // Rows past i64::MAX hold no id: the gradient is zero.
                return Tensor::zeros(&[rows, h], DType::F32, &self.device());
            };
            let out = super::cuda::embedding_backward(d, i, n, (rows, h), offset)?;
            return Ok(Tensor::from_cuda(Shape::new(&[rows, h])?, out));
        }
        let dy = super::grad::f32_host(OP, self)?;
        let dy = dy.as_slice::<f32>()?;
        let mut out = vec![0f32; rows * h];
        for (i, id) in ids.to_i64_vec()?.into_iter().enumerate() {
            let Some(r) = usize::try_from(id).ok().and_then(|id| id.checked_sub(row_offset)).filter(|&r| r < rows)
            else {
                continue;
            };
            out[r * h..(r + 1) * h].iter_mut().zip(&dy[i * h..(i + 1) * h]).for_each(|(a, &b)| *a += b);
        }
        Tensor::from_vec(out, &[rows, h], &crate::Device::Cpu)
    }
}
