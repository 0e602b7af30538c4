//! Element-wise ops between GEMMs: the gated activation on a merged `[gate | up]` output
//! (SwiGLU, GeGLU), a row-broadcast bias add, the residual add, a scalar scale (Gemma's
//! embedding) and soft-capping (Gemma's final logits). All compute in f32 and round to the dtype
//! at the points PyTorch does: once per op (a gated activation is two ops there, `act(gate)`
//! then `* up`, so it rounds twice, as Hugging Face's MLP does).

use crate::storage::{CpuStorage, Storage};
use crate::{Element, Error, Result, Shape, Tensor, with_dtype};

/// The activation of a gated MLP's gate, and what it does to the up projection.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Activation {
    /// `silu(g) = g / (1 + e^-g)` (Hugging Face's `silu`): SwiGLU.
    #[default]
    Silu,
    /// `gelu_tanh(g) = g/2 · (1 + tanh(sqrt(2/π) · (g + 0.044715 g³)))` (`gelu_pytorch_tanh`):
    /// GeGLU, as Gemma uses it.
    GeluTanh,
    /// gpt-oss's clamped SwiGLU: with `g' = min(g, limit)` and `u' = clamp(u, -limit, limit)`,
    /// `act(g) = g' σ(α g')` and the up factor is `u' + 1`, so the gated output is
    /// `(u' + 1) · g' σ(α g')` (transformers' `GptOssExperts._apply_gate`).
    ClampedSwiglu {
        /// The sigmoid's gain `α` (`swiglu_alpha`, 1.702).
        alpha: f32,
        /// The clamp (`swiglu_limit`, 7).
        limit: f32,
    },
}

impl Activation {
    /// The activation a Hugging Face config names in `hidden_act` / `hidden_activation`:
    /// `silu` (or `swish`) and `gelu_pytorch_tanh` (Gemma's); `None` for any other (tp's gated
    /// MLPs take these two).
    pub fn from_hidden_act(name: &str) -> Option<Activation> {
        match name {
            "silu" | "swish" => Some(Activation::Silu),
            "gelu_pytorch_tanh" => Some(Activation::GeluTanh),
            _ => None,
        }
    }

    /// What multiplies `act(gate)`: the up projection itself, or for the clamped SwiGLU
    /// `clamp(u, -limit, limit) + 1`.
    #[inline(always)]
    pub fn up(self, u: f32) -> f32 {
        match self {
            Activation::ClampedSwiglu { limit, .. } => u.clamp(-limit, limit) + 1.0,
            _ => u,
        }
    }

    /// The derivative of [`up`](Self::up): 1, or the clamp's pass-through mask (1 on
    /// `-limit <= u <= limit`, as `torch.clamp`'s gradient).
    pub fn up_derivative(self, u: f32) -> f32 {
        match self {
            Activation::ClampedSwiglu { limit, .. } => f32::from(u8::from((-limit..=limit).contains(&u))),
            _ => 1.0,
        }
    }

    /// The activation in f32.
    pub fn apply(self, g: f32) -> f32 {
        match self {
            Activation::Silu => g / (1.0 + (-g).exp()),
            Activation::ClampedSwiglu { alpha, limit } => {
                let g = g.min(limit);
                g / (1.0 + (-alpha * g).exp())
            }
            Activation::GeluTanh => {
                // PyTorch's CPU kernel: 0.5 * x * (1 + tanh(kBeta * (x + kKappa * x^3))).
                const BETA: f32 = std::f32::consts::SQRT_2 * std::f32::consts::FRAC_2_SQRT_PI * 0.5;
                const KAPPA: f32 = 0.044715;
                let cube = g * g * g;
                let inner = BETA * (g + KAPPA * cube);
                0.5 * g * (1.0 + inner.tanh())
            }
        }
    }

    /// The activation's derivative in f32: `silu'(g) = σ(g) · (1 + g · (1 - σ(g)))`;
    /// `gelu_tanh'(g) = (1 + tanh u) / 2 + g/2 · (1 - tanh² u) · β (1 + 3κ g²)` with
    /// `u = β (g + κ g³)`.
    pub fn derivative(self, g: f32) -> f32 {
        match self {
            Activation::Silu => {
                let s = 1.0 / (1.0 + (-g).exp());
                s * (1.0 + g * (1.0 - s))
            }
            Activation::GeluTanh => {
                const BETA: f32 = std::f32::consts::SQRT_2 * std::f32::consts::FRAC_2_SQRT_PI * 0.5;
                const KAPPA: f32 = 0.044715;
                let th = (BETA * (g + KAPPA * g * g * g)).tanh();
                0.5 * (1.0 + th) + 0.5 * g * (1.0 - th * th) * BETA * (1.0 + 3.0 * KAPPA * g * g)
            }
            // `d/dg [g σ(αg)] = σ(αg) (1 + α g (1 - σ(αg)))` below the clamp, 0 above it
            // (`torch.clamp(max=)` passes the gradient where `g <= limit`).
            Activation::ClampedSwiglu { alpha, limit } => {
                if g > limit {
                    return 0.0;
                }
                let s = 1.0 / (1.0 + (-alpha * g).exp());
                s * (1.0 + alpha * g * (1.0 - s))
            }
        }
    }

    /// The kernels' arguments for the activation: its code, and the clamped SwiGLU's alpha and
    /// limit (zeros for the others, which do not read them).
    pub(crate) fn kernel_args(self) -> (i32, f32, f32) {
        match self {
            Activation::Silu => (0, 0.0, 0.0),
            Activation::GeluTanh => (1, 0.0, 0.0),
            Activation::ClampedSwiglu { alpha, limit } => (2, alpha, limit),
        }
    }
}

impl Tensor {
    /// `silu(gate) * up` where the last dim of `self` is `[gate | up]`: `glu(Activation::Silu)`.
    pub fn swiglu(&self) -> Result<Tensor> {
        self.glu(Activation::Silu)
    }

    /// `act(gate) * up` where the last dim of `self` is `[gate | up]` (even length `2I`):
    /// `[.., 2I] -> [.., I]`, `act(gate)` rounded to the dtype before the product. The
    /// activation of a gated MLP after a merged gate/up projection.
    ///
    /// Errors: [`Error::RankMismatch`] for a scalar, [`Error::ShapeMismatch`] for an odd last dim.
    pub fn glu(&self, act: Activation) -> Result<Tensor> {
        const OP: &str = "glu";
        self.require_float()?;
        let (&two_i, lead) = self.dims().split_last().ok_or(Error::RankMismatch {
            op: OP,
            expected: "at least 1",
            dims: self.dims().to_vec(),
        })?;
        if two_i % 2 != 0 {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.dims().to_vec(),
                rhs: vec![two_i / 2, two_i / 2],
                why: "the last dim must be an even [gate | up] pair",
            });
        }
        let inner = two_i / 2;
        let rows: usize = lead.iter().product();
        let mut dims = lead.to_vec();
        dims.push(inner);
        let shape = Shape::new(&dims)?;
        if let Storage::Cuda(s) = self.storage() {
            return Ok(Tensor::from_cuda(shape, super::cuda::glu(s, rows, inner, act.kernel_args())?));
        }
        let src = self.cpu_storage(OP)?;
        let out = with_dtype!(src.dtype(), T => CpuStorage::from_vec(host_glu::<T>(src.as_slice::<T>().unwrap_or_default(), rows, inner, act)?));
        Ok(Tensor::from_cpu(shape, out))
    }

    /// `self + bias`, `bias` of shape `[N]` broadcast over the rows of `self: [.., N]`.
    ///
    /// Errors: dtype/device mismatch, [`Error::ShapeMismatch`] if `bias` is not `[N]`.
    pub fn add_row(&self, bias: &Tensor) -> Result<Tensor> {
        const OP: &str = "add_row";
        self.require_float()?;
        super::same_dtype_device(OP, self, bias)?;
        let n = *self.dims().last().ok_or(Error::RankMismatch { op: OP, expected: "at least 1", dims: vec![] })?;
        if bias.dims() != [n] {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.dims().to_vec(),
                rhs: bias.dims().to_vec(),
                why: "bias must be [N] for a [.., N] tensor",
            });
        }
        let rows = self.numel().checked_div(n).unwrap_or(0);
        if let (Storage::Cuda(s), Storage::Cuda(b)) = (self.storage(), bias.storage()) {
            return Ok(Tensor::from_cuda(self.shape().clone(), super::cuda::add_row(s, b, rows, n)?));
        }
        let (x, b) = (self.cpu_storage(OP)?, bias.cpu_storage(OP)?);
        let out = with_dtype!(x.dtype(), T => {
            let (xs, bs) = (x.as_slice::<T>().unwrap_or_default(), b.as_slice::<T>().unwrap_or_default());
            let v = xs.iter().enumerate().map(|(i, v)| T::from_f32(v.to_f32() + bs[i % n.max(1)].to_f32()));
            CpuStorage::from_vec(crate::alloc::collect(OP, xs.len(), v)?)
        });
        Ok(Tensor::from_cpu(self.shape().clone(), out))
    }
}

impl Tensor {
    /// `self + other`, element by element (same shape, dtype and device): the residual add.
    ///
    /// Errors: dtype/device mismatch, [`Error::ShapeMismatch`], [`Error::NotFloat`].
    pub fn add(&self, other: &Tensor) -> Result<Tensor> {
        let mut out = self.clone();
        out.add_assign(other)?;
        Ok(out)
    }

    /// `self += other` in place: the elements are overwritten where this tensor is their only
    /// owner (host or device); shared elements are copied first, as for every in-place write.
    ///
    /// Errors: as [`add`](Self::add); on error `self` is unchanged.
    pub fn add_assign(&mut self, other: &Tensor) -> Result<()> {
        const OP: &str = "add";
        self.require_float()?;
        super::same_dtype_device(OP, self, other)?;
        if self.dims() != other.dims() {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.dims().to_vec(),
                rhs: other.dims().to_vec(),
                why: "element-wise add needs equal shapes",
            });
        }
        let n = self.numel();
        if let Storage::Cuda(o) = other.storage() {
            return super::cuda::add_assign(self.cuda_storage_mut(OP)?, o, n);
        }
        let o = other.cpu_storage(OP)?;
        with_dtype!(self.dtype(), T => {
            let theirs = o.as_slice::<T>().unwrap_or_default();
            let mine = self.as_mut_slice::<T>()?;
            super::par::rows(mine, CHUNK, CHUNK, |c0, chunk| {
                for (a, b) in chunk.iter_mut().zip(&theirs[c0 * CHUNK..]) {
                    *a = T::from_f32(a.to_f32() + b.to_f32());
                }
            });
        });
        Ok(())
    }
}

/// Elements per task of the element-wise host loops.
const CHUNK: usize = 1 << 14;

/// `act(gate) ⊙ up` row by row, in f32 blocks: each block of the gate and up halves widened
/// once, the activation rounded to the dtype (as torch's activation output), the product
/// rounded again. SiLU runs as `g · σ(g)` with the vectorisable [`exp_neg`](super::attention)
/// (within 2 ulp of `exp`), so the block loop compiles to vector code.
fn host_glu<T: Element>(x: &[T], rows: usize, inner: usize, act: Activation) -> Result<Vec<T>> {
    let mut out = crate::alloc::zeroed::<T>("glu", rows * inner)?;
    super::par::rows(&mut out, inner, 2 * inner, |r0, chunk| {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked just above), all `#[target_feature]` adds.
            return unsafe { glu_rows_avx512(x, r0, chunk, inner, act) };
        }
        glu_rows(x, r0, chunk, inner, act)
    });
    Ok(out)
}

/// [`glu_rows`] compiled for AVX-512 (the same operations, none fused, so the same bits: the
/// activation's exponential vectorises 16 wide).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn glu_rows_avx512<T: Element>(x: &[T], r0: usize, chunk: &mut [T], inner: usize, act: Activation) {
    glu_rows(x, r0, chunk, inner, act)
}

/// Elements of the gate and up halves widened to `f32` at a time.
const GLU_BLOCK: usize = 256;

/// Output rows `r0 ..` (`chunk`, `inner` each) of [`host_glu`], in blocks of [`GLU_BLOCK`]
/// columns ([`glu_block`]). Plain loops (a closure would not be compiled with the caller's
/// target features).
#[inline(always)]
fn glu_rows<T: Element>(x: &[T], r0: usize, chunk: &mut [T], inner: usize, act: Activation) {
    let mut scratch = GluScratch::<T, GLU_BLOCK>::new();
    for (i, o) in chunk.chunks_exact_mut(inner.max(1)).enumerate() {
        let row = &x[(r0 + i) * 2 * inner..(r0 + i + 1) * 2 * inner];
        let (gate, up) = row.split_at(inner);
        for ((o, gate), up) in o.chunks_mut(GLU_BLOCK).zip(gate.chunks(GLU_BLOCK)).zip(up.chunks(GLU_BLOCK)) {
            glu_block(gate, up, o, act, &mut scratch);
        }
    }
}

/// The `f32` blocks of `N` elements [`glu_block`] works in.
struct GluScratch<T, const N: usize> {
    g: [f32; N],
    u: [f32; N],
    a: [T; N],
}

impl<T: Element, const N: usize> GluScratch<T, N> {
    fn new() -> Self {
        GluScratch { g: [0.0; N], u: [0.0; N], a: [T::from_f32(0.0); N] }
    }
}

/// `o = round(round(act(gate)) · up)` over one block of at most `N` elements (see
/// [`host_glu`]).
#[inline(always)]
fn glu_block<T: Element, const N: usize>(
    gate: &[T],
    up: &[T],
    o: &mut [T],
    act: Activation,
    scratch: &mut GluScratch<T, N>,
) {
    let n = o.len();
    let (g, u, a) = (&mut scratch.g[..n], &mut scratch.u[..n], &mut scratch.a[..n]);
    T::slice_to_f32(gate, g);
    T::slice_to_f32(up, u);
    activate(g, act);
    T::slice_from_f32(g, a); // rounded, as torch's activation output
    T::slice_to_f32(a, g);
    if let Activation::ClampedSwiglu { .. } = act {
        // `clamp(u) + 1`, rounded as torch's sum.
        for u in u.iter_mut() {
            *u = T::from_f32(act.up(*u)).to_f32();
        }
    }
    for (g, u) in g.iter_mut().zip(u.iter()) {
        *g *= u;
    }
    T::slice_from_f32(g, o);
}

/// The gated activation, element by element, on `f32` blocks of a gate and an up projection's
/// outputs (the same elements of each, as a product fused with its activation hands them
/// over): both rounded to `T` (as the product's output in `T` would be), then [`glu_block`],
/// the result widened back to `f32` (exact). So each output is bitwise [`Tensor::glu`]'s of
/// the product's `[G | U]` in `T`.
pub(super) fn glu_pair<T: Element>(gate: &[f32], up: &[f32], out: &mut [f32], act: Activation) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F (checked just above), all `#[target_feature]` adds.
        return unsafe { glu_pair_avx512::<T>(gate, up, out, act) };
    }
    glu_pair_body::<T>(gate, up, out, act)
}

/// [`glu_pair_body`] compiled for AVX-512 (the same operations, so the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn glu_pair_avx512<T: Element>(gate: &[f32], up: &[f32], out: &mut [f32], act: Activation) {
    glu_pair_body::<T>(gate, up, out, act)
}

#[inline(always)]
fn glu_pair_body<T: Element>(gate: &[f32], up: &[f32], out: &mut [f32], act: Activation) {
    if T::DTYPE == crate::DType::F32 {
        // Every rounding to `T` is the identity: `glu_block`'s operations without its copies.
        out.copy_from_slice(gate);
        activate(out, act);
        for (o, &u) in out.iter_mut().zip(up) {
            *o *= act.up(u);
        }
        return;
    }
    const N: usize = GLU_BLOCK;
    let mut scratch = GluScratch::<T, N>::new();
    let (mut gt, mut ut, mut ot) = ([T::from_f32(0.0); N], [T::from_f32(0.0); N], [T::from_f32(0.0); N]);
    for ((o, g), u) in out.chunks_mut(N).zip(gate.chunks(N)).zip(up.chunks(N)) {
        let n = o.len();
        T::slice_from_f32(g, &mut gt[..n]);
        T::slice_from_f32(u, &mut ut[..n]);
        glu_block(&gt[..n], &ut[..n], &mut ot[..n], act, &mut scratch);
        T::slice_to_f32(&ot[..n], o);
    }
}

/// `g = act(g)` element by element (one loop per activation, so each vectorises).
#[inline(always)]
fn activate(g: &mut [f32], act: Activation) {
    match act {
        Activation::Silu => {
            for v in g.iter_mut() {
                *v = silu(*v);
            }
        }
        Activation::GeluTanh | Activation::ClampedSwiglu { .. } => {
            for v in g.iter_mut() {
                *v = act.apply(*v);
            }
        }
    }
}

/// `g · σ(g)` with `σ(g) = 1 / (1 + e^-g)` for `g >= 0` and `e^g / (1 + e^g)` below, so the one
/// exponential taken is of `-|g|` (never overflows) and branch-free.
#[inline(always)]
fn silu(g: f32) -> f32 {
    let e = super::attention::exp_neg(-g.abs());
    let num = if g >= 0.0 { 1.0 } else { e };
    g * (num / (1.0 + e))
}

impl Tensor {
    /// `round(self · round(s))`: every element times the scalar `s` rounded to the dtype first
    /// (PyTorch's `x * torch.tensor(s).to(dtype)`; Gemma's embedding scale `sqrt(H)`).
    ///
    /// Errors: [`Error::NotFloat`], [`Error::InvalidArgument`] for a non-finite `s`.
    pub fn scale(&self, s: f32) -> Result<Tensor> {
        const OP: &str = "scale";
        self.require_float()?;
        if !s.is_finite() {
            return Err(Error::InvalidArgument { op: OP, why: format!("the factor must be finite, got {s}") });
        }
        let n = self.numel();
        if let Storage::Cuda(x) = self.storage() {
            return Ok(Tensor::from_cuda(self.shape().clone(), super::cuda::scale(x, n, s)?));
        }
        self.map_host(OP, |v, round| v * round(s))
    }

    /// Soft-capping at `cap`: `round(round(tanh(round(x / cap))) · cap)`, PyTorch's
    /// `x / cap; tanh; * cap` rounded after each op (Gemma's final logits).
    ///
    /// Errors: [`Error::NotFloat`], [`Error::InvalidArgument`] unless `cap` is finite and > 0.
    pub fn softcap(&self, cap: f32) -> Result<Tensor> {
        const OP: &str = "softcap";
        self.require_float()?;
        if !(cap.is_finite() && cap > 0.0) {
            return Err(Error::InvalidArgument { op: OP, why: format!("the cap must be finite and > 0, got {cap}") });
        }
        let n = self.numel();
        if let Storage::Cuda(x) = self.storage() {
            return Ok(Tensor::from_cuda(self.shape().clone(), super::cuda::softcap(x, n, cap)?));
        }
        self.map_host(OP, |v, round| round(round(v / cap).tanh()) * cap)
    }

    /// The host side of an element-wise op: `f(x, round)` of every element in f32, `round`
    /// rounding an f32 to this tensor's dtype, and the result rounded to it once more.
    fn map_host(&self, op: &'static str, f: impl Fn(f32, &dyn Fn(f32) -> f32) -> f32) -> Result<Tensor> {
        let x = self.cpu_storage(op)?;
        let out = with_dtype!(x.dtype(), T => {
            let round = |v: f32| T::from_f32(v).to_f32();
            let v = x.as_slice::<T>().unwrap_or_default().iter().map(|v| T::from_f32(f(v.to_f32(), &round)));
            CpuStorage::from_vec(crate::alloc::collect(op, self.numel(), v)?)
        });
        Ok(Tensor::from_cpu(self.shape().clone(), out))
    }
}

/// Backward passes of the element-wise ops (training; f32 results, on the host or the GPU:
/// `kernels/grad.cu`, the same formulas rounded in the same order).
impl Tensor {
    /// The gradient of [`glu`](Tensor::glu)`(act)` with respect to its input `self =
    /// [gate | up]: [.., 2I]`, given `dy: [.., I]`: `[dgate | dup]` with
    /// `dgate = dy ⊙ up(u) ⊙ act'(gate)` and `dup = dy ⊙ act(gate) ⊙ up'(u)` (`up` the identity
    /// but for the clamped SwiGLU's `clamp(u) + 1`: [`Activation::up`]), in f32.
    ///
    /// Errors: `dy` not `[.., I]` for this input, operands on different devices.
    pub fn glu_backward(&self, act: Activation, dy: &Tensor) -> Result<Tensor> {
        const OP: &str = "glu_backward";
        let (rows, two_i) = super::grad::rows_cols(OP, self)?;
        let inner = two_i / 2;
        if two_i % 2 != 0 || super::grad::rows_cols(OP, dy)? != (rows, inner) {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.dims().to_vec(),
                rhs: dy.dims().to_vec(),
                why: "needs an input [.., 2I] and a gradient [.., I]",
            });
        }
        if let Storage::Cuda(x) = self.storage() {
            self.require_float()?;
            let d = super::grad::cuda_float(OP, self, dy)?;
            let args = act.kernel_args();
            return Ok(Tensor::from_cuda(self.shape().clone(), super::cuda::glu_backward(x, d, rows, inner, args)?));
        }
        let (x, dyt) = (super::grad::f32_host(OP, self)?, super::grad::f32_host(OP, dy)?);
        let (x, dys) = (x.as_slice::<f32>()?, dyt.as_slice::<f32>()?);
        let mut out = vec![0f32; rows * two_i];
        super::par::rows(&mut out, two_i, two_i, |r0, chunk| {
            for (i, o) in chunk.chunks_exact_mut(two_i.max(1)).enumerate() {
                let r = r0 + i;
                let (g, u) = (&x[r * two_i..r * two_i + inner], &x[r * two_i + inner..(r + 1) * two_i]);
                let d = &dys[r * inner..(r + 1) * inner];
                let (dg, du) = o.split_at_mut(inner);
                for i in 0..inner {
                    dg[i] = d[i] * act.up(u[i]) * act.derivative(g[i]);
                    du[i] = d[i] * act.apply(g[i]) * act.up_derivative(u[i]);
                }
            }
        });
        Tensor::from_vec(out, self.dims(), &crate::Device::Cpu)
    }

    /// The gradient of [`softcap`](Tensor::softcap)`(cap)` with respect to its input, from its
    /// output `self = y = cap · tanh(x / cap)` and `dy`: `dy ⊙ (1 - (y / cap)²)`, in f32.
    ///
    /// Errors: shapes differing, a cap not finite and > 0, operands on different devices.
    pub fn softcap_backward(&self, cap: f32, dy: &Tensor) -> Result<Tensor> {
        const OP: &str = "softcap_backward";
        if self.dims() != dy.dims() || !(cap.is_finite() && cap > 0.0) {
            return Err(Error::InvalidArgument {
                op: OP,
                why: format!("needs one shape ({:?} vs {:?}) and a cap > 0 (got {cap})", self.dims(), dy.dims()),
            });
        }
        if let Storage::Cuda(y) = self.storage() {
            self.require_float()?;
            let d = super::grad::cuda_float(OP, self, dy)?;
            return Ok(Tensor::from_cuda(
                self.shape().clone(),
                super::cuda::softcap_backward(y, d, self.numel(), cap)?,
            ));
        }
        let (y, d) = (super::grad::f32_host(OP, self)?, super::grad::f32_host(OP, dy)?);
        let (y, d) = (y.as_slice::<f32>()?, d.as_slice::<f32>()?);
        let mut out = vec![0f32; y.len()];
        super::par::rows(&mut out, CHUNK, CHUNK, |c0, chunk| {
            let at = c0 * CHUNK;
            for (i, o) in chunk.iter_mut().enumerate() {
                *o = d[at + i] * (1.0 - (y[at + i] / cap).powi(2));
            }
        });
        Tensor::from_vec(out, self.dims(), &crate::Device::Cpu)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{bf16, f16};

    /// The AVX-512 build of the GLU rows gives the baseline build's bits, for every float dtype
    /// and both activations, on values across the exponential's range.
    #[test]
    fn the_avx512_glu_gives_the_baseline_bits() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            fn check<T: Element>() {
                let (rows, inner) = (3, 300);
                let mut s = 0x9E37_79B9u64;
                let x: Vec<T> = (0..rows * 2 * inner)
                    .map(|_| {
                        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        T::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 60.0)
                    })
                    .collect();
                for act in [Activation::Silu, Activation::GeluTanh] {
                    let (mut base, mut wide) =
                        (vec![T::from_f32(0.0); rows * inner], vec![T::from_f32(0.0); rows * inner]);
                    glu_rows(&x, 0, &mut base, inner, act);
                    // SAFETY: AVX-512F checked above.
                    unsafe { glu_rows_avx512(&x, 0, &mut wide, inner, act) };
                    assert!(base.iter().zip(&wide).all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits()));
                }
            }
            check::<f32>();
            check::<f16>();
            check::<bf16>();
        }
    }
}
