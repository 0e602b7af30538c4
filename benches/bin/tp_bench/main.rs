//! `tp-bench`: the project's main job (`cargo xtask bench` runs it; the GPU bundle carries it).
//!
//! On a GPU: shard-copy and gather-interleave bandwidth beside `cuMemcpyDtoD` on the same bytes,
//! and our GEMM kernels beside cuBLAS in the same process (TFLOP/s, ratio, outputs compared).
//! Without a GPU it says why in its first line and runs the host GEMM table, with numpy beside
//! it when installed. Results: a table on stdout, and `results.json` / `results.csv` in `--out`.
//!
//! Usage: `tp-bench [--quick] [--cpu] [--dtype f32,f16,bf16] [--shapes all|squares|tp|MxNxK,..]
//! [--only gemm,model,serving,gguf,train-gemm,pipeline,kv-cache] [--out DIR]`. `--only train-gemm` (opt-in:
//! never part of the default run) measures the forward, dgrad and wgrad GEMMs of a training step
//! beside torch (`train.rs`); `--only pipeline` (opt-in too) the measured bubble of each pipeline
//! schedule beside its formula, with one step's timeline per schedule as an SVG (`pipeline.rs`);
//! `--only moe` (opt-in) a 2B Qwen3-MoE-shaped GGUF file beside llama.cpp (`moe.rs`);
//! `--only lora` (opt-in) 16 streams over 4 LoRA adapters beside the base alone (`lora.rs`);
//! `--only kv-cache` (opt-in) the 8-bit KV caches' memory, speed and logits beside the model
//! dtype's (`kv_cache.rs`; `--model FILE.gguf` runs a GGUF file in f32). Writes `results.json`, `results.csv` and `results.svg` (throughput against size,
//! ours beside the reference, one panel per dtype) into DIR (default `target/bench`).

mod cpu;
mod gguf;
mod gpu;
mod kv_cache;
mod lora;
mod model;
mod moe;
mod pipeline;
mod serving;
mod shapes;
mod svg;
mod train;

use anyhow::{Context, Result, bail};
use std::fmt::Write as _;
use std::path::PathBuf;
use tp_core::DType;

/// One measured row.
#[derive(Debug, Clone)]
pub struct Row {
    /// What was measured (`gemm`, `copy`).
    pub kind: &'static str,
    /// Kernel or operation name.
    /// What was measured (`gemm`, `decode`, `serving c=16`, ...).
    pub name: String,
    /// Problem shape, e.g. `4096x4096x4096` or `256 MiB`.
    pub shape: String,
    /// The dtype, where one applies.
    pub dtype: String,
    /// Our figure and its unit (`TFLOP/s`, `GFLOP/s`, `GB/s`).
    pub ours: f64,
    /// The unit of `ours` and `baseline`.
    pub unit: &'static str,
    /// The reference measured in the same run (`cuBLAS`, `cuMemcpyDtoD`, `numpy`), if any.
    pub baseline_name: &'static str,
    /// The reference's figure, in `unit`.
    pub baseline: Option<f64>,
    /// Whether our output matched the reference's (None where not compared).
    pub matched: Option<bool>,
    /// Our figure as a fraction of the roofline (min of the measured compute ceiling and
    /// arithmetic intensity x the measured memory bandwidth), and which of the two binds.
    pub roofline: Option<f64>,
    /// `compute` or `memory`: which ceiling binds.
    pub bound: Option<&'static str>,
}

/// Ceilings measured at the start of a run, for the roofline column.
#[derive(Debug, Clone, Copy)]
pub struct Ceilings {
    /// Peak throughput measured, in the rows' unit (TFLOP/s on GPU, GFLOP/s on CPU).
    pub compute: f64,
    /// Memory bandwidth measured, in bytes per second divided by the same scale (TB/s, GB/s).
    pub memory: f64,
}

impl Ceilings {
    /// `(fraction of the roofline, "compute" | "memory")` for a GEMM of `flops` over `bytes`
    /// that ran at `ours`.
    pub fn place(&self, ours: f64, flops: f64, bytes: f64) -> (f64, &'static str) {
        let mem_roof = flops / bytes * self.memory;
        if mem_roof < self.compute { (ours / mem_roof, "memory") } else { (ours / self.compute, "compute") }
    }
}

impl Row {
    fn ratio(&self) -> Option<f64> {
        self.baseline.map(|b| self.ours / b)
    }
}

/// What to run.
pub struct Args {
    /// `--quick`: fewer shapes and rounds.
    pub quick: bool,
    /// `--cpu`: the host even where a GPU is found.
    pub cpu_only: bool,
    /// `--dtype`: the dtypes of the GEMM rows.
    pub dtypes: Vec<tp_core::DType>,
    /// `--shapes`: the GEMM problems (`all`, `squares`, `tp` or a list of `MxNxK`).
    pub shapes: Option<String>,
    /// `--out`: where results.json, results.csv and results.svg go.
    pub out: PathBuf,
    /// Whole-model rows (`--model tinyllama|DIR|none`; default tinyllama, none with `--quick`).
    pub model: Option<model::Which>,
    /// Which tables run (`--only gemm|model|serving|gguf|train-gemm,..`; default all but
    /// train-gemm, which runs only when named).
    pub only: Vec<String>,
}

impl Args {
    /// Whether the table `name` runs.
    pub fn runs(&self, name: &str) -> bool {
        self.only.is_empty() || self.named(name)
    }

    /// Whether `--only` names the table `name` (the opt-in tables run only then).
    pub fn named(&self, name: &str) -> bool {
        self.only.iter().any(|o| o == name)
    }
}

const USAGE: &str = "usage: tp-bench [--quick] [--cpu] [--dtype f32,f16,bf16] [--shapes all|squares|tp|MxNxK,..] \
                     [--model tinyllama|DIR|none] [--only gemm,model,serving,gguf,train-gemm,pipeline,kv-cache,moe,lora] [--out DIR]\n       \
                     tp-bench --write-model  (writes the TinyLlama-shaped checkpoint once and prints its folder)";

fn parse_args() -> Result<Args> {
    let mut a = Args {
        quick: false,
        cpu_only: false,
        dtypes: tp_core::DType::FLOATS.to_vec(),
        shapes: None,
        out: PathBuf::from("target/bench"),
        model: None,
        only: Vec::new(),
    };
    let mut model = None;
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--quick" => a.quick = true,
            "--cpu" => a.cpu_only = true,
            "--dtype" => a.dtypes = shapes::parse_dtypes(&it.next().context("--dtype needs a list")?)?,
            "--shapes" => a.shapes = Some(it.next().context("--shapes needs a value")?),
            "--out" => a.out = it.next().context("--out needs a directory")?.into(),
            "--model" => model = Some(it.next().context("--model needs tinyllama, a folder or none")?),
            "--only" => {
                let list = it.next().context(
                    "--only needs gemm, model, serving, gguf, train-gemm, pipeline, kv-cache, moe or lora (comma-separated)",
                )?;
                for t in list.split(',') {
                    if !["gemm", "model", "serving", "gguf", "train-gemm", "pipeline", "kv-cache", "moe", "lora"]
                        .contains(&t)
                    {
                        bail!(
                            "--only takes gemm, model, serving, gguf, train-gemm, pipeline, kv-cache, moe, lora; got {t:?}"
                        );
                    }
                    a.only.push(t.to_string());
                }
            }
            other => bail!("unknown argument {other:?}; {USAGE}"),
        }
    }
    a.model = match model.as_deref() {
        None if a.quick => None,
        None | Some("tinyllama") => Some(model::Which::TinyLlama),
        Some("none") => None,
        Some(dir) => Some(model::Which::Dir(PathBuf::from(dir))),
    };
    Ok(a)
}

impl Args {
    /// The GEMM problems to run on this backend.
    pub fn gemms(&self, gpu: bool) -> Result<Vec<shapes::Gemm>> {
        match &self.shapes {
            Some(spec) => shapes::parse_shapes(spec, gpu, self.quick),
            None => Ok(shapes::default_set(gpu, self.quick)),
        }
    }
}

fn main() {
    if let Err(e) = run() {
        eprintln!("tp-bench: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    // For scripts that serve the benchmark checkpoint (benches/reference/serve_features_bench.py).
    if std::env::args().nth(1).as_deref() == Some("--write-model") {
        println!("{}", model::dir_of(&model::Which::TinyLlama)?.display());
        return Ok(());
    }
    let args = parse_args()?;
    let gpu =
        if args.cpu_only { Err("--cpu given".to_string()) } else { tp_kernels::Gpu::get(0).map_err(|e| e.to_string()) };
    let mut rows = match &gpu {
        _ if !args.runs("gemm") => Vec::new(),
        Ok(g) => {
            println!(
                "GPU 0: {} (sm_{}{}, {} SMs); commit {}",
                g.name(),
                g.compute_capability().0,
                g.compute_capability().1,
                g.sm_count(),
                option_env!("TP_COMMIT").unwrap_or("unknown")
            );
            gpu::run(g, &args)?
        }
        Err(why) => {
            println!("no GPU: {why}; running the CPU backend");
            cpu::run(&args)?
        }
    };
    if args.named("train-gemm") {
        rows.extend(train::rows(&args)?);
    }
    if args.named("pipeline") {
        rows.extend(pipeline::rows(&args)?);
    }
    if args.named("moe") {
        rows.extend(moe::rows(&args)?);
    }
    if let Some(which) = &args.model {
        let device = if gpu.is_ok() { tp_core::Device::Cuda(0) } else { tp_core::Device::Cpu };
        if args.runs("model") {
            rows.extend(model::rows(&args, which, device)?);
        }
        if device == tp_core::Device::Cpu && args.runs("serving") {
            let dir = model::dir_of(which)?;
            if dir.extension().is_some_and(|e| e == "gguf") {
                rows.extend(serving::gguf_rows(&args, &dir)?);
            } else {
                rows.extend(serving::rows(&args, &dir)?);
            }
        }
        if device == tp_core::Device::Cpu && args.named("lora") {
            rows.extend(lora::rows(&args, &model::dir_of(which)?)?);
        }
        if device == tp_core::Device::Cpu && args.named("kv-cache") {
            let dir = model::dir_of(which)?;
            let gguf = dir.extension().is_some_and(|e| e == "gguf");
            rows.extend(kv_cache::rows(&args, &dir, if gguf { DType::F32 } else { DType::BF16 })?);
        }
        if device == tp_core::Device::Cpu && args.runs("gguf") && matches!(which, model::Which::TinyLlama) {
            rows.extend(gguf::rows(&args, &model::dir_of(which)?)?);
        }
        eprintln!();
    }
    print_table(&rows);
    write_results(&args.out, &rows)
}

fn print_table(rows: &[Row]) {
    println!(
        "\n{:<6} {:<28} {:<18} {:<5} {:>10} {:<8} {:>10} {:<13} {:>7} {:>6} {:>9}",
        "kind", "name", "shape", "dtype", "ours", "unit", "reference", "(what)", "ratio", "match", "roofline"
    );
    for r in rows {
        let base = r.baseline.map_or("-".into(), |b| format!("{b:.1}"));
        let ratio = r.ratio().map_or("-".into(), |x| format!("{x:.2}x"));
        let matched = r.matched.map_or("-", |m| if m { "yes" } else { "NO" });
        let roof = match (r.roofline, r.bound) {
            (Some(f), Some(b)) => format!("{:.0}% {}", 100.0 * f, &b[..3]),
            _ => "-".into(),
        };
        println!(
            "{:<6} {:<28} {:<18} {:<5} {:>10.1} {:<8} {:>10} {:<13} {:>7} {:>6} {:>9}",
            r.kind, r.name, r.shape, r.dtype, r.ours, r.unit, base, r.baseline_name, ratio, matched, roof
        );
    }
}

/// A JSON string literal.
fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out + "\""
}

fn write_results(dir: &std::path::Path, rows: &[Row]) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let num = |v: Option<f64>| v.filter(|x| x.is_finite()).map_or("null".to_string(), |x| format!("{x}"));
    let mut json = String::from("[\n");
    let mut csv =
        String::from("kind,name,shape,dtype,ours,unit,reference_name,reference,ratio,matched,roofline,bound\n");
    for (i, r) in rows.iter().enumerate() {
        let matched = r.matched.map_or("null".into(), |m| m.to_string());
        let _ = writeln!(
            json,
            "  {{\"kind\": {}, \"name\": {}, \"shape\": {}, \"dtype\": {}, \"ours\": {}, \"unit\": {}, \
             \"reference_name\": {}, \"reference\": {}, \"ratio\": {}, \"matched\": {}, \"roofline\": {}, \
             \"bound\": {}}}{}",
            json_str(r.kind),
            json_str(&r.name),
            json_str(&r.shape),
            json_str(&r.dtype),
            num(Some(r.ours)),
            json_str(r.unit),
            json_str(r.baseline_name),
            num(r.baseline),
            num(r.ratio()),
            matched,
            num(r.roofline),
            r.bound.map_or("null".into(), json_str),
            if i + 1 < rows.len() { "," } else { "" }
        );
        let _ = writeln!(
            csv,
            "{},{},{},{},{},{},{},{},{},{},{},{}",
            r.kind,
            r.name,
            r.shape,
            r.dtype,
            r.ours,
            r.unit,
            r.baseline_name,
            r.baseline.map_or(String::new(), |b| b.to_string()),
            r.ratio().map_or(String::new(), |b| b.to_string()),
            r.matched.map_or(String::new(), |m| m.to_string()),
            r.roofline.map_or(String::new(), |f| f.to_string()),
            r.bound.unwrap_or("")
        );
    }
    json.push_str("]\n");
    std::fs::write(dir.join("results.json"), json)?;
    std::fs::write(dir.join("results.csv"), csv)?;
    if let Some(svg) = svg::chart(rows) {
        std::fs::write(dir.join("results.svg"), svg)?;
    }
    println!("\nwrote {}/results.json, results.csv and results.svg", dir.display());
    Ok(())
}
