//! The GPU half of tp-bench: our kernels beside their references, measured in the same process,
//! over the shape set (squares 1024..16384, Llama 3 8B/70B projections at TP 1, 2, 4, 8 with 1 to
//! 4096 tokens) and dtypes, with the roofline column from ceilings measured at start (cuBLAS on
//! a large square per dtype; cuMemcpyDtoD bandwidth).
//!
//! Method: CUDA events around each run on the device's stream; 3 warm-up runs, then the median of
//! 20 (5 with --quick). Before every timed run a 256 MiB buffer is cleared, which evicts the
//! operands from the 50 MB L2, so no run is timed from cache. GEMM throughput is 2·M·N·K / time;
//! copy bandwidth counts the bytes read plus the bytes written.

use crate::shapes::Gemm as Problem;
use crate::{Args, Ceilings, Row};
use anyhow::{Context, Result, anyhow};
use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::CudaSlice;
use cudarc::driver::sys::CUevent_flags;
use half::{bf16, f16};
use std::sync::Arc;
use tp_core::rng::SplitMix64;
use tp_kernels::{ElemType, GemmArgs, GemmShape, Gpu, RowCopy};

const MIB: usize = 1 << 20;

struct Timer {
    gpu: Arc<Gpu>,
    flush: CudaSlice<u8>,
    reps: usize,
}

impl Timer {
    /// Median milliseconds of `f` over `reps` runs, each after an L2 flush.
    fn median_ms(&mut self, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
        let stream = self.gpu.stream().clone();
        let ctx = self.gpu.context();
        let ev = || ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| anyhow!("cuEventCreate: {e:?}"));
        let (start, end) = (ev()?, ev()?);
        for _ in 0..3 {
            f()?;
        }
        let mut times = Vec::with_capacity(self.reps);
        for _ in 0..self.reps {
            stream.memset_zeros(&mut self.flush).map_err(|e| anyhow!("memset: {e:?}"))?;
            start.record(&stream).map_err(|e| anyhow!("cuEventRecord: {e:?}"))?;
            f()?;
            end.record(&stream).map_err(|e| anyhow!("cuEventRecord: {e:?}"))?;
            end.synchronize().map_err(|e| anyhow!("cuEventSynchronize: {e:?}"))?;
            times.push(f64::from(start.elapsed_ms(&end).map_err(|e| anyhow!("cuEventElapsedTime: {e:?}"))?));
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    }
}

pub fn run(gpu: &Arc<Gpu>, args: &Args) -> Result<Vec<Row>> {
    let mut timer = Timer { gpu: gpu.clone(), flush: gpu.alloc(256 * MIB)?, reps: 20 };
    // cudarc panics on first use when libcublas cannot be loaded: probe for it first.
    // SAFETY: is_culib_present only tries to dlopen libcublas by its known names.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        anyhow::bail!("cuBLAS (libcublas.so.13) not found: put the CUDA libraries on LD_LIBRARY_PATH (run.sh does)");
    }
    let blas = CudaBlas::new(gpu.stream().clone()).map_err(|e| anyhow!("cuBLAS unavailable: {e:?}"))?;
    let mut rows = Vec::new();
    let memcpy_tbps = copies(gpu, &mut timer, args.quick, &mut rows)?;
    let gemms = args.gemms(true)?;
    // Compute ceilings: cuBLAS on a large square, per dtype, measured now.
    let edge = if args.quick { 4096 } else { 8192 };
    let mut ceilings = Vec::new();
    for dtype in &args.dtypes {
        let ty = elem(*dtype);
        let probe = Problem { label: "ceiling".into(), m: edge, n: edge, k: edge };
        let row = gemm_row(gpu, &mut timer, &blas, ty, &probe, None, false)?;
        let peak = row.baseline.unwrap_or(row.ours).max(row.ours);
        println!("ceiling {dtype}: {peak:.0} TFLOP/s (cuBLAS {edge}^3), memory {memcpy_tbps:.2} TB/s (cuMemcpyDtoD)");
        ceilings.push(Ceilings { compute: peak, memory: memcpy_tbps });
    }
    for (i, g) in gemms.iter().enumerate() {
        for (dtype, ceil) in args.dtypes.iter().zip(&ceilings) {
            eprint!("\r  [{}/{}] gemm {} {} {dtype}        ", i + 1, gemms.len(), g.label, g.shape());
            rows.push(gemm_row(gpu, &mut timer, &blas, elem(*dtype), g, Some(ceil), false)?);
            // On Hopper, the wgmma kernel beside the mma.sync one, against the same cuBLAS.
            if *dtype != tp_core::DType::F32 && gpu.compute_capability() == (9, 0) && g.k % 8 == 0 {
                rows.push(gemm_row(gpu, &mut timer, &blas, elem(*dtype), g, Some(ceil), true)?);
            }
        }
    }
    eprintln!();
    Ok(rows)
}

fn elem(d: tp_core::DType) -> ElemType {
    match d {
        tp_core::DType::F32 => ElemType::F32,
        tp_core::DType::F16 => ElemType::F16,
        tp_core::DType::BF16 => ElemType::BF16,
        tp_core::DType::I32 => ElemType::I32,
        tp_core::DType::I64 => ElemType::I64,
    }
}

/// `n` random elements of `ty` on the device, with magnitudes in [2^-8, 1) and random signs,
/// built from random bits (fast enough for 16384^2 operands).
fn random(gpu: &Gpu, ty: ElemType, n: usize, seed: u64) -> Result<CudaSlice<u8>> {
    if !ty.is_float() {
        anyhow::bail!("GEMM benchmarks take float types, not {ty:?}");
    }
    let mut rng = SplitMix64::new(seed);
    let mut bytes = Vec::with_capacity(n * ty.size());
    for _ in 0..n {
        let r = rng.next_u64();
        let (sign, exp, mant) = (r & 1, (r >> 1) & 7, r >> 4);
        match ty {
            ElemType::F32 => bytes
                .extend_from_slice(&(((sign << 31) | ((119 + exp) << 23) | (mant & 0x7f_ffff)) as u32).to_le_bytes()),
            ElemType::F16 => {
                bytes.extend_from_slice(&(((sign << 15) | ((7 + exp) << 10) | (mant & 0x3ff)) as u16).to_le_bytes())
            }
            ElemType::BF16 => {
                bytes.extend_from_slice(&(((sign << 15) | ((119 + exp) << 7) | (mant & 0x7f)) as u16).to_le_bytes())
            }
            ElemType::I32 | ElemType::I64 => {}
        }
    }
    Ok(gpu.htod(&bytes)?)
}

/// Copy rows; returns the memcpy bandwidth of the largest size (TB/s, read + write).
fn copies(gpu: &Arc<Gpu>, timer: &mut Timer, quick: bool, rows: &mut Vec<Row>) -> Result<f64> {
    let mut memcpy_tbps = 0.0;
    let sizes: &[usize] = if quick { &[256 * MIB] } else { &[256 * MIB, 1024 * MIB] };
    for &bytes in sizes {
        let label = format!("{} MiB", bytes / MIB);
        let src = gpu.alloc(2 * bytes)?; // room for a full tensor twice the shard
        let mut dst = gpu.alloc(2 * bytes)?;
        let gbps = |ms: f64| 2.0 * bytes as f64 / (ms * 1e-3) / 1e9;
        let stream = gpu.stream().clone();
        let memcpy = timer.median_ms(|| {
            let s = src.slice(0..bytes);
            let mut d = dst.slice_mut(0..bytes);
            stream.memcpy_dtod(&s, &mut d).map_err(|e| anyhow!("cuMemcpyDtoD: {e:?}"))
        })?;
        memcpy_tbps = gbps(memcpy) / 1e3;
        let mut push = |name: &str, ms: f64| {
            rows.push(Row {
                kind: "copy",
                name: name.into(),
                shape: label.clone(),
                dtype: "bf16".into(),
                ours: gbps(ms),
                unit: "GB/s",
                baseline_name: "cuMemcpyDtoD",
                baseline: Some(gbps(memcpy)),
                matched: None,
                roofline: None,
                bound: None,
            })
        };
        // A [R, 2C] bf16 tensor split in two along its last dim: narrow copies one half out,
        // scatter writes one half back into its slot.
        let r = 16384;
        let half = bytes / r;
        let narrow =
            RowCopy { rows: r, row_bytes: half, src_pitch: 2 * half, src_off: half, dst_pitch: half, dst_off: 0 };
        push("narrow (shard out)", timer.median_ms(|| Ok(gpu.row_copy(&mut dst, &src, narrow)?))?);
        let scatter =
            RowCopy { rows: r, row_bytes: half, src_pitch: half, src_off: 0, dst_pitch: 2 * half, dst_off: half };
        push("scatter (shard in)", timer.median_ms(|| Ok(gpu.row_copy(&mut dst, &src, scatter)?))?);
        // All-gather buffers of 8 even shards and of 7 uneven ones, interleaved to [rows, cols].
        let rows_g = 8192;
        let cols = bytes / 2 / rows_g;
        push(
            "gather-interleave even w8",
            timer.median_ms(|| Ok(gpu.gather_interleave(&mut dst, &src, rows_g, cols, 8, 2)?))?,
        );
        let cols_u = cols - 3; // not a multiple of 7
        push(
            "gather-interleave uneven w7",
            timer.median_ms(|| Ok(gpu.gather_interleave(&mut dst, &src, rows_g, cols_u, 7, 2)?))?,
        );
    }
    Ok(memcpy_tbps)
}

/// Our kernel (SIMT for f32; mma.sync, or wgmma when `wgmma`, for f16/bf16) and cuBLAS on the
/// same problem `C = A B^T` (B as `[N, K]`), with the roofline placement when `ceil` is given.
fn gemm_row(
    gpu: &Arc<Gpu>,
    timer: &mut Timer,
    blas: &CudaBlas,
    ty: ElemType,
    g: &Problem,
    ceil: Option<&Ceilings>,
    wgmma: bool,
) -> Result<Row> {
    let (m, n, k) = (g.m, g.n, g.k);
    let a = random(gpu, ty, m * k, 1)?;
    let b = random(gpu, ty, n * k, 2)?;
    let mut c_ours = gpu.alloc(m * n * ty.size())?;
    let mut c_ref = gpu.alloc(m * n * ty.size())?;
    let tflops = |ms: f64| 2.0 * (m * n * k) as f64 / (ms * 1e-3) / 1e12;

    // What tp-core runs for this shape (gemm_nt's choice), or the Hopper kernel when asked.
    let shape = GemmShape { m, n, k };
    let (name, ours_ms) = if wgmma {
        let run = || Ok(gpu.gemm_wgmma(GemmArgs { c: &mut c_ours, a: &a, b: &b, bias: None, shape, ty })?);
        ("gemm_wgmma", timer.median_ms(run)?)
    } else {
        let name = if m <= tp_kernels::SMALL_M_MAX {
            "gemm_small_m"
        } else if ty == ElemType::F32 {
            "gemm_simt_f32"
        } else {
            match gpu.gemm_kernel_for(k) {
                tp_kernels::GemmKernel::Wgmma => "gemm_wgmma",
                tp_kernels::GemmKernel::MmaSync => "gemm_mma",
            }
        };
        (name, timer.median_ms(|| Ok(gpu.gemm_nt(GemmArgs { c: &mut c_ours, a: &a, b: &b, bias: None, shape, ty })?))?)
    };
    let mnk = (m, n, k);
    let ref_ms = match ty {
        ElemType::F32 => {
            timer.median_ms(|| cublas_gemm::<f32>(blas, nt_config(mnk, 1.0f32, 0.0), &b, &a, &mut c_ref, (m, n, k)))?
        }
        ElemType::BF16 => timer.median_ms(|| {
            cublas_gemm::<bf16>(blas, nt_config(mnk, bf16::ONE, bf16::ZERO), &b, &a, &mut c_ref, (m, n, k))
        })?,
        ElemType::F16 => timer.median_ms(|| {
            cublas_gemm::<f16>(blas, nt_config(mnk, f16::ONE, f16::ZERO), &b, &a, &mut c_ref, (m, n, k))
        })?,
        ElemType::I32 | ElemType::I64 => anyhow::bail!("GEMM benchmarks take float types, not {ty:?}"),
    };
    let matched = outputs_match(gpu, &c_ours, &c_ref, m * n, ty)?;
    let ours = tflops(ours_ms);
    let placed = ceil.map(|c| c.place(ours, g.flops(), g.bytes(ty.size())));
    Ok(Row {
        kind: "gemm",
        name: format!("{name} {}", g.label),
        shape: g.shape(),
        dtype: format!("{ty:?}").to_lowercase(),
        ours,
        unit: "TFLOP/s",
        baseline_name: "cuBLAS",
        baseline: Some(tflops(ref_ms)),
        matched: Some(matched),
        roofline: placed.map(|p| p.0),
        bound: placed.map(|p| p.1),
    })
}

/// cuBLAS's view of row-major `C[M,N] = A[M,K] B[N,K]^T`: column-major, that is
/// `C^T = (B^T)^T A^T`, so `op_a = T` on B (ld K), `op_b = N` on A (ld K), `m = N`, `n = M`,
/// `ldc = N`.
fn nt_config<T>((m, n, k): (usize, usize, usize), alpha: T, beta: T) -> GemmConfig<T> {
    GemmConfig {
        transa: CUBLAS_OP_T,
        transb: CUBLAS_OP_N,
        m: n as i32,
        n: m as i32,
        k: k as i32,
        alpha,
        lda: k as i32,
        ldb: k as i32,
        beta,
        ldc: n as i32,
    }
}

/// cuBLAS GEMM on byte buffers viewed as `T`.
fn cublas_gemm<T>(
    blas: &CudaBlas,
    cfg: GemmConfig<T>,
    b: &CudaSlice<u8>,
    a: &CudaSlice<u8>,
    c: &mut CudaSlice<u8>,
    (m, n, k): (usize, usize, usize),
) -> Result<()>
where
    CudaBlas: Gemm<T>,
{
    // SAFETY: each byte buffer was allocated with exactly (elements x size_of::<T>()) bytes of
    // the element type T it is viewed as (see gemm_row), and device allocations are 256-byte
    // aligned, so the views are in bounds and aligned. `transmute` checks the length.
    let (bv, av) = unsafe { (b.transmute::<T>(n * k), a.transmute::<T>(m * k)) };
    let (bv, av) = (bv.context("B view")?, av.context("A view")?);
    // SAFETY: as above, for C's m*n elements.
    let mut cv = unsafe { c.transmute_mut::<T>(m * n) }.context("C view")?;
    // SAFETY: cfg describes column-major operands of exactly these views' sizes: B^T is K x N
    // with ld K (n*k elements), A is K x M with ld K (m*k), C is N x M with ld N (m*n); all
    // dimensions fit in i32 for the benchmark's sizes.
    unsafe { blas.gemm(cfg, &bv, &av, &mut cv) }.map_err(|e| anyhow!("cuBLAS gemm: {e:?}"))
}

/// Whether our output equals cuBLAS's within the rounding both incur: at most 2^-5 (half types)
/// or 1e-4 (f32) of the output's RMS, element by element.
fn outputs_match(gpu: &Gpu, ours: &CudaSlice<u8>, reference: &CudaSlice<u8>, n: usize, ty: ElemType) -> Result<bool> {
    let widen = |bytes: Vec<u8>| -> Vec<f64> {
        match ty {
            ElemType::F32 => {
                bytes.chunks_exact(4).map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]]))).collect()
            }
            ElemType::F16 => bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f64()).collect(),
            ElemType::BF16 => bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f64()).collect(),
            ElemType::I32 | ElemType::I64 => Vec::new(), // never reached: `random` refuses them
        }
    };
    let a = widen(gpu.dtoh(ours, n * ty.size())?);
    let b = widen(gpu.dtoh(reference, n * ty.size())?);
    let rms = (b.iter().map(|x| x * x).sum::<f64>() / n as f64).sqrt();
    let tol = rms * if ty == ElemType::F32 { 1e-4 } else { 2f64.powi(-5) };
    Ok(rms > 0.0 && a.iter().zip(&b).all(|(x, y)| (x - y).abs() <= tol))
}
