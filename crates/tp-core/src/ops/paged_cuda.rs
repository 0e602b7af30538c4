//! The CUDA side of [`Tensor::paged_attention`] and [`Tensor::write_slots`]
//! (`kernels/paged_attention.cu` through `tp-kernels`' `Gpu::paged_attention` and
//! `Gpu::write_slots`). The kernel computes each (row, head) with `tp_attention_T`'s arithmetic
//! in a fixed key order, so a row's result does not depend on the rest of the batch. Shapes,
//! dtypes, devices, block tables and slots are checked by the shared entry points in `paged.rs`
//! (and block tables and slots again by the launchers, whose launches rely on them).

use super::paged::{Geometry, PagedAttentionSpec, PagedSeq};
use crate::ops::cuda::elem_type;
use crate::storage::{CudaStorage, Storage};
use crate::{Error, Result, Tensor};

/// The device storage of `t`, or [`Error::UnsupportedDevice`].
fn cuda_of<'a>(op: &'static str, t: &'a Tensor) -> Result<&'a CudaStorage> {
    match t.storage() {
        Storage::Cuda(s) => Ok(s),
        Storage::Cpu(_) => Err(Error::UnsupportedDevice { op, device: t.device() }),
    }
}

/// Paged attention of `q: [T, Hq, D]` over `k_cache, v_cache: [num_blocks, block_size, Hkv, D]`
/// on the GPU (see [`Tensor::paged_attention`], which checked the arguments and made `geo`).
pub(crate) fn paged_attention_cuda(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    seqs: &[PagedSeq<'_>],
    spec: &PagedAttentionSpec,
    geo: Geometry,
) -> Result<Tensor> {
    const OP: &str = "paged_attention";
    let Geometry { hq, hkv, d, block_size, groups } = geo;
    let (t, num_blocks) = (q.dims()[0], k_cache.dims()[0]);
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
    let sinks = super::cuda::sinks_on(&qs.gpu, spec.sinks.as_deref())?;
    let mut buf = qs.gpu.alloc(bytes)?;
    qs.gpu.paged_attention(&mut buf, &qs.buf, &ks.buf, &vs.buf, shape, &rows, sinks.as_ref(), elem_type(q.dtype()))?;
    Ok(Tensor::from_cuda(q.shape().clone(), CudaStorage::new(buf, bytes, q.dtype(), qs.gpu.clone())))
}

/// Writes `src: [T, H, D]` row `t` into slot `slots[t]` of `cache: [num_blocks, block_size, H,
/// D]` (`dims`) on the GPU, in place (see [`Tensor::write_slots`], which checked the shapes and
/// slots).
pub(crate) fn write_slots_cuda(cache: &mut Tensor, src: &Tensor, slots: &[usize], dims: [usize; 4]) -> Result<()> {
    const OP: &str = "write_slots";
    let [num_blocks, block_size, h, d] = dims;
    let num_slots = num_blocks * block_size;
    let row_bytes = h * d * cache.dtype().size_in_bytes();
    let from = cuda_of(OP, src)?.clone();
    let dst = cache.cuda_storage_mut(OP)?;
    let gpu = dst.gpu.clone();
    gpu.write_slots(dst.unique_buf()?, &from.buf, slots, row_bytes, num_slots)?;
    Ok(())
}
