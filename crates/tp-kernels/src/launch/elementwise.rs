//! Launchers of `kernels/elementwise.cu`: the gated activations (SwiGLU, GeGLU), the row bias,
//! the in-place add, the scalar scale and soft-capping.

use super::{ElemType, i64_of, invalid, require_float, span};
use crate::error::{Result, driver};
use crate::gpu::Gpu;
use cudarc::driver::{CudaSlice, PushKernelArg};

impl Gpu {
    /// `out = act(gate) * up` over `rows` rows of `[gate | up]` (`inner` each), element type
    /// `ty`; `act` 0 is silu, 1 GELU's tanh approximation, 2 gpt-oss's clamped SwiGLU with its
    /// `(alpha, limit)` (`kernels/elementwise.cu`, `tp_glu_T`).
    pub fn glu(
        &self,
        out: &mut CudaSlice<u8>,
        input: &CudaSlice<u8>,
        (rows, inner): (usize, usize),
        (act, alpha, limit): (i32, f32, f32),
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "glu";
        if !(0..=2).contains(&act) || !alpha.is_finite() || !limit.is_finite() {
            return Err(invalid(K, format!("unknown activation code {act} (alpha {alpha}, limit {limit})")));
        }
        require_float(K, ty)?;
        let n = span(K, rows, inner, 0)?;
        if span(K, n, 2 * ty.size(), 0)? > input.len() || span(K, n, ty.size(), 0)? > out.len() {
            return Err(invalid(K, format!("{rows} x {inner} does not fit the buffers")));
        }
        if n == 0 {
            return Ok(());
        }
        let f = self.function(&format!("tp_glu_{}", ty.name()), 0)?;
        let (r, i) = (i64_of(K, rows)?, i64_of(K, inner)?);
        let mut b = self.stream().launch_builder(f);
        b.arg(out).arg(input).arg(&r).arg(&i).arg(&act).arg(&alpha).arg(&limit);
        // SAFETY: matches tp_glu_T(T* out, const T* in, int64 rows, int64 inner, int act, float
        // alpha, float limit); `in` holds rows*2*inner and `out` rows*inner elements (checked
        // above); act is 0, 1 or 2 (checked); distinct buffers (& vs &mut), 256-byte aligned.
        unsafe { b.launch(self.grid_rows(rows as u64)) }.map(drop).map_err(driver("cuLaunchKernel(tp_glu)"))
    }

    /// `out[r, c] = input[r, c] + bias[c]` (`kernels/elementwise.cu`, `tp_add_row_T`).
    pub fn add_row(
        &self,
        out: &mut CudaSlice<u8>,
        input: &CudaSlice<u8>,
        bias: &CudaSlice<u8>,
        rows: usize,
        cols: usize,
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "add_row";
        require_float(K, ty)?;
        let n = span(K, rows, cols, 0)?;
        let bytes = span(K, n, ty.size(), 0)?;
        if bytes > input.len() || bytes > out.len() || span(K, cols, ty.size(), 0)? > bias.len() {
            return Err(invalid(K, format!("{rows} x {cols} does not fit the buffers")));
        }
        if n == 0 {
            return Ok(());
        }
        let f = self.function(&format!("tp_add_row_{}", ty.name()), 0)?;
        let (r, c) = (i64_of(K, rows)?, i64_of(K, cols)?);
        let mut b = self.stream().launch_builder(f);
        b.arg(out).arg(input).arg(bias).arg(&r).arg(&c);
        // SAFETY: matches tp_add_row_T(T* out, const T* in, const T* bias, int64 rows, cols);
        // sizes checked above; `out` is the only buffer written and is borrowed mutably.
        unsafe { b.launch(self.grid_rows(rows as u64)) }.map(drop).map_err(driver("cuLaunchKernel(tp_add_row)"))
    }

    /// `x[i] += y[i]` for `n` elements of `ty`, in place (`tp_add_T`).
    pub fn add_inplace(&self, x: &mut CudaSlice<u8>, y: &CudaSlice<u8>, n: usize, ty: ElemType) -> Result<()> {
        const K: &str = "add";
        require_float(K, ty)?;
        let bytes = span(K, n, ty.size(), 0)?;
        if bytes > x.len() || bytes > y.len() {
            return Err(invalid(K, format!("{n} elements do not fit the buffers")));
        }
        if n == 0 {
            return Ok(());
        }
        let f = self.function(&format!("tp_add_{}", ty.name()), 0)?;
        let n_i = i64_of(K, n)?;
        let mut b = self.stream().launch_builder(f);
        b.arg(x).arg(y).arg(&n_i);
        // SAFETY: matches tp_add_T(T* x, const T* y, int64 n); both buffers hold n elements
        // (checked above) and are distinct (`&mut` vs `&`), 256-byte aligned.
        unsafe { b.launch(self.grid_stride(n as u64)) }.map(drop).map_err(driver("cuLaunchKernel(tp_add)"))
    }

    /// `out[i] = round(x[i] * round(s))` for `n` elements (`tp_scale_T`).
    pub fn scale(&self, out: &mut CudaSlice<u8>, x: &CudaSlice<u8>, n: usize, s: f32, ty: ElemType) -> Result<()> {
        self.unary_scalar("scale", "tp_scale", out, x, n, s, ty)
    }

    /// `out[i] = round(round(tanh(round(x[i] / cap))) * cap)` for `n` elements (`tp_softcap_T`).
    pub fn softcap(&self, out: &mut CudaSlice<u8>, x: &CudaSlice<u8>, n: usize, cap: f32, ty: ElemType) -> Result<()> {
        self.unary_scalar("softcap", "tp_softcap", out, x, n, cap, ty)
    }

    /// Launches `{kernel}_T(T* out, const T* x, int64 n, float v)` over `n` elements.
    #[allow(clippy::too_many_arguments)]
    fn unary_scalar(
        &self,
        name: &'static str,
        kernel: &str,
        out: &mut CudaSlice<u8>,
        x: &CudaSlice<u8>,
        n: usize,
        v: f32,
        ty: ElemType,
    ) -> Result<()> {
        require_float(name, ty)?;
        let bytes = span(name, n, ty.size(), 0)?;
        if bytes > x.len() || bytes > out.len() {
            return Err(invalid(name, format!("{n} elements do not fit the buffers")));
        }
        if !v.is_finite() {
            return Err(invalid(name, format!("the scalar must be finite, got {v}")));
        }
        if n == 0 {
            return Ok(());
        }
        let f = self.function(&format!("{kernel}_{}", ty.name()), 0)?;
        let n_i = i64_of(name, n)?;
        let mut b = self.stream().launch_builder(f);
        b.arg(out).arg(x).arg(&n_i).arg(&v);
        // SAFETY: matches tp_scale_T / tp_softcap_T(T* out, const T* x, int64 n, float v); both
        // buffers hold n elements of T (checked above) and are distinct (`&mut` vs `&`);
        // grid-stride over n.
        unsafe { b.launch(self.grid_stride(n as u64)) }.map(drop).map_err(driver("cuLaunchKernel(unary scalar)"))
    }
}
