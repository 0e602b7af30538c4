//! Causal scaled-dot-product attention with grouped-query heads, for a prefill of `T` tokens or
//! a decode step, against keys and values held in a cache.
//!
//! `q: [T, Hq, D]`, `k, v: [C, Hkv, D]`: query head `h` attends with KV head `h / (Hq / Hkv)`
//! (grouped-query attention; `Hkv = Hq` is multi-head, `Hkv = 1` multi-query). A tensor-parallel
//! rank whose query heads do not start at a group boundary (12 query heads over 4 KV heads at TP
//! 8: a rank may hold heads 2 and 3, which use KV heads 0 and 1) states the grouping instead
//! ([`KvGroups`]): query head `h` attends with KV head `(h + offset) / size`.
//! The first `L = kv_len` rows of the cache are valid and the `T` queries are its last `T`
//! tokens, so query `t` sits at position `p = L - T + t` and sees keys `j <= p` (and, with a
//! sliding window `W`, only `j > p - W`, as Mistral's mask). With scores
//! `s_j = scale · q·k_j`, the output is `Σ_j softmax(s)_j v_j`; scores, softmax and the weighted
//! sum are computed in f32 and the output rounded once to the dtype (PyTorch's SDPA does the
//! same on its fused paths).
//!
//! With attention sinks (gpt-oss: one learned logit `σ_h` per query head) the softmax runs over
//! the visible scores and `σ_h` together and the sink's share is dropped: with
//! `M = max(σ_h, max_j s_j)`, `y = Σ_j e^{s_j - M} v_j / (Σ_j e^{s_j - M} + e^{σ_h - M})`, as
//! transformers' eager `GptOssAttention` computes it (a virtual key whose value is zero).
//!
//! On the host, AVX-512 machines compute every row this way up to 4096 keys, the query heads of
//! a GQA group together (`paged_group.rs`); longer ones, and elsewhere prefills of
//! [`GEMM_MIN_TOKENS`] or more, run as GEMMs over score tiles ([`gemm_attention`]; [`crate::cpu::set_prefill_attention_gemms`]
//! picks either for one thread).

use super::dot_f32::{dot, weighted_rows};
use crate::storage::{CpuStorage, Storage};
use crate::{Element, Error, Result, Tensor, with_dtype};
use std::sync::Arc;

/// Which keys the queries see, and the score scale, for [`Tensor::attention`].
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionSpec {
    /// Valid rows of the key/value cache; the queries are its last `T`.
    pub kv_len: usize,
    /// Factor on `q·k` (usually `1/sqrt(D)`).
    pub scale: f32,
    /// At most this many most recent keys per query (Mistral's `sliding_window`); `None` for
    /// plain causal attention.
    pub sliding_window: Option<usize>,
    /// Which KV head each query head uses; `None`: `Hkv` must divide `Hq`, and query head `h`
    /// uses KV head `h / (Hq / Hkv)`.
    pub kv_groups: Option<KvGroups>,
    /// One attention-sink logit per query head of the call (gpt-oss's `sinks`, the rank's
    /// heads under tensor parallelism), or `None` for plain softmax.
    pub sinks: Option<Arc<[f32]>>,
}

/// How the query heads of one call share KV heads: query head `h` (counted from 0 in this call)
/// attends with KV head `(h + offset) / size`. `size` is the model's query heads per KV head;
/// `offset < size` is how far into its group the call's first query head sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvGroups {
    /// Query heads per KV head in the model (`num_attention_heads / num_key_value_heads`).
    pub size: usize,
    /// Position of this call's first query head within its group.
    pub offset: usize,
}

impl AttentionSpec {
    /// Plain causal attention over `kv_len` cached tokens with scale `1/sqrt(head_dim)`.
    pub fn causal(kv_len: usize, head_dim: usize) -> AttentionSpec {
        AttentionSpec {
            kv_len,
            scale: 1.0 / (head_dim.max(1) as f32).sqrt(),
            sliding_window: None,
            kv_groups: None,
            sinks: None,
        }
    }

    /// Query head `h`'s sink logit, if the call has sinks.
    #[inline]
    pub fn sink(&self, h: usize) -> Option<f32> {
        self.sinks.as_ref().map(|s| s[h])
    }

    /// Checks the sinks against the call's `hq` query heads: one finite logit per head.
    pub(super) fn check_sinks(&self, op: &'static str, hq: usize) -> Result<()> {
        match &self.sinks {
            Some(s) if s.len() != hq || s.iter().any(|x| !x.is_finite()) => Err(Error::InvalidArgument {
                op,
                why: format!("attention sinks must be {hq} finite logits (one per query head), got {}", s.len()),
            }),
            _ => Ok(()),
        }
    }

    /// The grouping for `hq` query heads over `hkv` KV heads, checked: every query head's KV
    /// head exists. `None` if they do not fit.
    pub fn groups(&self, hq: usize, hkv: usize) -> Option<KvGroups> {
        let g = match self.kv_groups {
            Some(g) => g,
            None if hkv > 0 && hq.is_multiple_of(hkv) => KvGroups { size: (hq / hkv).max(1), offset: 0 },
            None => return None,
        };
        let fits = g.size > 0 && g.offset < g.size && (hq == 0 || (g.offset + hq - 1) / g.size < hkv);
        fits.then_some(g)
    }

    /// The keys `lo..=p` that the query at position `p` sees.
    pub fn key_range(&self, p: usize) -> (usize, usize) {
        let lo = match self.sliding_window {
            Some(w) => (p + 1).saturating_sub(w),
            None => 0,
        };
        (lo, p)
    }
}

/// Work (multiply-adds) below which attention runs on one thread.
const PARALLEL_MIN_WORK: usize = 1 << 15;

/// How many groups of rows attention's `work` multiply-adds are cut into on tp-cpu's persistent
/// pool: one (inline) when too little to pay for it, else four per pool thread, claimed one at
/// a time so that a descheduled core delays only the groups it took.
pub(super) fn row_groups(work: usize) -> usize {
    if work < PARALLEL_MIN_WORK { 1 } else { 4 * crate::cpu::num_threads() }
}
/// Queries from which attention runs as GEMMs (prefill); fewer (decode) take the row loop.
pub(super) const GEMM_MIN_TOKENS: usize = 8;

/// Score elements one GEMM tile may hold (16 MiB of f32): long prefills go tile by tile.
const SCORE_TILE: usize = 1 << 22;

impl Tensor {
    /// Attention of the queries `self: [T, Hq, D]` over the cache `k, v: [C, Hkv, D]` (see the
    /// module docs). Returns `[T, Hq, D]` in the dtype of `self`.
    ///
    /// Errors: [`Error::RankMismatch`], [`Error::ShapeMismatch`] (head dims, `Hkv ∤ Hq`, `k`
    /// and `v` differing), dtype/device mismatches, [`Error::InvalidArgument`] when `kv_len`
    /// exceeds `C` or is smaller than `T`, or the window is 0; [`Error::NotFloat`].
    pub fn attention(&self, k: &Tensor, v: &Tensor, spec: &AttentionSpec) -> Result<Tensor> {
        crate::phase::timed(crate::phase::Phase::Attention, || self.attention_untimed(k, v, spec))
    }

    fn attention_untimed(&self, k: &Tensor, v: &Tensor, spec: &AttentionSpec) -> Result<Tensor> {
        const OP: &str = "attention";
        self.require_float()?;
        super::same_dtype_device(OP, self, k)?;
        super::same_dtype_device(OP, self, v)?;
        let rank3 = |t: &Tensor| match *t.dims() {
            [a, b, c] => Ok((a, b, c)),
            _ => {
                Err(Error::RankMismatch { op: OP, expected: "3 ([tokens, heads, head_dim])", dims: t.dims().to_vec() })
            }
        };
        let ((t, hq, d), (c, hkv, dk)) = (rank3(self)?, rank3(k)?);
        let mismatch = |why| Error::ShapeMismatch { op: OP, lhs: self.dims().to_vec(), rhs: k.dims().to_vec(), why };
        if k.dims() != v.dims() {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: k.dims().to_vec(),
                rhs: v.dims().to_vec(),
                why: "keys and values must have one shape",
            });
        }
        if dk != d {
            return Err(mismatch("queries and keys must have one head_dim"));
        }
        let Some(groups) = spec.groups(hq, hkv) else {
            return Err(mismatch(
                "each query head needs a KV head: Hkv must divide Hq, or kv_groups must map every query head to one",
            ));
        };
        if spec.kv_len > c || spec.kv_len < t {
            return Err(Error::InvalidArgument {
                op: OP,
                why: format!("kv_len {} must lie between the {t} queries and the cache's {c} rows", spec.kv_len),
            });
        }
        if spec.sliding_window == Some(0) || !spec.scale.is_finite() {
            return Err(Error::InvalidArgument { op: OP, why: "the window must be >= 1 and the scale finite".into() });
        }
        spec.check_sinks(OP, hq)?;
        let dims = (t, hq, hkv, d);
        if let (Storage::Cuda(qs), Storage::Cuda(ks), Storage::Cuda(vs)) = (self.storage(), k.storage(), v.storage()) {
            return Ok(Tensor::from_cuda(
                self.shape().clone(),
                super::cuda::attention(qs, ks, vs, dims, spec, groups)?,
            ));
        }
        let (qs, ks, vs) = (self.cpu_storage(OP)?, k.cpu_storage(OP)?, v.cpu_storage(OP)?);
        let out = with_dtype!(qs.dtype(), T => {
            let valid = spec.kv_len * hkv * d;
            let (q, k, v) = (widen::<T>(qs.as_slice::<T>().unwrap_or_default()),
                widen::<T>(&ks.as_slice::<T>().unwrap_or_default()[..valid]),
                widen::<T>(&vs.as_slice::<T>().unwrap_or_default()[..valid]));
            let y = if t >= GEMM_MIN_TOKENS && d > 0 && crate::cpu::prefill_attention_as_gemms(spec.kv_len) { gemm_attention(&q, &k, &v, dims, spec, groups)? } else { host_attention(&q, &k, &v, dims, spec, groups) };
            CpuStorage::from_vec(y.iter().map(|&x| T::from_f32(x)).collect::<Vec<T>>())
        });
        Ok(Tensor::from_cpu(self.shape().clone(), out))
    }
}

/// `s` as `f32`: borrowed when it already is (an f32 KV cache is read in place, not copied on
/// every step), widened into a new buffer otherwise.
fn widen<T: Element>(s: &[T]) -> std::borrow::Cow<'_, [f32]> {
    match bytemuck::try_cast_slice::<T, f32>(s) {
        Ok(f) if T::DTYPE == crate::DType::F32 => std::borrow::Cow::Borrowed(f),
        _ => {
            let mut v = vec![0f32; s.len()];
            T::slice_to_f32(s, &mut v);
            std::borrow::Cow::Owned(v)
        }
    }
}

/// Prefill attention on the host as GEMMs, one KV head at a time: its query heads' rows
/// `Q_g: [T·group, D]` against its keys `K_g: [L, D]` give the scores `S = Q_g K_g^T` (the
/// host GEMM, threaded), masked and soft-maxed row by row, and `O_g = P V_g`. Tokens go in
/// tiles so that a tile's scores stay within `SCORE_TILE`, each against only the keys its last
/// token can see. Same f32 math as the row loop, but at GEMM speed.
pub(super) fn gemm_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    (t, hq, hkv, d): (usize, usize, usize, usize),
    spec: &AttentionSpec,
    groups: KvGroups,
) -> Result<Vec<f32>> {
    let cpu = crate::Device::Cpu;
    let first_pos = spec.kv_len - t;
    let mut out = vec![0f32; t * hq * d];
    let tile = (SCORE_TILE / (groups.size.min(hq) * spec.kv_len).max(1)).clamp(1, t);
    for g in 0..hkv {
        // The query heads h0..h1 of this call that use KV head g.
        let h0 = (g * groups.size).saturating_sub(groups.offset).min(hq);
        let h1 = ((g + 1) * groups.size).saturating_sub(groups.offset).min(hq);
        let group = h1 - h0;
        if group == 0 {
            continue;
        }
        let rows_of = |src: &[f32], n: usize| -> Vec<f32> {
            let mut m = Vec::with_capacity(n * d);
            for j in 0..n {
                m.extend_from_slice(&src[(j * hkv + g) * d..(j * hkv + g + 1) * d]);
            }
            m
        };
        for t0 in (0..t).step_by(tile) {
            let tn = tile.min(t - t0);
            let keys = first_pos + t0 + tn; // the last token of the tile sees keys 0..keys
            let (lo_tile, _) = spec.key_range(first_pos + t0);
            let kg = Tensor::from_vec(rows_of(&k[lo_tile * hkv * d..], keys - lo_tile), &[keys - lo_tile, d], &cpu)?;
            let vg = Tensor::from_vec(rows_of(&v[lo_tile * hkv * d..], keys - lo_tile), &[keys - lo_tile, d], &cpu)?;
            let mut qg = Vec::with_capacity(tn * group * d);
            for tok in t0..t0 + tn {
                let at = (tok * hq + h0) * d;
                qg.extend_from_slice(&q[at..at + group * d]);
            }
            let qg = Tensor::from_vec(qg, &[tn * group, d], &cpu)?;
            let mut scores = qg.matmul_t(&kg)?; // [tn·group, keys - lo_tile]
            let width = keys - lo_tile;
            softmax_rows(
                scores.as_mut_slice::<f32>()?,
                width,
                |row| {
                    let p = first_pos + t0 + row / group;
                    let (lo, hi) = spec.key_range(p);
                    (lo - lo_tile, hi + 1 - lo_tile)
                },
                |row| spec.sink(h0 + row % group),
                spec.scale,
            );
            let o = scores.matmul(&vg)?; // [tn·group, d]
            let o = o.as_slice::<f32>()?;
            for (r, orow) in o.chunks_exact(d).enumerate() {
                let (tok, hh) = (t0 + r / group, r % group);
                let at = (tok * hq + h0 + hh) * d;
                out[at..at + d].copy_from_slice(orow);
            }
        }
    }
    Ok(out)
}

/// Row `r` of `s` (rows of `width` scores) becomes `softmax(scale · s[r, a..b])` on its
/// visible keys `range(r) = (a, b)` and zero elsewhere, the row's sink logit `sink(r)` (if
/// any) counted in the softmax and dropped; rows are split over threads when many.
pub(super) fn softmax_rows(
    s: &mut [f32],
    width: usize,
    range: impl Fn(usize) -> (usize, usize) + Sync,
    sink: impl Fn(usize) -> Option<f32> + Sync,
    scale: f32,
) {
    tp_cpu::par_row_groups(s, width, row_groups(s.len()), |first, chunk| {
        softmax_chunk(chunk, width, first, &Rows { range: &range, sink: &sink }, scale)
    });
}

/// Per row of a score matrix: its visible keys and its sink logit.
struct Rows<'a, R, S> {
    range: &'a R,
    sink: &'a S,
}

/// [`softmax_rows`] on the rows of `chunk` (row `i` of it is row `first + i`), its loops compiled
/// for the best vector unit the CPU has, picked at run time.
fn softmax_chunk<R: Fn(usize) -> (usize, usize), S: Fn(usize) -> Option<f32>>(
    chunk: &mut [f32],
    width: usize,
    first: usize,
    range: &Rows<'_, R, S>,
    scale: f32,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX-512F and FMA (checked just above), all `#[target_feature]`
            // adds to this otherwise safe function.
            return unsafe { softmax_chunk_avx512(chunk, width, first, range, scale) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA (checked just above).
            return unsafe { softmax_chunk_avx2(chunk, width, first, range, scale) };
        }
    }
    softmax_chunk_body(chunk, width, first, range, scale)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn softmax_chunk_avx512<R: Fn(usize) -> (usize, usize), S: Fn(usize) -> Option<f32>>(
    chunk: &mut [f32],
    width: usize,
    first: usize,
    range: &Rows<'_, R, S>,
    scale: f32,
) {
    softmax_chunk_body(chunk, width, first, range, scale)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn softmax_chunk_avx2<R: Fn(usize) -> (usize, usize), S: Fn(usize) -> Option<f32>>(
    chunk: &mut [f32],
    width: usize,
    first: usize,
    range: &Rows<'_, R, S>,
    scale: f32,
) {
    softmax_chunk_body(chunk, width, first, range, scale)
}

#[inline(always)]
fn softmax_chunk_body<R: Fn(usize) -> (usize, usize), S: Fn(usize) -> Option<f32>>(
    chunk: &mut [f32],
    width: usize,
    first: usize,
    range: &Rows<'_, R, S>,
    scale: f32,
) {
    for (i, row) in chunk.chunks_exact_mut(width).enumerate() {
        let (a, b) = (range.range)(first + i);
        let sink = (range.sink)(first + i);
        let max = row[a..b].iter().fold(sink.unwrap_or(f32::NEG_INFINITY), |m, &x| m.max(x * scale));
        for x in &mut row[a..b] {
            *x = exp_neg(*x * scale - max);
        }
        let inv = 1.0 / (row[a..b].iter().sum::<f32>() + sink.map_or(0.0, |s| exp_neg(s - max)));
        row[a..b].iter_mut().for_each(|x| *x *= inv);
        row[..a].fill(0.0);
        row[b..].fill(0.0);
    }
}

/// f32 attention on the host, its (token, head) rows spread over tp-cpu's pool when the work
/// pays for it.
fn host_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: (usize, usize, usize, usize),
    spec: &AttentionSpec,
    groups: KvGroups,
) -> Vec<f32> {
    let (t, hq, _, d) = dims;
    let mut out = vec![0f32; t * hq * d];
    if d == 0 {
        return out;
    }
    let work = (t * hq).saturating_mul(spec.kv_len).saturating_mul(d);
    tp_cpu::par_row_groups(&mut out, d, row_groups(work), |first, chunk| {
        attend_rows((q, k, v), dims, spec, groups, first, chunk)
    });
    out
}

/// Output rows `first..first + out.len() / D` (row `r` is token `r / Hq`, head `r % Hq`), with
/// the inner loops compiled for the best vector unit the CPU has (AVX-512, AVX2 + FMA, or the
/// baseline), picked at run time.
fn attend_rows(
    qkv: (&[f32], &[f32], &[f32]),
    dims: (usize, usize, usize, usize),
    spec: &AttentionSpec,
    groups: KvGroups,
    first: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX-512F and FMA (checked just above), all `#[target_feature]`
            // adds to this otherwise safe function.
            return unsafe { attend_rows_avx512(qkv, dims, spec, groups, first, out) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA (checked just above).
            return unsafe { attend_rows_avx2(qkv, dims, spec, groups, first, out) };
        }
    }
    // SAFETY: without FMA the body uses no instruction the CPU may lack.
    unsafe { attend_rows_body::<false>(qkv, dims, spec, groups, first, out) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn attend_rows_avx512(
    qkv: (&[f32], &[f32], &[f32]),
    dims: (usize, usize, usize, usize),
    spec: &AttentionSpec,
    groups: KvGroups,
    first: usize,
    out: &mut [f32],
) {
    let (q, k, v) = qkv;
    let (t, hq, hkv, d) = dims;
    if d == 0 {
        return;
    }
    // The consecutive rows of one token whose query heads share a KV head go through
    // `group_rows` together (as the paged op's rows do).
    let rows = out.len() / d;
    let (mut scores, mut kptr, mut vptr) = (Vec::new(), Vec::new(), Vec::new());
    let mut i = 0;
    while i < rows {
        let r = first + i;
        let (tok, kvh, g) = super::paged_group::gqa_run(r, rows - i, hq, groups);
        let (lo, hi) = spec.key_range(spec.kv_len - t + tok);
        kptr.clear();
        vptr.clear();
        for j in lo..=hi {
            kptr.push(k[(j * hkv + kvh) * d..][..d].as_ptr());
            vptr.push(v[(j * hkv + kvh) * d..][..d].as_ptr());
        }
        // SAFETY: this function's features hold AVX-512F and FMA, which its caller checked;
        // every pointer starts a `d`-float row of `k` or `v` (sliced just above).
        unsafe {
            super::paged_group::group_rows(
                &q[r * d..(r + g) * d],
                d,
                &kptr,
                &vptr,
                (spec.scale, spec.sinks.as_ref().map(|s| &s[r % hq..r % hq + g])),
                &mut scores,
                &mut out[i * d..(i + g) * d],
            );
        }
        i += g;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn attend_rows_avx2(
    qkv: (&[f32], &[f32], &[f32]),
    dims: (usize, usize, usize, usize),
    spec: &AttentionSpec,
    groups: KvGroups,
    first: usize,
    out: &mut [f32],
) {
    // SAFETY: this function's `#[target_feature]` holds AVX2 and FMA, which its caller checked.
    unsafe { attend_rows_body::<true>(qkv, dims, spec, groups, first, out) }
}

/// The portable body; `FMA` fuses the multiply-adds and takes the AVX2 dot product.
///
/// # Safety
/// With `FMA`, the CPU must have AVX2 and FMA.
#[inline(always)]
unsafe fn attend_rows_body<const FMA: bool>(
    (q, k, v): (&[f32], &[f32], &[f32]),
    (t, hq, hkv, d): (usize, usize, usize, usize),
    spec: &AttentionSpec,
    groups: KvGroups,
    first: usize,
    out: &mut [f32],
) {
    let mut scores = Vec::new();
    for (r, y) in (first..).zip(out.chunks_exact_mut(d.max(1))) {
        let (tok, head) = (r / hq, r % hq);
        let kvh = (head + groups.offset) / groups.size;
        let p = spec.kv_len - t + tok;
        let (lo, hi) = spec.key_range(p);
        let qv = &q[r * d..(r + 1) * d];
        scores.clear();
        let sink = spec.sink(head);
        let mut max = sink.unwrap_or(f32::NEG_INFINITY);
        for j in lo..=hi {
            let kj = &k[(j * hkv + kvh) * d..(j * hkv + kvh + 1) * d];
            // SAFETY: `FMA` only where the CPU has AVX2 and FMA (this function's contract).
            let s = unsafe { dot::<FMA>(qv, kj) } * spec.scale;
            max = max.max(s);
            scores.push(s);
        }
        for s in &mut scores {
            *s = exp_neg(*s - max);
        }
        let sum = scores.iter().sum::<f32>() + sink.map_or(0.0, |s| exp_neg(s - max));
        weighted_rows::<FMA>(y, &scores, &v[(lo * hkv + kvh) * d..], hkv * d);
        let inv = 1.0 / sum;
        y.iter_mut().for_each(|a| *a *= inv);
    }
}

/// `e^x` for `x <= 0` (softmax's shifted scores), branch-free so the loop over scores
/// vectorises: Cephes' `expf` (range reduction by `ln 2` in two parts, a degree-6 polynomial on
/// `|r| <= ln 2 / 2`, the power of two put in the exponent bits); within 2 ulp of `f32::exp`.
/// Below `-87` (where `e^x < 2^-125`) the result is `e^-87`, which weighs nothing beside the
/// maximum's 1.
#[inline(always)]
pub(super) fn exp_neg(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer (ties to even) in
    // plain arithmetic, so the loop vectorises (`f32::round` is a libm call on baseline x86_64).
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 0.0);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // 2^n for n in -126..=0: the biased exponent n + 127 in the exponent field.
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

#[cfg(test)]
mod tests {
    #[test]
    fn exp_neg_is_within_two_ulp_of_exp() {
        let mut worst = 0u32;
        for i in 0..=870_000 {
            let x = -(i as f32) * 1e-4;
            let (got, want) = (super::exp_neg(x), x.exp());
            let ulps = got.to_bits().abs_diff(want.to_bits());
            worst = worst.max(ulps);
        }
        assert!(worst <= 2, "worst {worst} ulp");
        assert_eq!(super::exp_neg(0.0), 1.0);
        assert!(super::exp_neg(-1e30) < 1e-37 && super::exp_neg(f32::NEG_INFINITY) < 1e-37);
    }
}
