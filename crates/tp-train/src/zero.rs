//! The distributed optimizer (ZeRO stage 1; Megatron-LM's `--use-distributed-optimizer`): the
//! data-parallel replicas share out AdamW's moments and the fp32 master weights instead of each
//! holding all of them.
//!
//! Each parameter of a rank (its tensor-parallel shard) is cut, flat, into chunks of
//! [`NORM_CHUNK`] elements, and the chunks are split over the `D` replicas in balanced
//! consecutive ranges ([`Layout`]): replica `d` holds the optimizer state of its range only. A
//! step then
//!
//! 1. reduce-scatters every gradient over the data-parallel group (replica `d` receives the
//!    sum of its range, folded in replica order, the bits an all-reduce gives there);
//! 2. takes the gradient norm from every replica's chunk values (the f32 sums of squares of
//!    [`owned_chunk_squares`]), gathered so that every replica adds all of them in the order
//!    the unsharded optimizer does: the same norm, bit for bit;
//! 3. applies AdamW to its range (elementwise, so the same bits as the whole tensor's update
//!    there), and all-gathers the updated ranges into every replica's weights.
//!
//! So a run with `--zero 1` logs and saves exactly what one without it does. Checkpoints stay
//! layout-free: the shards are gathered back into whole tensors before a save
//! (`unshard_states`), and a resumed run takes its range of the whole state it reads.

use crate::trainer::ParamState;
use crate::{Result, TrainError};
use std::ops::Range;
use tp_comm::{DeviceGroup, ReduceOp};
use tp_core::{DType, Device, Tensor};
use tp_layers::{NORM_CHUNK, Param, owned_chunk_squares, sum_chunks};

/// Where a parameter's chunks go: `offset` empty rows, then its chunks, padded to a multiple
/// of the replicas; replica `d` holds rows `d·m .. (d+1)·m`. The offset (a hash of the
/// parameter's name, below the replica count) spreads parameters of one chunk over the
/// replicas instead of piling them on the first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Chunks of the parameter.
    pub chunks: usize,
    /// Empty rows before them.
    pub offset: usize,
    /// Rows per replica.
    pub rows: usize,
}

impl Layout {
    /// The layout of a parameter of `n` elements named `key` over `replicas`.
    pub fn new(n: usize, key: &str, replicas: usize) -> Layout {
        let replicas = replicas.max(1);
        let hash = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
        let chunks = n.div_ceil(NORM_CHUNK);
        let offset = (hash % replicas as u64) as usize;
        Layout { chunks, offset, rows: (offset + chunks).div_ceil(replicas) }
    }

    /// The chunks replica `d` holds.
    pub fn chunk_range(&self, d: usize) -> Range<usize> {
        let (lo, hi) = (d * self.rows, (d + 1) * self.rows);
        let s = lo.max(self.offset).min(self.offset + self.chunks) - self.offset;
        let e = hi.max(self.offset).min(self.offset + self.chunks) - self.offset;
        s..e.max(s)
    }

    /// The elements (of `n`) replica `d` holds: its chunks', the last cut at `n`.
    pub fn range(&self, n: usize, d: usize) -> Range<usize> {
        let c = self.chunk_range(d);
        (c.start * NORM_CHUNK).min(n)..(c.end * NORM_CHUNK).min(n)
    }
}

/// The layout of `p` over `replicas`.
fn layout(p: &Param<'_>, replicas: usize) -> Layout {
    Layout::new(p.value.numel(), &crate::pipeline::exec::param_key(p), replicas)
}

/// The elements of `p` whose optimizer state this replica of `dp` holds.
pub(crate) fn shard(p: &Param<'_>, dp: &DeviceGroup) -> Range<usize> {
    layout(p, dp.world_size()).range(p.value.numel(), dp.rank())
}

/// Step 1: every parameter's gradient summed over `dp`, of which this replica keeps its range
/// (the gradient stays full-size, holding zeros outside the range). A parameter without a
/// gradient counts as zeros, as in the unsharded sum.
pub(crate) fn reduce_scatter_grads(params: &mut [Param<'_>], dp: &DeviceGroup) -> Result<()> {
    let (replicas, me) = (dp.world_size(), dp.rank());
    for p in params.iter_mut() {
        let n = p.value.numel();
        let l = layout(p, replicas);
        let rows = l.rows * replicas;
        let mut padded = vec![0f32; rows * NORM_CHUNK];
        if let Some(g) = p.grad.get() {
            let g = g.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
            let at = l.offset * NORM_CHUNK;
            padded[at..at + n].copy_from_slice(g.as_slice::<f32>()?);
        }
        let padded = Tensor::from_vec(padded, &[rows, NORM_CHUNK], &Device::Cpu)?.to_device(&dp.device())?;
        let mine = dp.reduce_scatter(&padded, 0, ReduceOp::Sum)?.to_device(&Device::Cpu)?;
        let range = l.range(n, me);
        // This replica's rows start at row `me·rows`; its first chunk is row `offset + start`.
        let skip = (l.offset + l.chunk_range(me).start).saturating_sub(me * l.rows) * NORM_CHUNK;
        let mut full = vec![0f32; n];
        if !range.is_empty() {
            let got = mine.as_slice::<f32>()?.get(skip..skip + range.len()).ok_or_else(|| {
                TrainError::Model(format!("reduce-scatter gave {} values, range {range:?}", mine.numel()))
            })?;
            full[range.clone()].copy_from_slice(got);
        }
        p.grad.set(Some(Tensor::from_vec(full, p.value.dims(), &Device::Cpu)?.to_device(&p.value.device())?));
    }
    Ok(())
}

/// Step 2: the sum of squares of `params`' owned gradient elements, from this replica's chunk
/// values and the others' (one all-gather of them all), added as
/// [`tp_layers::owned_sum_squares`] adds them.
pub(crate) fn sum_squares(params: &[Param<'_>], dp: &DeviceGroup) -> Result<f64> {
    let (replicas, me) = (dp.world_size(), dp.rank());
    let mut mine: Vec<i64> = Vec::new();
    for p in params {
        let values = owned_chunk_squares(p, layout(p, replicas).chunk_range(me))?;
        mine.extend(values.iter().map(|v| v.to_bits() as i64));
    }
    let n = mine.len();
    let all = dp.all_gather(&Tensor::from_vec(mine, &[n], &Device::Cpu)?.to_device(&dp.device())?, 0)?.to_i64_vec()?;
    // Replica-major: replica d's values for every parameter, then replica d + 1's.
    let mut at: Vec<usize> = Vec::with_capacity(replicas);
    let mut offset = 0;
    for d in 0..replicas {
        at.push(offset);
        for p in params {
            offset += layout(p, replicas).chunk_range(d).len();
        }
    }
    if offset != all.len() {
        return Err(TrainError::Model(format!(
            "the replicas' gradient chunks disagree ({} values gathered, {offset} expected)",
            all.len()
        )));
    }
    let mut total = 0f64;
    for p in params {
        let mut values = Vec::with_capacity(p.value.numel().div_ceil(NORM_CHUNK));
        let l = layout(p, replicas);
        for (d, at) in at.iter_mut().enumerate() {
            let k = l.chunk_range(d).len();
            values.extend(all[*at..*at + k].iter().map(|&b| f64::from_bits(b as u64)));
            *at += k;
        }
        total += sum_chunks(&values);
    }
    Ok(total)
}

/// Step 3's second half: every replica's updated `range` of `value` gathered into all of it
/// (the replicas' ranges follow each other in replica order).
pub(crate) fn gather_value(value: &mut Tensor, range: Range<usize>, dp: &DeviceGroup) -> Result<()> {
    let n = value.numel();
    let host = value.to_device(&Device::Cpu)?.reshape(&[n])?;
    let mine = host.narrow(0, range.start, range.len())?.to_device(&dp.device())?;
    let full = dp.all_gather(&mine, 0)?.reshape(value.dims())?;
    *value = full.to_device(&value.device())?;
    Ok(())
}

/// This replica's `range` of a parameter's whole state (`n` elements), or the state itself
/// when it is already that range.
pub(crate) fn take_shard(st: &mut ParamState, n: usize, range: Range<usize>) -> Result<()> {
    if st.adam.m.len() == range.len() {
        return Ok(());
    }
    if st.adam.m.len() != n {
        return Err(TrainError::Model(format!(
            "optimizer state of {} elements for a parameter of {n} (range {range:?})",
            st.adam.m.len()
        )));
    }
    let cut = |v: &mut Vec<f32>| *v = v[range.clone()].to_vec();
    cut(&mut st.adam.m);
    cut(&mut st.adam.v);
    if let Some(m) = &mut st.master {
        cut(m);
    }
    Ok(())
}

/// The whole state of every parameter from the replicas' parts (an all-gather of each), for a
/// checkpoint: `numel[i]` is parameter `i`'s length.
pub(crate) fn unshard_states(states: &[ParamState], numel: &[usize], dp: &DeviceGroup) -> Result<Vec<ParamState>> {
    let whole = |part: &[f32], n: usize| -> Result<Vec<f32>> {
        let t = Tensor::from_slice(part, &[part.len()], &Device::Cpu)?.to_device(&dp.device())?;
        let all = dp.all_gather(&t, 0)?.to_device(&Device::Cpu)?.to_vec::<f32>()?;
        if all.len() != n {
            return Err(TrainError::Model(format!("gathered {} optimizer values for a parameter of {n}", all.len())));
        }
        Ok(all)
    };
    states
        .iter()
        .zip(numel)
        .map(|(st, &n)| {
            Ok(ParamState {
                master: st.master.as_deref().map(|m| whole(m, n)).transpose()?,
                adam: crate::optim::AdamState { m: whole(&st.adam.m, n)?, v: whole(&st.adam.v, n)? },
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_every_element_once_in_replica_order() {
        for n in [0, 1, 255, 256, 257, 1000, 4096 * 3 + 5] {
            for replicas in 1..=5 {
                for key in ["a", "model.layers.0.mlp.down_proj.weight", "b"] {
                    let l = Layout::new(n, key, replicas);
                    let ranges: Vec<Range<usize>> = (0..replicas).map(|d| l.range(n, d)).collect();
                    assert_eq!(ranges.first().unwrap().start, 0);
                    assert_eq!(ranges.last().unwrap().end, n);
                    for w in ranges.windows(2) {
                        assert_eq!(w[0].end, w[1].start, "n {n}, {replicas} replicas");
                    }
                    // Every boundary on a chunk boundary (or the end).
                    assert!(ranges.iter().all(|r| r.start % NORM_CHUNK == 0 || r.start == n));
                    assert!(l.offset < replicas);
                }
            }
        }
        // One-chunk parameters spread over the replicas.
        let owners: std::collections::BTreeSet<usize> = (0..64)
            .map(|i| Layout::new(10, &format!("p{i}"), 4))
            .map(|l| (0..4).find(|&d| !l.chunk_range(d).is_empty()).unwrap())
            .collect();
        assert_eq!(owners.len(), 4, "{owners:?}");
    }
}
