//! [`Linear`]: `y = x W^T + b`, weight `[out, in]` as PyTorch and Hugging Face store it
//! (a tensor, or a GGUF file's quantized blocks: [`Weight`]).

use crate::error::{LayerError, Result};
use crate::grad::{Grad, Param, Placement};
use crate::lora::Lora;
use crate::weight::Weight;
use tp_core::{Activation, DType, Device, Tensor};

/// A linear layer: weight `W: [out, in]`, optional bias `b: [out]`; `forward(x) = x W^T + b`
/// for `x: [.., in]`, bias fused into the GEMM.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Weight,
    bias: Option<Tensor>,
    /// fp32 gradients of the weight and the bias (training; empty until a backward runs).
    grad_weight: Grad,
    grad_bias: Grad,
    /// LoRA adapters on the layer's modules, if any ([`crate::lora`]).
    lora: Option<Box<Lora>>,
}

impl Linear {
    /// Checks that `weight` is 2-D and `bias` is `[out]` with the same dtype and device.
    pub fn new(weight: impl Into<Weight>, bias: Option<Tensor>) -> Result<Linear> {
        let weight = weight.into();
        let (out, _) = weight.check_2d("Linear")?;
        if let Some(b) = &bias {
            check_bias(b, out, &weight, "Linear")?;
        }
        Ok(Linear { weight, bias, grad_weight: Grad::default(), grad_bias: Grad::default(), lora: None })
    }

    /// `[out, in]` as a tensor; an error for quantized blocks ([`Weight::dense`]).
    pub fn weight(&self) -> Result<&Tensor> {
        self.weight.dense()
    }
    /// The weight, however it is held.
    pub fn weights(&self) -> &Weight {
        &self.weight
    }
    /// `[out]`, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }
    /// Output features.
    pub fn out_features(&self) -> usize {
        self.weight.out_features()
    }
    /// Input features.
    pub fn in_features(&self) -> usize {
        self.weight.in_features()
    }
    /// The parameters' dtype (f32 for quantized blocks, which compute in f32).
    pub fn dtype(&self) -> DType {
        self.weight.dtype().unwrap_or(DType::F32)
    }
    /// Where the parameters live.
    pub fn device(&self) -> Device {
        self.weight.device()
    }

    /// `x W^T + b` for `x: [.., in]`, giving `[.., out]`, plus the adapters' `s · (x A^T) B^T`
    /// on their output columns when the layer has LoRA adapters.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.weight.linear(x, self.bias.as_ref())?;
        match &self.lora {
            Some(l) => l.forward(x, y),
            None => Ok(y),
        }
    }

    /// The layer's LoRA adapters, if any.
    pub fn lora(&self) -> Option<&Lora> {
        self.lora.as_deref()
    }

    /// `act(x G^T) ⊙ (x U^T)` for a quantized weight of two parts `[G; U]` without a bias,
    /// where the host's integer GEMM fuses the activation into the product
    /// ([`Tensor::linear_quant_glu`]): bitwise `self.forward(x)?.glu(act)`; `None` elsewhere.
    pub fn forward_glu(&self, x: &Tensor, act: Activation) -> Result<Option<Tensor>> {
        match (&self.weight, &self.bias) {
            // Not with adapters, nor while training them (the exact product of `forward`).
            (Weight::Quant(q), None) if self.lora.is_none() && !crate::lora::base_frozen() => {
                Ok(x.linear_quant_glu(q, act)?)
            }
            _ => Ok(None),
        }
    }

    /// Packs the weight once into the host GEMM's panels (host weights only; a no-op on a GPU
    /// or when already packed), so that products of many rows (prefill, batched decode) stop
    /// repacking it: the same numbers, bitwise, for as much memory again as the weight.
    pub fn pack_host(&mut self) -> Result<()> {
        self.weight.pack_host()
    }

    /// The same layer with parameters converted to `dtype` and moved to `device` (a dense
    /// weight only).
    pub fn to(&self, dtype: DType, device: &Device) -> Result<Linear> {
        let conv = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(dtype)?.to_device(device)?) };
        Linear::new(conv(self.weight.dense()?)?, self.bias.as_ref().map(conv).transpose()?)
    }
}

/// Training: the backward of `y = x W^T + b`, with `x: [T, in]`, `dy: [T, out]` (f32):
///
/// * `dx = dy W` ([`input_grad`](Linear::input_grad), no parameter touched);
/// * `dW += dy^T x`, `db += Σ_t dy[t]` ([`accumulate_grads`](Linear::accumulate_grads)).
///
/// The two are separate calls so that a tensor-parallel caller can start the all-reduce of `dx`
/// before the weight-gradient GEMM runs, overlapping them.
impl Linear {
    /// `dx = dy W` in f32. For a 16-bit weight, `dy` is rounded to its dtype and the GEMM runs
    /// on the 16-bit operands (as torch's bf16 autograd), its f32 sums kept.
    /// With adapters, their `Σ (s · dY_p B) A` is added.
    pub fn input_grad(&self, dy: &Tensor) -> Result<Tensor> {
        let dx = self.weight.input_grad(dy)?;
        match &self.lora {
            Some(l) => l.input_grad(dy, dx),
            None => Ok(dx),
        }
    }

    /// `dW += dy^T x` and, with a bias, `db += Σ_t dy[t]`, into the layer's fp32 gradients
    /// (`dy` rounded to `x`'s dtype first when that is 16-bit, so the GEMM runs on it).
    /// The adapters' gradients too, when the layer has some.
    pub fn accumulate_grads(&mut self, x: &Tensor, dy: &Tensor) -> Result<()> {
        if let Some(l) = &mut self.lora {
            l.accumulate(x, dy)?;
        }
        self.grad_weight.add_weight_grad(x, dy)?;
        if self.bias.is_some() {
            self.grad_bias.add_bias_grad(dy)?;
        }
        Ok(())
    }

    /// `dx` of [`input_grad`](Self::input_grad), then the parameters' gradients.
    pub fn backward(&mut self, x: &Tensor, dy: &Tensor) -> Result<Tensor> {
        let dx = self.input_grad(dy)?;
        self.accumulate_grads(x, dy)?;
        Ok(dx)
    }

    /// The weight and (if any) the bias as trainable parameters, placed by `weight` and `bias`
    /// (the placements of each local tensor's blocks; see [`Placement`]). An error for
    /// quantized blocks. With the base frozen ([`crate::lora::frozen_base`]), the layer's LoRA
    /// adapters instead (attached first inside [`crate::lora::attaching`]), whatever the
    /// weight's form.
    pub fn params<'a>(
        &'a mut self,
        weight: Vec<Placement>,
        bias: Vec<Placement>,
        f: &mut dyn FnMut(Param<'a>),
    ) -> Result<()> {
        let local = (self.weight.out_features(), self.weight.in_features());
        if crate::lora::visit(&mut self.lora, &weight, local, &self.weight.device(), f)? {
            return Ok(());
        }
        f(Param { value: self.weight.dense_mut()?, grad: &mut self.grad_weight, placements: weight });
        if let Some(b) = &mut self.bias {
            f(Param { value: b, grad: &mut self.grad_bias, placements: bias });
        }
        Ok(())
    }
}

/// `dy W` for a `[out, in]` weight `w`, in f32 (see [`Linear::input_grad`]).
pub(crate) fn grad_input(w: &Tensor, dy: &Tensor) -> Result<Tensor> {
    Ok(dy.to_dtype(w.dtype())?.matmul_f32(w, tp_core::WeightLayout::Kn)?)
}

/// `dy^T x` in f32 (see [`Linear::accumulate_grads`]).
pub(crate) fn grad_weight(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    Ok(dy.to_dtype(x.dtype())?.t_matmul(x)?)
}

/// Checks that `b` is `[out]` and, for a dense weight, of its dtype and on its device (a bias
/// beside quantized blocks is any float dtype on their device; it is added in f32).
pub(crate) fn check_bias(b: &Tensor, out: usize, weight: &Weight, what: &str) -> Result<()> {
    if b.dims() != [out] {
        return Err(LayerError::Config(format!("{what} bias must be [{out}], got {:?}", b.dims())));
    }
    let dtype_ok = weight.dtype().is_none_or(|d| d == b.dtype());
    if !dtype_ok || b.device() != weight.device() {
        return Err(LayerError::Config(format!(
            "{what} bias is {} on {}, weight is {} on {}",
            b.dtype(),
            b.device(),
            weight.dtype().map_or("quantized".to_string(), |d| d.to_string()),
            weight.device()
        )));
    }
    Ok(())
}
