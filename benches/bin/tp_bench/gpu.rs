//! The GPU half of tp-bench: our kernels beside their references, measured in the same process.
//!
//! Method: CUDA events around each run on the device's stream; 3 warm-up runs, then the median of
//! 20 (5 with --quick). Before every timed run a 256 MiB buffer is cleared, which evicts the
//! operands from the 50 MB L2, so no run is timed from cache. GEMM throughput is 2·M·N·K / time;
//! copy bandwidth counts the bytes read plus the bytes written.

use crate::Row;
use anyhow::{Context, Result, anyhow};
use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::CudaSlice;
use cudarc::driver::sys::CUevent_flags;
use half::{bf16, f16};
use std::sync::Arc;
use tp_core::rng::SplitMix64;
use tp_kernels::{ElemType, Gpu, RowCopy};

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

pub fn run(gpu: &Arc<Gpu>, quick: bool) -> Result<Vec<Row>> {
    let mut timer = Timer { gpu: gpu.clone(), flush: gpu.alloc(256 * MIB)?, reps: if quick { 5 } else { 20 } };
    let mut rows = Vec::new();
    copies(gpu, &mut timer, quick, &mut rows)?;
    gemms(gpu, &mut timer, quick, &mut rows)?;
    Ok(rows)
}

/// Random bytes on the device, `n` elements of `ty` drawn from [-1, 1).
fn random(gpu: &Gpu, ty: ElemType, n: usize, seed: u64) -> Result<CudaSlice<u8>> {
    let mut rng = SplitMix64::new(seed);
    let bytes: Vec<u8> = match ty {
        ElemType::F32 => (0..n).flat_map(|_| (rng.uniform(-1.0, 1.0) as f32).to_le_bytes()).collect(),
        ElemType::F16 => (0..n).flat_map(|_| f16::from_f64(rng.uniform(-1.0, 1.0)).to_le_bytes()).collect(),
        ElemType::BF16 => (0..n).flat_map(|_| bf16::from_f64(rng.uniform(-1.0, 1.0)).to_le_bytes()).collect(),
    };
    Ok(gpu.htod(&bytes)?)
}

fn copies(gpu: &Arc<Gpu>, timer: &mut Timer, quick: bool, rows: &mut Vec<Row>) -> Result<()> {
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
    Ok(())
}

fn gemms(gpu: &Arc<Gpu>, timer: &mut Timer, quick: bool, rows: &mut Vec<Row>) -> Result<()> {
    let blas = CudaBlas::new(gpu.stream().clone()).map_err(|e| anyhow!("cuBLAS unavailable: {e:?}"))?;
    let f32_sizes: &[usize] = if quick { &[2048] } else { &[2048, 4096] };
    let half_sizes: &[usize] = if quick { &[4096] } else { &[4096, 8192] };
    for &s in f32_sizes {
        rows.push(gemm_row(gpu, timer, &blas, ElemType::F32, s)?);
    }
    for ty in [ElemType::BF16, ElemType::F16] {
        for &s in half_sizes {
            rows.push(gemm_row(gpu, timer, &blas, ty, s)?);
        }
    }
    Ok(())
}

/// Our kernel and cuBLAS on the same square problem `C = A B^T` (B as `[N, K]`).
fn gemm_row(gpu: &Arc<Gpu>, timer: &mut Timer, blas: &CudaBlas, ty: ElemType, s: usize) -> Result<Row> {
    let (m, n, k) = (s, s, s);
    eprint!("\r  measuring gemm {s}^3 {ty:?}...        ");
    let a = random(gpu, ty, m * k, 1)?;
    let b = random(gpu, ty, n * k, 2)?;
    let mut c_ours = gpu.alloc(m * n * ty.size())?;
    let mut c_ref = gpu.alloc(m * n * ty.size())?;
    let tflops = |ms: f64| 2.0 * (m * n * k) as f64 / (ms * 1e-3) / 1e12;

    let (name, ours_ms) = if ty == ElemType::F32 {
        ("gemm_simt_f32 (NT)", timer.median_ms(|| Ok(gpu.gemm_simt_f32(&mut c_ours, &a, &b, None, (m, n, k), true)?))?)
    } else {
        ("gemm_mma (NT)", timer.median_ms(|| Ok(gpu.gemm_mma(&mut c_ours, &a, &b, None, (m, n, k), ty)?))?)
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
    };
    let matched = outputs_match(gpu, &c_ours, &c_ref, m * n, ty)?;
    Ok(Row {
        kind: "gemm",
        name: name.into(),
        shape: format!("{m}x{n}x{k}"),
        dtype: format!("{ty:?}").to_lowercase(),
        ours: tflops(ours_ms),
        unit: "TFLOP/s",
        baseline_name: "cuBLAS",
        baseline: Some(tflops(ref_ms)),
        matched: Some(matched),
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
        }
    };
    let a = widen(gpu.dtoh(ours, n * ty.size())?);
    let b = widen(gpu.dtoh(reference, n * ty.size())?);
    let rms = (b.iter().map(|x| x * x).sum::<f64>() / n as f64).sqrt();
    let tol = rms * if ty == ElemType::F32 { 1e-4 } else { 2f64.powi(-5) };
    Ok(rms > 0.0 && a.iter().zip(&b).all(|(x, y)| (x - y).abs() <= tol))
}
