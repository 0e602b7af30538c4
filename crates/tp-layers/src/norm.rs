//! [`RmsNorm`]: the replicated normalisation layer of Llama-style decoders.
//!
//! `y = w ⊙ round(x / sqrt(mean(x²) + eps))` over the last dim (`tp_core::Tensor::rms_norm`,
//! Hugging Face's rounding points). Every rank holds the whole `w: [H]` and normalises its whole
//! input; no communication.

use crate::checkpoint::Checkpoint;
use crate::error::{LayerError, Result};
use crate::options::LoadOptions;
use tp_comm::DeviceGroup;
use tp_core::Tensor;

/// RMSNorm with weight `w: [H]` and `eps`.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    /// Wraps a `[H]` weight.
    pub fn new(weight: Tensor, eps: f64) -> Result<RmsNorm> {
        if weight.ndim() != 1 {
            return Err(LayerError::Config(format!("RmsNorm weight must be [H], got {:?}", weight.dims())));
        }
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(LayerError::Config(format!("RmsNorm eps must be finite and >= 0, got {eps}")));
        }
        Ok(RmsNorm { weight, eps })
    }

    /// Loads `{prefix}.weight` whole onto the group's device.
    pub fn load(ckpt: &Checkpoint, prefix: &str, eps: f64, group: &DeviceGroup, opts: &LoadOptions) -> Result<RmsNorm> {
        let name = format!("{prefix}.weight");
        ckpt.param_info(&name)?;
        Self::new(ckpt.load(&name, opts.dtype, &group.device())?, eps)
    }

    /// `[H]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
    /// The epsilon under the square root.
    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// The normalised `x: [.., H]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.rms_norm(&self.weight, self.eps)?)
    }
}
