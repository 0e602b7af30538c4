//! The CUDA side of [`Tensor::paged_attention`] and [`Tensor::write_slots`]
//! (`kernels/paged_attention.cu` through `tp-kernels`' `Gpu::paged_attention` and
//! `Gpu::write_slots`). The kernel computes each (row, head) with `tp_attention_T`'s arithmetic
//! in a fixed key order, so a row's result does not depend on the rest of the batch. Shapes,
//! dtypes and devices are checked here; block tables and slots by the launchers, before upload.

use super::paged::{PagedAttentionSpec, PagedSeq};
use crate::ops::cuda::elem_type;
use crate::storage::{CudaStorage, Storage};
use crate::{AttentionSpec, Error, Result, Tensor};

/// The device storage of `t`, or [`Error::UnsupportedDevice`].
fn cuda_of<'a>(op: &'static str, t: &'a Tensor) -> Result<&'a CudaStorage> {
    match t.storage() {
        Storage::Cuda(s) => Ok(s),
        Storage::Cpu(_) => Err(Error::UnsupportedDevice { op, device: t.device() }),
    }
}

/// `[a, b, c]` of a rank-3 tensor.
fn dims3(op: &'static str, t: &Tensor, what: &'static str) -> Result<[usize; 3]> {
    <[usize; 3]>::try_from(t.dims()).map_err(|_| Error::RankMismatch { op, expected: what, dims: t.dims().to_vec() })
}

/// `[a, b, c, d]` of a rank-4 cache.
fn dims4(op: &'static str, t: &Tensor) -> Result<[usize; 4]> {
    <[usize; 4]>::try_from(t.dims()).map_err(|_| Error::RankMismatch {
        op,
        expected: "4 ([num_blocks, block_size, heads, head_dim])",
        dims: t.dims().to_vec(),
    })
}

/// Paged attention of `q: [T, Hq, D]` over `k_cache, v_cache: [num_blocks, block_size, Hkv, D]`
/// on the GPU (see [`Tensor::paged_attention`]).
pub(crate) fn paged_attention_cuda(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    seqs: &[PagedSeq<'_>],
    spec: &PagedAttentionSpec,
) -> Result<Tensor> {
    const OP: &str = "paged_attention";
    q.require_float()?;
    super::same_dtype_device(OP, q, k_cache)?;
    super::same_dtype_device(OP, q, v_cache)?;
    let [t, hq, d] = dims3(OP, q, "3 ([tokens, heads, head_dim])")?;
    let [num_blocks, block_size, hkv, dk] = dims4(OP, k_cache)?;
    let mismatch = |lhs: &Tensor, rhs: &Tensor, why| Error::ShapeMismatch {
        op: OP,
        lhs: lhs.dims().to_vec(),
        rhs: rhs.dims().to_vec(),
        why,
    };
    if k_cache.dims() != v_cache.dims() {
        return Err(mismatch(k_cache, v_cache, "key and value caches must have one shape"));
    }
    if dk != d {
        return Err(mismatch(q, k_cache, "queries and keys must have one head_dim"));
    }
    let groups = AttentionSpec { kv_len: 0, scale: spec.scale, sliding_window: None, kv_groups: spec.kv_groups }
        .groups(hq, hkv)
        .ok_or_else(|| {
            mismatch(
                q,
                k_cache,
                "each query head needs a KV head: Hkv must divide Hq, or kv_groups must map every query head to one",
            )
        })?;
    if spec.sliding_window == Some(0) || !spec.scale.is_finite() || block_size == 0 {
        return Err(Error::InvalidArgument {
            op: OP,
            why: "the window must be >= 1, the scale finite and blocks at least one position long".into(),
        });
    }
    let (qs, ks, vs) = (cuda_of(OP, q)?, cuda_of(OP, k_cache)?, cuda_of(OP, v_cache)?);
    let shape = tp_kernels::PagedShape {
        tokens: t,
        q_heads: hq,
        kv_heads: hkv,
        group: groups.size,
        group_offset: groups.offset,
        head_dim: d,
        num_blocks,
        block_size,
        scale: spec.scale,
        window: spec.sliding_window,
    };
    let rows: Vec<tp_kernels::PagedSequence<'_>> = seqs
        .iter()
        .map(|s| tp_kernels::PagedSequence { q_start: s.q_start, q_len: s.q_len, kv_len: s.kv_len, blocks: s.blocks })
        .collect();
    let bytes = t * hq * d * q.dtype().size_in_bytes();
    let mut buf = qs.gpu.alloc(bytes)?;
    qs.gpu.paged_attention(&mut buf, &qs.buf, &ks.buf, &vs.buf, shape, &rows, elem_type(q.dtype()))?;
    Ok(Tensor::from_cuda(q.shape().clone(), CudaStorage::new(buf, bytes, q.dtype(), qs.gpu.clone())))
}

/// Writes `src: [T, H, D]` row `t` into slot `slots[t]` of `cache: [num_blocks, block_size, H,
/// D]` on the GPU, in place (see [`Tensor::write_slots`]).
pub(crate) fn write_slots_cuda(cache: &mut Tensor, src: &Tensor, slots: &[usize]) -> Result<()> {
    const OP: &str = "write_slots";
    super::same_dtype_device(OP, cache, src)?;
    let [num_blocks, block_size, h, d] = dims4(OP, cache)?;
    let [t, hs, ds] = dims3(OP, src, "3 ([tokens, heads, head_dim])")?;
    if (hs, ds) != (h, d) {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: cache.dims().to_vec(),
            rhs: src.dims().to_vec(),
            why: "rows must have the cache's heads and head_dim",
        });
    }
    if t != slots.len() {
        return Err(Error::InvalidArgument { op: OP, why: format!("{t} rows but {} slots", slots.len()) });
    }
    let num_slots = num_blocks * block_size;
    if let Some(&bad) = slots.iter().find(|&&s| s >= num_slots) {
        return Err(Error::InvalidArgument {
            op: OP,
            why: format!("slot {bad} is past the cache's {num_slots} ({num_blocks} blocks of {block_size})"),
        });
    }
    let row_bytes = h * d * cache.dtype().size_in_bytes();
    let from = cuda_of(OP, src)?.clone();
    let dst = cache.cuda_storage_mut(OP)?;
    if from.gpu.ordinal() != dst.gpu.ordinal() {
        return Err(Error::DeviceMismatch { op: OP, lhs: dst.device(), rhs: from.device() });
    }
    let gpu = dst.gpu.clone();
    gpu.write_slots(dst.unique_buf()?, &from.buf, slots, row_bytes, num_slots)?;
    Ok(())
}
