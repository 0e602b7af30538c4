//! Causal scaled-dot-product attention with grouped-query heads, for a prefill of `T` tokens or
//! a decode step, against keys and values held in a cache.
//!
//! `q: [T, Hq, D]`, `k, v: [C, Hkv, D]` with `Hkv | Hq`: query head `h` attends with KV head
//! `h / (Hq / Hkv)` (grouped-query attention; `Hkv = Hq` is multi-head, `Hkv = 1` multi-query).
//! The first `L = kv_len` rows of the cache are valid and the `T` queries are its last `T`
//! tokens, so query `t` sits at position `p = L - T + t` and sees keys `j <= p` (and, with a
//! sliding window `W`, only `j > p - W`, as Mistral's mask). With scores
//! `s_j = scale · q·k_j`, the output is `Σ_j softmax(s)_j v_j`; scores, softmax and the weighted
//! sum are computed in f32 and the output rounded once to the dtype (PyTorch's SDPA does the
//! same on its fused paths).

use crate::storage::{CpuStorage, Storage};
use crate::{Element, Error, Result, Tensor, with_dtype};

/// Which keys the queries see, and the score scale, for [`Tensor::attention`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionSpec {
    /// Valid rows of the key/value cache; the queries are its last `T`.
    pub kv_len: usize,
    /// Factor on `q·k` (usually `1/sqrt(D)`).
    pub scale: f32,
    /// At most this many most recent keys per query (Mistral's `sliding_window`); `None` for
    /// plain causal attention.
    pub sliding_window: Option<usize>,
}

impl AttentionSpec {
    /// Plain causal attention over `kv_len` cached tokens with scale `1/sqrt(head_dim)`.
    pub fn causal(kv_len: usize, head_dim: usize) -> AttentionSpec {
        AttentionSpec { kv_len, scale: 1.0 / (head_dim.max(1) as f32).sqrt(), sliding_window: None }
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
const PARALLEL_MIN_WORK: usize = 1 << 18;

impl Tensor {
    /// Attention of the queries `self: [T, Hq, D]` over the cache `k, v: [C, Hkv, D]` (see the
    /// module docs). Returns `[T, Hq, D]` in the dtype of `self`.
    ///
    /// Errors: [`Error::RankMismatch`], [`Error::ShapeMismatch`] (head dims, `Hkv ∤ Hq`, `k`
    /// and `v` differing), dtype/device mismatches, [`Error::InvalidArgument`] when `kv_len`
    /// exceeds `C` or is smaller than `T`, or the window is 0; [`Error::NotFloat`].
    pub fn attention(&self, k: &Tensor, v: &Tensor, spec: &AttentionSpec) -> Result<Tensor> {
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
        if hkv == 0 || hq % hkv != 0 {
            return Err(mismatch("the KV heads must divide the query heads"));
        }
        if spec.kv_len > c || spec.kv_len < t {
            return Err(Error::InvalidArgument {
                op: OP,
                why: format!("kv_len {} must lie between the {t} queries and the cache's {c} rows", spec.kv_len),
            });
        }
        if spec.sliding_window == Some(0) || !spec.scale.is_finite() {
            return Err(Error::InvalidArgument { op: OP, why: "the window must be >= 1 and the scale finite".into() });
        }
        let dims = (t, hq, hkv, d);
        if let (Storage::Cuda(qs), Storage::Cuda(ks), Storage::Cuda(vs)) = (self.storage(), k.storage(), v.storage()) {
            return Ok(Tensor::from_cuda(self.shape().clone(), super::cuda::attention(qs, ks, vs, dims, spec)?));
        }
        let (qs, ks, vs) = (self.cpu_storage(OP)?, k.cpu_storage(OP)?, v.cpu_storage(OP)?);
        let out = with_dtype!(qs.dtype(), T => {
            let valid = spec.kv_len * hkv * d;
            let (q, k, v) = (widen::<T>(qs.as_slice::<T>().unwrap_or_default()),
                widen::<T>(&ks.as_slice::<T>().unwrap_or_default()[..valid]),
                widen::<T>(&vs.as_slice::<T>().unwrap_or_default()[..valid]));
            let y = host_attention(&q, &k, &v, dims, spec);
            CpuStorage::from_vec(y.iter().map(|&x| T::from_f32(x)).collect::<Vec<T>>())
        });
        Ok(Tensor::from_cpu(self.shape().clone(), out))
    }
}

fn widen<T: Element>(s: &[T]) -> Vec<f32> {
    let mut v = vec![0f32; s.len()];
    T::slice_to_f32(s, &mut v);
    v
}

/// f32 attention on the host, threaded over (token, head) rows when the work pays for it.
fn host_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: (usize, usize, usize, usize),
    spec: &AttentionSpec,
) -> Vec<f32> {
    let (t, hq, _, d) = dims;
    let mut out = vec![0f32; t * hq * d];
    let rows = t * hq;
    let work = rows.saturating_mul(spec.kv_len).saturating_mul(d);
    let threads = if work < PARALLEL_MIN_WORK { 1 } else { crate::cpu_gemm::num_threads().min(rows).max(1) };
    if threads <= 1 || d == 0 {
        attend_rows(q, k, v, dims, spec, 0, &mut out);
        return out;
    }
    let per = rows.div_ceil(threads);
    std::thread::scope(|s| {
        for (i, chunk) in out.chunks_mut(per * d).enumerate() {
            s.spawn(move || attend_rows(q, k, v, dims, spec, i * per, chunk));
        }
    });
    out
}

/// Output rows `first..first + out.len() / D` (row `r` is token `r / Hq`, head `r % Hq`).
fn attend_rows(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    (t, hq, hkv, d): (usize, usize, usize, usize),
    spec: &AttentionSpec,
    first: usize,
    out: &mut [f32],
) {
    let group = hq / hkv;
    let mut scores = Vec::new();
    for (r, y) in (first..).zip(out.chunks_exact_mut(d.max(1))) {
        let (tok, head) = (r / hq, r % hq);
        let kvh = head / group;
        let p = spec.kv_len - t + tok;
        let (lo, hi) = spec.key_range(p);
        let qv = &q[r * d..(r + 1) * d];
        scores.clear();
        let mut max = f32::NEG_INFINITY;
        for j in lo..=hi {
            let kj = &k[(j * hkv + kvh) * d..(j * hkv + kvh + 1) * d];
            let s = dot(qv, kj) * spec.scale;
            max = max.max(s);
            scores.push(s);
        }
        let mut sum = 0f32;
        for s in &mut scores {
            *s = (*s - max).exp();
            sum += *s;
        }
        y.fill(0.0);
        for (j, &w) in (lo..=hi).zip(&scores) {
            let vj = &v[(j * hkv + kvh) * d..(j * hkv + kvh + 1) * d];
            for (a, b) in y.iter_mut().zip(vj) {
                *a += w * b;
            }
        }
        let inv = 1.0 / sum;
        y.iter_mut().for_each(|a| *a *= inv);
    }
}

/// `Σ a_i b_i` in f32 with eight independent partial sums.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}
