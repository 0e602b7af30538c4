//! [`Weight`]: a linear layer's `[out, in]` weight, dense or held as quantized blocks.
//!
//! Dense weights are tensors (packed once for the host GEMM when asked); quantized ones are
//! the GGUF file's own blocks ([`QuantWeight`]), multiplied without being dequantized. Layers
//! hold a `Weight` and call [`Weight::matmul_t`]: `x W^T`, whichever it is.

use crate::error::{LayerError, Result};
use tp_core::{DType, Device, PackedWeight, QuantWeight, Tensor};

/// A linear layer's weight `W: [out, in]`.
#[derive(Debug, Clone)]
pub enum Weight {
    /// A tensor, and its host GEMM packing once [`Weight::pack_host`] ran.
    Dense {
        /// The weight, `[out, in]`.
        tensor: Tensor,
        /// Its host GEMM panels, once packed.
        packed: Option<PackedWeight>,
    },
    /// Quantized blocks (host memory).
    Quant(QuantWeight),
}

impl From<Tensor> for Weight {
    fn from(tensor: Tensor) -> Weight {
        Weight::Dense { tensor, packed: None }
    }
}

impl Weight {
    /// `[out, in]`; an error unless 2-D (dense).
    pub(crate) fn check_2d(&self, what: &str) -> Result<(usize, usize)> {
        match self {
            Weight::Dense { tensor, .. } => match *tensor.dims() {
                [o, i] => Ok((o, i)),
                ref d => Err(LayerError::Config(format!("{what} weight must be [out, in], got {d:?}"))),
            },
            Weight::Quant(q) => Ok((q.out_features(), q.in_features())),
        }
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        match self {
            Weight::Dense { tensor, .. } => tensor.dims().first().copied().unwrap_or(0),
            Weight::Quant(q) => q.out_features(),
        }
    }
    /// Input features.
    pub fn in_features(&self) -> usize {
        match self {
            Weight::Dense { tensor, .. } => tensor.dims().get(1).copied().unwrap_or(0),
            Weight::Quant(q) => q.in_features(),
        }
    }
    /// The dense tensor, or [`LayerError::Config`] for quantized blocks (which have no tensor:
    /// dequantize while loading, `--dtype`, to get one).
    pub fn dense(&self) -> Result<&Tensor> {
        match self {
            Weight::Dense { tensor, .. } => Ok(tensor),
            Weight::Quant(_) => Err(LayerError::Config(
                "this layer's weight is held as quantized blocks, not a tensor (load with a dtype to dequantize it)"
                    .into(),
            )),
        }
    }
    /// The dense tensor, writable (training: the optimizer updates it in place); any host
    /// packing of it is dropped, since it would go stale. [`LayerError::Config`] for quantized
    /// blocks.
    pub fn dense_mut(&mut self) -> Result<&mut Tensor> {
        match self {
            Weight::Dense { tensor, packed } => {
                *packed = None;
                Ok(tensor)
            }
            Weight::Quant(_) => {
                Err(LayerError::Config("a quantized weight cannot be trained (load it with a dtype)".into()))
            }
        }
    }
    /// The quantized blocks, if that is how the weight is held.
    pub fn quant(&self) -> Option<&QuantWeight> {
        match self {
            Weight::Dense { .. } => None,
            Weight::Quant(q) => Some(q),
        }
    }
    /// The dtype products come out in for an input of `x_dtype`: the tensor's for a dense
    /// weight; the input's own for quantized blocks.
    pub fn dtype(&self) -> Option<DType> {
        match self {
            Weight::Dense { tensor, .. } => Some(tensor.dtype()),
            Weight::Quant(_) => None,
        }
    }
    /// Where the weight lives.
    pub fn device(&self) -> Device {
        match self {
            Weight::Dense { tensor, .. } => tensor.device(),
            Weight::Quant(q) => q.device(),
        }
    }

    /// `x W^T (+ b)` for `x: [.., in]`. Quantized blocks multiply `x` quantized to 8 bits per
    /// block (the serving product), except while training adapters on them
    /// ([`crate::lora::frozen_base`]): then the weight is dequantized for the product, as QLoRA
    /// dequantizes its base, so that the gradients are those of the dequantized model.
    pub fn linear(&self, x: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        Ok(match self {
            Weight::Dense { tensor, packed: Some(p) } => x.linear_packed(tensor, p, bias)?,
            Weight::Dense { tensor, packed: None } => x.linear(tensor, bias)?,
            Weight::Quant(q) if crate::lora::base_frozen() => x
                .to_dtype(DType::F32)?
                .linear(&q.dequantize()?, bias.map(|b| b.to_dtype(DType::F32)).transpose()?.as_ref())?
                .to_dtype(x.dtype())?,
            Weight::Quant(q) => x.linear_quant(q, bias)?,
        })
    }

    /// `dY W` in f32 for `dy: [T, out]` (training's input gradient): a dense weight's GEMM
    /// (the dense GEMM of `Linear::input_grad`); quantized blocks are dequantized for it (a frozen base
    /// under LoRA), each element as ggml dequantizes it.
    pub fn input_grad(&self, dy: &Tensor) -> Result<Tensor> {
        match self {
            Weight::Dense { tensor, .. } => crate::linear::grad_input(tensor, dy),
            Weight::Quant(q) => crate::linear::grad_input(&q.dequantize()?, dy),
        }
    }

    /// `x W^T` for `x: [.., in]` (quantized blocks as in [`linear`](Self::linear)).
    pub fn matmul_t(&self, x: &Tensor) -> Result<Tensor> {
        if let Weight::Quant(_) = self
            && crate::lora::base_frozen()
        {
            return self.linear(x, None);
        }
        Ok(match self {
            Weight::Dense { tensor, packed: Some(p) } => x.linear_packed(tensor, p, None)?,
            Weight::Dense { tensor, packed: None } => x.matmul_t(tensor)?,
            Weight::Quant(q) => x.linear_quant(q, None)?,
        })
    }

    /// Packs a dense host weight once into the host GEMM's panels (a no-op on a GPU, when
    /// already packed, or for quantized blocks, which are their own packing): the same
    /// numbers, bitwise, for as much memory again as the weight.
    pub fn pack_host(&mut self) -> Result<()> {
        if let Weight::Dense { tensor, packed } = self
            && packed.is_none()
            && tensor.device() == Device::Cpu
        {
            *packed = Some(tensor.pack_weight()?);
        }
        Ok(())
    }

    /// The weights stacked along the rows (outputs side by side): dense tensors
    /// concatenated, quantized blocks kept as parts. A mix is an error.
    pub fn stack(parts: Vec<Weight>) -> Result<Weight> {
        if parts.iter().all(|p| matches!(p, Weight::Quant(_))) {
            let q: Vec<QuantWeight> = parts.into_iter().filter_map(|p| p.quant().cloned()).collect();
            return Ok(Weight::Quant(QuantWeight::stack(&q)?));
        }
        let dense = parts.iter().map(Weight::dense).collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&dense, 0)?.into())
    }
}
