//! `all_to_all` with variable counts (`torch.distributed.all_to_all_single` with split sizes):
//! how tokens split over ranks reach the ranks that hold their experts, and come back.
//!
//! Rank `r` holds `x_r: [n_r, ..]` cut along dim 0 into `W` consecutive chunks of
//! `send_counts[j]` rows, chunk `j` for rank `j`. Rank `j` receives, in rank order, every rank's
//! chunk `j`: `y_j = cat_r chunk_{r→j}`, and the row counts it got from each rank. No rank needs
//! to know beforehand what it will receive: the `W × W` counts are exchanged first (one small
//! all-gather of `W` integers per rank).
//!
//! The exchange itself is an all-gather of every rank's rows (their lengths known from the
//! counts), from which each rank keeps its chunks: correct on every backend that gathers (the
//! thread backend hands over references; NCCL moves `W - 1` times the rows a point-to-point
//! exchange would, which a grouped send/receive version would save).

use crate::{CommError, Communicator, Result};
use tp_core::{DType, Device, Tensor};

/// The `all_to_all` of `x` with `send_counts` (see the module docs) over `c`: this rank's
/// received rows, and how many came from each rank.
pub(crate) fn all_to_all(
    c: &(impl Communicator + ?Sized),
    x: &Tensor,
    send_counts: &[usize],
) -> Result<(Tensor, Vec<usize>)> {
    let (world, me) = (c.world_size(), c.rank());
    let rows = x
        .dims()
        .first()
        .copied()
        .ok_or_else(|| CommError::Mismatch { op: "all_to_all".into(), why: "a scalar has no rows to send".into() })?;
    if send_counts.len() != world || send_counts.iter().sum::<usize>() != rows {
        return Err(CommError::Mismatch {
            op: "all_to_all".into(),
            why: format!(
                "rank {me} sends {rows} rows split as {send_counts:?}: needs {world} counts summing to the rows"
            ),
        });
    }
    let mine: Vec<i64> = send_counts.iter().map(|&n| n as i64).collect();
    let counts = Tensor::from_vec(mine, &[1, world], &Device::Cpu)
        .and_then(|t| t.to_device(&x.device()))
        .map_err(crate::error::tensor_err("all_to_all"))?;
    let all = c.all_gather(&counts, 0)?;
    let all = all.to_dtype(DType::I64).and_then(|t| t.to_i64_vec()).map_err(crate::error::tensor_err("all_to_all"))?;
    let matrix: Vec<Vec<usize>> = all.chunks(world).map(|r| r.iter().map(|&n| n.max(0) as usize).collect()).collect();
    let lengths: Vec<usize> = matrix.iter().map(|r| r.iter().sum()).collect();
    let gathered = c.all_gather_sized(x, 0, &lengths)?;
    let (mut parts, mut start) = (Vec::with_capacity(world), 0usize);
    for (r, counts) in matrix.iter().enumerate() {
        let before: usize = counts[..me].iter().sum();
        parts.push(gathered.narrow(0, start + before, counts[me]).map_err(crate::error::tensor_err("all_to_all"))?);
        start += lengths[r];
    }
    let out = Tensor::cat(&parts, 0).map_err(crate::error::tensor_err("all_to_all"))?;
    Ok((out, matrix.iter().map(|r| r[me]).collect()))
}
