//! `cargo xtask bundle [--out DIR]`: everything a GPU host without a Rust toolchain needs, in one
//! folder (default `target/bundle/`): the GPU test suites and `tp-bench` built in release mode and
//! stripped, and `run.sh`, which finds libcuda, libnvrtc, libcublas and libnccl (system paths,
//! `CUDA_HOME`, Python's `nvidia/*/lib`), runs both and writes results to the folder it is given.

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Stdio;

const RUN_SH: &str = include_str!("run.sh");

pub fn run(args: &[String]) -> Result<()> {
    let out = match args {
        [] => crate::workspace_root().join("target/bundle"),
        [flag, dir] if flag == "--out" => PathBuf::from(dir),
        _ => bail!("usage: cargo xtask bundle [--out DIR]"),
    };
    let nvcc = crate::cuda::ensure_nvcc()?;
    println!("==> nvcc: {}", nvcc.display());
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let commit = git_commit();
    std::fs::create_dir_all(&out)?;

    let tests = build_executables(
        &cargo,
        &["test", "--release", "--locked", "-p", "tp-core", "--features", "gpu-tests", "--test", "gpu", "--no-run"],
        &commit,
    )?;
    let comm_tests = build_executables(
        &cargo,
        &[
            "test",
            "--release",
            "--locked",
            "-p",
            "tp-comm",
            "--features",
            "gpu-tests",
            "--test",
            "gpu_comm",
            "--no-run",
        ],
        &commit,
    )?;
    let layer_tests = build_executables(
        &cargo,
        &[
            "test",
            "--release",
            "--locked",
            "-p",
            "tp-layers",
            "--features",
            "gpu-tests",
            "--test",
            "gpu_layers",
            "--no-run",
        ],
        &commit,
    )?;
    let bench = build_executables(
        &cargo,
        &["build", "--release", "--locked", "-p", "tp-benches", "--bin", "tp-bench", "--bin", "tp-comm-bench"],
        &commit,
    )?;
    let gpu_tests = tests.first().context("cargo built no GPU test binary")?;
    let find = |name: &str| bench.iter().find(|p| p.file_name().is_some_and(|f| f == name)).cloned();
    let tp_bench = find("tp-bench").context("cargo built no tp-bench binary")?;
    let comm_bench = find("tp-comm-bench").context("cargo built no tp-comm-bench binary")?;
    install(gpu_tests, &out.join("gpu-tests"))?;
    install(comm_tests.first().context("cargo built no tp-comm GPU test binary")?, &out.join("gpu-comm-tests"))?;
    install(layer_tests.first().context("cargo built no tp-layers GPU test binary")?, &out.join("gpu-layer-tests"))?;
    install(&tp_bench, &out.join("tp-bench"))?;
    install(&comm_bench, &out.join("tp-comm-bench"))?;
    std::fs::write(out.join("run.sh"), RUN_SH)?;
    set_executable(&out.join("run.sh"))?;
    std::fs::write(out.join("COMMIT"), format!("{commit}\n"))?;
    let size: u64 = ["gpu-tests", "gpu-comm-tests", "gpu-layer-tests", "tp-bench", "tp-comm-bench", "run.sh"]
        .iter()
        .filter_map(|f| std::fs::metadata(out.join(f)).ok())
        .map(|m| m.len())
        .sum();
    println!(
        "bundle: {} ({:.1} MiB, commit {commit}); run it with: {}/run.sh RESULTS_DIR",
        out.display(),
        size as f64 / 1048576.0,
        out.display()
    );
    Ok(())
}

fn git_commit() -> String {
    let o = crate::command("git", &["rev-parse", "--short=12", "HEAD"]).output();
    let dirty = crate::command("git", &["status", "--porcelain", "--untracked-files=no"]).output();
    let hash = o.ok().filter(|o| o.status.success()).map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let dirty = dirty.ok().is_some_and(|o| !o.stdout.is_empty());
    format!("{}{}", hash.unwrap_or_else(|| "unknown".into()), if dirty { "-dirty" } else { "" })
}

/// Runs a cargo build with JSON messages and returns the executables it produced.
fn build_executables(cargo: &str, args: &[&str], commit: &str) -> Result<Vec<PathBuf>> {
    println!("\n==> {cargo} {}", args.join(" "));
    let mut full: Vec<&str> = args.to_vec();
    full.push("--message-format=json-render-diagnostics");
    let out = crate::command(cargo, &full)
        .env("TP_COMMIT", commit)
        .stderr(Stdio::inherit())
        .output()
        .context("cannot run cargo")?;
    if !out.status.success() {
        bail!("cargo {} failed", args.join(" "));
    }
    // Each artifact line carries "executable":"<path>" (null for libraries).
    let exes = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("\"reason\":\"compiler-artifact\""))
        .filter_map(|l| l.split("\"executable\":\"").nth(1).and_then(|r| r.split('"').next()).map(PathBuf::from))
        .collect();
    Ok(exes)
}

/// Copies a binary and strips its symbols (what travels to the GPU host is size-capped).
fn install(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to).with_context(|| format!("cannot copy {}", from.display()))?;
    let stripped = crate::command("strip", &[]).arg(to).status().is_ok_and(|s| s.success());
    if !stripped {
        println!("warning: could not strip {}", to.display());
    }
    set_executable(to)
}

fn set_executable(p: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755))
        .with_context(|| format!("chmod {}", p.display()))
}
