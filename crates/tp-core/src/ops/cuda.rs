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
pub(crate) fn glu(s: &CudaStorage, rows: usize, inner: usize, act: (i32, f32, f32)) -> Result<CudaStorage> {
    let (mut buf, parts) = alloc_like(s, rows * inner * s.dtype.size_in_bytes(), s.dtype)?;
    s.gpu.glu(&mut buf, &s.buf, (rows, inner), act, elem_type(s.dtype))?;
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
/// tensor cores for f16/bf16); `[K, N]` (a data gradient `dY W`) to `Gpu::gemm_nn` (SIMT for
/// f32, the mma.sync kernel's `kn` layout for f16/bf16: f32 accumulation, one rounding).
pub(crate) fn matmul(
    x: &CudaStorage,
    w: &CudaStorage,
    bias: Option<&CudaStorage>,
    shape: GemmShape,
    layout: WeightLayout,
) -> Result<CudaStorage> {
    let GemmShape { m, n, .. } = shape;
    for other in std::iter::once(w).chain(bias) {
        if other.gpu.ordinal() != x.gpu.ordinal() {
            return Err(Error::DeviceMismatch { op: "matmul", lhs: x.device(), rhs: other.device() });
        }
    }
    let gpu = &x.gpu;
    let dtype = x.dtype;
    let (mut buf, parts) = alloc_like(x, m * n * dtype.size_in_bytes(), dtype)?;
    let args = GemmArgs { c: &mut buf, a: &x.buf, b: &w.buf, bias: bias.map(|b| &*b.buf), shape, ty: elem_type(dtype) };
    match layout {
        // Decode shapes, SIMT f32 or tensor cores: tp-kernels picks per shape and device.
        WeightLayout::Nk => gpu.gemm_nt(args)?,
        WeightLayout::Kn => gpu.gemm_nn(args)?,
    }
    Ok(parts.finish(buf))
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
    let sinks = sinks_on(&q.gpu, spec.sinks.as_deref())?;
    let (mut buf, parts) = alloc_like(q, t * hq * d * q.dtype.size_in_bytes(), q.dtype)?;
    q.gpu.attention(&mut buf, &q.buf, &k.buf, &v.buf, shape, sinks.as_ref(), elem_type(q.dtype))?;
    Ok(parts.finish(buf))
}

/// Attention-sink logits (f32) copied to `gpu`, if the call has them.
pub(crate) fn sinks_on(
    gpu: &tp_kernels::Gpu,
    sinks: Option<&[f32]>,
) -> Result<Option<tp_kernels::cudarc::driver::CudaSlice<u8>>> {
    Ok(match sinks {
        Some(s) => Some(gpu.htod(bytemuck::cast_slice(s))?),
        None => None,
    })
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

// ---- Training: backward ops, cross-entropy pieces, gradient GEMMs, AdamW (results in f32) ----

/// The operands (`(storage, elements)`) in one element type, on one GPU: as they are when they
/// share a dtype, else each widened to f32 on the device (exact), so one kernel type `T` covers
/// them all.
fn unify<const N: usize>(op: &'static str, xs: [(&CudaStorage, usize); N]) -> Result<([CudaStorage; N], DType)> {
    let first = xs[0].0;
    for (s, _) in &xs[1..] {
        same_gpu(op, first, s)?;
    }
    let dtype = if xs.iter().all(|(s, _)| s.dtype == first.dtype) { first.dtype } else { DType::F32 };
    let mut out = Vec::with_capacity(N);
    for (s, n) in xs {
        out.push(if s.dtype == dtype { s.clone() } else { cast(s, n, dtype)? });
    }
    let out: [CudaStorage; N] =
        out.try_into().map_err(|_| Error::InvalidArgument { op, why: "operand count".into() })?;
    Ok((out, dtype))
}

/// `s` as `n` f32 on `like`'s GPU (a cast when it is another float dtype).
fn f32_on(op: &'static str, like: &CudaStorage, s: &CudaStorage, n: usize) -> Result<CudaStorage> {
    same_gpu(op, like, s)?;
    if s.dtype == DType::F32 { Ok(s.clone()) } else { cast(s, n, DType::F32) }
}

/// Each row's `Σ_j (dy ⊙ w')[r, j] · x[r, j]` (f32) over `rows` rows of `h`.
pub(crate) fn rms_norm_grad_dot(
    x: &CudaStorage,
    w: &CudaStorage,
    dy: &CudaStorage,
    (rows, h): (usize, usize),
    style: crate::NormStyle,
) -> Result<CudaStorage> {
    let ([x, w, dy], dtype) = unify("rms_norm_grad_dot", [(x, rows * h), (w, h), (dy, rows * h)])?;
    let (mut buf, parts) = alloc_like(&x, rows * 4, DType::F32)?;
    x.gpu.rms_norm_grad_dot(&mut buf, &x.buf, &w.buf, &dy.buf, (rows, h), style.code(), elem_type(dtype))?;
    Ok(parts.finish(buf))
}

/// RMSNorm's `(dx: rows x h, dw: h)` in f32; `split`: the forward's sums of squares over `n`
/// features and the summed dots (`rows` each) of a norm split over ranks.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rms_norm_backward(
    x: &CudaStorage,
    w: &CudaStorage,
    dy: &CudaStorage,
    (rows, h): (usize, usize),
    eps: f32,
    style: crate::NormStyle,
    split: Option<(&CudaStorage, usize, &CudaStorage)>,
) -> Result<(CudaStorage, CudaStorage)> {
    const OP: &str = "rms_norm_backward";
    let ([x, w, dy], dtype) = unify(OP, [(x, rows * h), (w, h), (dy, rows * h)])?;
    let split = split.map(|(ss, n, dot)| Ok::<_, Error>((f32_on(OP, &x, ss, rows)?, n, f32_on(OP, &x, dot, rows)?)));
    let split = split.transpose()?;
    let ty = elem_type(dtype);
    let gpu = &x.gpu;
    let (mut dx, dx_parts) = alloc_like(&x, rows * h * 4, DType::F32)?;
    let mut rstd = gpu.alloc(rows * 4)?;
    let stats = split.as_ref().map(|(ss, n, dot)| tp_kernels::NormSplit { sum_sq: &ss.buf, n: *n, dot: &dot.buf });
    gpu.rms_norm_backward(&mut dx, &mut rstd, &x.buf, &w.buf, &dy.buf, (rows, h), eps, style.code(), stats, ty)?;
    let (mut dw, dw_parts) = alloc_like(&x, h * 4, DType::F32)?;
    gpu.col_sum(&mut dw, &dy.buf, Some((&*x.buf, &rstd)), (rows, h), ty)?;
    Ok((dx_parts.finish(dx), dw_parts.finish(dw)))
}

/// The column sums (f32) of `rows` rows of `cols`.
pub(crate) fn sum_rows(x: &CudaStorage, rows: usize, cols: usize) -> Result<CudaStorage> {
    let (mut buf, parts) = alloc_like(x, cols * 4, DType::F32)?;
    x.gpu.col_sum(&mut buf, &x.buf, None, (rows, cols), elem_type(x.dtype))?;
    Ok(parts.finish(buf))
}

/// `[cols, rows]` f32, the transpose of `x: [rows, cols]`.
pub(crate) fn transpose2d(x: &CudaStorage, rows: usize, cols: usize) -> Result<CudaStorage> {
    let (mut buf, parts) = alloc_like(x, rows * cols * 4, DType::F32)?;
    x.gpu.transpose(&mut buf, &x.buf, (rows, cols), elem_type(x.dtype))?;
    Ok(parts.finish(buf))
}

/// RoPE's input gradient (f32) of `dy: [tokens, heads, d]`, as [`rope`]'s arguments.
pub(crate) fn rope_backward(
    dy: &CudaStorage,
    positions: &[usize],
    inv_freq: &[f32],
    attention_scaling: f32,
    (t, h, d): (usize, usize, usize),
) -> Result<CudaStorage> {
    let pos: Vec<i64> = positions.iter().map(|&p| i64::try_from(p).unwrap_or(i64::MAX)).collect();
    let pos = dy.gpu.htod(bytemuck::cast_slice(&pos))?;
    let freq = dy.gpu.htod(bytemuck::cast_slice(inv_freq))?;
    let (mut buf, parts) = alloc_like(dy, t * h * d * 4, DType::F32)?;
    let shape = (t, h, inv_freq.len(), d);
    dy.gpu.rope_backward(&mut buf, &dy.buf, &pos, &freq, attention_scaling, shape, elem_type(dy.dtype))?;
    Ok(parts.finish(buf))
}

/// The gated activation's input gradient `[rows, 2 inner]` (f32).
pub(crate) fn glu_backward(
    x: &CudaStorage,
    dy: &CudaStorage,
    rows: usize,
    inner: usize,
    act: (i32, f32, f32),
) -> Result<CudaStorage> {
    let ([x, dy], dtype) = unify("glu_backward", [(x, rows * 2 * inner), (dy, rows * inner)])?;
    let (mut buf, parts) = alloc_like(&x, rows * 2 * inner * 4, DType::F32)?;
    x.gpu.glu_backward(&mut buf, &x.buf, &dy.buf, (rows, inner), act, elem_type(dtype))?;
    Ok(parts.finish(buf))
}

/// Soft-capping's input gradient (f32) from its output `y`, `n` elements.
pub(crate) fn softcap_backward(y: &CudaStorage, dy: &CudaStorage, n: usize, cap: f32) -> Result<CudaStorage> {
    let ([y, dy], dtype) = unify("softcap_backward", [(y, n), (dy, n)])?;
    let (mut buf, parts) = alloc_like(&y, n * 4, DType::F32)?;
    y.gpu.softcap_backward(&mut buf, &y.buf, &dy.buf, n, cap, elem_type(dtype))?;
    Ok(parts.finish(buf))
}

/// The embedding table's gradient `[rows, h]` (f32): `dy: [n, h]` scatter-added by `ids`.
pub(crate) fn embedding_backward(
    dy: &CudaStorage,
    ids: &CudaStorage,
    n: usize,
    (rows, h): (usize, usize),
    offset: i64,
) -> Result<CudaStorage> {
    same_gpu("embedding_backward", dy, ids)?;
    let (mut buf, parts) = alloc_like(dy, rows * h * 4, DType::F32)?;
    let (ty, id_ty) = (elem_type(dy.dtype), elem_type(ids.dtype));
    dy.gpu.embedding_backward(&mut buf, &dy.buf, &ids.buf, n, (rows, h), offset, ty, id_ty)?;
    Ok(parts.finish(buf))
}

/// Each row's maximum (f32) of `x: [rows, n]`.
pub(crate) fn row_max(x: &CudaStorage, rows: usize, n: usize) -> Result<CudaStorage> {
    let (mut buf, parts) = alloc_like(x, rows * 4, DType::F32)?;
    x.gpu.row_max(&mut buf, &x.buf, (rows, n), elem_type(x.dtype))?;
    Ok(parts.finish(buf))
}

/// The targets as the kernels take them: int64, -1 where a row's target is on another rank.
fn upload_targets(x: &CudaStorage, targets: &[Option<usize>]) -> Result<tp_kernels::cudarc::driver::CudaSlice<u8>> {
    let t: Vec<i64> = targets.iter().map(|t| t.map_or(-1, |j| i64::try_from(j).unwrap_or(-1))).collect();
    Ok(x.gpu.htod(bytemuck::cast_slice(&t))?)
}

/// `[2, rows]` f32: each row's `Σ_j e^{x - max}` and its target's logit (0 when not local).
pub(crate) fn cross_entropy_parts(
    x: &CudaStorage,
    max: &CudaStorage,
    targets: &[Option<usize>],
    (rows, n): (usize, usize),
) -> Result<CudaStorage> {
    let max = f32_on("cross_entropy_parts", x, max, rows)?;
    let t = upload_targets(x, targets)?;
    let (mut buf, parts) = alloc_like(x, 2 * rows * 4, DType::F32)?;
    x.gpu.cross_entropy_parts(&mut buf, &x.buf, &max.buf, &t, (rows, n), elem_type(x.dtype))?;
    Ok(parts.finish(buf))
}

/// The cross-entropy's gradient `[rows, n]` (f32) on these logit columns.
pub(crate) fn cross_entropy_backward(
    x: &CudaStorage,
    (max, sum_exp): (&CudaStorage, &CudaStorage),
    targets: &[Option<usize>],
    weights: &[f32],
    (rows, n): (usize, usize),
) -> Result<CudaStorage> {
    const OP: &str = "cross_entropy_backward";
    let (max, sum_exp) = (f32_on(OP, x, max, rows)?, f32_on(OP, x, sum_exp, rows)?);
    let t = upload_targets(x, targets)?;
    let w = x.gpu.htod(bytemuck::cast_slice(weights))?;
    let (mut buf, parts) = alloc_like(x, rows * n * 4, DType::F32)?;
    x.gpu.cross_entropy_backward(&mut buf, &x.buf, &max.buf, &sum_exp.buf, &t, &w, (rows, n), elem_type(x.dtype))?;
    Ok(parts.finish(buf))
}

/// `a^T b` for `a: [t, m]`, `b: [t, k]`: `[m, k]` f32. Two f16 or two bf16 operands run on
/// tensor cores; anything else in f32 (operands of another dtype widened first) on the SIMT
/// kernel.
pub(crate) fn t_matmul(a: &CudaStorage, b: &CudaStorage, (t, m, k): (usize, usize, usize)) -> Result<CudaStorage> {
    let ([a, b], dtype) = unify("t_matmul", [(a, t * m), (b, t * k)])?;
    let (mut buf, parts) = alloc_like(&a, m * k * 4, DType::F32)?;
    let shape = GemmShape { m, n: k, k: t };
    let args =
        tp_kernels::GemmTnArgs { c: &mut buf, a: &a.buf, b: &b.buf, shape, ty: elem_type(dtype), accumulate: false };
    a.gpu.gemm_tn(args)?;
    Ok(parts.finish(buf))
}

/// `acc += a^T b` in place (`acc`: `m * k` f32), as [`t_matmul`], added in the GEMM's epilogue.
pub(crate) fn add_t_matmul(
    acc: &mut CudaStorage,
    a: &CudaStorage,
    b: &CudaStorage,
    (t, m, k): (usize, usize, usize),
) -> Result<()> {
    const OP: &str = "add_t_matmul";
    let ([a, b], dtype) = unify(OP, [(a, t * m), (b, t * k)])?;
    same_gpu(OP, acc, &a)?;
    let gpu = acc.gpu.clone();
    let shape = GemmShape { m, n: k, k: t };
    let c = acc.unique_buf()?;
    gpu.gemm_tn(tp_kernels::GemmTnArgs { c, a: &a.buf, b: &b.buf, shape, ty: elem_type(dtype), accumulate: true })?;
    Ok(())
}

/// One AdamW step over device tensors (f32, one GPU; checked by the caller): `params[i]`'s
/// weights, gradient, moments and decay flag.
pub(crate) fn adamw(
    params: Vec<(&mut CudaStorage, &CudaStorage, &mut CudaStorage, &mut CudaStorage, usize, bool)>,
    f: tp_kernels::AdamwFactors,
) -> Result<()> {
    let Some(gpu) = params.first().map(|p| p.1.gpu.clone()) else { return Ok(()) };
    for (p, g, m, v, _, _) in &params {
        for s in [&**p, *g, &**m, &**v] {
            same_gpu("adamw_step", s, g)?;
        }
    }
    let mut tensors = Vec::with_capacity(params.len());
    for (p, g, m, v, n, decay) in params {
        tensors.push(tp_kernels::AdamwTensor {
            param: p.unique_buf()?,
            grad: &g.buf,
            m: m.unique_buf()?,
            v: v.unique_buf()?,
            n,
            decay,
        });
    }
    gpu.adamw(&mut tensors, f)?;
    Ok(())
}

/// A router's choices on the GPU (`tp_moe_route`): each row's `k` experts and weights, read
/// back to the host (`rows * k` of each).
pub(crate) fn moe_route(
    logits: &CudaStorage,
    (rows, e, k): (usize, usize, usize),
    renormalize: bool,
) -> Result<(Vec<u32>, Vec<f32>)> {
    let slots = rows * k;
    let (mut experts, mut weights) = (logits.gpu.alloc(slots * 4)?, logits.gpu.alloc(slots * 4)?);
    logits.gpu.moe_route(
        &mut experts,
        &mut weights,
        &logits.buf,
        (rows, e, k),
        renormalize,
        elem_type(logits.dtype),
    )?;
    let word = |b: &[u8]| [b[0], b[1], b[2], b[3]];
    let ids = logits.gpu.dtoh(&experts, slots * 4)?;
    let w = logits.gpu.dtoh(&weights, slots * 4)?;
    Ok((
        ids.chunks_exact(4).map(|b| i32::from_le_bytes(word(b)).max(0) as u32).collect(),
        w.chunks_exact(4).map(|b| f32::from_le_bytes(word(b))).collect(),
    ))
}

/// The experts' outputs combined on the GPU (`tp_moe_combine`): `[rows, h]` f32.
pub(crate) fn moe_combine(
    y: &CudaStorage,
    pos: &[i64],
    weights: &[f32],
    (rows, k, h, y_rows): (usize, usize, usize, usize),
) -> Result<CudaStorage> {
    let (mut out, parts) = alloc_like(y, rows * h * 4, DType::F32)?;
    let pos_d = y.gpu.htod(bytemuck::cast_slice(pos))?;
    let w_d = y.gpu.htod(bytemuck::cast_slice(weights))?;
    y.gpu.moe_combine(&mut out, &y.buf, (&pos_d, pos), &w_d, (rows, k, h, y_rows), elem_type(y.dtype))?;
    Ok(parts.finish(out))
}

/// A mixture's experts' linear layers in one launch (`tp_gemm_mma_T_grouped`): `[rows, n]` of
/// `x`'s dtype, expert `e`'s rows `offsets[e] .. offsets[e + 1]`.
pub(crate) fn grouped_linear(
    x: &CudaStorage,
    experts: &[(&CudaStorage, Option<&CudaStorage>)],
    offsets: &[usize],
    (rows, n, k): (usize, usize, usize),
) -> Result<CudaStorage> {
    let (mut out, parts) = alloc_like(x, rows * n * x.dtype.size_in_bytes(), x.dtype)?;
    let list: Vec<tp_kernels::GroupedExpert<'_>> =
        experts.iter().map(|(w, b)| tp_kernels::GroupedExpert { weight: &w.buf, bias: b.map(|b| &*b.buf) }).collect();
    x.gpu.gemm_mma_grouped(&mut out, &x.buf, &list, offsets, (n, k), elem_type(x.dtype))?;
    Ok(parts.finish(out))
}

/// One slot's `(A, B, scale)` on the GPU.
pub(crate) type LoraDeviceFactors<'a> = (&'a CudaStorage, &'a CudaStorage, f32);

/// LoRA's batched product on the GPU (`tp_lora_shrink`, `tp_lora_expand`): `y` copied, then
/// every row of a slot with factors `(A, B, scale)` gets `scale · (x A^T) B^T` added; `(rows,
/// in, out, rank)`.
pub(crate) fn lora_product(
    x: &CudaStorage,
    y: &CudaStorage,
    factors: &[Option<LoraDeviceFactors<'_>>],
    slots: &[i32],
    (rows, width, out, rank): (usize, usize, usize, usize),
) -> Result<CudaStorage> {
    let gpu = &x.gpu;
    let bytes = rows * out * y.dtype.size_in_bytes();
    let (mut yo, parts) = alloc_like(y, bytes, y.dtype)?;
    if bytes > 0 {
        let copy = RowCopy { rows: 1, row_bytes: bytes, src_pitch: bytes, src_off: 0, dst_pitch: bytes, dst_off: 0 };
        gpu.row_copy(&mut yo, &y.buf, copy)?;
    }
    let slot_d = gpu.htod(bytemuck::cast_slice(slots))?;
    let scales: Vec<f32> = factors.iter().map(|f| f.map_or(0.0, |f| f.2)).collect();
    let scales_d = gpu.htod(bytemuck::cast_slice(&scales))?;
    let mut u = gpu.alloc(rows * rank * 4)?;
    let a: Vec<tp_kernels::LoraFactor<'_>> = factors.iter().map(|f| f.map(|f| &*f.0.buf)).collect();
    let b: Vec<tp_kernels::LoraFactor<'_>> = factors.iter().map(|f| f.map(|f| &*f.1.buf)).collect();
    let shrink = tp_kernels::LoraShape { rows, width, rank, ld: (width, 1) };
    gpu.lora_shrink(&mut u, &x.buf, &a, &slot_d, shrink, 1.0, elem_type(x.dtype))?;
    let expand = tp_kernels::LoraShape { rows, width: out, rank, ld: (rank, 1) };
    gpu.lora_expand(&mut yo, &u, &b, &slot_d, &scales_d, expand, elem_type(y.dtype))?;
    Ok(parts.finish(yo))
}
