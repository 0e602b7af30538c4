//! The host half of tp-bench: host GEMM throughput over a few shapes and dtypes.
//!
//! Each figure is the median of 7 samples after 2 warm-up runs; a sample repeats the product
//! until it lasts at least 20 ms. FLOPs are `2·M·N·K`. When `python3` has numpy, the same f32
//! products (`x @ w.T`) are timed there with the same method, in the same run, and the ratio is
//! printed: numpy's OpenBLAS is the well-known CPU reference.

use crate::Row;
use anyhow::Result;
use std::process::Command;
use std::time::{Duration, Instant};
use tp_core::{DType, Device, Tensor};

const SAMPLES: usize = 7;
const MIN_SAMPLE: Duration = Duration::from_millis(20);

/// `(label, M, N, K)`. TP shapes: Llama 3 8B (hidden 4096, fused QKV 6144, MLP 14336) sharded
/// over 2 ranks: column-parallel QKV `N = 3072, K = 4096`; row-parallel down `N = 4096, K = 7168`.
const SHAPES: &[(&str, usize, usize, usize)] = &[
    ("square", 256, 256, 256),
    ("square", 512, 512, 512),
    ("square", 1024, 1024, 1024),
    ("square", 2048, 2048, 2048),
    ("8B qkv tp2", 1, 3072, 4096),
    ("8B qkv tp2", 16, 3072, 4096),
    ("8B qkv tp2", 128, 3072, 4096),
    ("8B down tp2", 128, 4096, 7168),
];
const QUICK: usize = 3; // --quick: the first squares only, up to 1024³

pub fn run(quick: bool) -> Result<Vec<Row>> {
    let shapes = if quick { &SHAPES[..QUICK] } else { SHAPES };
    println!("host GEMM y = x W^T on {} threads", tp_core::cpu_gemm::num_threads());
    let numpy = numpy_baseline(shapes);
    if let Err(why) = &numpy {
        println!("numpy baseline skipped: {why}");
    }
    let mut rows = Vec::new();
    for (i, &(label, m, n, k)) in shapes.iter().enumerate() {
        for dtype in DType::ALL {
            eprint!("\r  measuring {label} {m}x{n}x{k} {dtype}...          ");
            let gflops = time_tp(m, n, k, dtype)?;
            let base = numpy.as_ref().ok().filter(|_| dtype == DType::F32).map(|v| v[i]);
            rows.push(Row {
                kind: "gemm",
                name: format!("cpu x_wT {label}"),
                shape: format!("{m}x{n}x{k}"),
                dtype: dtype.to_string(),
                ours: gflops,
                unit: "GFLOP/s",
                baseline_name: if base.is_some() { "numpy" } else { "-" },
                baseline: base,
                matched: None,
            });
        }
    }
    eprintln!();
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
fn numpy_baseline(shapes: &[(&str, usize, usize, usize)]) -> Result<Vec<f64>, String> {
    let out = Command::new("python3")
        .arg("-c")
        .arg(NUMPY_SCRIPT)
        .args(shapes.iter().map(|&(_, m, n, k)| format!("{m},{n},{k}")))
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
