//! The host half of tp-bench: host GEMM throughput over the shape set and dtypes, with the
//! roofline column from ceilings measured at start, and the column/row-parallel layers over
//! LocalGroup threads.
//!
//! Each figure is the median of 7 samples after 2 warm-up runs; a sample repeats the product
//! until it lasts at least 20 ms. FLOPs are `2·M·N·K`. When `python3` has numpy, the same f32
//! products (`x @ w.T`) are timed there with the same method, in the same run, and the ratio is
//! printed: numpy's OpenBLAS is the well-known CPU reference.

use crate::shapes::Gemm;
use crate::{Args, Ceilings, Row};
use anyhow::Result;
use std::process::Command;
use std::time::{Duration, Instant};
use tp_comm::DeviceGroup;
use tp_core::{DType, Device, Tensor};
use tp_layers::{ColumnParallel, Linear, RowParallel};

const SAMPLES: usize = 7;
const MIN_SAMPLE: Duration = Duration::from_millis(20);

pub fn run(args: &Args) -> Result<Vec<Row>> {
    let gemms = args.gemms(false)?;
    println!("host GEMM y = x W^T on {} threads", tp_core::cpu::num_threads());
    let numpy = numpy_baseline(&gemms);
    if let Err(why) = &numpy {
        println!("numpy baseline skipped: {why}");
    }
    let ceil = ceilings(numpy.as_ref().ok().and_then(|v| v.iter().copied().reduce(f64::max)))?;
    println!(
        "ceilings: {:.0} GFLOP/s (best f32 GEMM measured), {:.1} GB/s (host copy, read + write)",
        ceil.compute, ceil.memory
    );
    let mut rows = Vec::new();
    for (i, g) in gemms.iter().enumerate() {
        for &dtype in &args.dtypes {
            eprint!("\r  measuring {} {} {dtype}...          ", g.label, g.shape());
            let gflops = time_tp(g.m, g.n, g.k, dtype)?;
            let base = numpy.as_ref().ok().filter(|_| dtype == DType::F32).map(|v| v[i]);
            let (roof, bound) = ceil.place(gflops, g.flops(), g.bytes(dtype.size_in_bytes()));
            rows.push(Row {
                kind: "gemm",
                name: format!("cpu x_wT {}", g.label),
                shape: g.shape(),
                dtype: dtype.to_string(),
                ours: gflops,
                unit: "GFLOP/s",
                baseline_name: if base.is_some() { "numpy" } else { "-" },
                baseline: base,
                matched: None,
                roofline: Some(roof),
                bound: Some(bound),
            });
        }
    }
    rows.extend(layer_rows(args)?);
    eprintln!();
    Ok(rows)
}

/// The compute ceiling (best of a 1024^3 f32 GEMM of ours and numpy's best) and the host memory
/// bandwidth (a 256 MiB copy, bytes read + written).
fn ceilings(numpy_best: Option<f64>) -> Result<Ceilings> {
    let ours = time_tp(1024, 1024, 1024, DType::F32)?;
    let src = vec![1u8; 256 << 20];
    let mut dst = vec![0u8; 256 << 20];
    let secs = median_seconds(|| {
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        Ok(())
    })?;
    Ok(Ceilings { compute: ours.max(numpy_best.unwrap_or(0.0)), memory: 2.0 * src.len() as f64 / secs / 1e9 })
}

/// ColumnParallel and RowParallel forwards over 2 LocalGroup ranks (threads): GFLOP/s of the
/// whole layer, wall time of the slowest rank, the all-reduce included for RowParallel.
fn layer_rows(args: &Args) -> Result<Vec<Row>> {
    let (tokens, hidden, inter, world) = if args.quick { (16, 1024, 2816, 2) } else { (64, 4096, 14336, 2) };
    let mut rows = Vec::new();
    for &dtype in &args.dtypes {
        eprint!("\r  measuring layers {dtype}...                       ");
        let w = Tensor::rand(&[inter, hidden], dtype, 1, &Device::Cpu)?;
        let x = Tensor::rand(&[tokens, hidden], dtype, 2, &Device::Cpu)?;
        let a = Tensor::rand(&[tokens, inter], dtype, 3, &Device::Cpu)?;
        let wd = Tensor::rand(&[hidden, inter], dtype, 4, &Device::Cpu)?;
        let full = Linear::new(w, None)?;
        let flops = 2.0 * (tokens * hidden * inter) as f64;
        for (name, is_col) in [("ColumnParallel::forward w2", true), ("RowParallel::forward w2", false)] {
            let groups = DeviceGroup::local(world, Duration::from_secs(120), |_| Device::Cpu)?;
            let times: Vec<Result<f64>> = std::thread::scope(|s| {
                let hs: Vec<_> = groups
                    .into_iter()
                    .map(|g| {
                        let (full, x, a, wd) = (&full, &x, &a, &wd);
                        s.spawn(move || -> Result<f64> {
                            let col = ColumnParallel::from_full(full, g.rank(), world)?;
                            let row = RowParallel::from_full(wd, None, g.rank(), world)?;
                            median_seconds(|| {
                                g.barrier()?;
                                if is_col {
                                    std::hint::black_box(col.forward(x)?);
                                } else {
                                    std::hint::black_box(row.forward_split(a, &g)?);
                                }
                                g.barrier()?;
                                Ok(())
                            })
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("rank panicked")))).collect()
            });
            let secs = times.into_iter().collect::<Result<Vec<_>>>()?.into_iter().fold(0.0, f64::max);
            rows.push(Row {
                kind: "layer",
                name: name.into(),
                shape: format!(
                    "{tokens}x{}x{}",
                    if is_col { inter } else { hidden },
                    if is_col { hidden } else { inter }
                ),
                dtype: dtype.to_string(),
                ours: flops / secs / 1e9,
                unit: "GFLOP/s",
                baseline_name: "-",
                baseline: None,
                matched: None,
                roofline: None,
                bound: None,
            });
        }
    }
    Ok(rows)
}

fn flops(m: usize, n: usize, k: usize) -> f64 {
    2.0 * m as f64 * n as f64 * k as f64
}

fn time_tp(m: usize, n: usize, k: usize, dtype: DType) -> Result<f64> {
    let x = Tensor::rand(&[m, k], dtype, 1, &Device::Cpu)?;
    let w = Tensor::rand(&[n, k], dtype, 2, &Device::Cpu)?;
    let secs = median_seconds(|| {
        std::hint::black_box(x.matmul_t(&w)?);
        Ok(())
    })?;
    Ok(flops(m, n, k) / secs / 1e9)
}

/// Median seconds per call of `f`, over `SAMPLES` samples of at least `MIN_SAMPLE` each.
fn median_seconds(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let start = Instant::now();
    f()?;
    let one = start.elapsed().max(Duration::from_micros(1));
    let reps = (MIN_SAMPLE.as_secs_f64() / one.as_secs_f64()).ceil().max(1.0) as usize;
    let mut samples = Vec::with_capacity(SAMPLES);
    for _ in 0..SAMPLES {
        let t = Instant::now();
        for _ in 0..reps {
            f()?;
        }
        samples.push(t.elapsed().as_secs_f64() / reps as f64);
    }
    samples.sort_by(f64::total_cmp);
    Ok(samples[SAMPLES / 2])
}

/// The numpy script: same method as `median_seconds`, one GFLOP/s figure per line.
const NUMPY_SCRIPT: &str = r#"
import sys, time
import numpy as np
rng = np.random.default_rng(0)
for arg in sys.argv[1:]:
    m, n, k = map(int, arg.split(","))
    x = rng.uniform(-1, 1, (m, k)).astype(np.float32)
    w = rng.uniform(-1, 1, (n, k)).astype(np.float32)
    x @ w.T
    t = time.perf_counter(); x @ w.T; one = max(time.perf_counter() - t, 1e-6)
    reps = max(1, int(-(-0.02 // one)))
    s = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(reps):
            x @ w.T
        s.append((time.perf_counter() - t) / reps)
    s.sort()
    print(2.0 * m * n * k / s[3] / 1e9)
"#;

/// numpy's GFLOP/s for each shape, f32, `x @ w.T`. OpenBLAS tuning variables that this
/// workplace sets for old OpenBLAS builds are removed for this command only, so numpy runs its
/// best kernel for the CPU.
fn numpy_baseline(shapes: &[Gemm]) -> Result<Vec<f64>, String> {
    let out = Command::new("python3")
        .arg("-c")
        .arg(NUMPY_SCRIPT)
        .args(shapes.iter().map(|g| format!("{},{},{}", g.m, g.n, g.k)))
        .env_remove("OPENBLAS_CORETYPE")
        .env_remove("OPENBLAS_L2_SIZE")
        .output()
        .map_err(|e| format!("cannot run python3 ({e})"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().last().unwrap_or("python3 failed");
        return Err(format!("{last} (pip install numpy to compare against OpenBLAS)"));
    }
    let v: Vec<f64> = String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.trim().parse().ok()).collect();
    if v.len() != shapes.len() {
        return Err(format!("numpy printed {} figures for {} shapes", v.len(), shapes.len()));
    }
    Ok(v)
}
