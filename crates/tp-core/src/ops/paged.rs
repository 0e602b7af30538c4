//! Paged attention: causal attention of a flat batch of tokens from several sequences, each
//! over its own keys and values held in fixed-size blocks of a shared cache, and the write of
//! new keys and values into the cache's slots.
//!
//! The cache is `[num_blocks, block_size, Hkv, D]`; a sequence's position `p` lives in block
//! `blocks[p / block_size]`, row `p % block_size` (its *slot* is
//! `blocks[p / block_size] · block_size + p % block_size`). The queries `q: [T, Hq, D]` are the
//! rows of every sequence of the batch one after the other; a sequence's `q_len` rows are the
//! last `q_len` of its `kv_len` positions, so its query `t` sits at position
//! `kv_len - q_len + t` and sees the keys of its own blocks at positions `j <= p` (within a
//! sliding window `W`, only `j > p - W`), with the grouped-query head mapping of
//! [`KvGroups`](crate::KvGroups), exactly as [`Tensor::attention`] does for one sequence.
//!
//! The caches are tensors in the queries' dtype, or 8-bit buffers on the host
//! ([`QuantKvBuffer`], `ops/kv_quant.rs`) whose rows are widened to f32 as they are read.
//!
//! On CUDA the kernels of `kernels/paged_attention.cu` run (`ops/paged_cuda.rs`); on the host every (row, head) is computed by one sequential algorithm (the keys in position
//! order: scores in f32, their maximum, `exp`, their sum, the weighted sum of the values, one
//! division, one rounding to the dtype), as [`Tensor::attention`]'s decode loop does; rows
//! are split over threads, never the work of one row. On AVX-512 machines the query heads of a
//! token that share a KV head are computed together (`ops/paged_group.rs`), reading each key
//! and value row once for the group, with every head's arithmetic the same whichever heads
//! share its pass. A row's result therefore depends only on its query and its sequence's keys,
//! bitwise, whatever else is in the batch.

use super::attention::{GEMM_MIN_TOKENS, exp_neg, gemm_attention, row_groups};
use super::dot_f32::{dot, dots8, weighted_refs, weighted_rows};
use super::kv_quant::{KvQuant, QuantKvBuffer};
#[cfg(target_arch = "x86_64")]
use super::paged_group::{gqa_run, group_rows};
use crate::storage::{CpuStorage, Storage};
use crate::{AttentionSpec, Element, Error, KvGroups, Result, Tensor, with_dtype, with_storable};

/// Scores (query rows times keys) from which a prefill chunk attends through score tiles on the
/// host, where the machine runs prefill attention as GEMMs (on AVX-512 only past 4096 keys: see
/// [`crate::cpu::prefill_attention_as_gemms`]). Measured on Zen 4 with the per-row loop of one head at a
/// time: a 512-token prompt alone took 352 ms of attention in tiles against 458 row by row,
/// while 16 prompts of 128 tokens in one step took 828 ms in tiles (one sequence's small
/// products after another) against 715-736.
const TILED_MIN_SCORES: usize = 1 << 16;

/// One sequence of a flat token batch, for [`Tensor::paged_attention`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedSeq<'a> {
    /// First row of `q` (and of the output) belonging to this sequence.
    pub q_start: usize,
    /// Its rows: the last `q_len` of its `kv_len` positions (query `t` sits at position
    /// `kv_len - q_len + t`).
    pub q_len: usize,
    /// Positions valid in its blocks (the context before this step plus `q_len`).
    pub kv_len: usize,
    /// Block table: position `p` lives in block `blocks[p / block_size]`, row
    /// `p % block_size`.
    pub blocks: &'a [u32],
}

/// The score scale, window and head grouping of a [`Tensor::paged_attention`] call (the same for
/// every sequence of the batch).
#[derive(Debug, Clone, PartialEq)]
pub struct PagedAttentionSpec {
    /// Factor on `q·k` (usually `1/sqrt(D)`).
    pub scale: f32,
    /// At most this many most recent keys per query; `None` for plain causal attention.
    pub sliding_window: Option<usize>,
    /// Which KV head each query head uses; `None`: `Hkv` must divide `Hq`.
    pub kv_groups: Option<KvGroups>,
    /// One attention-sink logit per query head (gpt-oss), or `None` (see
    /// [`AttentionSpec::sinks`]).
    pub sinks: Option<std::sync::Arc<[f32]>>,
}

impl PagedAttentionSpec {
    /// The single-sequence spec with the same scale, window and grouping (its `kv_len` unused),
    /// whose `groups` and `key_range` this op shares.
    fn as_spec(&self) -> AttentionSpec {
        AttentionSpec {
            kv_len: 0,
            scale: self.scale,
            sliding_window: self.sliding_window,
            kv_groups: self.kv_groups,
            sinks: self.sinks.clone(),
        }
    }
}

/// The checked sizes of one call.
#[derive(Debug, Clone, Copy)]
pub(super) struct Geometry {
    pub(super) hq: usize,
    pub(super) hkv: usize,
    pub(super) d: usize,
    pub(super) block_size: usize,
    pub(super) groups: KvGroups,
}

impl Tensor {
    /// Causal (and windowed) attention of the queries `self: [T, Hq, D]` of every sequence in
    /// `seqs` over its own blocks of `k_cache, v_cache: [num_blocks, block_size, Hkv, D]` (see
    /// the module docs). Returns `[T, Hq, D]` in the dtype of `self`; scores, softmax and sums
    /// in f32. Each (row, head) is computed on its own with a fixed reduction order, so a row's
    /// result is bitwise the same whatever else is in the batch.
    ///
    /// Errors: [`Error::RankMismatch`], [`Error::ShapeMismatch`] (head dims, `k`/`v` shapes,
    /// query heads without a KV head), dtype/device mismatches, [`Error::NotFloat`], and
    /// [`Error::InvalidArgument`] for a sequence with no rows, more rows than positions, rows
    /// past `T`, a block table too short for its positions or naming a block past the cache,
    /// rows of `q` covered by no sequence or by two, a zero window or a non-finite scale.
    pub fn paged_attention(
        &self,
        k_cache: &Tensor,
        v_cache: &Tensor,
        seqs: &[PagedSeq<'_>],
        spec: &PagedAttentionSpec,
    ) -> Result<Tensor> {
        self.paged_attention_kv(KvBuffer::Dense(k_cache), KvBuffer::Dense(v_cache), seqs, spec)
    }

    /// [`paged_attention`](Self::paged_attention) over caches stored either dense or in 8 bits
    /// ([`QuantKvBuffer`]: keys and values widened to f32 as they are read, each row exactly
    /// as [`QuantKvBuffer::to_f32_tensor`] decodes it). The output is in the dtype of `self`.
    ///
    /// Errors: those of [`paged_attention`](Self::paged_attention); [`Error::InvalidArgument`]
    /// when the key cache is stored one way and the value cache another;
    /// [`Error::UnsupportedDevice`] for 8-bit caches with queries off the host.
    pub fn paged_attention_kv(
        &self,
        k_cache: KvBuffer<'_>,
        v_cache: KvBuffer<'_>,
        seqs: &[PagedSeq<'_>],
        spec: &PagedAttentionSpec,
    ) -> Result<Tensor> {
        const OP: &str = "paged_attention";
        let (geo, row_seq) = check_paged(self, k_cache, v_cache, seqs, spec)?;
        if let (KvBuffer::Dense(k), KvBuffer::Dense(v)) = (k_cache, v_cache)
            && matches!(self.storage(), Storage::Cuda(_))
        {
            return super::paged_cuda::paged_attention_cuda(self, k, v, seqs, spec, geo);
        }
        let qs = self.cpu_storage(OP)?;
        let out = crate::phase::timed(crate::phase::Phase::Attention, || -> Result<CpuStorage> {
            Ok(with_dtype!(qs.dtype(), E => {
                let qe = qs.as_slice::<E>().unwrap_or_default();
                let mut q = vec![0f32; qe.len()];
                E::slice_to_f32(qe, &mut q);
                let y = match (k_cache, v_cache) {
                    (KvBuffer::Dense(k), KvBuffer::Dense(v)) => {
                        let (k, v) = (k.cpu_storage(OP)?, v.cpu_storage(OP)?);
                        let (k, v) = (k.as_slice::<E>().unwrap_or_default(), v.as_slice::<E>().unwrap_or_default());
                        host_attention(&q, &DenseRows { k, v, hkv: geo.hkv, d: geo.d }, geo, seqs, &row_seq, spec)?
                    }
                    (KvBuffer::Quant(k), KvBuffer::Quant(v)) => {
                        let rows = QuantRows { k: k.bytes(), v: v.bytes(), quant: k.quant(), hkv: geo.hkv, row_bytes: k.row_bytes() };
                        host_attention(&q, &rows, geo, seqs, &row_seq, spec)?
                    }
                    // (check_paged refuses caches stored two ways.)
                    _ => return Err(Error::InvalidArgument { op: OP, why: "caches stored two ways".into() }),
                };
                CpuStorage::from_vec(y.iter().map(|&x| E::from_f32(x)).collect::<Vec<E>>())
            }))
        })?;
        Ok(Tensor::from_cpu(self.shape().clone(), out))
    }

    /// Writes row `t` of `src: [T, H, D]` into flat slot `slots[t]` of this cache
    /// `[num_blocks, block_size, H, D]` (slot `= block · block_size + offset`), in place.
    ///
    /// Errors (the cache unchanged): [`Error::RankMismatch`], [`Error::ShapeMismatch`] when
    /// `src`'s heads or head size differ, dtype/device mismatches, [`Error::InvalidArgument`]
    /// when `slots` has not `T` entries, a slot lies past the cache, or two rows name one slot.
    pub fn write_slots(&mut self, src: &Tensor, slots: &[usize]) -> Result<()> {
        const OP: &str = "write_slots";
        super::same_dtype_device(OP, self, src)?;
        let &[nb, bs, h, d] = self.dims() else {
            return Err(Error::RankMismatch {
                op: OP,
                expected: "4 ([num_blocks, block_size, heads, head_dim]) for the cache",
                dims: self.dims().to_vec(),
            });
        };
        check_slots(OP, &[nb, bs, h, d], src.dims(), slots)?;
        if matches!(self.storage(), Storage::Cuda(_)) {
            return super::paged_cuda::write_slots_cuda(self, src, slots, [nb, bs, h, d]);
        }
        let row = h * d;
        let from = src.cpu_storage(OP)?;
        crate::phase::timed(crate::phase::Phase::Attention, || {
            with_storable!(self.dtype(), E => {
                let s = from.as_slice::<E>().unwrap_or_default();
                let dst = self.as_mut_slice::<E>()?;
                for (i, &slot) in slots.iter().enumerate() {
                    dst[slot * row..(slot + 1) * row].copy_from_slice(&s[i * row..(i + 1) * row]);
                }
            });
            Ok(())
        })
    }
}

/// Checks a slot write of `src_dims` (`[T, heads, head_dim]`) into a cache of `cache`
/// (`[num_blocks, block_size, heads, head_dim]`): the source's heads and head size, one slot
/// per row, every slot inside the cache and none named twice.
pub(super) fn check_slots(op: &'static str, cache: &[usize; 4], src_dims: &[usize], slots: &[usize]) -> Result<()> {
    let [nb, bs, h, d] = *cache;
    let &[t, hs, ds] = src_dims else {
        return Err(Error::RankMismatch {
            op,
            expected: "3 ([tokens, heads, head_dim]) for the source",
            dims: src_dims.to_vec(),
        });
    };
    if (hs, ds) != (h, d) {
        return Err(Error::ShapeMismatch {
            op,
            lhs: cache.to_vec(),
            rhs: src_dims.to_vec(),
            why: "the source rows must have the cache's heads and head_dim",
        });
    }
    if slots.len() != t {
        return Err(Error::InvalidArgument { op, why: format!("{} slots given for {t} source rows", slots.len()) });
    }
    let total = nb * bs; // the cache's shape was checked when it was made
    if let Some((i, &s)) = slots.iter().enumerate().find(|(_, s)| **s >= total) {
        return Err(Error::InvalidArgument {
            op,
            why: format!("slot {s} of row {i} is past the cache's {total} slots ({nb} blocks of {bs})"),
        });
    }
    let mut sorted = slots.to_vec();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::InvalidArgument { op, why: format!("slot {} is written by two rows", w[0]) });
    }
    Ok(())
}

/// Checks every argument of [`Tensor::paged_attention`]; returns the sizes and, per row of `q`,
/// the index of the sequence it belongs to.
fn check_paged(
    q: &Tensor,
    k: KvBuffer<'_>,
    v: KvBuffer<'_>,
    seqs: &[PagedSeq<'_>],
    spec: &PagedAttentionSpec,
) -> Result<(Geometry, Vec<usize>)> {
    const OP: &str = "paged_attention";
    q.require_float()?;
    let (kdims, vdims) = match (k, v) {
        (KvBuffer::Dense(k), KvBuffer::Dense(v)) => {
            super::same_dtype_device(OP, q, k)?;
            super::same_dtype_device(OP, q, v)?;
            (k.dims().to_vec(), v.dims().to_vec())
        }
        (KvBuffer::Quant(k), KvBuffer::Quant(v)) => {
            if q.device() != crate::Device::Cpu {
                return Err(Error::UnsupportedDevice {
                    op: "paged_attention over an 8-bit KV cache",
                    device: q.device(),
                });
            }
            if k.quant() != v.quant() {
                return Err(Error::InvalidArgument {
                    op: OP,
                    why: format!("the key cache is stored as {} and the value cache as {}", k.quant(), v.quant()),
                });
            }
            (k.dims().to_vec(), v.dims().to_vec())
        }
        _ => {
            return Err(Error::InvalidArgument {
                op: OP,
                why: "the key and value caches must be stored alike (both dense or both 8-bit)".into(),
            });
        }
    };
    let &[t, hq, d] = q.dims() else {
        return Err(Error::RankMismatch { op: OP, expected: "3 ([tokens, heads, head_dim])", dims: q.dims().to_vec() });
    };
    let &[num_blocks, block_size, hkv, dk] = kdims.as_slice() else {
        return Err(Error::RankMismatch {
            op: OP,
            expected: "4 ([num_blocks, block_size, kv_heads, head_dim]) for the caches",
            dims: kdims,
        });
    };
    let mismatch = |why| Error::ShapeMismatch { op: OP, lhs: q.dims().to_vec(), rhs: kdims.clone(), why };
    if kdims != vdims {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: kdims.clone(),
            rhs: vdims,
            why: "the key and value caches must have one shape",
        });
    }
    if dk != d {
        return Err(mismatch("queries and keys must have one head_dim"));
    }
    spec.as_spec().check_sinks(OP, hq)?;
    let Some(groups) = spec.as_spec().groups(hq, hkv) else {
        return Err(mismatch(
            "each query head needs a KV head: Hkv must divide Hq, or kv_groups must map every query head to one",
        ));
    };
    if spec.sliding_window == Some(0) || !spec.scale.is_finite() {
        return Err(Error::InvalidArgument { op: OP, why: "the window must be >= 1 and the scale finite".into() });
    }
    let bad = |i: usize, why: String| Error::InvalidArgument { op: OP, why: format!("sequence {i}: {why}") };
    let mut row_seq = vec![usize::MAX; t];
    for (i, s) in seqs.iter().enumerate() {
        if s.q_len == 0 || s.q_len > s.kv_len {
            return Err(bad(i, format!("{} query rows for {} positions (need 1..=positions)", s.q_len, s.kv_len)));
        }
        let end = s.q_start.checked_add(s.q_len).filter(|&e| e <= t);
        let Some(end) = end else {
            return Err(bad(i, format!("rows {}..+{} pass the {t} rows of q", s.q_start, s.q_len)));
        };
        let used = s.kv_len.div_ceil(block_size.max(1));
        if block_size == 0 || s.blocks.len() < used {
            return Err(bad(
                i,
                format!("{} blocks of {block_size} cannot hold its {} positions", s.blocks.len(), s.kv_len),
            ));
        }
        if let Some(b) = s.blocks[..used].iter().find(|&&b| b as usize >= num_blocks) {
            return Err(bad(i, format!("block {b} is past the cache's {num_blocks} blocks")));
        }
        for (r, owner) in row_seq[s.q_start..end].iter_mut().enumerate() {
            if *owner != usize::MAX {
                return Err(bad(i, format!("row {} of q also belongs to sequence {owner}", s.q_start + r)));
            }
            *owner = i;
        }
    }
    if let Some(r) = row_seq.iter().position(|&o| o == usize::MAX) {
        return Err(Error::InvalidArgument { op: OP, why: format!("row {r} of q belongs to no sequence") });
    }
    Ok((Geometry { hq, hkv, d, block_size, groups }, row_seq))
}

/// A paged cache as [`Tensor::paged_attention_kv`] reads it: a dense tensor (the queries'
/// dtype, on their device) or an 8-bit buffer on the host.
#[derive(Debug, Clone, Copy)]
pub enum KvBuffer<'a> {
    /// `[num_blocks, block_size, Hkv, D]` in the queries' dtype.
    Dense(&'a Tensor),
    /// The same dims in 8 bits.
    Quant(&'a QuantKvBuffer),
}

/// Where the host attention reads keys and values: one (slot, KV head) row of each, widened
/// to f32.
trait KvRows: Sync {
    /// The keys of `slot`'s KV head `head` into `k`, its values into `v` (`D` each).
    fn widen(&self, slot: usize, head: usize, k: &mut [f32], v: &mut [f32]);
    /// The same rows in place, where the cache holds them as f32 already.
    fn direct(&self, _slot: usize, _head: usize) -> Option<(&[f32], &[f32])> {
        None
    }
}

/// A dense cache's elements.
struct DenseRows<'a, E> {
    k: &'a [E],
    v: &'a [E],
    hkv: usize,
    d: usize,
}

impl<E: Element> KvRows for DenseRows<'_, E> {
    #[inline(always)]
    fn widen(&self, slot: usize, head: usize, k: &mut [f32], v: &mut [f32]) {
        let at = (slot * self.hkv + head) * self.d;
        E::slice_to_f32(&self.k[at..at + self.d], k);
        E::slice_to_f32(&self.v[at..at + self.d], v);
    }

    #[inline(always)]
    fn direct(&self, slot: usize, head: usize) -> Option<(&[f32], &[f32])> {
        let at = (slot * self.hkv + head) * self.d;
        Some((E::as_f32(&self.k[at..at + self.d])?, E::as_f32(&self.v[at..at + self.d])?))
    }
}

/// An 8-bit cache's rows.
struct QuantRows<'a> {
    k: &'a [u8],
    v: &'a [u8],
    quant: KvQuant,
    hkv: usize,
    row_bytes: usize,
}

impl KvRows for QuantRows<'_> {
    #[inline(always)]
    fn widen(&self, slot: usize, head: usize, k: &mut [f32], v: &mut [f32]) {
        let at = (slot * self.hkv + head) * self.row_bytes;
        self.quant.decode(&self.k[at..at + self.row_bytes], k);
        self.quant.decode(&self.v[at..at + self.row_bytes], v);
    }
}

/// The f32 attention of every row of the batch on the host: long prefill chunks through the
/// score tiles of the single-sequence op where the machine runs prefill attention as GEMMs,
/// unless results must not depend on the batch; the
/// rest per (row, head), rows spread over tp-cpu's pool when the work pays (the pool splits the
/// whole batch's rows).
fn host_attention<S: KvRows>(
    q: &[f32],
    kv: &S,
    geo: Geometry,
    seqs: &[PagedSeq<'_>],
    row_seq: &[usize],
    spec: &PagedAttentionSpec,
) -> Result<Vec<f32>> {
    let invariant = tp_cpu::batch_invariant();
    let tiled: Vec<bool> = seqs
        .iter()
        .map(|s| {
            !invariant
                && s.q_len >= GEMM_MIN_TOKENS
                && s.q_len * s.kv_len >= TILED_MIN_SCORES
                && crate::cpu::prefill_attention_as_gemms(s.kv_len)
        })
        .collect();
    let rows = row_seq.len() * geo.hq;
    let mut y = vec![0f32; rows * geo.d];
    if geo.d == 0 {
        return Ok(y);
    }
    let longest = seqs.iter().zip(&tiled).filter(|(_, t)| !**t).map(|(s, _)| s.kv_len).max().unwrap_or(0);
    let work = rows.saturating_mul(longest).saturating_mul(geo.d);
    let ctx = RowCtx { q, kv, geo, seqs, row_seq, spec: spec.as_spec(), skip: &tiled };
    tp_cpu::par_row_groups(&mut y, geo.d, row_groups(work), |first, chunk| paged_rows(&ctx, first, chunk));
    for (s, _) in seqs.iter().zip(&tiled).filter(|(_, t)| **t) {
        let rows = s.q_start * geo.hq * geo.d..(s.q_start + s.q_len) * geo.hq * geo.d;
        let ys = tiled_seq(&q[rows.clone()], kv, geo, s, spec)?;
        y[rows].copy_from_slice(&ys);
    }
    Ok(y)
}

/// What every row of one call reads.
struct RowCtx<'a, S> {
    q: &'a [f32],
    kv: &'a S,
    geo: Geometry,
    seqs: &'a [PagedSeq<'a>],
    row_seq: &'a [usize],
    spec: AttentionSpec,
    /// Per sequence: its rows are computed elsewhere (left zero here).
    skip: &'a [bool],
}

/// Attention of one sequence's `q_len` rows `q: [q_len, Hq, D]` (f32) over its blocks through
/// the single-sequence op's score tiles ([`gemm_attention`]: products of a tile of queries with
/// all its keys, softmax, products with the values; scores never held beyond a tile), the
/// sequence's keys and values gathered in position order and widened to f32 first.
fn tiled_seq<S: KvRows>(
    q: &[f32],
    kv: &S,
    geo: Geometry,
    s: &PagedSeq<'_>,
    spec: &PagedAttentionSpec,
) -> Result<Vec<f32>> {
    let Geometry { hq, hkv, d, block_size: bs, groups } = geo;
    let row = hkv * d;
    let (mut kf, mut vf) = (vec![0f32; s.kv_len * row], vec![0f32; s.kv_len * row]);
    for (j, (kd, vd)) in kf.chunks_exact_mut(row).zip(vf.chunks_exact_mut(row)).enumerate() {
        let slot = s.blocks[j / bs] as usize * bs + j % bs;
        for (h, (kh, vh)) in kd.chunks_exact_mut(d).zip(vd.chunks_exact_mut(d)).enumerate() {
            kv.widen(slot, h, kh, vh);
        }
    }
    let one = AttentionSpec { kv_len: s.kv_len, ..spec.as_spec() };
    gemm_attention(q, &kf, &vf, (s.q_len, hq, hkv, d), &one, groups)
}

/// Output rows `first..first + out.len() / D` (row `r` is token `r / Hq`, head `r % Hq`), with
/// the loops compiled for the best vector unit the CPU has, picked at run time (one choice per
/// machine, so every row of every call takes the same path).
fn paged_rows<S: KvRows>(ctx: &RowCtx<'_, S>, first: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX-512F and FMA (checked just above), all `#[target_feature]`
            // adds to this otherwise safe function.
            return unsafe { paged_rows_avx512(ctx, first, out) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA (checked just above).
            return unsafe { paged_rows_avx2(ctx, first, out) };
        }
    }
    // SAFETY: without FMA the body uses no instruction the CPU may lack.
    unsafe { paged_rows_body::<S, false>(ctx, first, out) }
}

/// One KV head's keys and values of one sequence from position `base` on, widened to f32.
#[cfg(target_arch = "x86_64")]
#[derive(Default)]
struct Widened {
    seq: Option<usize>,
    base: usize,
    k: Vec<f32>,
    v: Vec<f32>,
}

/// The AVX-512 rows: the consecutive rows of one token whose query heads share a KV head (a GQA
/// group, or the part of it in this chunk) go through [`group_rows`] together, reading each key
/// and value row once for all of them; each row's arithmetic is the same whichever rows share
/// its group (see `paged_group.rs`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn paged_rows_avx512<S: KvRows>(ctx: &RowCtx<'_, S>, first: usize, out: &mut [f32]) {
    let Geometry { hq, d, block_size: bs, groups, .. } = ctx.geo;
    let rows = out.len() / d.max(1);
    let mut scores = Vec::new();
    // Per KV head, the rows widened to f32 so far (a cache not in f32), kept across the rows of
    // this chunk: a prefill chunk's tokens see growing key ranges of one sequence, so each key
    // is widened once per chunk instead of once per token.
    let mut wide: Vec<Widened> = (0..ctx.geo.hkv).map(|_| Widened::default()).collect();
    let (mut kptr, mut vptr): (Vec<*const f32>, Vec<*const f32>) = (Vec::new(), Vec::new());
    // (sequence, KV head, first key, last key) of what `kptr`/`vptr` point at.
    let mut held: Option<(usize, usize, usize, usize)> = None;
    let mut i = 0;
    while i < rows {
        let r = first + i;
        let (tok, kvh, g) = gqa_run(r, rows - i, hq, groups);
        let si = ctx.row_seq[tok];
        if ctx.skip[si] {
            i += g;
            continue;
        }
        let s = &ctx.seqs[si];
        let p = s.kv_len - s.q_len + (tok - s.q_start);
        let (lo, hi) = ctx.spec.key_range(p);
        if held != Some((si, kvh, lo, hi)) {
            let slot = |j: usize| s.blocks[j / bs] as usize * bs + j % bs;
            kptr.clear();
            vptr.clear();
            if ctx.kv.direct(slot(lo), kvh).is_some() {
                // f32 rows are read where they are.
                for j in lo..=hi {
                    let (kd, vd) = ctx.kv.direct(slot(j), kvh).expect("an f32 cache");
                    kptr.push(kd.as_ptr());
                    vptr.push(vd.as_ptr());
                }
            } else {
                let w = &mut wide[kvh];
                if w.seq != Some(si) || lo < w.base {
                    (w.seq, w.base) = (Some(si), lo);
                    w.k.clear();
                    w.v.clear();
                }
                // Widen the keys past those held, up to `hi`.
                let (from, to) = (w.base + w.k.len() / d, hi + 1);
                if to > from {
                    w.k.resize((to - w.base) * d, 0.0);
                    w.v.resize((to - w.base) * d, 0.0);
                    let (ks, vs) = (&mut w.k[(from - w.base) * d..], &mut w.v[(from - w.base) * d..]);
                    for ((j, kd), vd) in (from..to).zip(ks.chunks_exact_mut(d)).zip(vs.chunks_exact_mut(d)) {
                        ctx.kv.widen(slot(j), kvh, kd, vd);
                    }
                }
                let rows = (lo - w.base) * d..(hi + 1 - w.base) * d;
                kptr.extend(w.k[rows.clone()].chunks_exact(d).map(<[f32]>::as_ptr));
                vptr.extend(w.v[rows].chunks_exact(d).map(<[f32]>::as_ptr));
            }
            held = Some((si, kvh, lo, hi));
        }
        // SAFETY: this function's features hold AVX-512F and FMA, which its caller checked;
        // every pointer is the start of a `d`-float row of the cache or of a `wide` buffer
        // (unchanged since the pointers were taken: a buffer only grows when `held` changes,
        // and then the pointers are taken anew); one key and one value row per position.
        unsafe {
            group_rows(
                &ctx.q[r * d..(r + g) * d],
                d,
                &kptr,
                &vptr,
                (ctx.spec.scale, ctx.spec.sinks.as_ref().map(|s| &s[r % hq..r % hq + g])),
                &mut scores,
                &mut out[i * d..(i + g) * d],
            );
        }
        i += g;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn paged_rows_avx2<S: KvRows>(ctx: &RowCtx<'_, S>, first: usize, out: &mut [f32]) {
    // SAFETY: as in `paged_rows_avx512`.
    unsafe { paged_rows_body::<S, true>(ctx, first, out) }
}

/// The portable body; `FMA` fuses the multiply-adds and takes the AVX2 dot product. Keys are
/// visited in position order through the sequence's block table.
///
/// A KV head's keys and values over a row's key range are widened to f32 once and kept while
/// the next rows read the same head of the same sequence over the same range: the query heads
/// of a group (GQA) are consecutive rows of one token, so their keys and values are read and
/// widened once for the group instead of once per query head. Every row still computes its
/// scores, softmax and weighted sum from the same f32 values in the same order, so a row's
/// result does not depend on which rows share its chunk.
///
/// # Safety
/// With `FMA`, the CPU must have AVX2 and FMA.
#[inline(always)]
unsafe fn paged_rows_body<S: KvRows, const FMA: bool>(ctx: &RowCtx<'_, S>, first: usize, out: &mut [f32]) {
    let Geometry { hq, d, block_size: bs, groups, .. } = ctx.geo;
    let (mut scores, mut krows, mut vrows) = (Vec::new(), Vec::new(), Vec::new());
    // The rows of an f32 cache, read in place instead of copied into `krows` / `vrows`.
    let (mut kref, mut vref): (Vec<&[f32]>, Vec<&[f32]>) = (Vec::new(), Vec::new());
    // (sequence, KV head, first key, last key) of what `krows`/`vrows` hold.
    let mut held: Option<(usize, usize, usize, usize)> = None;
    for (r, y) in (first..).zip(out.chunks_exact_mut(d.max(1))) {
        let (tok, head) = (r / hq, r % hq);
        let si = ctx.row_seq[tok];
        if ctx.skip[si] {
            continue;
        }
        let s = &ctx.seqs[si];
        let kvh = (head + groups.offset) / groups.size;
        let p = s.kv_len - s.q_len + (tok - s.q_start);
        let (lo, hi) = ctx.spec.key_range(p);
        if held != Some((si, kvh, lo, hi)) {
            let n = hi + 1 - lo;
            let slot = |j: usize| s.blocks[j / bs] as usize * bs + j % bs;
            kref.clear();
            vref.clear();
            if ctx.kv.direct(slot(lo), kvh).is_some() {
                // f32 rows are read where they are.
                for j in lo..=hi {
                    let (kd, vd) = ctx.kv.direct(slot(j), kvh).expect("an f32 cache");
                    kref.push(kd);
                    vref.push(vd);
                }
            } else {
                krows.resize(n * d, 0.0);
                vrows.resize(n * d, 0.0);
                for ((j, kd), vd) in (lo..=hi).zip(krows.chunks_exact_mut(d)).zip(vrows.chunks_exact_mut(d)) {
                    ctx.kv.widen(slot(j), kvh, kd, vd);
                }
            }
            held = Some((si, kvh, lo, hi));
        }
        let direct = !kref.is_empty();
        let key = |j: usize| if direct { kref[j] } else { &krows[j * d..(j + 1) * d] };
        let qv = &ctx.q[r * d..(r + 1) * d];
        let n = if direct { kref.len() } else { krows.len() / d.max(1) };
        scores.clear();
        scores.resize(n, 0.0);
        // Eight keys at a time (the same bits as one at a time), then the rest.
        let whole = n / 8 * 8;
        for (j0, out) in (0..whole).step_by(8).zip(scores.chunks_exact_mut(8)) {
            let keys =
                [key(j0), key(j0 + 1), key(j0 + 2), key(j0 + 3), key(j0 + 4), key(j0 + 5), key(j0 + 6), key(j0 + 7)];
            // SAFETY: `FMA` only where the CPU has AVX2 and FMA (this function's contract);
            // every key row holds `d` values.
            let dots = unsafe { dots8::<FMA>(qv, keys) };
            for (o, v) in out.iter_mut().zip(dots) {
                *o = v * ctx.spec.scale;
            }
        }
        for (j, o) in scores.iter_mut().enumerate().skip(whole) {
            // SAFETY: as above.
            *o = unsafe { dot::<FMA>(qv, key(j)) } * ctx.spec.scale;
        }
        let sink = ctx.spec.sink(head);
        let max = scores.iter().fold(sink.unwrap_or(f32::NEG_INFINITY), |m, &v| m.max(v));
        for sc in &mut scores {
            *sc = exp_neg(*sc - max);
        }
        let sum = scores.iter().sum::<f32>() + sink.map_or(0.0, |s| exp_neg(s - max));
        if direct {
            weighted_refs::<FMA>(y, &scores, &vref);
        } else {
            weighted_rows::<FMA>(y, &scores, &vrows, d);
        }
        let inv = 1.0 / sum;
        y.iter_mut().for_each(|a| *a *= inv);
    }
}
