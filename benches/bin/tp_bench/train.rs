//! `tp-bench --only train-gemm`: the three host GEMM layouts of a training step, at the shapes
//! of one SmolLM2-135M step (hidden 576, intermediate 1536, 9 query / 3 KV heads of 64, vocab
//! 49152; 8 rows x 256 tokens = 2048 tokens, and a skinny 256-token step), plus the weight
//! gradients of q/o and gate/up over 4096 tokens and the LM heads of 128k (Llama 3.2 1B,
//! hidden 2048) and 152k (Qwen2.5 0.5B, hidden 896) vocabularies at 256 tokens, tp beside
//! torch in the same run:
//!
//! * forward `Y = X W^T`: `x.matmul_t(&w)` (torch `x @ w.T`), `[T, in] x [out, in]`;
//! * dgrad `dX = dY W`: `dy.matmul_f32(&w, WeightLayout::Kn)` (torch `dy @ w`);
//! * wgrad `dW = dY^T X`: `dy.t_matmul(&x)` (torch `dy.T @ x`), `[out, in]` over T.
//!
//! Both sides take their operands in the row's dtype (f32 or bf16). tp's dgrad and wgrad
//! return f32 sums for bf16 operands; torch returns bf16 (its forward and tp's forward both
//! return bf16). torch runs on tp's thread count (`torch.set_num_threads`).
//!
//! Timing as the host GEMM table (`cpu.rs`): rounds alternate torch and tp and keep each side's
//! best, a round's figure the median of 7 samples after 2 warm-ups, a sample at least 20 ms.
//! Accuracy: each side's output is checked on 64 sampled entries against a float64 dot product
//! of its own operands (exact values of the dtype): max |out - ref| / max |ref| over the sample.
//! A row matches when tp's error is within 1e-4 (f32) or 8e-3 (bf16; a bf16 output's rounding
//! is up to 2^-9 of its magnitude). Opt-in: only `--only train-gemm` runs it.
//!
//! Outputs are fresh tensors on every call from glibc's default malloc, for torch too; `tp
//! train` sets `M_MMAP_THRESHOLD` to 1 GiB so that large outputs reuse freed memory instead of
//! faulting in new pages. `GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1073741824` measures both
//! sides that way (the python child inherits it).

use crate::{Args, Row};
use anyhow::{Result, bail};
use half::bf16;
use std::collections::HashMap;
use std::process::Command;
use tp_core::{DType, Device, Tensor, WeightLayout};

/// (label, in, out) of SmolLM2-135M's projections: q and o are both 576x576, k and v 192x576,
/// gate and up 1536x576, down 576x1536, the (tied) LM head 49152x576.
const PROJECTIONS: [(&str, usize, usize); 5] =
    [("q/o", 576, 576), ("k/v", 576, 192), ("gate/up", 576, 1536), ("down", 1536, 576), ("lm_head", 576, 49152)];
/// Tokens of one step: 8 rows x 256, and a skinny one row of 256.
const TOKENS: [usize; 2] = [2048, 256];
/// Output entries compared with the float64 reference.
const SAMPLE: usize = 64;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Pass {
    Fwd,
    Dgrad,
    Wgrad,
}

impl Pass {
    const ALL: [Pass; 3] = [Pass::Fwd, Pass::Dgrad, Pass::Wgrad];
    fn as_str(self) -> &'static str {
        match self {
            Pass::Fwd => "fwd",
            Pass::Dgrad => "dgrad",
            Pass::Wgrad => "wgrad",
        }
    }
    fn product(self) -> &'static str {
        match self {
            Pass::Fwd => "X_WT",
            Pass::Dgrad => "dY_W",
            Pass::Wgrad => "dYT_X",
        }
    }
}

/// One training GEMM: `pass` of a projection `[out, in]` over `tokens`.
#[derive(Clone, Debug)]
struct TrainGemm {
    label: &'static str,
    pass: Pass,
    tokens: usize,
    inp: usize,
    out: usize,
}

impl TrainGemm {
    fn flops(&self) -> f64 {
        2.0 * (self.tokens * self.inp * self.out) as f64
    }
    /// `MxNxK` of the product as run: fwd `T x out x in`, dgrad `T x in x out`, wgrad
    /// `out x in x T`.
    fn shape(&self) -> String {
        let (t, i, o) = (self.tokens, self.inp, self.out);
        match self.pass {
            Pass::Fwd => format!("{t}x{o}x{i}"),
            Pass::Dgrad => format!("{t}x{i}x{o}"),
            Pass::Wgrad => format!("{o}x{i}x{t}"),
        }
    }
}

/// The larger vocabularies' LM heads, (label, hidden, vocab): Llama 3.2 1B's 128256 x 2048 and
/// Qwen2.5 0.5B's 151936 x 896, each pass at 256 tokens.
const BIG_HEADS: [(&str, usize, usize); 2] = [("lm_head128k", 2048, 128_256), ("lm_head152k", 896, 151_936)];
/// Tokens of the long weight-gradient rows (wgrad's depth): q/o and gate/up at 4096.
const LONG_WGRAD: usize = 4096;

/// The set: every projection at 2048 and 256 tokens, the wgrad of q/o and gate/up at 4096
/// tokens, and the 128k and 152k LM heads at 256 (quick: every projection at 2048, and the
/// LM head and gate/up at 256), each pass.
fn train_set(quick: bool) -> Vec<TrainGemm> {
    let mut v = Vec::new();
    for tokens in TOKENS {
        for (label, inp, out) in PROJECTIONS {
            if quick && tokens != TOKENS[0] && !matches!(label, "lm_head" | "gate/up") {
                continue;
            }
            for pass in Pass::ALL {
                v.push(TrainGemm { label, pass, tokens, inp, out });
            }
        }
    }
    if !quick {
        for (label, inp, out) in PROJECTIONS.into_iter().filter(|p| matches!(p.0, "q/o" | "gate/up")) {
            v.push(TrainGemm { label, pass: Pass::Wgrad, tokens: LONG_WGRAD, inp, out });
        }
        for (label, inp, out) in BIG_HEADS {
            for pass in Pass::ALL {
                v.push(TrainGemm { label, pass, tokens: TOKENS[1], inp, out });
            }
        }
    }
    v
}

fn tolerance(dtype: DType) -> f64 {
    if dtype == DType::F32 { 1e-4 } else { 8e-3 }
}

pub fn rows(args: &Args) -> Result<Vec<Row>> {
    let dtypes: Vec<DType> = args.dtypes.iter().copied().filter(|d| matches!(d, DType::F32 | DType::BF16)).collect();
    if dtypes.is_empty() {
        bail!("--only train-gemm runs f32 and bf16; --dtype named neither");
    }
    let set = train_set(args.quick);
    let threads = tp_core::cpu::num_threads();
    println!(
        "host training GEMMs of a SmolLM2-135M step on {threads} threads, kernel family {}: fwd x.matmul_t(w), \
         dgrad dy.matmul_f32(w, Kn), wgrad dy.t_matmul(x); torch x @ w.T, dy @ w, dy.T @ x",
        tp_core::cpu::CpuKernel::current()
    );
    if std::env::var_os("GLIBC_TUNABLES").is_none() {
        println!(
            "note: fresh outputs come from glibc's default malloc (large ones mmap'd and faulted in on every call, \
             torch's too); tp train raises M_MMAP_THRESHOLD to reuse them: to measure that way run with \
             GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=1073741824"
        );
    }
    let rounds = if args.quick { 2 } else { 3 };
    // Per dtype: torch's (version, GFLOP/s, error) per shape, best GFLOP/s and worst error.
    let mut torch: HashMap<DType, (String, Vec<f64>, Vec<f64>)> = HashMap::new();
    let mut torch_skipped = None;
    let mut ours = vec![vec![0.0f64; dtypes.len()]; set.len()];
    let mut our_err = vec![vec![0.0f64; dtypes.len()]; set.len()];
    for round in 0..rounds {
        for &dtype in &dtypes {
            if torch_skipped.is_some() {
                break;
            }
            eprint!("\r  torch {dtype} training GEMMs (round {} of {rounds})...                    ", round + 1);
            match (torch_baseline(dtype, &set, threads), torch.remove(&dtype)) {
                (Ok(new), Some(old)) => {
                    let best = old.1.iter().zip(&new.1).map(|(a, b)| a.max(*b)).collect();
                    let err = old.2.iter().zip(&new.2).map(|(a, b)| a.max(*b)).collect();
                    torch.insert(dtype, (old.0, best, err));
                }
                (Ok(new), None) => drop(torch.insert(dtype, new)),
                (Err(_), Some(old)) => drop(torch.insert(dtype, old)), // a later round failed: keep the first
                (Err(why), None) => torch_skipped = Some(why),
            }
        }
        for (i, g) in set.iter().enumerate() {
            for (d, &dtype) in dtypes.iter().enumerate() {
                eprint!(
                    "\r  measuring {} {} {} {dtype} (round {} of {rounds})...          ",
                    g.pass.as_str(),
                    g.label,
                    g.shape(),
                    round + 1
                );
                let (gflops, err) = time_tp(g, dtype)?;
                ours[i][d] = ours[i][d].max(gflops);
                our_err[i][d] = our_err[i][d].max(err);
            }
        }
    }
    eprintln!();
    for (dtype, (version, _, _)) in &torch {
        println!("reference {dtype} (training GEMMs): {version}");
    }
    if let Some(why) = &torch_skipped {
        println!("torch baseline skipped: {why}");
    }
    println!(
        "each figure: the best of {rounds} interleaved rounds (torch, then tp), each the median of 7 samples; \
         bf16: tp's dgrad/wgrad return f32, torch's bf16"
    );
    println!(
        "max |out - ref| / max |ref| on {SAMPLE} sampled outputs against float64 (match: tp within {:.0e} f32, \
         {:.0e} bf16):",
        tolerance(DType::F32),
        tolerance(DType::BF16)
    );
    let mut rows = Vec::new();
    for (i, g) in set.iter().enumerate() {
        for (d, &dtype) in dtypes.iter().enumerate() {
            let t = torch.get(&dtype);
            let torch_err = t.map_or("-".to_string(), |(_, _, e)| format!("{:.1e}", e[i]));
            println!(
                "  {:<6} {:<8} {:<18} {:<5} tp {:.1e}  torch {torch_err}",
                g.pass.as_str(),
                g.label,
                g.shape(),
                dtype,
                our_err[i][d]
            );
            let base = t.map(|(_, v, _)| v[i]);
            rows.push(Row {
                kind: "train",
                name: format!("cpu {} {} {}", g.pass.as_str(), g.pass.product(), g.label),
                shape: g.shape(),
                dtype: dtype.to_string(),
                ours: ours[i][d],
                unit: "GFLOP/s",
                baseline_name: if base.is_some() { "torch" } else { "-" },
                baseline: base,
                matched: Some(our_err[i][d] <= tolerance(dtype)),
                roofline: None,
                bound: None,
            });
        }
    }
    Ok(rows)
}

/// Reads element `i` of a host tensor as f64 (exact for f32 and bf16).
fn reader(t: &Tensor) -> Result<Box<dyn Fn(usize) -> f64 + '_>> {
    Ok(match t.dtype() {
        DType::F32 => {
            let s = t.as_slice::<f32>()?;
            Box::new(move |i| f64::from(s[i]))
        }
        DType::BF16 => {
            let s = t.as_slice::<bf16>()?;
            Box::new(move |i| f64::from(s[i].to_f32()))
        }
        other => bail!("no reader for {other}"),
    })
}

/// Sampled output positions `(row, col)` of an `rows x cols` output (a fixed LCG).
fn sample(rows: usize, cols: usize) -> Vec<(usize, usize)> {
    let mut s: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (s >> 33) as usize
    };
    (0..SAMPLE).map(|_| (next() % rows, next() % cols)).collect()
}

/// Our GFLOP/s for `g` in `dtype`, and the max relative error of the output on a sample.
fn time_tp(g: &TrainGemm, dtype: DType) -> Result<(f64, f64)> {
    let (t, inp, out) = (g.tokens, g.inp, g.out);
    let cpu = Device::Cpu;
    let w = Tensor::rand(&[out, inp], dtype, 2, &cpu)?;
    let x = Tensor::rand(&[t, inp], dtype, 1, &cpu)?;
    let dy = Tensor::rand(&[t, out], dtype, 3, &cpu)?;
    let run = || -> Result<Tensor> {
        Ok(match g.pass {
            Pass::Fwd => x.matmul_t(&w)?,
            Pass::Dgrad => dy.matmul_f32(&w, WeightLayout::Kn)?,
            Pass::Wgrad => dy.t_matmul(&x)?,
        })
    };
    let y = run()?;
    let secs = crate::cpu::median_seconds(|| {
        std::hint::black_box(run()?);
        Ok(())
    })?;
    // out[r, c] = sum_k a(r, k) b(k, c) over the pass's operands.
    let (xr, wr, dyr, yr) = (reader(&x)?, reader(&w)?, reader(&dy)?, reader(&y)?);
    let (rows, cols, depth) = match g.pass {
        Pass::Fwd => (t, out, inp),
        Pass::Dgrad => (t, inp, out),
        Pass::Wgrad => (out, inp, t),
    };
    if y.dims() != [rows, cols] {
        bail!("{} {}: output {:?}, expected [{rows}, {cols}]", g.pass.as_str(), g.label, y.dims());
    }
    let (mut max_err, mut max_ref) = (0.0f64, 0.0f64);
    for (r, c) in sample(rows, cols) {
        let reference: f64 = (0..depth)
            .map(|k| match g.pass {
                Pass::Fwd => xr(r * inp + k) * wr(c * inp + k),
                Pass::Dgrad => dyr(r * out + k) * wr(k * inp + c),
                Pass::Wgrad => dyr(k * out + r) * xr(k * inp + c),
            })
            .sum();
        max_err = max_err.max((yr(r * cols + c) - reference).abs());
        max_ref = max_ref.max(reference.abs());
    }
    Ok((g.flops() / secs / 1e9, max_err / max_ref.max(f64::MIN_POSITIVE)))
}

/// The torch side: the same products, timed as `median_seconds` does, each output checked the
/// same way. Arguments: dtype, threads, then `pass,T,in,out` per shape. Prints a version line,
/// then `GFLOP/s max_rel_err` per shape.
const SCRIPT: &str = r#"
import sys, time
import torch
dtype, threads = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(threads)
torch.manual_seed(0)
dt = {"bf16": torch.bfloat16, "f32": torch.float32}[dtype]
print(f"torch {torch.__version__} (oneDNN, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}; results in {dtype})")
make = lambda r, c: (torch.rand(r, c) * 2 - 1).to(dt)
g = torch.Generator().manual_seed(1)
for arg in sys.argv[3:]:
    p, t, i, o = arg.split(",")
    t, i, o = int(t), int(i), int(o)
    w = make(o, i)
    if p == "fwd":
        a = make(t, i)
        f = lambda: a @ w.T
    elif p == "dgrad":
        a = make(t, o)
        f = lambda: a @ w
    else:
        a, x = make(t, o), make(t, i)
        f = lambda: a.T @ x
    y = f()
    tm = time.perf_counter(); f(); one = max(time.perf_counter() - tm, 1e-6)
    reps = max(1, int(-(-0.02 // one)))
    s = []
    for _ in range(7):
        tm = time.perf_counter()
        for _ in range(reps):
            f()
        s.append((time.perf_counter() - tm) / reps)
    s.sort()
    rows, cols = y.shape
    r = torch.randint(0, rows, (64,), generator=g)
    c = torch.randint(0, cols, (64,), generator=g)
    if p == "fwd":
        ref = (a[r].double() * w[c].double()).sum(1)
    elif p == "dgrad":
        ref = (a[r].double() * w[:, c].T.double()).sum(1)
    else:
        ref = (a[:, r].T.double() * x[:, c].T.double()).sum(1)
    err = (y[r, c].double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300)
    print(2.0 * t * i * o / s[3] / 1e9, float(err), flush=True)
    del y, w, a, f
"#;

/// torch's version line, GFLOP/s and max relative error per shape of `set` in `dtype`.
#[allow(clippy::type_complexity)]
fn torch_baseline(dtype: DType, set: &[TrainGemm], threads: usize) -> Result<(String, Vec<f64>, Vec<f64>), String> {
    let out = Command::new("python3")
        .arg("-c")
        .arg(SCRIPT)
        .arg(dtype.as_str())
        .arg(threads.to_string())
        .args(set.iter().map(|g| format!("{},{},{},{}", g.pass.as_str(), g.tokens, g.inp, g.out)))
        .env_remove("OPENBLAS_CORETYPE")
        .env_remove("OPENBLAS_L2_SIZE")
        .output()
        .map_err(|e| format!("cannot run python3 ({e})"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().last().unwrap_or("python3 failed");
        return Err(format!("{last} (pip install torch to compare the training GEMMs)"));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut lines = stdout.lines();
    let version = lines.next().unwrap_or("torch").to_string();
    let (mut gflops, mut errs) = (Vec::new(), Vec::new());
    for l in lines {
        let v: Vec<f64> = l.split_whitespace().filter_map(|v| v.parse().ok()).collect();
        if let [a, b] = v[..] {
            gflops.push(a);
            errs.push(b);
        }
    }
    if gflops.len() != set.len() {
        return Err(format!("torch printed {} figures for {} shapes", gflops.len(), set.len()));
    }
    Ok((version, gflops, errs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lm_head_shapes_are_a_step_of_2048_tokens() {
        let set = train_set(false);
        assert_eq!(set.len(), 2 * 5 * 3 + 2 + 2 * 3);
        let lm: Vec<String> =
            set.iter().filter(|g| g.label == "lm_head" && g.tokens == 2048).map(TrainGemm::shape).collect();
        assert_eq!(lm, ["2048x49152x576", "2048x576x49152", "49152x576x2048"]);
        let big: Vec<String> = set.iter().filter(|g| g.label == "lm_head128k").map(TrainGemm::shape).collect();
        assert_eq!(big, ["256x128256x2048", "256x2048x128256", "128256x2048x256"]);
        let long: Vec<String> = set.iter().filter(|g| g.tokens == LONG_WGRAD).map(TrainGemm::shape).collect();
        assert_eq!(long, ["576x576x4096", "1536x576x4096"]);
        assert!(train_set(true).len() < set.len());
    }

    #[test]
    fn small_products_match_float64() {
        for pass in Pass::ALL {
            for dtype in [DType::F32, DType::BF16] {
                let g = TrainGemm { label: "t", pass, tokens: 37, inp: 29, out: 53 };
                let (gflops, err) = time_tp(&g, dtype).unwrap();
                assert!(gflops > 0.0 && err <= tolerance(dtype), "{pass:?} {dtype}: {err}");
            }
        }
    }
}
