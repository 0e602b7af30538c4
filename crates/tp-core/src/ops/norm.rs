//! RMSNorm, as Llama, Qwen2 and Mistral use it (Hugging Face's `LlamaRMSNorm`).
//!
//! For each row `x` of the last dim (length `H`):
//! `y = w ⊙ round(x · (mean(x²) + eps)^-1/2)`, where the normalisation is computed in f32 and
//! rounded (nearest even) to the input dtype before the multiply by the weight `w: [H]`, whose
//! product is rounded again: exactly the two rounding points of Hugging Face's code
//! (`weight * hidden_states.to(input_dtype)`). In f32 both roundings are no-ops.

use crate::storage::{CpuStorage, Storage};
use crate::{Element, Error, Result, Tensor, with_dtype};

impl Tensor {
    /// RMSNorm over the last dim with weight `w: [H]` (same dtype and device) and `eps > 0`.
    ///
    /// Errors: [`Error::RankMismatch`] for a scalar, [`Error::ShapeMismatch`] if `w` is not
    /// `[H]`, dtype/device mismatches, [`Error::InvalidArgument`] for a negative or non-finite
    /// `eps`, [`Error::NotFloat`] for integer tensors.
    pub fn rms_norm(&self, weight: &Tensor, eps: f64) -> Result<Tensor> {
        const OP: &str = "rms_norm";
        self.require_float()?;
        super::same_dtype_device(OP, self, weight)?;
        let h = *self.dims().last().ok_or(Error::RankMismatch { op: OP, expected: "at least 1", dims: vec![] })?;
        if weight.dims() != [h] {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.dims().to_vec(),
                rhs: weight.dims().to_vec(),
                why: "the weight must be [H] for an input [.., H]",
            });
        }
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(Error::InvalidArgument { op: OP, why: format!("eps must be finite and >= 0, got {eps}") });
        }
        let rows = self.numel().checked_div(h).unwrap_or(0);
        if let (Storage::Cuda(x), Storage::Cuda(w)) = (self.storage(), weight.storage()) {
            return Ok(Tensor::from_cuda(self.shape().clone(), super::cuda::rms_norm(x, w, rows, h, eps as f32)?));
        }
        let (x, w) = (self.cpu_storage(OP)?, weight.cpu_storage(OP)?);
        let out = with_dtype!(x.dtype(), T => {
            let (xs, ws) = (x.as_slice::<T>().unwrap_or_default(), w.as_slice::<T>().unwrap_or_default());
            CpuStorage::from_vec(host_rms_norm::<T>(xs, ws, h, eps as f32))
        });
        Ok(Tensor::from_cpu(self.shape().clone(), out))
    }
}

/// The host RMSNorm of every row of `x` (rows of `h` elements); the sum of squares is taken in
/// f64, the rest in f32 as on the GPU.
fn host_rms_norm<T: Element>(x: &[T], w: &[T], h: usize, eps: f32) -> Vec<T> {
    let mut out = Vec::with_capacity(x.len());
    let w: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
    for row in x.chunks_exact(h.max(1)) {
        let ss: f64 = row.iter().map(|v| f64::from(v.to_f32()).powi(2)).sum();
        let mean = (ss / h as f64) as f32;
        let rstd = 1.0 / (mean + eps).sqrt();
        out.extend(row.iter().zip(&w).map(|(v, w)| {
            let normed = T::from_f32(v.to_f32() * rstd); // rounding point 1: to the input dtype
            T::from_f32(w * normed.to_f32()) // rounding point 2: the weight product
        }));
    }
    out
}
