//! [`RmsNorm`]: the replicated normalisation layer of Llama-style decoders.
//!
//! `y = w ⊙ round(x / sqrt(mean(x²) + eps))` over the last dim (Hugging Face's `LlamaRMSNorm`,
//! two rounding points), or Gemma's `y = round(x / sqrt(mean(x²) + eps) · (1 + w))` computed in
//! f32 ([`NormStyle`]). Every rank holds the whole `w: [H]` and normalises its whole input; no
//! communication. (A norm over features split across ranks, OLMo 2's q/k norm, lives in the
//! attention layer: it needs the ranks' sums of squares.)

use crate::error::{LayerError, Result};
use crate::loader::Loader;
use tp_core::{NormStyle, Tensor};

/// RMSNorm with weight `w: [H]`, `eps` and a [`NormStyle`].
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
    style: NormStyle,
    /// fp32 gradient of the weight (training).
    grad: crate::Grad,
}

impl RmsNorm {
    /// Wraps a `[H]` weight (Llama's style).
    pub fn new(weight: Tensor, eps: f64) -> Result<RmsNorm> {
        Self::with_style(weight, eps, NormStyle::Weight)
    }

    /// Wraps a `[H]` weight applied in `style`.
    pub fn with_style(weight: Tensor, eps: f64, style: NormStyle) -> Result<RmsNorm> {
        if weight.ndim() != 1 {
            return Err(LayerError::Config(format!("RmsNorm weight must be [H], got {:?}", weight.dims())));
        }
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(LayerError::Config(format!("RmsNorm eps must be finite and >= 0, got {eps}")));
        }
        Ok(RmsNorm { weight, eps, style, grad: crate::Grad::default() })
    }

    /// Loads `weight` (under the loader's prefix) whole onto the group's device.
    pub fn load(ld: &Loader<'_>, eps: f64, style: NormStyle) -> Result<RmsNorm> {
        Self::with_style(ld.full("weight")?, eps, style)
    }

    /// Loads entries `start..start + len` of `weight`: the slice of a norm over features that
    /// are split across ranks.
    pub fn load_slice(ld: &Loader<'_>, (start, len): (usize, usize), eps: f64, style: NormStyle) -> Result<RmsNorm> {
        Self::with_style(ld.rows("weight", start, len)?, eps, style)
    }

    /// `[H]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
    /// The epsilon under the square root.
    pub fn eps(&self) -> f64 {
        self.eps
    }
    /// How the weight is applied.
    pub fn style(&self) -> NormStyle {
        self.style
    }

    /// The normalised `x: [.., H]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.rms_norm_with(&self.weight, self.eps, self.style, None)?)
    }

    /// `x: [.., H_r]` normalised with each row's sum of squares `sum_sq: [rows]` (f32) over
    /// `n` features: the norm of features split across ranks, whose statistic the ranks
    /// computed together (`mean = sum_sq / n`).
    pub fn forward_with_sum_squares(&self, x: &Tensor, sum_sq: &Tensor, n: usize) -> Result<Tensor> {
        Ok(x.rms_norm_with(&self.weight, self.eps, self.style, Some((sum_sq, n)))?)
    }
}

/// Training: `dx = r·g - x·r³·(Σ g·x)/n` and `dw += Σ_rows dy ⊙ x·r` with `g = dy ⊙ w'`
/// (`tp_core::Tensor::rms_norm_backward`).
impl RmsNorm {
    /// `dx` (f32) from the forward's input `x` and `dy`, accumulating the weight's gradient.
    pub fn backward(&mut self, x: &Tensor, dy: &Tensor) -> Result<Tensor> {
        let (dx, dw) = x.rms_norm_backward(&self.weight, dy, self.eps, self.style, None)?;
        self.grad.add(&dw)?;
        Ok(dx)
    }

    /// This rank's part of `Σ g·x` per row, for a norm over features split across ranks.
    pub fn grad_dot(&self, x: &Tensor, dy: &Tensor) -> Result<Tensor> {
        Ok(x.rms_norm_grad_dot(&self.weight, dy, self.style)?)
    }

    /// [`backward`](Self::backward) of [`forward_with_sum_squares`](Self::forward_with_sum_squares):
    /// the forward's statistics `sum_sq` over `n` features, and `dot`, the ranks' total of
    /// [`grad_dot`](Self::grad_dot).
    pub fn backward_split(
        &mut self,
        x: &Tensor,
        dy: &Tensor,
        sum_sq: &Tensor,
        n: usize,
        dot: &Tensor,
    ) -> Result<Tensor> {
        let (dx, dw) = x.rms_norm_backward(&self.weight, dy, self.eps, self.style, Some((sum_sq, n, dot)))?;
        self.grad.add(&dw)?;
        Ok(dx)
    }

    /// The weight as a parameter placed by `placements`.
    pub fn param<'a>(&'a mut self, placements: Vec<crate::Placement>, f: &mut dyn FnMut(crate::Param<'a>)) {
        f(crate::Param { value: &mut self.weight, grad: &mut self.grad, placements });
    }
}
