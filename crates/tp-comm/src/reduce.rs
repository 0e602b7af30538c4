//! Element-wise reduction of several tensors, on the host, in rank order.
//!
//! Accumulates in f64 and rounds once to the dtype, so every rank that reduces the same inputs
//! gets bit-identical results, and sums of small integers are exact in every dtype.

use crate::{CommError, ReduceOp, Result};
use tp_core::{Device, Element, Tensor};

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
    let hosts = parts.iter().map(|p| p.to_device(&Device::Cpu)).collect::<tp_core::Result<Vec<_>>>();
    let hosts = hosts.map_err(crate::error::tensor_err(op_name))?;
    let n = first.numel();
    let out = tp_core::with_dtype!(first.dtype(), T => {
        let slices = hosts.iter().map(|h| h.as_slice::<T>()).collect::<tp_core::Result<Vec<_>>>();
        let slices = slices.map_err(crate::error::tensor_err(op_name))?;
        let count = parts.len() as f64;
        let mut out: Vec<T> = Vec::with_capacity(n);
        for i in 0..n {
            let mut acc = slices[0][i].to_f64();
            for s in &slices[1..] {
                let v = s[i].to_f64();
                acc = match op {
                    ReduceOp::Sum | ReduceOp::Avg => acc + v,
                    ReduceOp::Max => acc.max(v),
                    ReduceOp::Min => acc.min(v),
                };
            }
            out.push(T::from_f64(if op == ReduceOp::Avg { acc / count } else { acc }));
        }
        Tensor::from_vec(out, first.dims(), &Device::Cpu)
    });
    out.map_err(crate::error::tensor_err(op_name))
}
