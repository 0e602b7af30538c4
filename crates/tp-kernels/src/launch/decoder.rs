//! Launchers of the decoder kernels: RMSNorm (`kernels/norm.cu`), RoPE (`rope.cu`), attention (`attention.cu`), the embedding lookup and the
//! argmax (`tokens.cu`). Each checks buffer sizes, types and limits against the kernel's
//! contract before its `unsafe` launch, as in `launch.rs`.

use super::{ElemType, i64_of, invalid, require_float, span};
use crate::consts;
use crate::error::{Result, driver};
use crate::gpu::Gpu;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

/// Shape of one attention call: `tokens` queries of `q_heads` heads, `kv_heads` KV heads of
/// `head_dim`, the first `kv_len` cache rows valid, and an optional sliding window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionShape {
    /// Query tokens `T` (the last `T` of the `kv_len` cached ones).
    pub tokens: usize,
    /// Query heads.
    pub q_heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Query heads per KV head in the model: query head `h` uses KV head
    /// `(h + group_offset) / group`.
    pub group: usize,
    /// Position of query head 0 within its group (`< group`).
    pub group_offset: usize,
    /// Features per head, at most `consts::ATTENTION_MAX_HEAD_DIM`.
    pub head_dim: usize,
    /// Valid cache rows, `tokens <= kv_len`.
    pub kv_len: usize,
    /// Factor on the scores.
    pub scale: f32,
    /// Sliding window (most recent keys seen), or `None`.
    pub window: Option<usize>,
}

/// Checks attention sinks against the call's query heads: at least `q_heads` f32 logits.
pub(super) fn check_sinks(k: &'static str, sinks: Option<&CudaSlice<u8>>, q_heads: usize) -> Result<()> {
    match sinks {
        Some(s) if span(k, q_heads, 4, 0)? > s.len() => {
            Err(invalid(k, format!("{} bytes of sinks for {q_heads} query heads", s.len())))
        }
        _ => Ok(()),
    }
}

impl Gpu {
    /// RMSNorm of `rows` rows of `h` elements (`tp_rms_norm_T`): style 0 `out = w *
    /// round(x * rstd)`, style 1 `out = x * rstd * (1 + w)`, style 2 `out = w * (x * rstd)`; the mean of squares of row `r` is
    /// its own, or `sum_sq[r] / n` when `stats = Some((sum_sq, n))` (`rows` f32 on this device).
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(
        &self,
        out: &mut CudaSlice<u8>,
        x: &CudaSlice<u8>,
        w: &CudaSlice<u8>,
        (rows, h): (usize, usize),
        eps: f32,
        style: i32,
        stats: Option<(&CudaSlice<u8>, usize)>,
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "rms_norm";
        require_float(K, ty)?;
        let bytes = span(K, rows, h, 0).and_then(|n| span(K, n, ty.size(), 0))?;
        if bytes > x.len() || bytes > out.len() || span(K, h, ty.size(), 0)? > w.len() {
            return Err(invalid(K, format!("{rows} x {h} does not fit the buffers")));
        }
        if !(0..=2).contains(&style) {
            return Err(invalid(K, format!("unknown norm style {style}")));
        }
        if let Some((s, n)) = stats
            && (span(K, rows, 4, 0)? > s.len() || n == 0)
        {
            return Err(invalid(K, format!("{rows} sums of squares over {n} features do not fit")));
        }
        if bytes == 0 {
            return Ok(());
        }
        let f = self.function(&format!("tp_rms_norm_{}", ty.name()), 0)?;
        let (r, hi) = (i64_of(K, rows)?, i64_of(K, h)?);
        let n = i64_of(K, stats.map_or(h, |s| s.1))?;
        let mut b = self.stream().launch_builder(f);
        b.arg(out).arg(x).arg(w).arg(&r).arg(&hi).arg(&eps).arg(&style);
        match stats {
            Some((s, _)) => b.arg(s),
            None => b.arg(&super::NULL_PTR),
        };
        b.arg(&n);
        // SAFETY: matches tp_rms_norm_T(T* out, const T* x, const T* w, int64 rows, int64 h,
        // float eps, int style, const float* sum_sq, int64 n); x and out hold rows*h elements,
        // w holds h, sum_sq (when not null) rows floats and n > 0 (checked above); style is 0,
        // 1 or 2; out is the only buffer written and is borrowed mutably. 256 threads: the
        // kernel's launch bounds and a multiple of 32, as its block reduction needs.
        unsafe { b.launch(self.grid_rows(rows as u64)) }.map(drop).map_err(driver("cuLaunchKernel(tp_rms_norm)"))
    }

    /// `out[r] = Σ_j x[r, j]²` (f32) over `rows` rows of `h` elements (`tp_sum_squares_T`).
    pub fn sum_squares(
        &self,
        out: &mut CudaSlice<u8>,
        x: &CudaSlice<u8>,
        (rows, h): (usize, usize),
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "sum_squares";
        require_float(K, ty)?;
        let bytes = span(K, rows, h, 0).and_then(|n| span(K, n, ty.size(), 0))?;
        if bytes > x.len() || span(K, rows, 4, 0)? > out.len() {
            return Err(invalid(K, format!("{rows} x {h} does not fit the buffers")));
        }
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(&format!("tp_sum_squares_{}", ty.name()), 0)?;
        let (r, hi) = (i64_of(K, rows)?, i64_of(K, h)?);
        let mut b = self.stream().launch_builder(f);
        b.arg(out).arg(x).arg(&r).arg(&hi);
        // SAFETY: matches tp_sum_squares_T(float* out, const T* x, int64 rows, int64 h); x holds
        // rows*h elements and out rows floats (checked above); out is the only buffer written,
        // borrowed mutably; 256 threads, a multiple of 32, as the block reduction needs.
        unsafe { b.launch(self.grid_rows(rows as u64)) }.map(drop).map_err(driver("cuLaunchKernel(tp_sum_squares)"))
    }

    /// RoPE over `x: [tokens, heads, dim]` (`tp_rope_T`), rotating the first `2 * half`
    /// features of each head (`half` = `inv_freq.len()`) and copying the rest; `pos` holds `tokens`
    /// int64 positions and `inv_freq` the f32 frequencies, both on this device; cos and sin are
    /// multiplied by `attention_scaling` (YaRN's attention factor; 1 leaves them unchanged) in
    /// f32 before their rounding to the dtype.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        out: &mut CudaSlice<u8>,
        x: &CudaSlice<u8>,
        pos: &CudaSlice<u8>,
        inv_freq: &CudaSlice<u8>,
        attention_scaling: f32,
        (tokens, heads, half, dim): (usize, usize, usize, usize),
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "rope";
        require_float(K, ty)?;
        if span(K, half, 2, 0)? > dim {
            return Err(invalid(K, format!("{} rotated features do not fit heads of {dim}", 2 * half)));
        }
        let n = span(K, tokens, heads, 0).and_then(|r| span(K, r, dim, 0))?;
        let bytes = span(K, n, ty.size(), 0)?;
        if bytes > x.len()
            || bytes > out.len()
            || span(K, tokens, 8, 0)? > pos.len()
            || span(K, half, 4, 0)? > inv_freq.len()
        {
            return Err(invalid(K, format!("{tokens} x {heads} x {dim} does not fit the buffers")));
        }
        if n == 0 {
            return Ok(());
        }
        let f = self.function(&format!("tp_rope_{}", ty.name()), 0)?;
        let [t, h, hf, d] = [i64_of(K, tokens)?, i64_of(K, heads)?, i64_of(K, half)?, i64_of(K, dim)?];
        let mut b = self.stream().launch_builder(f);
        b.arg(out).arg(x).arg(pos).arg(inv_freq).arg(&attention_scaling).arg(&t).arg(&h).arg(&hf).arg(&d);
        // SAFETY: matches tp_rope_T(T* out, const T* x, const int64* pos, const float* inv_freq,
        // float scale, int64 tokens, heads, half, dim): `attention_scaling` is an f32 passed by
        // value. x and out hold tokens*heads*dim elements with 2*half <= dim, pos `tokens`
        // int64 and inv_freq `half` floats (checked above); only out is written, borrowed
        // mutably; allocations are 256-byte aligned, so every typed access is aligned.
        unsafe { b.launch(self.grid_rows((tokens * heads) as u64)) }
            .map(drop)
            .map_err(driver("cuLaunchKernel(tp_rope)"))
    }

    /// Causal GQA attention (`tp_attention_T`): `q, out: [tokens, q_heads, head_dim]`, `k, v`:
    /// at least `[kv_len, kv_heads, head_dim]`; `sinks`, if any, `q_heads` f32 attention-sink
    /// logits (gpt-oss), one joining each head's softmax.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        out: &mut CudaSlice<u8>,
        q: &CudaSlice<u8>,
        k: &CudaSlice<u8>,
        v: &CudaSlice<u8>,
        s: AttentionShape,
        sinks: Option<&CudaSlice<u8>>,
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "attention";
        require_float(K, ty)?;
        check_sinks(K, sinks, s.q_heads)?;
        if s.head_dim > consts::ATTENTION_MAX_HEAD_DIM as usize {
            return Err(invalid(K, format!("head_dim {} exceeds {}", s.head_dim, consts::ATTENTION_MAX_HEAD_DIM)));
        }
        let groups_fit = s.group > 0
            && s.group_offset < s.group
            && (s.q_heads == 0 || (s.group_offset + s.q_heads - 1) / s.group < s.kv_heads);
        if !groups_fit || s.kv_len < s.tokens || s.window == Some(0) {
            return Err(invalid(K, format!("inconsistent shape {s:?}")));
        }
        let q_bytes = span(K, s.tokens, s.q_heads, 0)
            .and_then(|r| span(K, r, s.head_dim, 0))
            .and_then(|n| span(K, n, ty.size(), 0))?;
        let kv_bytes = span(K, s.kv_len, s.kv_heads, 0)
            .and_then(|r| span(K, r, s.head_dim, 0))
            .and_then(|n| span(K, n, ty.size(), 0))?;
        if q_bytes > q.len() || q_bytes > out.len() || kv_bytes > k.len() || kv_bytes > v.len() {
            return Err(invalid(K, format!("{s:?} does not fit the buffers")));
        }
        if q_bytes == 0 {
            return Ok(());
        }
        let f = self.function(&format!("tp_attention_{}", ty.name()), 0)?;
        let [t, hq, hkv, g, go, d, l] =
            [s.tokens, s.q_heads, s.kv_heads, s.group, s.group_offset, s.head_dim, s.kv_len].map(|v| i64_of(K, v));
        let (t, hq, hkv, g, go, d, l) = (t?, hq?, hkv?, g?, go?, d?, l?);
        let window = i64_of(K, s.window.unwrap_or(0))?;
        let rows = (s.tokens * s.q_heads) as u64;
        let blocks = rows.clamp(1, u64::from(self.sm_count()) * 32);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (consts::ATTENTION_WARPS * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream().launch_builder(f);
        b.arg(out).arg(q).arg(k).arg(v).arg(&t).arg(&hq).arg(&hkv).arg(&g).arg(&go).arg(&d).arg(&l);
        b.arg(&s.scale).arg(&window);
        let null: u64 = 0;
        match sinks {
            Some(s) => b.arg(s),
            None => b.arg(&null),
        };
        // SAFETY: matches tp_attention_T(T* out, const T* q, const T* k, const T* v, int64 tokens,
        // hq, hkv, group, group_offset, d, kv_len, float scale, int64 window, const float*
        // sinks): sinks null (a zero pointer) or q_heads floats (checked), read at h < hq. q and out hold
        // tokens*hq*d elements and k, v at least kv_len*hkv*d (checked above); the kernel reads
        // keys j <= kv_len - 1 only, of KV heads (h + group_offset) / group < hkv for every
        // h < hq (checked above), and head_dim <= 256 fits its shared arrays; kv_len >= tokens,
        // so every query sees at least its own key. 128 threads is its launch bound. Only out is
        // written, borrowed mutably.
        unsafe { b.launch(cfg) }.map(drop).map_err(driver("cuLaunchKernel(tp_attention)"))
    }

    /// Vocab-parallel embedding lookup (`tp_embedding_T_I`): `n` ids of `id_ty` (i32 or i64)
    /// into rows of `table: [rows, h]` offset by `offset`; `out: [n, h]`.
    #[allow(clippy::too_many_arguments)]
    pub fn embedding(
        &self,
        out: &mut CudaSlice<u8>,
        table: &CudaSlice<u8>,
        ids: &CudaSlice<u8>,
        n: usize,
        (rows, h): (usize, usize),
        offset: i64,
        ty: ElemType,
        id_ty: ElemType,
    ) -> Result<()> {
        const K: &str = "embedding";
        require_float(K, ty)?;
        if !matches!(id_ty, ElemType::I32 | ElemType::I64) {
            return Err(invalid(K, "ids must be i32 or i64"));
        }
        let out_bytes = span(K, n, h, 0).and_then(|e| span(K, e, ty.size(), 0))?;
        let table_bytes = span(K, rows, h, 0).and_then(|e| span(K, e, ty.size(), 0))?;
        if out_bytes > out.len() || table_bytes > table.len() || span(K, n, id_ty.size(), 0)? > ids.len() {
            return Err(invalid(K, format!("{n} ids x {h} from {rows} rows do not fit the buffers")));
        }
        if out_bytes == 0 {
            return Ok(());
        }
        let f = self.function(&format!("tp_embedding_{}_{}", ty.name(), id_ty.name()), 0)?;
        let [n_i, r_i, h_i] = [i64_of(K, n)?, i64_of(K, rows)?, i64_of(K, h)?];
        let mut b = self.stream().launch_builder(f);
        b.arg(out).arg(table).arg(ids).arg(&n_i).arg(&r_i).arg(&h_i).arg(&offset);
        // SAFETY: matches tp_embedding_T_I(T* out, const T* table, const I* ids, int64 n, rows,
        // h, offset). out holds n*h elements, table rows*h, ids n of I (checked above); the
        // kernel reads a table row only when 0 <= id - offset < rows. Only out is written.
        unsafe { b.launch(self.grid_rows(n as u64)) }.map(drop).map_err(driver("cuLaunchKernel(tp_embedding)"))
    }

    /// Per-row maximum and its first index (`tp_max_index_T`) over `x: [rows, n]`, `n >= 1`:
    /// `vals` receives `rows` f32, `idx` `rows` int64.
    pub fn max_index(
        &self,
        vals: &mut CudaSlice<u8>,
        idx: &mut CudaSlice<u8>,
        x: &CudaSlice<u8>,
        (rows, n): (usize, usize),
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "max_index";
        require_float(K, ty)?;
        if n == 0 {
            return Err(invalid(K, "rows must not be empty"));
        }
        let x_bytes = span(K, rows, n, 0).and_then(|e| span(K, e, ty.size(), 0))?;
        if x_bytes > x.len() || span(K, rows, 4, 0)? > vals.len() || span(K, rows, 8, 0)? > idx.len() {
            return Err(invalid(K, format!("{rows} x {n} does not fit the buffers")));
        }
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(&format!("tp_max_index_{}", ty.name()), 0)?;
        let (r_i, n_i) = (i64_of(K, rows)?, i64_of(K, n)?);
        let mut b = self.stream().launch_builder(f);
        b.arg(vals).arg(idx).arg(x).arg(&r_i).arg(&n_i);
        // SAFETY: matches tp_max_index_T(float* vals, int64* idx, const T* x, int64 rows, n);
        // x holds rows*n elements, vals rows floats, idx rows int64 (checked above); vals and idx
        // are distinct mutable borrows; 256 threads as its reduction expects.
        unsafe { b.launch(self.grid_rows(rows as u64)) }.map(drop).map_err(driver("cuLaunchKernel(tp_max_index)"))
    }
}
