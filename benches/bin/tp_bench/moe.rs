//! The mixture-of-experts rows of tp-bench (`--only moe`): a Qwen3-MoE-shaped GGUF file of about
//! 2B parameters, 8 of 64 experts active per token, in llama.cpp's Q4_K_M mixture, and a
//! gpt-oss-shaped one of about 1.7B, 4 of 32 experts active, its experts in MXFP4 (both written
//! once by `benches/reference/make_moe_gguf.py`), run by tp on their quantized blocks (the first
//! at TP 1 and 2, the second at TP 1) beside llama.cpp (`llama_cpp.Llama`, the same file and
//! threads) in the same run: prefill of a 512-token prompt, decode after it and after its first 8
//! tokens. The gpt-oss rows are named `gpt-oss ...`.
//!
//! Decode should read only the experts a token chose. The `bytes/token` row gives the bytes a
//! decode step must read when it does (attention, routers, norms, the chosen experts' blocks,
//! the LM head, one embedding row) beside the whole file's; each decode row's roofline column is
//! our tokens/s over `bandwidth / those active bytes`.

use crate::gguf::{PROMPT_LEN, Speeds, llama_cpp, measure};
use crate::{Args, Row};
use anyhow::{Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Writes (once) the benchmark's MoE file `name` under `target/bench/gguf/` (`args` for
/// `make_moe_gguf.py`).
fn file(name: &str, args: &[&str]) -> Result<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = root.join("target/bench/gguf");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(name);
    if path.exists() {
        return Ok(path);
    }
    eprintln!("  writing {} (once)...", path.display());
    let script = root.join("benches/reference/make_moe_gguf.py");
    if !Command::new("python3").arg(&script).arg(&path).args(args).status()?.success() {
        let _ = std::fs::remove_file(&path);
        bail!("make_moe_gguf.py failed (pip install gguf numpy)");
    }
    Ok(path)
}

/// `(bytes one decode step reads when it reads only the chosen experts, the file's bytes)`.
fn active_bytes(path: &Path) -> Result<(f64, f64)> {
    let f = tp_gguf::GgufFile::open(path)?;
    let arch = f.get_str("general.architecture")?.unwrap_or_default().to_string();
    let used = f.get_u64(&format!("{arch}.expert_used_count"))?.unwrap_or(0) as f64;
    let experts = f.get_u64(&format!("{arch}.expert_count"))?.unwrap_or(1).max(1) as f64;
    let (mut active, mut all) = (0f64, 0f64);
    for t in f.tensors() {
        let b = t.n_bytes as f64;
        all += b;
        active += if t.name.ends_with("_exps.weight") {
            b * used / experts
        } else if t.name == "token_embd.weight" {
            b / t.dims.get(1).copied().unwrap_or(1).max(1) as f64 // one row
        } else {
            b
        };
    }
    Ok((active, all))
}

/// The MoE rows: the Qwen3-MoE file's, then the gpt-oss file's.
pub fn rows(args: &Args) -> Result<Vec<Row>> {
    let mut rows = file_rows(args, &file("qwen3moe-2b-Q4_K_M.gguf", &[])?, "", "Q4_K_M", &[1, 2])?;
    let gpt_oss = file("gpt-oss-1.7b-MXFP4.gguf", &["--arch", "gpt-oss"])?;
    rows.extend(file_rows(args, &gpt_oss, "gpt-oss ", "MXFP4+Q8_0", &[1])?);
    Ok(rows)
}

/// One file's rows (names prefixed by `label`) at the `worlds` TP degrees.
fn file_rows(args: &Args, path: &Path, label: &str, dtype: &'static str, worlds: &[usize]) -> Result<Vec<Row>> {
    let bandwidth = crate::cpu::read_bandwidth()?;
    let (active, all) = active_bytes(path)?;
    let config = tp_models::ModelConfig::from_dir(path)?;
    let steps = if args.quick { 8 } else { 32 };
    let prompt: Vec<i64> = (0..PROMPT_LEN as i64).map(|i| (i * 7919 + 13) % config.vocab_size as i64).collect();
    println!(
        "MoE rows: {} ({:.2} GiB, {:.0} MiB read per decode step when only the chosen experts are), \
         {PROMPT_LEN}-token prompt, {steps} decode steps, bandwidth {bandwidth:.1} GB/s",
        path.display(),
        all / (1u64 << 30) as f64,
        active / (1u64 << 20) as f64
    );
    let lc = llama_cpp(path, steps);
    if let Err(why) = &lc {
        println!("llama.cpp baseline skipped: {why}");
    }
    let roof = bandwidth * 1e9 / active;
    let row = |name: String, ours: f64, unit: &'static str, base: Option<f64>, roof: Option<f64>| Row {
        kind: "moe",
        name,
        shape: format!("{PROMPT_LEN} tokens"),
        dtype: dtype.into(),
        ours,
        unit,
        baseline_name: if base.is_some() { "llama.cpp" } else { "-" },
        baseline: base,
        matched: None,
        roofline: roof,
        bound: roof.map(|_| "memory"),
    };
    let mut rows = vec![Row {
        shape: "active / whole file".into(),
        ..row(format!("{label}bytes/token"), active / 1e6, "MB", None, None)
    }];
    rows[0].baseline = Some(all / 1e6);
    rows[0].baseline_name = "whole file";
    for &world in worlds {
        eprint!("\r  measuring {} at TP {world}...          ", path.display());
        let (prefill, decode, short) = measure(path, None, world, &prompt, steps)?;
        let base = |f: fn(&Speeds) -> f64| lc.as_ref().ok().filter(|_| world == 1).map(f);
        rows.push(row(format!("{label}prefill TP{world}"), prefill, "tokens/s", base(|b| b.0), None));
        rows.push(row(format!("{label}decode TP{world}"), decode, "tokens/s", base(|b| b.1), Some(decode / roof)));
        rows.push(row(format!("{label}decode@8 TP{world}"), short, "tokens/s", base(|b| b.2), Some(short / roof)));
    }
    Ok(rows)
}
