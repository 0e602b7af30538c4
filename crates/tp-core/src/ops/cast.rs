//! Dtype conversion. Widening is exact; narrowing rounds to nearest, ties to even, once (a
//! `f16 -> bf16` cast goes through the exact `f32` value, so it too rounds only once).

use crate::storage::{CpuStorage, Storage};
use crate::{DType, Element, Result, Tensor, with_dtype};

/// Elements converted per chunk through the `f32` staging buffer.
const CHUNK: usize = 4096;

impl Tensor {
    /// This tensor converted to `dtype` (a clone if it already has it).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        // Integers hold token ids; converting them to or from floats is not an operation tp has.
        for d in [self.dtype(), dtype] {
            if !d.is_float() {
                return Err(crate::Error::NotFloat { dtype: d });
            }
        }
        if let Storage::Cuda(s) = self.storage() {
            return Ok(Tensor::from_cuda(self.shape().clone(), super::cuda::cast(s, self.numel(), dtype)?));
        }
        let src = self.cpu_storage("to_dtype")?;
        let out = with_dtype!(src.dtype(), S => with_dtype!(dtype, D => {
            CpuStorage::from_vec(convert::<S, D>(src.as_slice::<S>().unwrap_or_default())?)
        }));
        Ok(Tensor::from_cpu(self.shape().clone(), out))
    }
}

fn convert<S: Element, D: Element>(src: &[S]) -> Result<Vec<D>> {
    let mut out = crate::alloc::zeroed::<D>("to_dtype", src.len())?;
    let mut staging = [0f32; CHUNK];
    for (s, d) in src.chunks(CHUNK).zip(out.chunks_mut(CHUNK)) {
        let staging = &mut staging[..s.len()];
        S::slice_to_f32(s, staging);
        D::slice_from_f32(staging, d);
    }
    Ok(out)
}
