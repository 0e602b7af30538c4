//! [`Linear`]: `y = x W^T + b`, weight `[out, in]` as PyTorch and Hugging Face store it.

use crate::error::{LayerError, Result};
use tp_core::{DType, Device, PackedWeight, Tensor};

/// A dense layer: weight `W: [out, in]`, optional bias `b: [out]`; `forward(x) = x W^T + b` for
/// `x: [.., in]`, bias fused into the GEMM.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
    /// The weight packed for the host GEMM, once [`pack_host`](Self::pack_host) ran.
    packed: Option<PackedWeight>,
}

impl Linear {
    /// Checks that `weight` is 2-D and `bias` is `[out]` with the same dtype and device.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Result<Linear> {
        let &[out, _] = weight.dims() else {
            return Err(LayerError::Config(format!("Linear weight must be [out, in], got {:?}", weight.dims())));
        };
        if let Some(b) = &bias {
            if b.dims() != [out] {
                return Err(LayerError::Config(format!("Linear bias must be [{out}], got {:?}", b.dims())));
            }
            if b.dtype() != weight.dtype() || b.device() != weight.device() {
                return Err(LayerError::Config(format!(
                    "Linear bias is {} on {}, weight is {} on {}",
                    b.dtype(),
                    b.device(),
                    weight.dtype(),
                    weight.device()
                )));
            }
        }
        Ok(Linear { weight, bias, packed: None })
    }

    /// `[out, in]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
    /// `[out]`, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }
    /// Output features.
    pub fn out_features(&self) -> usize {
        self.weight.dims()[0]
    }
    /// Input features.
    pub fn in_features(&self) -> usize {
        self.weight.dims()[1]
    }
    /// The parameters' dtype.
    pub fn dtype(&self) -> DType {
        self.weight.dtype()
    }
    /// Where the parameters live.
    pub fn device(&self) -> Device {
        self.weight.device()
    }

    /// `x W^T + b` for `x: [.., in]`, giving `[.., out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match &self.packed {
            Some(p) => x.linear_packed(&self.weight, p, self.bias.as_ref())?,
            None => x.linear(&self.weight, self.bias.as_ref())?,
        })
    }

    /// Packs the weight once into the host GEMM's panels (host weights only; a no-op on a GPU
    /// or when already packed), so that products of many rows (prefill, batched decode) stop
    /// repacking it: the same numbers, bitwise, for as much memory again as the weight.
    pub fn pack_host(&mut self) -> Result<()> {
        self.packed = pack_host(&self.weight, self.packed.take())?;
        Ok(())
    }

    /// The same layer with parameters converted to `dtype` and moved to `device`.
    pub fn to(&self, dtype: DType, device: &Device) -> Result<Linear> {
        let conv = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(dtype)?.to_device(device)?) };
        Linear::new(conv(&self.weight)?, self.bias.as_ref().map(conv).transpose()?)
    }
}

/// `weight` packed for the host GEMM (kept if `have` holds it already); `None` off the host.
pub(crate) fn pack_host(weight: &Tensor, have: Option<PackedWeight>) -> Result<Option<PackedWeight>> {
    if have.is_some() || weight.device() != Device::Cpu {
        return Ok(have);
    }
    Ok(Some(weight.pack_weight()?))
}
