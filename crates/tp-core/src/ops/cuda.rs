//! The CUDA versions of the ops, on `tp-kernels`' launchers. Called by the op functions when
//! their operands are on a GPU; inputs are validated there, before anything runs here.

use crate::storage::CudaStorage;
use crate::{DType, Error, Result, WeightLayout};
use tp_kernels::{ElemType, GemmArgs, GemmShape, RowCopy};

pub(crate) fn elem_type(d: DType) -> ElemType {
    match d {
        DType::F32 => ElemType::F32,
        DType::F16 => ElemType::F16,
        DType::BF16 => ElemType::BF16,
        DType::I32 => ElemType::I32,
        DType::I64 => ElemType::I64,
    }
}

fn alloc_like(
    s: &CudaStorage,
    bytes: usize,
    dtype: DType,
) -> Result<(tp_kernels::cudarc::driver::CudaSlice<u8>, CudaStorageParts)> {
    Ok((s.gpu.alloc(bytes)?, CudaStorageParts { len: bytes, dtype, gpu: s.gpu.clone() }))
}

/// What a new storage needs besides its buffer.
pub(crate) struct CudaStorageParts {
    len: usize,
    dtype: DType,
    gpu: std::sync::Arc<tp_kernels::Gpu>,
}

impl CudaStorageParts {
    fn finish(self, buf: tp_kernels::cudarc::driver::CudaSlice<u8>) -> CudaStorage {
        CudaStorage::new(buf, self.len, self.dtype, self.gpu)
    }
}

/// `narrow`: rows `start..start+len` of each of `outer` blocks of `size` rows of `inner` elements.
pub(crate) fn narrow(
    s: &CudaStorage,
    (outer, size, inner): (usize, usize, usize),
    start: usize,
    len: usize,
) -> Result<CudaStorage> {
    let eb = s.dtype.size_in_bytes();
    let row_bytes = len * inner * eb;
    let (mut buf, parts) = alloc_like(s, outer * row_bytes, s.dtype)?;
    let copy = RowCopy {
        rows: outer,
        row_bytes,
        src_pitch: size * inner * eb,
        src_off: start * inner * eb,
        dst_pitch: row_bytes,
        dst_off: 0,
    };
    s.gpu.row_copy(&mut buf, &s.buf, copy)?;
    Ok(parts.finish(buf))
}

/// `cat`: each part, `outer` blocks of `len_i * inner` elements, into its slot of the output.
pub(crate) fn cat(parts: &[(&CudaStorage, usize)], outer: usize, inner: usize, total: usize) -> Result<CudaStorage> {
    let first = parts.first().ok_or(Error::CatEmpty)?.0;
    let eb = first.dtype.size_in_bytes();
    let (mut buf, out) = alloc_like(first, outer * total * inner * eb, first.dtype)?;
    let mut offset = 0;
    for &(s, len) in parts {
        if s.gpu.ordinal() != first.gpu.ordinal() {
            return Err(Error::DeviceMismatch { op: "cat", lhs: first.device(), rhs: s.device() });
        }
        let row_bytes = len * inner * eb;
        let copy = RowCopy {
            rows: outer,
            row_bytes,
            src_pitch: row_bytes,
            src_off: 0,
            dst_pitch: total * inner * eb,
            dst_off: offset * inner * eb,
        };
        first.gpu.row_copy(&mut buf, &s.buf, copy)?;
        offset += len;
    }
    Ok(out.finish(buf))
}

/// Dtype conversion of `numel` elements.
pub(crate) fn cast(s: &CudaStorage, numel: usize, to: DType) -> Result<CudaStorage> {
    let (mut buf, parts) = alloc_like(s, numel * to.size_in_bytes(), to)?;
    s.gpu.cast(&mut buf, &s.buf, numel, elem_type(s.dtype), elem_type(to))?;
    Ok(parts.finish(buf))
}

/// `act(gate) * up` over `rows` rows of `[gate | up]`, `inner` each.
pub(crate) fn glu(s: &CudaStorage, rows: usize, inner: usize, act: crate::Activation) -> Result<CudaStorage> {
    let (mut buf, parts) = alloc_like(s, rows * inner * s.dtype.size_in_bytes(), s.dtype)?;
    s.gpu.glu(&mut buf, &s.buf, (rows, inner), act.code(), elem_type(s.dtype))?;
    Ok(parts.finish(buf))
}

/// `round(x · round(s))` over `n` elements.
pub(crate) fn scale(x: &CudaStorage, n: usize, s: f32) -> Result<CudaStorage> {
    let (mut buf, parts) = alloc_like(x, n * x.dtype.size_in_bytes(), x.dtype)?;
    x.gpu.scale(&mut buf, &x.buf, n, s, elem_type(x.dtype))?;
    Ok(parts.finish(buf))
}

/// Soft-capping at `cap` over `n` elements.
pub(crate) fn softcap(x: &CudaStorage, n: usize, cap: f32) -> Result<CudaStorage> {
    let (mut buf, parts) = alloc_like(x, n * x.dtype.size_in_bytes(), x.dtype)?;
    x.gpu.softcap(&mut buf, &x.buf, n, cap, elem_type(x.dtype))?;
    Ok(parts.finish(buf))
}

/// Per-row sums of squares (f32) of `rows` rows of `h`.
pub(crate) fn sum_squares(x: &CudaStorage, rows: usize, h: usize) -> Result<CudaStorage> {
    let (mut buf, parts) = alloc_like(x, rows * 4, DType::F32)?;
    x.gpu.sum_squares(&mut buf, &x.buf, (rows, h), elem_type(x.dtype))?;
    Ok(parts.finish(buf))
}

/// `x + bias` over `rows` rows of `cols`.
pub(crate) fn add_row(x: &CudaStorage, bias: &CudaStorage, rows: usize, cols: usize) -> Result<CudaStorage> {
    if bias.gpu.ordinal() != x.gpu.ordinal() {
        return Err(Error::DeviceMismatch { op: "add_row", lhs: x.device(), rhs: bias.device() });
    }
    let (mut buf, parts) = alloc_like(x, rows * cols * x.dtype.size_in_bytes(), x.dtype)?;
    x.gpu.add_row(&mut buf, &x.buf, &bias.buf, rows, cols, elem_type(x.dtype))?;
    Ok(parts.finish(buf))
}

/// The rank-major all-gather buffer `(world, rows, cols_r)` interleaved to `(rows, cols)`.
pub(crate) fn interleave(s: &CudaStorage, rows: usize, cols: usize, world: usize) -> Result<CudaStorage> {
    let eb = s.dtype.size_in_bytes();
    let (mut buf, parts) = alloc_like(s, rows * cols * eb, s.dtype)?;
    s.gpu.gather_interleave(&mut buf, &s.buf, rows, cols, world, eb)?;
    Ok(parts.finish(buf))
}

/// `y = x op(W) + b` with `x: m×k`, `W` in `layout` (`n×k` or `k×n`), `y: m×n`, all of one
/// dtype, on one device.
///
/// The `[N, K]` layout goes to `Gpu::gemm_nt` (decode kernel for M <= 8, SIMT for f32,
/// tensor cores for f16/bf16). `[K, N]`: f32 runs SIMT; f16/bf16 widen to f32, run SIMT and round
/// back once, the same single rounding but slower (checkpoints use `[N, K]`).
pub(crate) fn matmul(
    x: &CudaStorage,
    w: &CudaStorage,
    bias: Option<&CudaStorage>,
    shape: GemmShape,
    layout: WeightLayout,
) -> Result<CudaStorage> {
    let GemmShape { m, n, k } = shape;
    for other in std::iter::once(w).chain(bias) {
        if other.gpu.ordinal() != x.gpu.ordinal() {
            return Err(Error::DeviceMismatch { op: "matmul", lhs: x.device(), rhs: other.device() });
        }
    }
    let gpu = &x.gpu;
    let dtype = x.dtype;
    match (dtype, layout) {
        (_, WeightLayout::Nk) => {
            // Decode shapes, SIMT f32 or tensor cores: tp-kernels picks per shape and device.
            let (mut buf, parts) = alloc_like(x, m * n * dtype.size_in_bytes(), dtype)?;
            let bias = bias.map(|b| &*b.buf);
            gpu.gemm_nt(GemmArgs { c: &mut buf, a: &x.buf, b: &w.buf, bias, shape, ty: elem_type(dtype) })?;
            Ok(parts.finish(buf))
        }
        (DType::F32, WeightLayout::Kn) => {
            let (mut buf, parts) = alloc_like(x, m * n * 4, dtype)?;
            let bias = bias.map(|b| &*b.buf);
            gpu.gemm_simt_f32(GemmArgs { c: &mut buf, a: &x.buf, b: &w.buf, bias, shape, ty: ElemType::F32 }, false)?;
            Ok(parts.finish(buf))
        }
        (_, WeightLayout::Kn) => {
            let xf = cast(x, m * k, DType::F32)?;
            let wf = cast(w, k * n, DType::F32)?;
            let bf = bias.map(|b| cast(b, n, DType::F32)).transpose()?;
            let yf = matmul(&xf, &wf, bf.as_ref(), shape, layout)?;
            cast(&yf, m * n, dtype)
        }
    }
}

/// `x += y` in place over `n` elements.
pub(crate) fn add_assign(x: &mut CudaStorage, y: &CudaStorage, n: usize) -> Result<()> {
    if y.gpu.ordinal() != x.gpu.ordinal() {
        return Err(Error::DeviceMismatch { op: "add", lhs: x.device(), rhs: y.device() });
    }
    let (gpu, ty) = (x.gpu.clone(), elem_type(x.dtype));
    gpu.add_inplace(x.unique_buf()?, &y.buf, n, ty)?;
    Ok(())
}

/// RMSNorm of `rows` rows of `h` in `style`, with the sums of squares over `n` features given
/// or not.
pub(crate) fn rms_norm(
    x: &CudaStorage,
    w: &CudaStorage,
    rows: usize,
    h: usize,
    eps: f32,
    style: crate::NormStyle,
    stats: Option<(&CudaStorage, usize)>,
) -> Result<CudaStorage> {
    same_gpu("rms_norm", x, w)?;
    if let Some((s, _)) = stats {
        same_gpu("rms_norm", x, s)?;
    }
    let (mut buf, parts) = alloc_like(x, rows * h * x.dtype.size_in_bytes(), x.dtype)?;
    let stats = stats.map(|(s, n)| (&*s.buf, n));
    x.gpu.rms_norm(&mut buf, &x.buf, &w.buf, (rows, h), eps, style.code(), stats, elem_type(x.dtype))?;
    Ok(parts.finish(buf))
}

/// RoPE of `x: [tokens, heads, d]` at `positions` with this call's frequencies `inv_freq`
/// (uploaded per call: dynamic scaling recomputes them), cos and sin multiplied by
/// `attention_scaling` in f32.
pub(crate) fn rope(
    x: &CudaStorage,
    positions: &[usize],
    inv_freq: &[f32],
    attention_scaling: f32,
    (t, h, d): (usize, usize, usize),
) -> Result<CudaStorage> {
    let pos: Vec<i64> = positions.iter().map(|&p| i64::try_from(p).unwrap_or(i64::MAX)).collect();
    let pos = x.gpu.htod(bytemuck::cast_slice(&pos))?;
    let freq = x.gpu.htod(bytemuck::cast_slice(inv_freq))?;
    let (mut buf, parts) = alloc_like(x, t * h * d * x.dtype.size_in_bytes(), x.dtype)?;
    x.gpu.rope(&mut buf, &x.buf, &pos, &freq, attention_scaling, (t, h, inv_freq.len(), d), elem_type(x.dtype))?;
    Ok(parts.finish(buf))
}

/// Attention of `q: [t, hq, d]` over the first `spec.kv_len` rows of `k, v: [.., hkv, d]`,
/// query head `h` using KV head `(h + groups.offset) / groups.size`.
pub(crate) fn attention(
    q: &CudaStorage,
    k: &CudaStorage,
    v: &CudaStorage,
    (t, hq, hkv, d): (usize, usize, usize, usize),
    spec: &crate::AttentionSpec,
    groups: crate::KvGroups,
) -> Result<CudaStorage> {
    same_gpu("attention", q, k)?;
    same_gpu("attention", q, v)?;
    let shape = tp_kernels::AttentionShape {
        tokens: t,
        q_heads: hq,
        kv_heads: hkv,
        group: groups.size,
        group_offset: groups.offset,
        head_dim: d,
        kv_len: spec.kv_len,
        scale: spec.scale,
        window: spec.sliding_window,
    };
    let (mut buf, parts) = alloc_like(q, t * hq * d * q.dtype.size_in_bytes(), q.dtype)?;
    q.gpu.attention(&mut buf, &q.buf, &k.buf, &v.buf, shape, elem_type(q.dtype))?;
    Ok(parts.finish(buf))
}

/// Embedding rows of `table: [rows, h]` for `n` ids.
pub(crate) fn embedding(
    table: &CudaStorage,
    ids: &CudaStorage,
    n: usize,
    (rows, h): (usize, usize),
    offset: i64,
) -> Result<CudaStorage> {
    same_gpu("embedding", table, ids)?;
    let (mut buf, parts) = alloc_like(table, n * h * table.dtype.size_in_bytes(), table.dtype)?;
    let (ty, id_ty) = (elem_type(table.dtype), elem_type(ids.dtype));
    table.gpu.embedding(&mut buf, &table.buf, &ids.buf, n, (rows, h), offset, ty, id_ty)?;
    Ok(parts.finish(buf))
}

/// Row maxima (f32) and their first indices (i64) of `x: [rows, n]`.
pub(crate) fn max_with_index(x: &CudaStorage, rows: usize, n: usize) -> Result<(CudaStorage, CudaStorage)> {
    let (mut vals, vparts) = alloc_like(x, rows * 4, DType::F32)?;
    let (mut idx, iparts) = alloc_like(x, rows * 8, DType::I64)?;
    x.gpu.max_index(&mut vals, &mut idx, &x.buf, (rows, n), elem_type(x.dtype))?;
    Ok((vparts.finish(vals), iparts.finish(idx)))
}

/// Writes `src` (`outer` blocks of `len * inner` elements) into rows `start..start + len` of
/// each block of `dst` (`outer` blocks of `size * inner`), in place.
pub(crate) fn slice_set(
    dst: &mut CudaStorage,
    src: &CudaStorage,
    (outer, size, inner): (usize, usize, usize),
    start: usize,
    len: usize,
) -> Result<()> {
    if src.gpu.ordinal() != dst.gpu.ordinal() {
        return Err(Error::DeviceMismatch { op: "slice_set", lhs: dst.device(), rhs: src.device() });
    }
    let eb = dst.dtype.size_in_bytes();
    let row_bytes = len * inner * eb;
    let copy = RowCopy {
        rows: outer,
        row_bytes,
        src_pitch: row_bytes,
        src_off: 0,
        dst_pitch: size * inner * eb,
        dst_off: start * inner * eb,
    };
    let gpu = dst.gpu.clone();
    gpu.row_copy(dst.unique_buf()?, &src.buf, copy)?;
    Ok(())
}

fn same_gpu(op: &'static str, a: &CudaStorage, b: &CudaStorage) -> Result<()> {
    if a.gpu.ordinal() != b.gpu.ordinal() {
        return Err(Error::DeviceMismatch { op, lhs: a.device(), rhs: b.device() });
    }
    Ok(())
}
