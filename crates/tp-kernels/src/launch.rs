//! Typed launchers. Each checks its arguments against the kernel's contract (sizes, alignment,
//! grid limits) and returns [`KernelError::InvalidLaunch`] instead of launching a kernel that
//! would read or write out of bounds. Every `unsafe` launch carries a SAFETY note.

use crate::error::{KernelError, Result, driver};
use crate::gpu::Gpu;
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaSlice, LaunchArgs, LaunchConfig, PushKernelArg};

/// Element types the kernels know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElemType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    BF16,
    /// 32-bit signed integer (token ids).
    I32,
    /// 64-bit signed integer (token ids).
    I64,
}

impl ElemType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            ElemType::F32 | ElemType::I32 => 4,
            ElemType::F16 | ElemType::BF16 => 2,
            ElemType::I64 => 8,
        }
    }
    /// Whether this is one of the floating-point types the arithmetic kernels take.
    pub fn is_float(self) -> bool {
        matches!(self, ElemType::F32 | ElemType::F16 | ElemType::BF16)
    }
    pub(crate) fn name(self) -> &'static str {
        match self {
            ElemType::F32 => "f32",
            ElemType::F16 => "f16",
            ElemType::BF16 => "bf16",
            ElemType::I32 => "i32",
            ElemType::I64 => "i64",
        }
    }
}

/// Refuses an integer type for a float-only kernel.
pub(crate) fn require_float(kernel: &'static str, ty: ElemType) -> Result<()> {
    if ty.is_float() { Ok(()) } else { Err(invalid(kernel, format!("takes f32, f16 or bf16, not {}", ty.name()))) }
}

/// A strided copy of `rows` rows of `row_bytes` bytes: row `j` is read at
/// `src_off + j * src_pitch` and written at `dst_off + j * dst_pitch` (all in bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowCopy {
    /// Number of rows.
    pub rows: usize,
    /// Bytes copied per row.
    pub row_bytes: usize,
    /// Bytes between the starts of consecutive source rows.
    pub src_pitch: usize,
    /// Byte offset of the first source row.
    pub src_off: usize,
    /// Bytes between the starts of consecutive destination rows.
    pub dst_pitch: usize,
    /// Byte offset of the first destination row.
    pub dst_off: usize,
}

/// Threads per block of the 1-D grid-stride kernels.
const BLOCK: u32 = 256;
/// Grid-stride grids get at most this many blocks per SM.
const BLOCKS_PER_SM: u64 = 32;
/// Tile edge of both GEMM kernels.
const TILE: usize = 128;
/// Dynamic shared memory of the mma.sync GEMM (kernels/gemm_mma.cu, SMEM_BYTES).
pub const MMA_SMEM_BYTES: u32 = 81920;
/// Dynamic shared memory of the Hopper GEMM (kernels/gemm_wgmma.cu, SMEM_BYTES).
pub const WGMMA_SMEM_BYTES: u32 = 197696;

/// A TMA descriptor as a kernel parameter (`const __grid_constant__ CUtensorMap`).
#[repr(C, align(128))]
#[derive(Clone, Copy)]
struct TensorMap(cudarc::driver::sys::CUtensorMap);

// SAFETY: CUtensorMap is 128 bytes of plain data that the kernel receives by value; the
// wrapper keeps its 128-byte alignment, and it holds no host pointers the device would follow
// (the global address inside is a device address).
unsafe impl cudarc::driver::DeviceRepr for TensorMap {}

/// Largest M the decode-shaped kernel takes (`kernels/gemm_small_m.cu`, MAX_M).
pub const SMALL_M_MAX: usize = 8;

/// The tensor-core GEMM kernels, for [`Gpu::gemm_tensor_core`]'s choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmKernel {
    /// Ampere-style mma.sync + ldmatrix + cp.async (sm_80 and later).
    MmaSync,
    /// Hopper wgmma + TMA, warp-specialised and persistent (sm_90a).
    Wgmma,
}

pub(crate) fn invalid(kernel: &'static str, why: impl Into<String>) -> KernelError {
    KernelError::InvalidLaunch { kernel, why: why.into() }
}

/// `a * b + c` with overflow as an error.
pub(crate) fn span(kernel: &'static str, a: usize, b: usize, c: usize) -> Result<usize> {
    a.checked_mul(b).and_then(|x| x.checked_add(c)).ok_or_else(|| invalid(kernel, "size overflows usize"))
}

pub(crate) fn i64_of(kernel: &'static str, v: usize) -> Result<i64> {
    i64::try_from(v).map_err(|_| invalid(kernel, format!("{v} does not fit in a 64-bit signed index")))
}

/// The widest unit (16, 8, 4, 2 or 1 bytes) dividing every value.
fn unit_for(values: &[usize]) -> usize {
    [16, 8, 4, 2, 1].into_iter().find(|u| values.iter().all(|v| v % u == 0)).unwrap_or(1)
}

impl Gpu {
    pub(crate) fn grid_stride(&self, items: u64) -> LaunchConfig {
        let blocks = items.div_ceil(u64::from(BLOCK)).clamp(1, u64::from(self.sm_count()) * BLOCKS_PER_SM);
        LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
    }

    /// A grid of one block per row, capped at `BLOCKS_PER_SM` per SM (blocks stride over rows).
    pub(crate) fn grid_rows(&self, rows: u64) -> LaunchConfig {
        let blocks = rows.clamp(1, u64::from(self.sm_count()) * BLOCKS_PER_SM);
        LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
    }

    /// Strided row copy from `src` to `dst` (`kernels/shard_copy.cu`, `tp_row_copy_uN`): narrow
    /// into a contiguous shard, or scatter a shard into its slot of a full tensor.
    pub fn row_copy(&self, dst: &mut CudaSlice<u8>, src: &CudaSlice<u8>, c: RowCopy) -> Result<()> {
        const K: &str = "row_copy";
        if c.rows == 0 || c.row_bytes == 0 {
            return Ok(());
        }
        let src_end = span(K, c.rows - 1, c.src_pitch, c.src_off + c.row_bytes)?;
        let dst_end = span(K, c.rows - 1, c.dst_pitch, c.dst_off + c.row_bytes)?;
        if src_end > src.len() || dst_end > dst.len() {
            return Err(invalid(
                K,
                format!("copy reaches byte {src_end} of src ({}) / {dst_end} of dst ({})", src.len(), dst.len()),
            ));
        }
        if c.rows > 1 && (c.src_pitch < c.row_bytes || c.dst_pitch < c.row_bytes) {
            return Err(invalid(K, "pitches shorter than a row would overlap rows"));
        }
        let (sp, dp) = if c.rows == 1 { (c.row_bytes, c.row_bytes) } else { (c.src_pitch, c.dst_pitch) };
        let unit = unit_for(&[c.row_bytes, sp, dp, c.src_off, c.dst_off]);
        let name = format!("tp_row_copy_u{unit}");
        let f = self.function("shard_copy", &name)?;
        let (rows, units) = (i64_of(K, c.rows)?, i64_of(K, c.row_bytes / unit)?);
        let (sp, so) = (i64_of(K, sp / unit)?, i64_of(K, c.src_off / unit)?);
        let (dp, doff) = (i64_of(K, dp / unit)?, i64_of(K, c.dst_off / unit)?);
        let cfg = self.grid_stride((c.rows as u64).saturating_mul(units as u64));
        let mut b = self.stream().launch_builder(&f);
        b.arg(dst).arg(src).arg(&rows).arg(&units).arg(&sp).arg(&so).arg(&dp).arg(&doff);
        // SAFETY: argument order and types match tp_row_copy_uN(U* dst, const U* src, int64 rows,
        // row_units, src_pitch, src_off, dst_pitch, dst_off). Every unit read lies below
        // `src_end <= src.len()` and every write below `dst_end <= dst.len()` (checked above),
        // and all offsets and pitches are multiples of `unit` while allocations are 256-byte
        // aligned, so each `U` access is aligned. `dst` is borrowed mutably and `src` shared,
        // so the two buffers are distinct. The buffers outlive the launch: cudarc records their
        // use on the stream.
        unsafe { b.launch(cfg) }.map(drop).map_err(driver("cuLaunchKernel(tp_row_copy)"))
    }

    /// Gather-interleave (`tp_gather_uN`): `src` is a rank-major all-gather buffer
    /// `(world, rows, cols_r)` of `elem` bytes per element, `cols_r` the balanced split of `cols`;
    /// `dst` receives `(rows, cols)` row-major.
    pub fn gather_interleave(
        &self,
        dst: &mut CudaSlice<u8>,
        src: &CudaSlice<u8>,
        rows: usize,
        cols: usize,
        world: usize,
        elem: usize,
    ) -> Result<()> {
        const K: &str = "gather_interleave";
        if world == 0 || elem == 0 {
            return Err(invalid(K, "world size and element size must be positive"));
        }
        let bytes = span(K, rows, cols, 0)?.checked_mul(elem).ok_or_else(|| invalid(K, "size overflows"))?;
        if bytes > src.len() || bytes > dst.len() {
            return Err(invalid(K, format!("needs {bytes} bytes; src has {}, dst {}", src.len(), dst.len())));
        }
        if bytes == 0 {
            return Ok(());
        }
        // Even shards may move in wide units: every shard width, in bytes, must be a multiple.
        // (For power-of-two `elem`, `elem` divides `q * elem`, so the unit is never narrower.)
        let unit = if cols % world == 0 { unit_for(&[(cols / world) * elem]) } else { elem };
        if ![1, 2, 4, 8, 16].contains(&unit) || unit % elem != 0 {
            return Err(invalid(K, format!("no gather kernel for {elem}-byte elements")));
        }
        let cols_u = cols * elem / unit;
        let (q, r) = (cols_u / world, cols_u % world);
        let f = self.function("shard_copy", &format!("tp_gather_u{unit}"))?;
        let [rows_i, cols_i, q_i, r_i] = [i64_of(K, rows)?, i64_of(K, cols_u)?, i64_of(K, q)?, i64_of(K, r)?];
        let cfg = self.grid_stride((rows as u64).saturating_mul(cols_u as u64));
        let mut b = self.stream().launch_builder(&f);
        b.arg(dst).arg(src).arg(&rows_i).arg(&cols_i).arg(&q_i).arg(&r_i);
        // SAFETY: matches tp_gather_uN(U* dst, const U* src, int64 rows, cols, q, r). The kernel
        // writes dst[0 .. rows*cols_u) and reads src at gather_src(), a permutation of the same
        // range (index_math.cuh; checked on the host by tp-core's tests), and rows*cols_u*unit =
        // `bytes` fits both buffers (checked above). Units are 1 byte or divide every shard's
        // byte width, and the buffers are 256-byte aligned, so accesses are aligned.
        unsafe { b.launch(cfg) }.map(drop).map_err(driver("cuLaunchKernel(tp_gather)"))
    }

    /// `dst[i] = src[i]` converted from `from` to `to` (`kernels/cast.cu`), `n` elements.
    pub fn cast(
        &self,
        dst: &mut CudaSlice<u8>,
        src: &CudaSlice<u8>,
        n: usize,
        from: ElemType,
        to: ElemType,
    ) -> Result<()> {
        const K: &str = "cast";
        require_float(K, from)?;
        require_float(K, to)?;
        if from == to {
            return Err(invalid(K, "source and destination types are equal; copy instead"));
        }
        if span(K, n, from.size(), 0)? > src.len() || span(K, n, to.size(), 0)? > dst.len() {
            return Err(invalid(K, format!("{n} elements do not fit the buffers")));
        }
        if n == 0 {
            return Ok(());
        }
        let f = self.function("cast", &format!("tp_cast_{}_{}", from.name(), to.name()))?;
        let n_i = i64_of(K, n)?;
        let mut b = self.stream().launch_builder(&f);
        b.arg(dst).arg(src).arg(&n_i);
        // SAFETY: matches tp_cast_S_D(D* dst, const S* src, int64 n); n elements of each type fit
        // the buffers (checked above), which are 256-byte aligned and distinct (& vs &mut).
        unsafe { b.launch(self.grid_stride(n as u64)) }.map(drop).map_err(driver("cuLaunchKernel(tp_cast)"))
    }

    /// `out = silu(gate) * up` over `rows` rows of `[gate | up]` (`inner` each), element type
    /// `ty` (`kernels/elementwise.cu`, `tp_swiglu_T`).
    pub fn swiglu(
        &self,
        out: &mut CudaSlice<u8>,
        input: &CudaSlice<u8>,
        rows: usize,
        inner: usize,
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "swiglu";
        require_float(K, ty)?;
        let n = span(K, rows, inner, 0)?;
        if span(K, n, 2 * ty.size(), 0)? > input.len() || span(K, n, ty.size(), 0)? > out.len() {
            return Err(invalid(K, format!("{rows} x {inner} does not fit the buffers")));
        }
        if n == 0 {
            return Ok(());
        }
        let f = self.function("elementwise", &format!("tp_swiglu_{}", ty.name()))?;
        let (r, i) = (i64_of(K, rows)?, i64_of(K, inner)?);
        let mut b = self.stream().launch_builder(&f);
        b.arg(out).arg(input).arg(&r).arg(&i);
        // SAFETY: matches tp_swiglu_T(T* out, const T* in, int64 rows, int64 inner); `in` holds
        // rows*2*inner and `out` rows*inner elements (checked above); distinct buffers (& vs
        // &mut), 256-byte aligned.
        unsafe { b.launch(self.grid_rows(rows as u64)) }.map(drop).map_err(driver("cuLaunchKernel(tp_swiglu)"))
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
        let f = self.function("elementwise", &format!("tp_add_row_{}", ty.name()))?;
        let (r, c) = (i64_of(K, rows)?, i64_of(K, cols)?);
        let mut b = self.stream().launch_builder(&f);
        b.arg(out).arg(input).arg(bias).arg(&r).arg(&c);
        // SAFETY: matches tp_add_row_T(T* out, const T* in, const T* bias, int64 rows, cols);
        // sizes checked above; `out` is the only buffer written and is borrowed mutably.
        unsafe { b.launch(self.grid_rows(rows as u64)) }.map(drop).map_err(driver("cuLaunchKernel(tp_add_row)"))
    }

    /// fp32 SIMT GEMM with fused bias (`kernels/gemm_simt.cu`): `C = A op(B) + bias` where `A` is
    /// `m×k`, `B` is `n×k` when `nk` (so `C = A B^T`) or `k×n` otherwise, `bias` has `n` entries.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_simt_f32(
        &self,
        c: &mut CudaSlice<u8>,
        a: &CudaSlice<u8>,
        b: &CudaSlice<u8>,
        bias: Option<&CudaSlice<u8>>,
        (m, n, k): (usize, usize, usize),
        nk: bool,
    ) -> Result<()> {
        const K: &str = "gemm_simt_f32";
        check_gemm(K, c, a, b, bias, (m, n, k), 4)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let grid = gemm_grid(K, m, n)?;
        let vec_a = k % 4 == 0;
        let vec_b = if nk { k % 4 == 0 } else { n % 4 == 0 };
        let vec = i32::from(vec_a) | (i32::from(vec_b) << 1);
        let f = self.function("gemm_simt", if nk { "tp_gemm_simt_f32_nk" } else { "tp_gemm_simt_f32_kn" })?;
        let [m_i, n_i, k_i] = [i64_of(K, m)?, i64_of(K, n)?, i64_of(K, k)?];
        let mut l = self.stream().launch_builder(&f);
        l.arg(c).arg(a).arg(b);
        push_bias(&mut l, bias);
        l.arg(&m_i).arg(&n_i).arg(&k_i).arg(&vec);
        let cfg = LaunchConfig { grid_dim: grid, block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: matches tp_gemm_simt_f32_xx(float* C, const float* A, const float* B,
        // const float* bias_or_null, int64 M, N, K, int vec). check_gemm verified that A holds
        // m*k, B n*k, C m*n and bias n floats; the kernel bounds-checks every tile edge against
        // M, N, K. Vector (16-byte) loads are enabled only when every row start is a multiple of
        // 4 floats from a 256-byte aligned base. C is the only buffer written and is borrowed
        // mutably, so it aliases no input.
        unsafe { l.launch(cfg) }.map(drop).map_err(driver("cuLaunchKernel(tp_gemm_simt)"))
    }

    /// bf16/f16 tensor-core GEMM with fused bias (`kernels/gemm_mma.cu`): `C = A B^T + bias`,
    /// `A` `m×k`, `B` `n×k` (nn.Linear layout), `C` `m×n`, all of element type `ty`.
    /// Needs compute capability 8.0 or later.
    pub fn gemm_mma(
        &self,
        c: &mut CudaSlice<u8>,
        a: &CudaSlice<u8>,
        b: &CudaSlice<u8>,
        bias: Option<&CudaSlice<u8>>,
        (m, n, k): (usize, usize, usize),
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "gemm_mma";
        if !matches!(ty, ElemType::F16 | ElemType::BF16) {
            return Err(invalid(K, "the mma.sync kernel takes f16 or bf16; use gemm_simt_f32"));
        }
        if self.compute_capability().0 < 8 {
            return Err(invalid(
                K,
                format!(
                    "needs sm_80 or later, device is sm_{}{}",
                    self.compute_capability().0,
                    self.compute_capability().1
                ),
            ));
        }
        if self.smem_optin() < MMA_SMEM_BYTES {
            return Err(invalid(
                K,
                format!("needs {MMA_SMEM_BYTES} B of shared memory per block, device allows {}", self.smem_optin()),
            ));
        }
        check_gemm(K, c, a, b, bias, (m, n, k), 2)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let grid = gemm_grid(K, m, n)?;
        let aligned = k % 8 == 0; // rows of A and B start on 16-byte boundaries
        let name = format!("tp_gemm_mma_{}_nk{}", ty.name(), if aligned { "" } else { "_unaligned" });
        let f = self.function("gemm_mma", &name)?;
        f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, MMA_SMEM_BYTES as i32)
            .map_err(driver("cuFuncSetAttribute"))?;
        let [m_i, n_i, k_i] = [i64_of(K, m)?, i64_of(K, n)?, i64_of(K, k)?];
        let mut l = self.stream().launch_builder(&f);
        l.arg(c).arg(a).arg(b);
        push_bias(&mut l, bias);
        l.arg(&m_i).arg(&n_i).arg(&k_i);
        let cfg = LaunchConfig { grid_dim: grid, block_dim: (256, 1, 1), shared_mem_bytes: MMA_SMEM_BYTES };
        // SAFETY: matches tp_gemm_mma_T_nk[_unaligned](T* C, const T* A, const T* B,
        // const T* bias_or_null, int64 M, N, K). check_gemm verified the buffer sizes; the
        // kernel zero-fills loads past M, N, K and skips stores past M, N. The 16-byte cp.async
        // path is chosen only when K % 8 == 0, so every row of A and B starts 16-byte aligned
        // from a 256-byte aligned allocation. The dynamic shared memory requested is the
        // kernel's SMEM_BYTES (static_assert there) and within the device's opt-in limit, which
        // the function attribute was raised to above. C is borrowed mutably: no aliasing.
        unsafe { l.launch(cfg) }.map(drop).map_err(driver("cuLaunchKernel(tp_gemm_mma)"))
    }
}

impl Gpu {
    /// The kernel that `gemm_tensor_core` uses for this shape on this device: `TP_GEMM_KERNEL`
    /// (`mma` or `wgmma`) when set; otherwise mma.sync. The Hopper kernel becomes the sm_90
    /// default once it has passed the GPU suite on an H200 (it compiles and its SASS is checked
    /// in CI, but it has not run yet); it needs K % 8 == 0 either way.
    pub fn gemm_kernel_for(&self, k: usize) -> GemmKernel {
        let wgmma_ok = self.compute_capability() == (9, 0) && k % 8 == 0;
        match std::env::var("TP_GEMM_KERNEL").as_deref() {
            Ok("wgmma") if wgmma_ok => GemmKernel::Wgmma,
            _ => GemmKernel::MmaSync,
        }
    }

    /// bf16/f16 `C = A B^T + bias` on the kernel [`gemm_kernel_for`](Self::gemm_kernel_for)
    /// picks.
    pub fn gemm_tensor_core(
        &self,
        c: &mut CudaSlice<u8>,
        a: &CudaSlice<u8>,
        b: &CudaSlice<u8>,
        bias: Option<&CudaSlice<u8>>,
        (m, n, k): (usize, usize, usize),
        ty: ElemType,
    ) -> Result<()> {
        match self.gemm_kernel_for(k) {
            GemmKernel::Wgmma => self.gemm_wgmma(c, a, b, bias, (m, n, k), ty),
            GemmKernel::MmaSync => self.gemm_mma(c, a, b, bias, (m, n, k), ty),
        }
    }

    /// `C = A B^T + bias` for the `[N, K]` weight layout, on the kernel that suits the shape:
    /// the decode kernel for `m <= 8` (any dtype), the SIMT kernel for f32, and the tensor-core
    /// kernel [`gemm_kernel_for`](Self::gemm_kernel_for) picks for f16/bf16.
    pub fn gemm_nt(
        &self,
        c: &mut CudaSlice<u8>,
        a: &CudaSlice<u8>,
        b: &CudaSlice<u8>,
        bias: Option<&CudaSlice<u8>>,
        (m, n, k): (usize, usize, usize),
        ty: ElemType,
    ) -> Result<()> {
        if (1..=SMALL_M_MAX).contains(&m) {
            return self.gemm_small_m(c, a, b, bias, (m, n, k), ty);
        }
        match ty {
            ElemType::F32 => self.gemm_simt_f32(c, a, b, bias, (m, n, k), true),
            ElemType::F16 | ElemType::BF16 => self.gemm_tensor_core(c, a, b, bias, (m, n, k), ty),
            ElemType::I32 | ElemType::I64 => require_float("gemm_nt", ty),
        }
    }

    /// Decode-shaped `C = A B^T + bias` for `1 <= m <= 8` (`kernels/gemm_small_m.cu`): one
    /// warp per weight row, 16-byte loads, so the weight streams from memory once.
    pub fn gemm_small_m(
        &self,
        c: &mut CudaSlice<u8>,
        a: &CudaSlice<u8>,
        b: &CudaSlice<u8>,
        bias: Option<&CudaSlice<u8>>,
        (m, n, k): (usize, usize, usize),
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "gemm_small_m";
        require_float(K, ty)?;
        if !(1..=SMALL_M_MAX).contains(&m) {
            return Err(invalid(K, format!("M = {m}; this kernel takes 1..={SMALL_M_MAX}")));
        }
        check_gemm(K, c, a, b, bias, (m, n, k), ty.size())?;
        if n == 0 {
            return Ok(());
        }
        let vec = k % (16 / ty.size()) == 0; // every row starts 16-byte aligned
        let name = format!("tp_gemm_small_m_{}{}", ty.name(), if vec { "" } else { "_unaligned" });
        let f = self.function("gemm_small_m", &name)?;
        let (m_i, n_i, k_i) = (m as i32, i64_of(K, n)?, i64_of(K, k)?);
        let blocks = (n as u64).div_ceil(8).clamp(1, u64::from(self.sm_count()) * BLOCKS_PER_SM);
        let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut l = self.stream().launch_builder(&f);
        l.arg(c).arg(a).arg(b);
        push_bias(&mut l, bias);
        l.arg(&m_i).arg(&n_i).arg(&k_i);
        // SAFETY: matches tp_gemm_small_m_T[_unaligned](T* C, const T* A, const T* B,
        // const T* bias_or_null, int M, int64 N, int64 K). check_gemm verified that A holds m*k,
        // B n*k, C m*n and bias n elements; the kernel reads rows of A and B only below K and
        // writes C[m][n] only for m < M (<= 8) and n < N. The 16-byte vector variant is chosen only
        // when K is a multiple of the vector width, so every vector is in bounds and aligned
        // (allocations are 256-byte aligned). C is borrowed mutably: no aliasing.
        unsafe { l.launch(cfg) }.map(drop).map_err(driver("cuLaunchKernel(tp_gemm_small_m)"))
    }

    /// A 2-D TMA descriptor over a row-major `rows x k` matrix of 2-byte elements at `buf`, box
    /// `64 x box_rows`, 128-byte swizzle, zero fill past the edges.
    fn tensor_map(&self, buf: &CudaSlice<u8>, ty: ElemType, rows: usize, k: usize, box_rows: u32) -> Result<TensorMap> {
        use cudarc::driver::DevicePtr;
        use cudarc::driver::sys::{
            CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave, CUtensorMapL2promotion,
            CUtensorMapSwizzle,
        };
        let dt = match ty {
            ElemType::BF16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            ElemType::F16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            _ => return Err(invalid("gemm_wgmma", "TMA maps here are for 2-byte types")),
        };
        let (ptr, _sync) = buf.device_ptr(self.stream());
        let dims = [k as u64, rows as u64];
        let strides = [(k * ty.size()) as u64]; // bytes between rows; dim 0 is contiguous
        let boxes = [64u32, box_rows];
        let elem_strides = [1u32, 1];
        // SAFETY: all-zero bytes are a valid (if meaningless) CUtensorMap, fully overwritten by
        // a successful cuTensorMapEncodeTiled below.
        let mut map: cudarc::driver::sys::CUtensorMap = unsafe { std::mem::zeroed() };
        // SAFETY: the arrays hold `rank` = 2 entries each and outlive the call; `ptr` is the
        // device address of `buf`, which holds rows*k elements (checked by check_gemm), is
        // 256-byte aligned, and has a row stride that is a multiple of 16 bytes (k % 8 == 0,
        // checked by the caller), as TMA requires.
        let r = unsafe {
            cudarc::driver::sys::cuTensorMapEncodeTiled(
                &mut map,
                dt,
                2,
                ptr as usize as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                elem_strides.as_ptr(),
                CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        r.result().map_err(driver("cuTensorMapEncodeTiled"))?;
        Ok(TensorMap(map))
    }

    /// Hopper bf16/f16 GEMM with fused bias (`kernels/gemm_wgmma.cu`): `C = A B^T + bias`,
    /// `A: m x k`, `B: n x k`. Needs sm_90 and `k % 8 == 0`.
    pub fn gemm_wgmma(
        &self,
        c: &mut CudaSlice<u8>,
        a: &CudaSlice<u8>,
        b: &CudaSlice<u8>,
        bias: Option<&CudaSlice<u8>>,
        (m, n, k): (usize, usize, usize),
        ty: ElemType,
    ) -> Result<()> {
        const K: &str = "gemm_wgmma";
        if !matches!(ty, ElemType::F16 | ElemType::BF16) {
            return Err(invalid(K, "the wgmma kernel takes f16 or bf16"));
        }
        if self.compute_capability() != (9, 0) {
            let (ma, mi) = self.compute_capability();
            return Err(invalid(K, format!("needs sm_90 (Hopper), device is sm_{ma}{mi}")));
        }
        if k % 8 != 0 {
            return Err(invalid(K, format!("K = {k} is not a multiple of 8 (TMA needs 16-byte row strides)")));
        }
        if self.smem_optin() < WGMMA_SMEM_BYTES {
            return Err(invalid(
                K,
                format!("needs {WGMMA_SMEM_BYTES} B of shared memory per block, device allows {}", self.smem_optin()),
            ));
        }
        check_gemm(K, c, a, b, bias, (m, n, k), 2)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let too_big = |v: usize| i32::try_from(v).is_err();
        if too_big(m) || too_big(n) || too_big(k) {
            return Err(invalid(K, "M, N and K must fit in 32-bit ints"));
        }
        let tiles = m.div_ceil(128) * n.div_ceil(256);
        let grid = (tiles.min(self.sm_count() as usize)) as u32;
        let (map_a, map_b) = (self.tensor_map(a, ty, m, k, 128)?, self.tensor_map(b, ty, n, k, 256)?);
        let name = format!("tp_gemm_wgmma_{}", ty.name());
        let f = self.function("gemm_wgmma", &name)?;
        f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, WGMMA_SMEM_BYTES as i32)
            .map_err(driver("cuFuncSetAttribute"))?;
        let [m_i, n_i, k_i] = [m as i32, n as i32, k as i32];
        let mut l = self.stream().launch_builder(&f);
        l.arg(c);
        push_bias(&mut l, bias);
        l.arg(&map_a).arg(&map_b).arg(&m_i).arg(&n_i).arg(&k_i);
        let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (384, 1, 1), shared_mem_bytes: WGMMA_SMEM_BYTES };
        // SAFETY: matches tp_gemm_wgmma_T(T* C, const T* bias_or_null, CUtensorMap tma_a,
        // CUtensorMap tma_b, int M, N, K). The maps describe exactly A (m x k) and B (n x k),
        // whose sizes check_gemm verified; TMA never reads outside them (it zero-fills past the
        // edges). C holds m*n elements and the kernel skips stores past M and N. The dynamic
        // shared memory equals the kernel's SMEM_BYTES (static_assert there), within the device
        // limit the attribute was raised to; 384 threads is the kernel's __launch_bounds__.
        // C is borrowed mutably, so it aliases neither A nor B.
        unsafe { l.launch(cfg) }.map(drop).map_err(driver("cuLaunchKernel(tp_gemm_wgmma)"))
    }
}

/// A null device pointer, passed where a kernel's optional bias is absent.
static NULL_PTR: u64 = 0;

/// Pushes the GEMM kernels' `const T* bias` argument: the bias buffer, or a null pointer.
fn push_bias<'a>(l: &mut LaunchArgs<'a>, bias: Option<&'a CudaSlice<u8>>) {
    match bias {
        Some(bias) => l.arg(bias),
        None => l.arg(&NULL_PTR),
    };
}

/// Buffer-size checks shared by the GEMM launchers (`elem` bytes per element).
fn check_gemm(
    kernel: &'static str,
    c: &CudaSlice<u8>,
    a: &CudaSlice<u8>,
    b: &CudaSlice<u8>,
    bias: Option<&CudaSlice<u8>>,
    (m, n, k): (usize, usize, usize),
    elem: usize,
) -> Result<()> {
    let need = |rows: usize, cols: usize| span(kernel, rows, cols, 0).and_then(|x| span(kernel, x, elem, 0));
    for (what, have, want) in [("A", a.len(), need(m, k)?), ("B", b.len(), need(n, k)?), ("C", c.len(), need(m, n)?)] {
        if have < want {
            return Err(invalid(kernel, format!("{what} holds {have} bytes, needs {want}")));
        }
    }
    if let Some(bias) = bias
        && bias.len() < need(1, n)?
    {
        return Err(invalid(kernel, format!("bias holds {} bytes, needs {}", bias.len(), n * elem)));
    }
    Ok(())
}

/// `(ceil(n / 128), ceil(m / 128), 1)`, within CUDA's grid limits.
fn gemm_grid(kernel: &'static str, m: usize, n: usize) -> Result<(u32, u32, u32)> {
    let (gx, gy) = (n.div_ceil(TILE), m.div_ceil(TILE));
    if gx > i32::MAX as usize || gy > 65535 {
        return Err(invalid(kernel, format!("grid {gx} x {gy} exceeds CUDA's limits (2^31-1 x 65535)")));
    }
    Ok((gx as u32, gy as u32, 1))
}

#[cfg(test)]
mod tests {
    #[test]
    fn unit_is_the_widest_common_divisor_power() {
        assert_eq!(super::unit_for(&[32, 64, 16]), 16);
        assert_eq!(super::unit_for(&[24, 8]), 8);
        assert_eq!(super::unit_for(&[6, 4]), 2);
        assert_eq!(super::unit_for(&[3]), 1);
    }

    #[test]
    fn grids_respect_limits() {
        assert_eq!(super::gemm_grid("t", 129, 1).unwrap(), (1, 2, 1));
        assert!(super::gemm_grid("t", 65536 * 128, 1).is_err());
    }
}
