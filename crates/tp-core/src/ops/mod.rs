//! Tensor operations. Each file holds one family; all of them validate their inputs and return
//! typed errors before touching data.

mod attention;
mod attention_backward;
mod cast;
mod cuda;
mod dot_f32;
mod elementwise;
mod grad;
mod kv_quant;
mod layout;
mod lora;
mod loss;
mod matmul;
mod moe;
mod norm;
mod paged;
mod paged_cuda;
#[cfg(target_arch = "x86_64")]
mod paged_group;
mod par;
mod quant;
mod rope;
mod tokens;

pub use attention::{AttentionSpec, KvGroups};
pub use elementwise::Activation;
pub use grad::{AdamwParam, AdamwStep, adamw_step};
pub use kv_quant::{KvQuant, QuantKvBuffer};
pub use lora::{LoraFactors, lora_product};
pub use matmul::{PackedWeight, WeightLayout};
pub use moe::{RouterKind, Routing, grouped_linear, moe_combine, route, softmax, take_routed};
pub use norm::NormStyle;
pub use paged::{KvBuffer, PagedAttentionSpec, PagedSeq};
pub use quant::QuantWeight;
pub use rope::{RopeScaling, RotaryEmbedding};

use crate::{Error, Result, Tensor};

/// Checks that `a` and `b` share dtype and device.
pub(crate) fn same_dtype_device(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch { op, lhs: a.dtype(), rhs: b.dtype() });
    }
    if a.device() != b.device() {
        return Err(Error::DeviceMismatch { op, lhs: a.device(), rhs: b.device() });
    }
    Ok(())
}
