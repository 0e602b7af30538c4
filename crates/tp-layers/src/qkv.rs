//! [`QkvParallel`]: the query/key/value projections split by whole attention heads.
//!
//! Queries: `num_heads` heads of `head_dim`, split over ranks by the balanced policy on heads,
//! rank `r` holding heads `[a_r, b_r)`. Keys/values (grouped-query attention, `num_kv_heads`
//! dividing `num_heads`, `g = num_heads / num_kv_heads` query heads per KV head): rank `r` holds
//! exactly the KV heads its query heads attend with, `[a_r / g, ceil(b_r / g))`. Where the TP
//! degree divides the KV heads that is an even split (as in Megatron-LM and vLLM); where the KV
//! heads divide the TP degree (Llama 3 70B's 8 KV heads at TP 16), each KV head is replicated on
//! `world / num_kv_heads` consecutive ranks, as vLLM does; and any other world size up to
//! `num_heads` works too (12 query / 4 KV heads at TP 8: heads 2,2,2,2,1,1,1,1, rank 1's heads 2
//! and 3 attend with KV heads 0 and 1, so it holds both), where Megatron-LM and vLLM refuse.
//! Rank `r`'s GEMM gives `[Q_r | K_r | V_r]`.

use crate::error::{LayerError, Result};
use crate::linear::Linear;
use crate::loader::Loader;
use crate::parts::Projections;
use crate::weight::Weight;
use std::ops::Range;
use tp_core::{Tensor, TensorShard};

/// The attention heads of a model: query heads, key/value heads (dividing them) and head size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionHeads {
    /// Query heads (`num_attention_heads`).
    pub num_heads: usize,
    /// Key/value heads (`num_key_value_heads`), dividing `num_heads`.
    pub num_kv_heads: usize,
    /// Features per head (`head_dim`, or `hidden_size / num_attention_heads`).
    pub head_dim: usize,
}

impl AttentionHeads {
    /// Rows of the q, k and v projections: `num_heads * head_dim` and twice
    /// `num_kv_heads * head_dim`, checked against overflow.
    pub fn rows(&self) -> Result<[usize; 3]> {
        let q = self.num_heads.checked_mul(self.head_dim);
        let kv = self.num_kv_heads.checked_mul(self.head_dim);
        match (q, kv) {
            (Some(q), Some(kv)) => Ok([q, kv, kv]),
            _ => Err(LayerError::Config(format!("{self:?}: heads x head_dim overflows"))),
        }
    }
}

/// Which heads a rank holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QkvLayout {
    /// Query heads in the model.
    pub num_heads: usize,
    /// Key/value heads in the model (divides `num_heads`).
    pub num_kv_heads: usize,
    /// Features per head.
    pub head_dim: usize,
    /// This rank.
    pub rank: usize,
    /// Tensor-parallel degree.
    pub world_size: usize,
    /// First query head this rank holds.
    pub q_start: usize,
    /// Number of query heads this rank holds.
    pub q_len: usize,
    /// First KV head this rank holds.
    pub kv_start: usize,
    /// Number of KV heads this rank holds.
    pub kv_len: usize,
}

impl QkvLayout {
    /// The heads of rank `rank` out of `world_size`.
    ///
    /// Errors (the same on every rank, so none goes on to wait for the others): heads that do
    /// not group (`num_kv_heads` must divide `num_heads`), and a world size above `num_heads`
    /// (a rank would hold no query head).
    pub fn new(
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        rank: usize,
        world_size: usize,
    ) -> Result<QkvLayout> {
        if num_heads == 0 || num_kv_heads == 0 || head_dim == 0 || num_heads % num_kv_heads != 0 {
            return Err(LayerError::Config(format!(
                "need num_heads ({num_heads}) a positive multiple of num_kv_heads ({num_kv_heads}) and head_dim > 0"
            )));
        }
        if world_size > num_heads {
            return Err(LayerError::Config(format!(
                "{num_heads} query heads cannot be placed on {world_size} ranks: each rank needs at least one"
            )));
        }
        let q = TensorShard::new(0, num_heads, rank, world_size)?;
        let group = num_heads / num_kv_heads; // query heads per KV head
        let kv_start = q.start() / group;
        let kv_len = q.end().div_ceil(group) - kv_start;
        Ok(QkvLayout {
            num_heads,
            num_kv_heads,
            head_dim,
            rank,
            world_size,
            q_start: q.start(),
            q_len: q.len(),
            kv_start,
            kv_len,
        })
    }

    fn rows(&self, start: usize, len: usize) -> (usize, usize) {
        (start * self.head_dim, len * self.head_dim)
    }

    /// This rank's query heads, counted in the model.
    pub fn q_heads(&self) -> Range<usize> {
        self.q_start..self.q_start + self.q_len
    }

    /// The input features of the output projection (`o_proj`, `[H, heads·D]`) this rank
    /// holds: those of its query heads, `[q_start·D, (q_start + q_len)·D)`, the head-aligned
    /// range [`RowParallel::load_columns`](crate::RowParallel::load_columns) takes (uneven
    /// where the heads are).
    pub fn o_proj_columns(&self) -> Range<usize> {
        self.q_start * self.head_dim..(self.q_start + self.q_len) * self.head_dim
    }

    /// This rank's KV heads, counted in the model.
    pub fn kv_heads(&self) -> Range<usize> {
        self.kv_start..self.kv_start + self.kv_len
    }

    /// The KV heads this rank is the first to hold, counted from its first KV head (a range
    /// within `0..kv_len`). Where ranks share a KV head (more ranks than KV heads, or query heads
    /// straddling a group), exactly one rank owns it, so a sum over the ranks' owned heads
    /// counts every KV head once (the full-width k norm's sum of squares).
    pub fn kv_owned(&self) -> Range<usize> {
        let prev_end = match self.rank.checked_sub(1) {
            Some(prev) => QkvLayout::new(self.num_heads, self.num_kv_heads, self.head_dim, prev, self.world_size)
                .map_or(0, |p| p.kv_start + p.kv_len),
            None => 0,
        };
        let start = prev_end.clamp(self.kv_start, self.kv_start + self.kv_len);
        start - self.kv_start..self.kv_len
    }

    /// For each of this rank's KV heads (`0..kv_len`): whether this rank owns it (is the first
    /// to hold it, [`kv_owned`](Self::kv_owned)) and whether another rank holds it too (a
    /// neighbour: ranks hold contiguous ranges of KV heads in rank order), so that its
    /// gradient here is a partial sum.
    pub fn kv_sharing(&self) -> Vec<(bool, bool)> {
        let holds = |rank: Option<usize>, head: usize| {
            rank.filter(|&r| r < self.world_size)
                .and_then(|r| QkvLayout::new(self.num_heads, self.num_kv_heads, self.head_dim, r, self.world_size).ok())
                .is_some_and(|o| o.kv_heads().contains(&head))
        };
        let owned = self.kv_owned();
        (0..self.kv_len)
            .map(|j| {
                let head = self.kv_start + j;
                (owned.contains(&j), holds(self.rank.checked_sub(1), head) || holds(Some(self.rank + 1), head))
            })
            .collect()
    }

    /// How this rank's query heads share its KV heads: local query head `h` attends with local
    /// KV head `(h + offset) / size`.
    pub fn kv_groups(&self) -> tp_core::KvGroups {
        let size = self.num_heads / self.num_kv_heads;
        tp_core::KvGroups { size, offset: self.q_start - self.kv_start * size }
    }
}

/// Rank `r`'s fused Q/K/V projection.
#[derive(Debug, Clone)]
pub struct QkvParallel {
    linear: Linear,
    layout: QkvLayout,
}

impl QkvParallel {
    /// Packs the local weight once into the host GEMM's panels (host weights only; a no-op on a GPU
    /// or when already packed), so that products of many rows (prefill, batched decode) stop
    /// repacking it: the same numbers, bitwise, for as much memory again as the weight.
    pub fn pack_host(&mut self) -> Result<()> {
        self.linear.pack_host()
    }

    /// Rank `layout.rank`'s heads of full projections `q: [heads*hd, H]`, `k`, `v:
    /// [kv_heads*hd, H]`.
    pub fn from_full(q: &Linear, k: &Linear, v: &Linear, layout: QkvLayout) -> Result<QkvParallel> {
        let (hd, nq, nkv) = (layout.head_dim, layout.num_heads, layout.num_kv_heads);
        if q.out_features() != nq * hd || k.out_features() != nkv * hd || v.out_features() != nkv * hd {
            return Err(LayerError::Config(format!(
                "q/k/v have {}/{}/{} rows; the layout needs {}/{}/{}",
                q.out_features(),
                k.out_features(),
                v.out_features(),
                nq * hd,
                nkv * hd,
                nkv * hd
            )));
        }
        let (qs, ql) = layout.rows(layout.q_start, layout.q_len);
        let (ks, kl) = layout.rows(layout.kv_start, layout.kv_len);
        let take = |l: &Linear, s: usize, n: usize| -> Result<(Weight, Option<Tensor>)> {
            Ok((l.weight()?.narrow(0, s, n)?.into(), l.bias().map(|b| b.narrow(0, s, n)).transpose()?))
        };
        let parts = [take(q, qs, ql)?, take(k, ks, kl)?, take(v, ks, kl)?];
        Self::assemble(parts, layout)
    }

    /// Loads the q, k and v projections under the loader's prefix (`names`: Hugging Face's
    /// separate `q_proj`, `k_proj`, `v_proj`, or a fused `qkv_proj` whose rows are `[q; k; v]`),
    /// reading only this rank's heads of each; biases optional (all or none).
    pub fn load(ld: &Loader<'_>, heads: AttentionHeads, names: Projections<3>) -> Result<QkvParallel> {
        let AttentionHeads { num_heads, num_kv_heads, head_dim } = heads;
        let layout = QkvLayout::new(num_heads, num_kv_heads, head_dim, ld.rank(), ld.world_size())?;
        let rows = heads.rows()?;
        names.check(ld, &rows, None)?;
        let bias = names.has_bias(ld)?;
        let (qs, ql) = layout.rows(layout.q_start, layout.q_len);
        let (ks, kl) = layout.rows(layout.kv_start, layout.kv_len);
        let parts = [
            names.read(ld, 0, &rows, (qs, ql), bias)?,
            names.read(ld, 1, &rows, (ks, kl), bias)?,
            names.read(ld, 2, &rows, (ks, kl), bias)?,
        ];
        Self::assemble(parts, layout)
    }

    fn assemble(parts: [(Weight, Option<Tensor>); 3], layout: QkvLayout) -> Result<QkvParallel> {
        let weight = Weight::stack(parts.iter().map(|p| p.0.clone()).collect())?;
        let biases: Vec<&Tensor> = parts.iter().filter_map(|p| p.1.as_ref()).collect();
        let bias = match biases.len() {
            0 => None,
            3 => Some(Tensor::cat(&biases, 0)?),
            _ => return Err(LayerError::Config("q/k/v must all have biases or none".into())),
        };
        Ok(QkvParallel { linear: Linear::new(weight, bias)?, layout })
    }

    /// Which heads this rank holds.
    pub fn layout(&self) -> &QkvLayout {
        &self.layout
    }

    /// The local fused layer (`[Q_r; K_r; V_r]` rows).
    pub fn local(&self) -> &Linear {
        &self.linear
    }

    /// `[Q_r | K_r | V_r]` for `x: [.., H]`, then split: `(Q_r, K_r, V_r)` with
    /// `q_len * head_dim` and `kv_len * head_dim` features.
    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let y = self.linear.forward(x)?;
        let last = y.ndim() - 1;
        let (q, kv) = (self.layout.q_len * self.layout.head_dim, self.layout.kv_len * self.layout.head_dim);
        Ok((y.narrow(last, 0, q)?, y.narrow(last, q, kv)?, y.narrow(last, q + kv, kv)?))
    }
}

/// Training.
///
/// `dX = Σ_r [dQ_r | dK_r | dV_r] [Wq_r; Wk_r; Wv_r]`, all-reduced as a column-parallel layer's.
/// A KV head held by several ranks (replicated where there are fewer KV heads than ranks, or
/// shared by straddling query heads) gets from each of them the gradient of its own query heads
/// only: each rank's `dX` term is still right (the all-reduce adds them), and its weight
/// gradient is a partial sum, marked so in [`params`](QkvParallel::params).
impl QkvParallel {
    /// `dX: [T, H]` (f32, every rank the same) from this rank's `[dQ_r | dK_r | dV_r]`,
    /// accumulating the local weight's and bias's gradients.
    /// Under sequence parallelism (`batch`), `dX` is reduce-scattered to this rank's rows.
    pub fn backward(
        &mut self,
        x: &Tensor,
        dqkv: &Tensor,
        group: &tp_comm::DeviceGroup,
        batch: Option<&crate::SeqBatch>,
    ) -> Result<Tensor> {
        crate::column::column_backward(&mut self.linear, group, x, dqkv, batch)
    }

    /// The stacked weight and bias as parameters named by `names` under `prefix`: this rank's
    /// query heads' rows of q (owned), and per KV head its rows of k and v, owned by the first
    /// rank holding the head and partial where other ranks hold it too.
    pub fn params<'a>(
        &'a mut self,
        prefix: &str,
        names: Projections<3>,
        f: &mut dyn FnMut(crate::Param<'a>),
    ) -> Result<()> {
        let l = self.layout;
        let d = l.head_dim;
        let rows = [l.num_heads * d, l.num_kv_heads * d, l.num_kv_heads * d];
        let sharing = l.kv_sharing();
        let mut blocks = vec![crate::parts::RowBlock {
            part: 0,
            local: 0,
            start: l.q_start * d,
            len: l.q_len * d,
            owned: true,
            partial: false,
        }];
        for part in [1, 2] {
            for (j, &(owned, partial)) in sharing.iter().enumerate() {
                blocks.push(crate::parts::RowBlock {
                    part,
                    local: l.q_len * d + (part - 1) * l.kv_len * d + j * d,
                    start: (l.kv_start + j) * d,
                    len: d,
                    owned,
                    partial,
                });
            }
        }
        let (w, b) = names.placements(prefix, &rows, self.linear.in_features(), &blocks);
        self.linear.params(w, b, f)
    }
}
