//! Element-wise reduction of several ranks' tensors, on the host, in rank order.
//!
//! Rounding: element `i` is `x_0[i] op x_1[i] op ... op x_{n-1}[i]`, evaluated left to right in
//! `f32` (each addition rounded to nearest even in `f32`; `f16`/`bf16` inputs are widened exactly
//! first), then rounded once to the dtype; `Avg` divides that sum by the world size in `f32`
//! before the final rounding. For `f32` this is `n - 1` roundings, for `f16`/`bf16` the `f32`
//! additions are exact as long as the partial sums need at most 24 significant bits (sums of
//! small integers always do) and the result carries one rounding to the dtype. `Max`/`Min`
//! ignore NaNs unless every input is NaN. The order is fixed per element, whoever computes it,
//! so every rank gets bit-identical results however the work is split.

use crate::{CommError, ReduceOp, Result};
use std::mem::MaybeUninit;
use tp_core::{Device, Element, Tensor};

/// Elements reduced per step through the `f32` accumulator (stays in L1).
const BLOCK: usize = 512;

/// Checks that every rank passed the same shape and dtype.
pub(crate) fn check(op_name: &'static str, parts: &[&Tensor]) -> Result<()> {
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
    if !first.dtype().is_float() {
        return Err(CommError::Tensor { op: op_name, source: tp_core::Error::NotFloat { dtype: first.dtype() } });
    }
    Ok(())
}

/// Reduces elements `range` of every input (`inputs[r]` is rank `r`'s whole tensor) into `out`
/// (`out.len() == range.len()`), in rank order, as the module docs define.
pub(crate) fn reduce_range<T: Element>(
    inputs: &[&[T]],
    range: std::ops::Range<usize>,
    op: ReduceOp,
    out: &mut [MaybeUninit<T>],
) {
    assert_eq!(out.len(), range.len(), "reduce_range: output length");
    let world = inputs.len() as f32;
    let mut acc = [0f32; BLOCK];
    let mut tmp = [0f32; BLOCK];
    let mut narrow = [T::from_f32(0.0); BLOCK];
    for (b, out) in out.chunks_mut(BLOCK).enumerate() {
        let start = range.start + b * BLOCK;
        let len = out.len();
        let (acc, tmp, narrow) = (&mut acc[..len], &mut tmp[..len], &mut narrow[..len]);
        T::slice_to_f32(&inputs[0][start..start + len], acc);
        for x in &inputs[1..] {
            T::slice_to_f32(&x[start..start + len], tmp);
            combine(acc, tmp, op);
        }
        if op == ReduceOp::Avg {
            acc.iter_mut().for_each(|a| *a /= world);
        }
        T::slice_from_f32(acc, narrow);
        for (o, v) in out.iter_mut().zip(&*narrow) {
            o.write(*v);
        }
    }
}

/// One more rank's values `v` folded into `acc` (the sum's next term, or the running max/min).
fn combine(acc: &mut [f32], v: &[f32], op: ReduceOp) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => acc.iter_mut().zip(v).for_each(|(a, v)| *a += v),
        ReduceOp::Max => acc.iter_mut().zip(v).for_each(|(a, v)| *a = a.max(*v)),
        ReduceOp::Min => acc.iter_mut().zip(v).for_each(|(a, v)| *a = a.min(*v)),
    }
}

/// [`reduce_range`] over the ranks' same elements, where rank `me`'s are `own` and every
/// other rank's are in `others` (rank order, `me` left out), written over `own`: the same order
/// and bits as [`reduce_range`] into a separate output.
pub(crate) fn reduce_in_place<T: Element>(own: &mut [T], me: usize, others: &[&[T]], op: ReduceOp) {
    let world = (others.len() + 1) as f32;
    let mut acc = [0f32; BLOCK];
    let mut tmp = [0f32; BLOCK];
    for (b, own) in own.chunks_mut(BLOCK).enumerate() {
        let (start, len) = (b * BLOCK, own.len());
        let (acc, tmp) = (&mut acc[..len], &mut tmp[..len]);
        for r in 0..others.len() + 1 {
            let src: &[T] = match r.cmp(&me) {
                std::cmp::Ordering::Equal => own,
                std::cmp::Ordering::Less => &others[r][start..start + len],
                std::cmp::Ordering::Greater => &others[r - 1][start..start + len],
            };
            if r == 0 {
                T::slice_to_f32(src, acc);
                continue;
            }
            T::slice_to_f32(src, tmp);
            combine(acc, tmp, op);
        }
        if op == ReduceOp::Avg {
            acc.iter_mut().for_each(|a| *a /= world);
        }
        T::slice_from_f32(acc, own);
    }
}

/// The whole reduction of `parts` (same shape and dtype, checked here) as a new host tensor.
pub(crate) fn reduce(op_name: &'static str, parts: &[&Tensor], op: ReduceOp) -> Result<Tensor> {
    check(op_name, parts)?;
    let hosts = parts.iter().map(|p| p.to_device(&Device::Cpu)).collect::<tp_core::Result<Vec<_>>>();
    let hosts = hosts.map_err(crate::error::tensor_err(op_name))?;
    let first = &hosts[0];
    let n = first.numel();
    let out = tp_core::with_dtype!(first.dtype(), T => {
        let slices = hosts.iter().map(|h| h.as_slice::<T>()).collect::<tp_core::Result<Vec<_>>>();
        let slices = slices.map_err(crate::error::tensor_err(op_name))?;
        let mut out: Vec<T> = Vec::with_capacity(n);
        reduce_range(&slices, 0..n, op, &mut out.spare_capacity_mut()[..n]);
        // SAFETY: `reduce_range` initialised all `n` elements of the spare capacity.
        unsafe { out.set_len(n) };
        Tensor::from_vec(out, first.dims(), &Device::Cpu)
    });
    out.map_err(crate::error::tensor_err(op_name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tp_core::{DType, bf16};

    #[test]
    fn sums_round_in_f32_in_rank_order() {
        // 1 + 2^-24 + 2^-24: f32 left to right loses both small terms; f64 would keep them.
        let parts: Vec<Tensor> = [1.0, 2f64.powi(-24), 2f64.powi(-24)]
            .iter()
            .map(|&v| Tensor::from_fn_f64(&[3], DType::F32, &Device::Cpu, |_| v).unwrap())
            .collect();
        let refs: Vec<&Tensor> = parts.iter().collect();
        let y = reduce("t", &refs, ReduceOp::Sum).unwrap();
        assert_eq!(y.to_f64_vec().unwrap(), vec![1.0; 3]);
        // bf16: 1 + 2^-8 + 2^-8 is exact in f32 (1 + 2^-7), then rounds once to bf16 (exact).
        let parts: Vec<Tensor> = [1.0, 2f64.powi(-8), 2f64.powi(-8)]
            .iter()
            .map(|&v| Tensor::from_fn_f64(&[1], DType::BF16, &Device::Cpu, |_| v).unwrap())
            .collect();
        let refs: Vec<&Tensor> = parts.iter().collect();
        let y = reduce("t", &refs, ReduceOp::Sum).unwrap();
        assert_eq!(y.as_slice::<bf16>().unwrap()[0], bf16::from_f64(1.0 + 2f64.powi(-7)));
    }

    #[test]
    fn in_place_gives_the_separate_outputs_bits() {
        let n = 2 * BLOCK + 5;
        let parts: Vec<Vec<tp_core::bf16>> = (0..4)
            .map(|r| (0..n).map(|i| bf16::from_f64(((i * 13 + r * 7) % 29) as f64 * 0.37 - 5.1)).collect())
            .collect();
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg] {
            let refs: Vec<&[tp_core::bf16]> = parts.iter().map(Vec::as_slice).collect();
            let mut want = Vec::with_capacity(n);
            reduce_range(&refs, 0..n, op, &mut want.spare_capacity_mut()[..n]);
            // SAFETY: all `n` elements written by `reduce_range`.
            unsafe { want.set_len(n) };
            for me in 0..4 {
                let mut own = parts[me].clone();
                let others: Vec<&[tp_core::bf16]> =
                    parts.iter().enumerate().filter(|(r, _)| *r != me).map(|(_, p)| p.as_slice()).collect();
                reduce_in_place(&mut own, me, &others, op);
                assert_eq!(own, want, "{op:?} rank {me}");
            }
        }
    }

    #[test]
    fn every_op_on_blocks_and_tails() {
        let n = 3 * BLOCK + 7;
        let parts: Vec<Tensor> = (0..3)
            .map(|r| {
                Tensor::from_fn_f64(&[n], DType::F16, &Device::Cpu, |i| ((i * 7 + r * 3) % 13) as f64 - 6.0).unwrap()
            })
            .collect();
        let refs: Vec<&Tensor> = parts.iter().collect();
        let vals: Vec<Vec<f64>> = parts.iter().map(|p| p.to_f64_vec().unwrap()).collect();
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg] {
            let y = reduce("t", &refs, op).unwrap().to_f64_vec().unwrap();
            for i in 0..n {
                let col = vals.iter().map(|v| v[i]);
                let want = match op {
                    ReduceOp::Sum => col.sum(),
                    ReduceOp::Max => col.fold(f64::MIN, f64::max),
                    ReduceOp::Min => col.fold(f64::MAX, f64::min),
                    ReduceOp::Avg => f64::from(tp_core::f16::from_f32((col.sum::<f64>() as f32) / 3.0).to_f32()),
                };
                assert_eq!(y[i], want, "{op:?} element {i}");
            }
        }
    }
}
