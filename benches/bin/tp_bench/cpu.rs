//! The host half of tp-bench: host GEMM throughput over the shape set and dtypes beside the
//! well-known CPU references, with a roofline column, and the column/row-parallel layers over
//! LocalGroup threads.
//!
//! Each figure is the best of 3 rounds (2 with `--quick`) that alternate the references and
//! ours, a round's figure the median of 7 samples after 2 warm-up runs; a sample repeats the
//! product until it lasts at least 20 ms. FLOPs are `2·M·N·K`. Decode shapes (`M <= 8`) cycle through
//! copies of the weight that together exceed the last-level cache, so the weight streams from
//! memory as it does in a model (the references get the same copies). References, timed the
//! same way in the same run: numpy (OpenBLAS) for `f32`, torch (oneDNN) for `f16`/`bf16` when
//! it is importable (`cargo xtask bench` provisions numpy; torch is optional).
//!
//! Roofline: a row's figure over `min(compute ceiling of its dtype, intensity x memory
//! bandwidth)`. The compute ceiling of a dtype is the best figure seen for it in the run (ours
//! or a reference's), the memory bandwidth the best of a 256 MiB copy, a 256 MiB read on every
//! thread, and what any memory-bound row achieved, so no row exceeds 100%.

use crate::shapes::Gemm;
use crate::{Args, Ceilings, Row};
use anyhow::Result;
use std::collections::HashMap;
use std::process::Command;
use std::time::{Duration, Instant};
use tp_comm::DeviceGroup;
use tp_core::{DType, Device, Tensor};
use tp_layers::{ColumnParallel, Linear, RowParallel};

const SAMPLES: usize = 7;
/// Interleaved rounds of references and ours (2 with `--quick`).
const ROUNDS: usize = 3;
const MIN_SAMPLE: Duration = Duration::from_millis(20);
/// Rows of x at or below which a product is decode-shaped (weight-streaming).
const DECODE_ROWS: usize = 8;
/// Bytes of weight copies a decode row cycles through (more than any last-level cache here).
const ROTATE_BYTES: usize = 160 << 20;
const MAX_COPIES: usize = 8;

/// Weight copies a `g` product of `elem`-byte elements cycles through.
fn copies(g: &Gemm, elem: usize) -> usize {
    if g.m > DECODE_ROWS {
        return 1;
    }
    ROTATE_BYTES.div_ceil(g.n * g.k * elem).clamp(1, MAX_COPIES)
}

pub fn run(args: &Args) -> Result<Vec<Row>> {
    let gemms = args.gemms(false)?;
    println!(
        "host GEMM y = x W^T on {} threads, kernel family {} (TP_CPU_KERNEL; available: {})",
        tp_core::cpu::num_threads(),
        tp_core::cpu::CpuKernel::current(),
        tp_core::cpu::CpuKernel::available().iter().map(|k| k.as_str()).collect::<Vec<_>>().join(", ")
    );
    let f32_shapes: Vec<&Gemm> = if args.dtypes.contains(&DType::F32) { gemms.iter().collect() } else { Vec::new() };
    let all_shapes: Vec<&Gemm> = gemms.iter().collect();
    let other_dtypes: Vec<DType> = args.dtypes.iter().copied().filter(|&d| d != DType::F32).collect();
    // Rounds alternate the references and ours, and each side keeps its best figure per row:
    // on a shared machine a burst of load then costs both sides alike, not whichever ran in it.
    let rounds = if args.quick { 2 } else { ROUNDS };
    let mut numpy: Result<(String, Vec<f64>), String> = Err("not run".into());
    let mut torch: HashMap<DType, (String, Vec<f64>)> = HashMap::new();
    let mut torch_skipped = None;
    let mut ours = vec![vec![0.0f64; args.dtypes.len()]; gemms.len()];
    for round in 0..rounds {
        if !f32_shapes.is_empty() && (round == 0 || numpy.is_ok()) {
            numpy = match (numpy, python_baseline(Reference::Numpy, DType::F32, &f32_shapes)) {
                (Ok(old), Ok(new)) => Ok(best_of(old, new)),
                (Ok(old), Err(_)) => Ok(old), // a later round failed: keep the first
                (Err(_), new) => new,
            };
        }
        for &dtype in &other_dtypes {
            if torch_skipped.is_some() {
                break;
            }
            match (python_baseline(Reference::Torch, dtype, &all_shapes), torch.remove(&dtype)) {
                (Ok(new), Some(old)) => drop(torch.insert(dtype, best_of(old, new))),
                (Ok(new), None) => drop(torch.insert(dtype, new)),
                (Err(_), Some(old)) => drop(torch.insert(dtype, old)), // a later round failed: keep the first
                (Err(why), None) => torch_skipped = Some(why),
            }
        }
        for (i, g) in gemms.iter().enumerate() {
            for (d, &dtype) in args.dtypes.iter().enumerate() {
                eprint!(
                    "\r  measuring {} {} {dtype} (round {} of {rounds})...          ",
                    g.label,
                    g.shape(),
                    round + 1
                );
                ours[i][d] = ours[i][d].max(time_tp(g, dtype)?);
            }
        }
    }
    eprintln!();
    match &numpy {
        Ok((version, _)) => println!("reference f32: {version}"),
        Err(why) => println!("numpy baseline skipped: {why}"),
    }
    for (dtype, (version, _)) in &torch {
        println!("reference {dtype}: {version}");
    }
    if let Some(why) = &torch_skipped {
        println!("torch baseline skipped: {why}");
    }
    println!(
        "each figure: the best of {rounds} interleaved rounds (references, then ours), each the median of {SAMPLES} samples"
    );
    let measured = memory_ceiling()?;
    println!(
        "memory: {:.1} GB/s host copy (read + write), {:.1} GB/s read on {} threads",
        measured.0,
        measured.1,
        tp_core::cpu::num_threads()
    );
    let mut rows = Vec::new();
    for (i, g) in gemms.iter().enumerate() {
        for (d, &dtype) in args.dtypes.iter().enumerate() {
            let gflops = ours[i][d];
            let base = match dtype {
                DType::F32 => numpy.as_ref().ok().map(|(_, v)| v[i]),
                _ => torch.get(&dtype).map(|(_, v)| v[i]),
            };
            let base_name = match (dtype, base) {
                (_, None) => "-",
                (DType::F32, _) => "numpy",
                _ => "torch",
            };
            rows.push(Row {
                kind: "gemm",
                name: format!("cpu x_wT {}", g.label),
                shape: g.shape(),
                dtype: dtype.to_string(),
                ours: gflops,
                unit: "GFLOP/s",
                baseline_name: base_name,
                baseline: base,
                matched: None,
                roofline: None,
                bound: None,
            });
        }
    }
    place(&mut rows, &gemms, args, measured.0.max(measured.1));
    rows.extend(layer_rows(args)?);
    eprintln!();
    Ok(rows)
}

/// Fills the roofline column: per-dtype compute ceilings and one memory ceiling, each the best
/// seen in the run (see the module docs).
fn place(rows: &mut [Row], gemms: &[Gemm], args: &Args, measured_memory: f64) {
    let gemm_of = |r: &Row| gemms.iter().find(|g| g.shape() == r.shape);
    let mut compute: HashMap<String, f64> = HashMap::new();
    let mut memory = measured_memory;
    for r in rows.iter() {
        let best = r.ours.max(r.baseline.unwrap_or(0.0));
        let c = compute.entry(r.dtype.clone()).or_insert(0.0);
        *c = c.max(best);
        if let (Some(g), Ok(dtype)) = (gemm_of(r), r.dtype.parse::<DType>()) {
            if g.m <= DECODE_ROWS {
                // A weight-streaming row: its effective bandwidth is a memory figure too.
                memory = memory.max(best * g.bytes(dtype.size_in_bytes()) / g.flops());
            }
        }
    }
    println!(
        "ceilings: {} (best GEMM seen per dtype), {memory:.1} GB/s memory",
        args.dtypes
            .iter()
            .filter_map(|d| compute.get(d.as_str()).map(|c| format!("{c:.0} GFLOP/s {d}")))
            .collect::<Vec<_>>()
            .join(", ")
    );
    for r in rows.iter_mut() {
        let (Some(g), Ok(dtype)) = (gemm_of(r), r.dtype.parse::<DType>()) else { continue };
        let ceil = Ceilings { compute: compute[&r.dtype], memory };
        let (roof, bound) = ceil.place(r.ours, g.flops(), g.bytes(dtype.size_in_bytes()));
        r.roofline = Some(roof);
        r.bound = Some(bound);
    }
}

/// (host copy GB/s counting read + write, read GB/s on every thread), 256 MiB each.
fn memory_ceiling() -> Result<(f64, f64)> {
    let src = vec![1u8; 256 << 20];
    let mut dst = vec![0u8; 256 << 20];
    let secs = median_seconds(|| {
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        Ok(())
    })?;
    let copy = 2.0 * src.len() as f64 / secs / 1e9;
    Ok((copy, read_bandwidth()?))
}

/// GB/s of reading 256 MiB with every host-kernel thread, each its own contiguous part (the
/// access pattern of a weight-streaming decode step); median of several runs.
pub fn read_bandwidth() -> Result<f64> {
    let words: Vec<u64> = vec![1; 32 << 20];
    let threads = tp_core::cpu::num_threads();
    let secs = median_seconds(|| {
        let per = words.len().div_ceil(threads);
        let total: u64 = std::thread::scope(|s| {
            // Sixteen independent lanes (one 512-bit add per 64 bytes once vectorised): the
            // sum keeps up with memory, which one chained accumulator need not.
            let hs: Vec<_> = words
                .chunks(per)
                .map(|c| {
                    s.spawn(move || {
                        let mut acc = [0u64; 16];
                        for ch in c.chunks_exact(16) {
                            for (a, &w) in acc.iter_mut().zip(ch) {
                                *a = a.wrapping_add(w);
                            }
                        }
                        acc.iter().fold(0u64, |a, &w| a ^ w)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0)).fold(0, |a, b| a ^ b)
        });
        std::hint::black_box(total);
        Ok(())
    })?;
    Ok((words.len() * 8) as f64 / secs / 1e9)
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
                            let col = ColumnParallel::from_full(full, &g)?;
                            let row = RowParallel::from_full(wd, None, &g)?;
                            let step = || -> Result<()> {
                                g.barrier()?;
                                if is_col {
                                    std::hint::black_box(col.forward(x)?);
                                } else {
                                    std::hint::black_box(row.forward_split(a)?);
                                }
                                g.barrier()?;
                                Ok(())
                            };
                            // Every rank must run the same number of steps (each has barriers):
                            // the repetition count comes from the slowest rank's warm-up.
                            step()?;
                            let start = Instant::now();
                            step()?;
                            let one = Tensor::from_vec(vec![start.elapsed().as_secs_f32()], &[1], &Device::Cpu)?;
                            let one = g.all_reduce(&one, tp_comm::ReduceOp::Max)?.to_f64_vec()?[0];
                            sampled_seconds(reps_for(one), step)
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

/// A reference's version line and figures: the better of two rounds' figure for each shape.
fn best_of((version, a): (String, Vec<f64>), (_, b): (String, Vec<f64>)) -> (String, Vec<f64>) {
    (version, a.iter().zip(&b).map(|(x, y)| x.max(*y)).collect())
}

/// Our GFLOP/s for `g` in `dtype`, cycling through weight copies for decode shapes.
fn time_tp(g: &Gemm, dtype: DType) -> Result<f64> {
    let x = Tensor::rand(&[g.m, g.k], dtype, 1, &Device::Cpu)?;
    let ws = (0..copies(g, dtype.size_in_bytes()))
        .map(|c| Tensor::rand(&[g.n, g.k], dtype, 2 + c as u64, &Device::Cpu))
        .collect::<tp_core::Result<Vec<_>>>()?;
    let mut next = 0;
    let secs = median_seconds(|| {
        std::hint::black_box(x.matmul_t(&ws[next])?);
        next = (next + 1) % ws.len();
        Ok(())
    })?;
    Ok(g.flops() / secs / 1e9)
}

/// Median seconds per call of `f`, over `SAMPLES` samples of at least `MIN_SAMPLE` each.
pub fn median_seconds(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let start = Instant::now();
    f()?;
    sampled_seconds(reps_for(start.elapsed().as_secs_f64()), f)
}

/// Calls per sample for a call that took `one` seconds.
fn reps_for(one: f64) -> usize {
    (MIN_SAMPLE.as_secs_f64() / one.max(1e-6)).ceil().max(1.0) as usize
}

/// Median seconds per call of `f` over `SAMPLES` samples of `reps` calls.
fn sampled_seconds(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
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

#[derive(Clone, Copy)]
enum Reference {
    Numpy,
    Torch,
}

/// The reference script: the same method as `median_seconds` (and the same weight copies for
/// decode shapes), one GFLOP/s figure per shape line after a version line. Arguments: the
/// dtype, then `M,N,K,copies` per shape.
const SCRIPT: &str = r#"
import sys, time
which, dtype = sys.argv[1], sys.argv[2]
if which == "numpy":
    import numpy as np
    rng = np.random.default_rng(0)
    cfg = np.show_config(mode="dicts").get("Build Dependencies", {}).get("blas", {})
    print(f"numpy {np.__version__} ({cfg.get('name', '?')} {cfg.get('version', '')})".strip())
    make = lambda r, c: rng.uniform(-1, 1, (r, c)).astype(np.float32)
    prod = lambda x, w: x @ w.T
else:
    import torch
    torch.manual_seed(0)
    dt = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[dtype]
    print(f"torch {torch.__version__} (oneDNN, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()})")
    make = lambda r, c: (torch.rand(r, c) * 2 - 1).to(dt)
    prod = torch.nn.functional.linear
for arg in sys.argv[3:]:
    m, n, k, copies = map(int, arg.split(","))
    x = make(m, k)
    ws = [make(n, k) for _ in range(copies)]
    i = [0]
    def f():
        prod(x, ws[i[0]])
        i[0] = (i[0] + 1) % copies
    f()
    t = time.perf_counter(); f(); one = max(time.perf_counter() - t, 1e-6)
    reps = max(1, int(-(-0.02 // one)))
    s = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(reps):
            f()
        s.append((time.perf_counter() - t) / reps)
    s.sort()
    print(2.0 * m * n * k / s[3] / 1e9, flush=True)
"#;

/// The reference's version line and GFLOP/s for each shape, `x @ w.T` in `dtype`. OpenBLAS
/// tuning variables that this workplace sets for old OpenBLAS builds are removed for this
/// command only, so numpy runs its best kernel for the CPU.
fn python_baseline(which: Reference, dtype: DType, shapes: &[&Gemm]) -> Result<(String, Vec<f64>), String> {
    if shapes.is_empty() {
        return Err("no shapes".into());
    }
    let (name, hint) = match which {
        Reference::Numpy => ("numpy", "cargo xtask bench installs it; or pip install numpy"),
        Reference::Torch => ("torch", "optional: pip install torch to compare f16/bf16 against oneDNN"),
    };
    let out = Command::new("python3")
        .arg("-c")
        .arg(SCRIPT)
        .arg(name)
        .arg(dtype.as_str())
        .args(shapes.iter().map(|g| format!("{},{},{},{}", g.m, g.n, g.k, copies(g, dtype.size_in_bytes()))))
        .env_remove("OPENBLAS_CORETYPE")
        .env_remove("OPENBLAS_L2_SIZE")
        .output()
        .map_err(|e| format!("cannot run python3 ({e})"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().last().unwrap_or("python3 failed");
        return Err(format!("{last} ({hint})"));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut lines = stdout.lines();
    let version = lines.next().unwrap_or(name).to_string();
    let v: Vec<f64> = lines.filter_map(|l| l.trim().parse().ok()).collect();
    if v.len() != shapes.len() {
        return Err(format!("{name} printed {} figures for {} shapes", v.len(), shapes.len()));
    }
    Ok((version, v))
}
