//! Launchers of `kernels/grad.cu`, training's backward kernels: RMSNorm's `dx` (and its split
//! statistic) and `dw`, RoPE's transposed rotation, the gated activation's and soft-capping's
//! gradients, the embedding's scatter-add, deterministic column sums and the 2-D transpose. Every
//! output is f32; the inputs of one call share one element type `ty`. Each checks buffer sizes,
//! types and codes against the kernel's contract before its `unsafe` launch.

use super::{ElemType, i64_of, invalid, require_float, span};
use crate::consts;
use crate::error::{Result, driver};
use crate::gpu::Gpu;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

/// The statistics of an RMSNorm over features split across ranks, for its backward: the
/// forward's per-row sums of squares over all `n` features and the ranks' summed
/// [`Gpu::rms_norm_grad_dot`] parts, `rows` f32 each.
#[derive(Debug, Clone, Copy)]
pub struct NormSplit<'a> {
    /// `Σ_j x[r, j]²` over the full width, `rows` f32.
    pub sum_sq: &'a CudaSlice<u8>,
    /// The full width (> 0).
    pub n: usize,
    /// `Σ_j (dy ⊙ w')[r, j] x[r, j]` over the full width, `rows` f32.
    pub dot: &'a CudaSlice<u8>,
}

/// `rows * cols` elements of `size` bytes, checked.
fn bytes(kernel: &'static str, rows: usize, cols: usize, size: usize) -> Result<usize> {
    span(kernel, rows, cols, 0).and_then(|n| span(kernel, n, size, 0))
}

fn check_style(kernel: &'static str, style: i32) -> Result<()> {
    if (0..=2).contains(&style) { Ok(()) } else { Err(invalid(kernel, format!("unknown norm style {style}"))) }
}

impl Gpu {
    /// `out[r] = Σ_j (dy[r, j] · w'[j]) · x[r, j]` in f32 over `rows` rows of `h`
    /// (`tp_rms_norm_grad_dot_T`), `w'` the weight as `style` applies it (1: `1 + w`): one
    /// rank's part of a split norm's backward sum. `out`: `rows` f32.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_grad_dot(
        &self,
        out: &mut CudaSlice<u8>,
        x: &CudaSlice<u8>,
        w: &CudaSlice<u8>,
        dy: &CudaSlice<u8>,
        (rows, h): (usize, usize),
        style: i32,
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "rms_norm_grad_dot";
        require_float(K, ty)?;
        check_style(K, style)?;
        let b = bytes(K, rows, h, ty.size())?;
        if b > x.len() || b > dy.len() || bytes(K, h, 1, ty.size())? > w.len() || bytes(K, rows, 1, 4)? > out.len() {
            return Err(invalid(K, format!("{rows} x {h} does not fit the buffers")));
        }
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(&format!("tp_rms_norm_grad_dot_{}", ty.name()), 0)?;
        let (r, hi) = (i64_of(K, rows)?, i64_of(K, h)?);
        let mut l = self.stream().launch_builder(f);
        l.arg(out).arg(x).arg(w).arg(dy).arg(&r).arg(&hi).arg(&style);
        // SAFETY: matches tp_rms_norm_grad_dot_T(float* out, const T* x, const T* w, const T* dy,
        // int64 rows, int64 h, int style): x and dy hold rows*h elements of T, w h, out rows
        // floats (checked above); style is 0, 1 or 2; out is the only buffer written, borrowed
        // mutably. 256 threads, a multiple of 32, as the block reduction needs.
        unsafe { l.launch(self.grid_rows(rows as u64)) }
            .map(drop)
            .map_err(driver("cuLaunchKernel(tp_rms_norm_grad_dot)"))
    }

    /// RMSNorm's input gradient (`tp_rms_norm_backward_T`): `dx = (rstd·dy)·w' − x·rstd³·dot/n`
    /// per row, f32 (`rows x h`), with each row's own mean of squares and `dot`
    /// ([`rms_norm_grad_dot`](Self::rms_norm_grad_dot)'s sum) over its `h` features, or those of
    /// `split` over `n`. Also writes each row's `rstd` (`rows` f32) for the weight gradient's
    /// column sum ([`col_sum`](Self::col_sum) of `dy ⊙ x` scaled by `rstd`).
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_backward(
        &self,
        dx: &mut CudaSlice<u8>,
        rstd: &mut CudaSlice<u8>,
        x: &CudaSlice<u8>,
        w: &CudaSlice<u8>,
        dy: &CudaSlice<u8>,
        (rows, h): (usize, usize),
        eps: f32,
        style: i32,
        split: Option<NormSplit<'_>>,
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "rms_norm_backward";
        require_float(K, ty)?;
        check_style(K, style)?;
        let b = bytes(K, rows, h, ty.size())?;
        let row_floats = bytes(K, rows, 1, 4)?;
        if b > x.len()
            || b > dy.len()
            || bytes(K, h, 1, ty.size())? > w.len()
            || bytes(K, rows, h, 4)? > dx.len()
            || row_floats > rstd.len()
        {
            return Err(invalid(K, format!("{rows} x {h} does not fit the buffers")));
        }
        if let Some(s) = split
            && (row_floats > s.sum_sq.len() || row_floats > s.dot.len() || s.n == 0)
        {
            return Err(invalid(K, format!("{rows} statistics over {} features do not fit", s.n)));
        }
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(&format!("tp_rms_norm_backward_{}", ty.name()), 0)?;
        let (r, hi) = (i64_of(K, rows)?, i64_of(K, h)?);
        let n = i64_of(K, split.map_or(h, |s| s.n))?;
        let mut l = self.stream().launch_builder(f);
        l.arg(dx).arg(rstd).arg(x).arg(w).arg(dy).arg(&r).arg(&hi).arg(&eps).arg(&style);
        match split {
            Some(s) => l.arg(s.sum_sq).arg(&n).arg(s.dot),
            None => l.arg(&super::NULL_PTR).arg(&n).arg(&super::NULL_PTR),
        };
        // SAFETY: matches tp_rms_norm_backward_T(float* dx, float* rstd, const T* x, const T* w,
        // const T* dy, int64 rows, int64 h, float eps, int style, const float* sum_sq, int64 n,
        // const float* dot). x and dy hold rows*h elements of T, w h, dx rows*h floats, rstd rows
        // floats; sum_sq and dot are both null or both rows floats with n > 0 (checked above);
        // style is 0, 1 or 2. dx and rstd are distinct mutable borrows, the only buffers written.
        // 256 threads, a multiple of 32, as the block reductions need.
        unsafe { l.launch(self.grid_rows(rows as u64)) }
            .map(drop)
            .map_err(driver("cuLaunchKernel(tp_rms_norm_backward)"))
    }

    /// Column sums in f32 over `rows` rows of `cols` (`tp_col_sum_T`, then
    /// `tp_col_sum_finish`): `out[c] = Σ_r a[r, c]`, or with `scaled = Some((b, s))`
    /// `Σ_r (a[r, c]·b[r, c])·s[r]` (`b` of `ty`, `s` `rows` f32): a bias gradient, or RMSNorm's
    /// weight gradient (`a = dy`, `b = x`, `s = rstd`). Deterministic: rows are cut into at most
    /// `COL_SUM_MAX_CHUNKS` chunks summed in a fixed order, whatever the device. `out`: `cols`
    /// f32; a scratch buffer of `chunks x cols` f32 is allocated when there is more than one chunk.
    pub fn col_sum(
        &self,
        out: &mut CudaSlice<u8>,
        a: &CudaSlice<u8>,
        scaled: Option<(&CudaSlice<u8>, &CudaSlice<u8>)>,
        (rows, cols): (usize, usize),
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "col_sum";
        require_float(K, ty)?;
        let b = bytes(K, rows, cols, ty.size())?;
        if b > a.len() || bytes(K, cols, 1, 4)? > out.len() {
            return Err(invalid(K, format!("{rows} x {cols} does not fit the buffers")));
        }
        if let Some((bm, s)) = scaled
            && (b > bm.len() || bytes(K, rows, 1, 4)? > s.len())
        {
            return Err(invalid(K, format!("the scaling operands do not fit {rows} x {cols}")));
        }
        if cols == 0 {
            return Ok(());
        }
        let chunks = rows.div_ceil(consts::COL_SUM_CHUNK_ROWS as usize).clamp(1, consts::COL_SUM_MAX_CHUNKS as usize);
        let chunk = rows.div_ceil(chunks).max(1);
        let gx = u32::try_from(cols.div_ceil(32))
            .ok()
            .filter(|&g| g <= i32::MAX as u32)
            .ok_or_else(|| invalid(K, format!("{cols} columns exceed the grid")))?;
        let cfg = LaunchConfig {
            grid_dim: (gx, chunks as u32, 1),
            block_dim: (consts::ELEMENTWISE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.function(&format!("tp_col_sum_{}", ty.name()), 0)?;
        let [r, c, ch] = [i64_of(K, rows)?, i64_of(K, cols)?, i64_of(K, chunk)?];
        let mut partial = if chunks > 1 { Some(self.alloc(bytes(K, chunks, cols, 4)?)?) } else { None };
        {
            let mut l = self.stream().launch_builder(f);
            match partial.as_mut() {
                Some(p) => l.arg(p),
                None => l.arg(&mut *out),
            };
            l.arg(a);
            match scaled {
                Some((bm, s)) => l.arg(bm).arg(s),
                None => l.arg(&super::NULL_PTR).arg(&super::NULL_PTR),
            };
            l.arg(&r).arg(&c).arg(&ch);
            // SAFETY: matches tp_col_sum_T(float* partial, const T* a, const T* b, const float* s,
            // int64 rows, int64 cols, int64 chunk). a (and b) hold rows*cols elements of T, s rows
            // floats, both null or neither (checked above); the grid's chunks (y, at most
            // COL_SUM_MAX_CHUNKS, within CUDA's 65535) times chunk rows cover rows, and the kernel
            // reads rows below `rows` and columns below `cols` only; it writes partial[y * cols
            // + c] for c < cols: `out` (cols floats) when there is one chunk, else the scratch
            // buffer of chunks*cols floats. The written buffer is borrowed mutably. 256 threads =
            // 32 columns x 8 row lanes, as the kernel's static_assert says.
            unsafe { l.launch(cfg) }.map(drop).map_err(driver("cuLaunchKernel(tp_col_sum)"))?;
        }
        let Some(partial) = partial else { return Ok(()) };
        let f = self.function("tp_col_sum_finish", 0)?;
        let q = i64_of(K, chunks)?;
        let mut l = self.stream().launch_builder(f);
        l.arg(out).arg(&partial).arg(&q).arg(&c);
        // SAFETY: matches tp_col_sum_finish(float* out, const float* partial, int64 chunks,
        // int64 cols): partial holds chunks*cols floats (allocated above, every one written by the
        // first pass: its grid covers every (chunk, column)); out holds cols floats (checked);
        // distinct buffers, out borrowed mutably. Grid-stride over cols.
        unsafe { l.launch(self.grid_stride(cols as u64)) }
            .map(drop)
            .map_err(driver("cuLaunchKernel(tp_col_sum_finish)"))
    }

    /// RoPE's input gradient over `dy: [tokens, heads, dim]` (`tp_rope_backward_T`): each
    /// rotated pair turned back (`c·dy1 + s·dy2`, `c·dy2 − s·dy1`, cos and sin of the forward's
    /// angles times `attention_scaling`, unrounded), features past `2 * half` copied; `out`:
    /// `tokens x heads x dim` f32. `pos` (`tokens` int64) and `inv_freq` (`half` f32) on this
    /// device, as for [`rope`](Self::rope).
    #[allow(clippy::too_many_arguments)]
    pub fn rope_backward(
        &self,
        out: &mut CudaSlice<u8>,
        dy: &CudaSlice<u8>,
        pos: &CudaSlice<u8>,
        inv_freq: &CudaSlice<u8>,
        attention_scaling: f32,
        (tokens, heads, half, dim): (usize, usize, usize, usize),
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "rope_backward";
        require_float(K, ty)?;
        if span(K, half, 2, 0)? > dim {
            return Err(invalid(K, format!("{} rotated features do not fit heads of {dim}", 2 * half)));
        }
        let n = span(K, tokens, heads, 0).and_then(|r| span(K, r, dim, 0))?;
        if bytes(K, n, 1, ty.size())? > dy.len()
            || bytes(K, n, 1, 4)? > out.len()
            || bytes(K, tokens, 1, 8)? > pos.len()
            || bytes(K, half, 1, 4)? > inv_freq.len()
        {
            return Err(invalid(K, format!("{tokens} x {heads} x {dim} does not fit the buffers")));
        }
        if n == 0 {
            return Ok(());
        }
        let f = self.function(&format!("tp_rope_backward_{}", ty.name()), 0)?;
        let [t, h, hf, d] = [i64_of(K, tokens)?, i64_of(K, heads)?, i64_of(K, half)?, i64_of(K, dim)?];
        let mut l = self.stream().launch_builder(f);
        l.arg(out).arg(dy).arg(pos).arg(inv_freq).arg(&attention_scaling).arg(&t).arg(&h).arg(&hf).arg(&d);
        // SAFETY: matches tp_rope_backward_T(float* out, const T* dy, const int64* pos,
        // const float* inv_freq, float scale, int64 tokens, heads, half, dim). dy holds
        // tokens*heads*dim elements of T and out as many floats, with 2*half <= dim; pos holds
        // `tokens` int64 and inv_freq `half` floats (checked above); only out is written,
        // borrowed mutably; 256-byte aligned allocations keep every typed access aligned.
        unsafe { l.launch(self.grid_rows((tokens * heads) as u64)) }
            .map(drop)
            .map_err(driver("cuLaunchKernel(tp_rope_backward)"))
    }

    /// The gated activation's input gradient (`tp_glu_backward_T`): for `input = [gate | up]`
    /// (`rows x 2 inner`) and `dy` (`rows x inner`), `out = [dy·up·act'(gate) | dy·act(gate)]`,
    /// `rows x 2 inner` f32; `act` 0 silu, 1 GELU's tanh approximation.
    #[allow(clippy::too_many_arguments)]
    pub fn glu_backward(
        &self,
        out: &mut CudaSlice<u8>,
        input: &CudaSlice<u8>,
        dy: &CudaSlice<u8>,
        (rows, inner): (usize, usize),
        (act, alpha, limit): (i32, f32, f32),
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "glu_backward";
        require_float(K, ty)?;
        if !(0..=2).contains(&act) || !alpha.is_finite() || !limit.is_finite() {
            return Err(invalid(K, format!("unknown activation code {act} (alpha {alpha}, limit {limit})")));
        }
        let n = span(K, rows, inner, 0)?;
        if bytes(K, n, 2, ty.size())? > input.len()
            || bytes(K, n, 1, ty.size())? > dy.len()
            || bytes(K, n, 2, 4)? > out.len()
        {
            return Err(invalid(K, format!("{rows} x {inner} does not fit the buffers")));
        }
        if n == 0 {
            return Ok(());
        }
        let f = self.function(&format!("tp_glu_backward_{}", ty.name()), 0)?;
        let (r, i) = (i64_of(K, rows)?, i64_of(K, inner)?);
        let mut l = self.stream().launch_builder(f);
        l.arg(out).arg(input).arg(dy).arg(&r).arg(&i).arg(&act).arg(&alpha).arg(&limit);
        // SAFETY: matches tp_glu_backward_T(float* out, const T* in, const T* dy, int64 rows,
        // int64 inner, int act, float alpha, float limit); `in` holds rows*2*inner and dy
        // rows*inner elements of T, out rows*2*inner floats (checked above); act is 0, 1 or 2;
        // out is the only buffer written, borrowed mutably.
        unsafe { l.launch(self.grid_rows(rows as u64)) }.map(drop).map_err(driver("cuLaunchKernel(tp_glu_backward)"))
    }

    /// Soft-capping's input gradient from its output `y` (`tp_softcap_backward_T`):
    /// `out[i] = dy[i]·(1 − (y[i]/cap)²)` over `n` elements, f32. `cap` finite and > 0.
    #[allow(clippy::too_many_arguments)]
    pub fn softcap_backward(
        &self,
        out: &mut CudaSlice<u8>,
        y: &CudaSlice<u8>,
        dy: &CudaSlice<u8>,
        n: usize,
        cap: f32,
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "softcap_backward";
        require_float(K, ty)?;
        if !(cap.is_finite() && cap > 0.0) {
            return Err(invalid(K, format!("the cap must be finite and > 0, got {cap}")));
        }
        let b = bytes(K, n, 1, ty.size())?;
        if b > y.len() || b > dy.len() || bytes(K, n, 1, 4)? > out.len() {
            return Err(invalid(K, format!("{n} elements do not fit the buffers")));
        }
        if n == 0 {
            return Ok(());
        }
        let f = self.function(&format!("tp_softcap_backward_{}", ty.name()), 0)?;
        let n_i = i64_of(K, n)?;
        let mut l = self.stream().launch_builder(f);
        l.arg(out).arg(y).arg(dy).arg(&n_i).arg(&cap);
        // SAFETY: matches tp_softcap_backward_T(float* out, const T* y, const T* dy, int64 n,
        // float cap); y and dy hold n elements of T, out n floats (checked above); out is the
        // only buffer written, borrowed mutably; grid-stride over n.
        unsafe { l.launch(self.grid_stride(n as u64)) }.map(drop).map_err(driver("cuLaunchKernel(tp_softcap_backward)"))
    }

    /// The vocab-parallel embedding's table gradient (`tp_embedding_backward_T_I`): `out`
    /// (`rows x h` f32) is zeroed, then row `ids[i] - offset` receives `dy[i]` (`dy`: `n x h` of
    /// `ty`) for every id this table holds, repeated ids summed in ascending `i` (the host's
    /// order, without atomics: deterministic). `ids`: `n` of `id_ty` (i32 or i64).
    #[allow(clippy::too_many_arguments)]
    pub fn embedding_backward(
        &self,
        out: &mut CudaSlice<u8>,
        dy: &CudaSlice<u8>,
        ids: &CudaSlice<u8>,
        n: usize,
        (rows, h): (usize, usize),
        offset: i64,
        ty: ElemType,
        id_ty: ElemType,
    ) -> Result<()> {
        const K: &str = "embedding_backward";
        require_float(K, ty)?;
        if !matches!(id_ty, ElemType::I32 | ElemType::I64) {
            return Err(invalid(K, "ids must be i32 or i64"));
        }
        if offset < 0 {
            return Err(invalid(K, format!("the row offset must be >= 0, got {offset}")));
        }
        let out_bytes = bytes(K, rows, h, 4)?;
        if out_bytes > out.len() || bytes(K, n, h, ty.size())? > dy.len() || bytes(K, n, 1, id_ty.size())? > ids.len() {
            return Err(invalid(K, format!("{n} ids x {h} into {rows} rows do not fit the buffers")));
        }
        if out_bytes == 0 {
            return Ok(());
        }
        self.stream().memset_zeros(&mut *out).map_err(driver("cuMemsetD8Async"))?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(&format!("tp_embedding_backward_{}_{}", ty.name(), id_ty.name()), 0)?;
        let [n_i, r_i, h_i] = [i64_of(K, n)?, i64_of(K, rows)?, i64_of(K, h)?];
        let mut l = self.stream().launch_builder(f);
        l.arg(out).arg(dy).arg(ids).arg(&n_i).arg(&r_i).arg(&h_i).arg(&offset);
        // SAFETY: matches tp_embedding_backward_T_I(float* out, const T* dy, const I* ids, int64
        // n, rows, h, offset). out holds rows*h floats (zeroed above, on the same stream), dy n*h
        // elements of T, ids n of I (checked above); the kernel writes out's row id - offset only
        // when offset <= id < offset + rows (offset >= 0: no overflow), each row by one block.
        // Only out is written, borrowed mutably. 256 threads: its shared list and warp counts
        // are sized for ELEMENTWISE_THREADS.
        unsafe { l.launch(self.grid_rows(n as u64)) }.map(drop).map_err(driver("cuLaunchKernel(tp_embedding_backward)"))
    }

    /// `out = x^T` in f32 (`tp_transpose_T`): `x` is `rows x cols` of `ty`, `out` `cols x rows`.
    pub fn transpose(
        &self,
        out: &mut CudaSlice<u8>,
        x: &CudaSlice<u8>,
        (rows, cols): (usize, usize),
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "transpose";
        require_float(K, ty)?;
        if bytes(K, rows, cols, ty.size())? > x.len() || bytes(K, rows, cols, 4)? > out.len() {
            return Err(invalid(K, format!("{rows} x {cols} does not fit the buffers")));
        }
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        let f = self.function(&format!("tp_transpose_{}", ty.name()), 0)?;
        let tiles = span(K, rows.div_ceil(32), cols.div_ceil(32), 0)?;
        let (r, c) = (i64_of(K, rows)?, i64_of(K, cols)?);
        let mut l = self.stream().launch_builder(f);
        l.arg(out).arg(x).arg(&r).arg(&c);
        // SAFETY: matches tp_transpose_T(float* out, const T* x, int64 rows, int64 cols); x holds
        // rows*cols elements of T and out rows*cols floats (checked above); the kernel bounds-checks
        // every tile edge; out is the only buffer written, borrowed mutably; 256 threads = 32 x 8,
        // as its tile loops assume (a multiple of 32).
        unsafe { l.launch(self.grid_rows(tiles as u64)) }.map(drop).map_err(driver("cuLaunchKernel(tp_transpose)"))
    }
}
