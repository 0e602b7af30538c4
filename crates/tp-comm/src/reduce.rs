//! Element-wise reduction of several tensors, on the host, in rank order.
//!
//! Accumulates in f64 and rounds once to the dtype, so every rank that reduces the same inputs
//! gets bit-identical results, and sums of small integers are exact in every dtype.

use crate::{CommError, ReduceOp, Result};
use tp_core::{Device, Tensor};

/// `parts[0] op parts[1] op ...`, element by element, as a host tensor of `parts[0]`'s dtype.
pub(crate) fn reduce(op_name: &'static str, parts: &[&Tensor], op: ReduceOp) -> Result<Tensor> {
    let first = parts.first().ok_or_else(|| CommError::Mismatch { op: op_name.into(), why: "no inputs".into() })?;
    for p in parts {
        if p.dims() != first.dims() || p.dtype() != first.dtype() {
            return Err(CommError::Mismatch {
                op: op_name.into(),
                why: format!(
                    "ranks passed {:?} {} and {:?} {}; a reduction needs equal shapes and dtypes",
                    first.dims(),
                    first.dtype(),
                    p.dims(),
                    p.dtype()
                ),
            });
        }
    }
    let values = parts.iter().map(|p| p.to_f64_vec()).collect::<tp_core::Result<Vec<_>>>();
    let values = values.map_err(crate::error::tensor_err(op_name))?;
    let mut acc = values[0].clone();
    for v in &values[1..] {
        for (a, b) in acc.iter_mut().zip(v) {
            *a = match op {
                ReduceOp::Sum | ReduceOp::Avg => *a + b,
                ReduceOp::Max => a.max(*b),
                ReduceOp::Min => a.min(*b),
            };
        }
    }
    if op == ReduceOp::Avg {
        let n = parts.len() as f64;
        acc.iter_mut().for_each(|a| *a /= n);
    }
    Tensor::from_fn_f64(first.dims(), first.dtype(), &Device::Cpu, |i| acc[i])
        .map_err(crate::error::tensor_err(op_name))
}
