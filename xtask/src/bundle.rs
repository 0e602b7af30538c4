//! `cargo xtask bundle [--out DIR]`: everything a GPU host without a Rust toolchain needs, in one
//! folder (default `target/bundle/`): the GPU test suites, `tp-bench`, `tp-comm-bench` and the
//! `generate` example built in release mode, stripped and packed into `bins.tar.gz`, and
//! `run.sh`, which unpacks them into a temporary folder, finds libcuda,
//! libnvrtc, libcublas and libnccl (system paths and `/usr/local/nvidia/lib64`, `CUDA_HOME`,
//! Python's `nvidia/*/lib`; appended after the inherited `LD_LIBRARY_PATH`; reported as the
//! loader will find them, `ldconfig -p` included), runs them and writes results to the folder it
//! is given.

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Stdio;

const RUN_SH: &str = include_str!("run.sh");

/// The archive of the bundle's binaries, which run.sh unpacks.
const ARCHIVE: &str = "bins.tar.gz";

/// The GPU suites: (file in the bundle, package, test target). run.sh runs each.
const SUITES: &[(&str, &str, &str)] = &[
    ("gpu-tests", "tp-core", "gpu"),
    ("gpu-quant-tests", "tp-core", "gpu_quant"),
    ("gpu-grad-tests", "tp-core", "gpu_grad"),
    ("gpu-moe-tests", "tp-core", "gpu_moe"),
    ("gpu-comm-tests", "tp-comm", "gpu_comm"),
    ("gpu-layer-tests", "tp-layers", "gpu_layers"),
    ("gpu-model-tests", "tp-models", "gpu_models"),
];

pub fn run(args: &[String]) -> Result<()> {
    let out = match args {
        [] => crate::workspace_root().join("target/bundle"),
        // Absolute: tar and strip run from the workspace root, the copies from here.
        [flag, dir] if flag == "--out" => std::path::absolute(dir).with_context(|| format!("--out {dir}"))?,
        _ => bail!("usage: cargo xtask bundle [--out DIR]"),
    };
    let nvcc = crate::cuda::ensure_nvcc()?;
    println!("==> nvcc: {}", nvcc.display());
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let commit = git_commit();
    std::fs::create_dir_all(&out)?;

    let mut files = Vec::new();
    for &(name, package, test) in SUITES {
        let args =
            ["test", "--release", "--locked", "-p", package, "--features", "gpu-tests", "--test", test, "--no-run"];
        let built = build_executables(&cargo, &args, &commit)?;
        // The test's own executable (`deps/{test}-HASH`), not a binary target of the package
        // that cargo builds beside it for integration tests (tp-comm's tp-probe).
        let prefix = format!("{test}-");
        let exe = built
            .iter()
            .find(|p| p.file_name().and_then(|f| f.to_str()).is_some_and(|f| f.starts_with(&prefix)))
            .with_context(|| format!("cargo built no {package} GPU test binary ({test})"))?;
        install(exe, &out.join(name))?;
        files.push(name);
    }
    let bench = build_executables(
        &cargo,
        &["build", "--release", "--locked", "-p", "tp-benches", "--bin", "tp-bench", "--bin", "tp-comm-bench"],
        &commit,
    )?;
    let examples = build_executables(
        &cargo,
        &["build", "--release", "--locked", "-p", "tp-models", "--example", "generate"],
        &commit,
    )?;
    let find = |list: &[PathBuf], name: &str| list.iter().find(|p| p.file_name().is_some_and(|f| f == name)).cloned();
    for (list, name) in [(&bench, "tp-bench"), (&bench, "tp-comm-bench"), (&examples, "generate")] {
        let exe = find(list, name).with_context(|| format!("cargo built no {name} binary"))?;
        install(&exe, &out.join(name))?;
        files.push(name);
    }
    // The binaries (each ~10 MiB, mostly the same embedded fatbins) travel as one gzip archive,
    // a fraction of their size: what a device call carries is capped at 64 MiB. run.sh unpacks
    // it into a temporary folder.
    let raw: u64 = files.iter().filter_map(|f| std::fs::metadata(out.join(f)).ok()).map(|m| m.len()).sum();
    let archive = out.join(ARCHIVE);
    let _ = std::fs::remove_file(&archive);
    let packed = crate::command("tar", &["-czf"]).arg(&archive).arg("-C").arg(&out).args(&files).status();
    if !packed.is_ok_and(|s| s.success()) {
        bail!("tar -czf {} failed (tar and gzip are needed to pack the bundle)", archive.display());
    }
    for f in &files {
        std::fs::remove_file(out.join(f))?;
    }
    println!("binaries: {:.1} MiB, packed into {ARCHIVE}", raw as f64 / 1048576.0);
    let mut files = vec![ARCHIVE];
    std::fs::write(out.join("run.sh"), RUN_SH)?;
    set_executable(&out.join("run.sh"))?;
    std::fs::write(out.join("COMMIT"), format!("{commit}\n"))?;
    files.push("run.sh");
    let size: u64 = files.iter().filter_map(|f| std::fs::metadata(out.join(f)).ok()).map(|m| m.len()).sum();
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
