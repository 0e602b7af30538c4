//! [`MergedColumnParallel`]: several column-parallel projections of the same input in one GEMM.
//!
//! For projections `A^(0), .., A^(k-1)` (e.g. an MLP's gate and up), rank `r` holds its balanced
//! row shard of each and stacks them, `[A^(0)_r; ..; A^(k-1)_r]`, so one GEMM gives
//! `[Y^(0)_r | .. | Y^(k-1)_r]`. No communication. In a checkpoint the projections are separate
//! tensors or one fused tensor ([`Projections`]); each rank reads only its rows of each part.

use crate::column::check_placement;
use crate::error::{LayerError, Result};
use crate::linear::Linear;
use crate::loader::Loader;
use crate::parts::Projections;
use crate::weight::Weight;
use tp_comm::DeviceGroup;
use tp_core::{Activation, Tensor, TensorShard};

/// Rank `r`'s stacked shards of several column-parallel projections.
#[derive(Debug, Clone)]
pub struct MergedColumnParallel {
    linear: Linear,
    shards: Vec<TensorShard>,
    group: DeviceGroup,
}

impl MergedColumnParallel {
    /// Packs the local weight once into the host GEMM's panels (host weights only; a no-op on a GPU
    /// or when already packed), so that products of many rows (prefill, batched decode) stop
    /// repacking it: the same numbers, bitwise, for as much memory again as the weight.
    pub fn pack_host(&mut self) -> Result<()> {
        self.linear.pack_host()
    }

    /// Wraps a local stacked layer whose row blocks are `shards` (each over dim 0 of its part).
    pub fn new(linear: Linear, shards: Vec<TensorShard>, group: &DeviceGroup) -> Result<MergedColumnParallel> {
        let rows: usize = shards.iter().map(|s| s.len()).sum();
        if shards.is_empty() || rows != linear.out_features() || shards.iter().any(|s| s.dim() != 0) {
            return Err(LayerError::Config(format!(
                "merged layer has {} rows but its dim-0 shards cover {rows}",
                linear.out_features()
            )));
        }
        for s in &shards {
            check_placement(s, linear.device(), group)?;
        }
        Ok(MergedColumnParallel { linear, shards, group: group.clone() })
    }

    /// `group`'s rank's stacked shards of full layers `parts` (same input size and dtype).
    pub fn from_full(parts: &[&Linear], group: &DeviceGroup) -> Result<MergedColumnParallel> {
        Self::from_full_with(parts, group, |rows| Ok(TensorShard::new(0, rows, group.rank(), group.world_size())?))
    }

    /// [`from_full`](Self::from_full), every row of each part on this rank (see
    /// [`load_whole`](Self::load_whole)).
    pub fn from_full_whole(parts: &[&Linear], group: &DeviceGroup) -> Result<MergedColumnParallel> {
        Self::from_full_with(parts, group, |rows| whole_shard(rows, group.rank(), group.world_size()))
    }

    /// Stacks this rank's rows of each part, given by `shard_of(rows)`.
    fn from_full_with(
        parts: &[&Linear],
        group: &DeviceGroup,
        shard_of: impl Fn(usize) -> Result<TensorShard>,
    ) -> Result<MergedColumnParallel> {
        let (mut weights, mut biases, mut shards) = (Vec::new(), Vec::new(), Vec::new());
        for p in parts {
            let s = shard_of(p.out_features())?;
            weights.push(s.shard(p.weight()?)?);
            biases.push(p.bias().map(|b| s.shard(b)).transpose()?);
            shards.push(s);
        }
        let bias = if biases.iter().all(Option::is_some) {
            Some(Tensor::cat(&biases.into_iter().flatten().collect::<Vec<_>>(), 0)?.to_device(&group.device())?)
        } else if biases.iter().all(Option::is_none) {
            None
        } else {
            return Err(LayerError::Config("merged parts must all have a bias or all have none".into()));
        };
        let weight = Tensor::cat(&weights, 0)?.to_device(&group.device())?;
        Self::new(Linear::new(weight, bias)?, shards, group)
    }

    /// Loads `N` projections under the loader's prefix, separate or fused (a fused tensor is
    /// split into `N` equal parts of rows), reading only this rank's rows of each; biases when
    /// every part has one. The parts must share their input size.
    pub fn load<const N: usize>(ld: &Loader<'_>, names: Projections<N>) -> Result<MergedColumnParallel> {
        Self::load_aligned(ld, names, 1)
    }

    /// [`load`](Self::load), each part's rows split over the ranks in whole units of `granule`
    /// rows (balanced over the units, uneven where they do not divide) when the rows are a
    /// multiple of it and every rank gets at least one unit; otherwise the balanced split. The
    /// MLP splits its intermediate features so on the blocks of its quantized down projection,
    /// so that no rank's columns of it cut a block.
    pub fn load_aligned<const N: usize>(
        ld: &Loader<'_>,
        names: Projections<N>,
        granule: usize,
    ) -> Result<MergedColumnParallel> {
        Self::load_with(ld, names, |rows| aligned_shard(rows, granule, ld.rank(), ld.world_size()))
    }

    /// Every row of each part on this rank (an expert that expert parallelism places whole on
    /// one rank): each part's shard covers all its rows.
    pub fn load_whole<const N: usize>(ld: &Loader<'_>, names: Projections<N>) -> Result<MergedColumnParallel> {
        Self::load_with(ld, names, |rows| whole_shard(rows, ld.rank(), ld.world_size()))
    }

    /// Loads the parts, each part's rows on this rank given by `shard_of(rows)`.
    fn load_with<const N: usize>(
        ld: &Loader<'_>,
        names: Projections<N>,
        shard_of: impl Fn(usize) -> Result<TensorShard>,
    ) -> Result<MergedColumnParallel> {
        let rows: [usize; N] = match names {
            Projections::Separate(n) => {
                let mut rows = [0; N];
                for (r, name) in rows.iter_mut().zip(n) {
                    *r = ld.dims2(&format!("{name}.weight"))?.0;
                }
                rows
            }
            Projections::Fused(name) => {
                let t = format!("{name}.weight");
                let (total, width) = ld.dims2(&t)?;
                if N == 0 || total % N != 0 {
                    return Err(LayerError::WrongShape {
                        name: ld.name(&t),
                        found: vec![total, width],
                        expected: vec![total.div_ceil(N.max(1)) * N, width],
                    });
                }
                [total / N; N]
            }
        };
        names.check(ld, &rows, None)?;
        let bias = names.has_bias(ld)?;
        let (mut weights, mut biases, mut shards) = (Vec::new(), Vec::new(), Vec::new());
        for (i, &r) in rows.iter().enumerate() {
            let s = shard_of(r)?;
            let (w, b) = names.read(ld, i, &rows, (s.start(), s.len()), bias)?;
            weights.push(w);
            biases.extend(b);
            shards.push(s);
        }
        let bias = if bias { Some(Tensor::cat(&biases, 0)?) } else { None };
        Self::new(Linear::new(Weight::stack(weights)?, bias)?, shards, ld.group())
    }

    /// Each part's shard, in order.
    pub fn shards(&self) -> &[TensorShard] {
        &self.shards
    }
    /// The local stacked layer.
    pub fn local(&self) -> &Linear {
        &self.linear
    }
    /// The local stacked layer, for a backward without communication (an expert's).
    pub(crate) fn local_mut(&mut self) -> &mut Linear {
        &mut self.linear
    }
    /// The group the layer runs on.
    pub fn group(&self) -> &DeviceGroup {
        &self.group
    }

    /// `[Y^(0)_r | .. | Y^(k-1)_r]` in one GEMM.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.linear.forward(x)
    }

    /// `act(Y^(0)_r) ⊙ Y^(1)_r` of a gate/up layer, fused into the product where the host
    /// can ([`Linear::forward_glu`]); `None` elsewhere.
    pub fn forward_glu(&self, x: &Tensor, act: Activation) -> Result<Option<Tensor>> {
        if self.shards.len() != 2 {
            return Ok(None);
        }
        self.linear.forward_glu(x, act)
    }

    /// Splits a local output into the parts' blocks.
    pub fn split(&self, y: &Tensor) -> Result<Vec<Tensor>> {
        let last = y.ndim().saturating_sub(1);
        let mut start = 0;
        self.shards
            .iter()
            .map(|s| {
                let t = y.narrow(last, start, s.len())?;
                start += s.len();
                Ok(t)
            })
            .collect()
    }

    /// Every part's full output `Y^(i)`, each all-gathered along the last dim.
    pub fn forward_gathered(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let y = self.forward(x)?;
        let parts = self.split(&y)?;
        parts
            .iter()
            .zip(&self.shards)
            .map(|(p, s)| Ok(self.group.all_gather_balanced(p, p.ndim() - 1, s.global_len())?))
            .collect()
    }
}

/// Training: the backward of a column-parallel layer ([`ColumnParallel::backward`](crate::ColumnParallel::backward)),
/// the stacked parts in one GEMM each.
impl MergedColumnParallel {
    /// `dX: [T, in]` (f32, every rank the same) from this rank's stacked output gradient
    /// `[dY^(0)_r | .. | dY^(k-1)_r]`, accumulating the local weight's and bias's gradients.
    pub fn backward(&mut self, x: &Tensor, dy: &Tensor) -> Result<Tensor> {
        crate::column::column_backward(&mut self.linear, &self.group, x, dy, None)
    }

    /// [`backward`](Self::backward) where `dX` goes back to `batch`'s layout (under sequence
    /// parallelism, reduce-scattered to this rank's rows).
    pub fn backward_batch(&mut self, x: &Tensor, dy: &Tensor, batch: &crate::SeqBatch) -> Result<Tensor> {
        crate::column::column_backward(&mut self.linear, &self.group, x, dy, Some(batch))
    }

    /// The stacked weight and bias as parameters: part `i`'s rows are rows `shards[i]` of the
    /// checkpoint's tensor named by `names` under `prefix` (separate or fused).
    pub fn params<'a, const N: usize>(
        &'a mut self,
        prefix: &str,
        names: Projections<N>,
        f: &mut dyn FnMut(crate::Param<'a>),
    ) -> Result<()> {
        if self.shards.len() != N {
            return Err(LayerError::Config(format!("{} parts named for {} shards", N, self.shards.len())));
        }
        let mut rows = [0; N];
        let mut blocks = Vec::new();
        let mut local = 0;
        for (i, s) in self.shards.iter().enumerate() {
            rows[i] = s.global_len();
            let (start, len) = (s.start(), s.len());
            blocks.push(crate::parts::RowBlock { part: i, local, start, len, owned: true, partial: false });
            local += len;
        }
        let (w, b) = names.placements(prefix, &rows, self.linear.in_features(), &blocks);
        self.linear.params(w, b, f)
    }
}

/// A dim-0 shard of all `rows` rows on rank `rank` of `world` (a part held whole by one rank).
pub(crate) fn whole_shard(rows: usize, rank: usize, world: usize) -> Result<TensorShard> {
    Ok(TensorShard::with_range(0, rows, rank, world, 0, rows)?)
}

/// Rank `rank`'s rows of `len` split in whole units of `granule` (balanced over the units) when
/// `len` is a multiple of `granule` and there are at least as many units as ranks; the balanced
/// split of the rows otherwise.
pub(crate) fn aligned_shard(len: usize, granule: usize, rank: usize, world: usize) -> Result<TensorShard> {
    if granule > 1 && len % granule == 0 && len / granule >= world {
        let units = TensorShard::new(0, len / granule, rank, world)?;
        return Ok(TensorShard::with_range(0, len, rank, world, units.start() * granule, units.len() * granule)?);
    }
    Ok(TensorShard::new(0, len, rank, world)?)
}
