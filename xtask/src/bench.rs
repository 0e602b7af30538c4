//! `cargo xtask bench [--quick] [--cpu] [--out DIR]`: builds and runs `tp-bench` (benches/bin) in
//! release mode. On a GPU it measures our kernels beside cuBLAS and cuMemcpyDtoD; without one it
//! says why and runs the host GEMM table beside numpy (installed here, pinned, under `target/`,
//! so a fresh machine shows the reference) and torch when it is importable. Results go to
//! `target/bench/` by default.

use anyhow::{Context, Result, bail};
use std::path::PathBuf;

/// The numpy that the host table is compared with (OpenBLAS inside; no dependencies).
const NUMPY: &str = "numpy==2.3.5";

pub fn run(args: &[String]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // Kernels are embedded at build time: make sure there is an nvcc to build them with.
    if let Err(e) = crate::cuda::ensure_nvcc() {
        println!("warning: no nvcc ({e:#}); the GPU kernels will not be built");
    }
    let mut cmd: Vec<&str> =
        vec!["run", "--quiet", "--release", "--locked", "-p", "tp-benches", "--bin", "tp-bench", "--"];
    cmd.extend(args.iter().map(String::as_str));
    let mut c = crate::command(&cargo, &cmd);
    match ensure_numpy() {
        Ok(dir) => {
            let mut paths = vec![dir];
            paths.extend(
                std::env::var_os("PYTHONPATH")
                    .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
                    .unwrap_or_default(),
            );
            c.env("PYTHONPATH", std::env::join_paths(paths).context("PYTHONPATH")?);
        }
        Err(e) => println!("warning: no numpy for the host baseline ({e:#})"),
    }
    println!("\n==> {cargo} {}", cmd.join(" "));
    let status = c.status().with_context(|| format!("cannot start {cargo}"))?;
    if !status.success() {
        bail!("tp-bench failed ({status})");
    }
    Ok(())
}

/// The pinned numpy, installed from PyPI into `target/numpy-<version>/` the first time.
fn ensure_numpy() -> Result<PathBuf> {
    let dir = crate::workspace_root().join(format!("target/numpy-{}", NUMPY.trim_start_matches("numpy==")));
    if dir.join("numpy/__init__.py").exists() {
        return Ok(dir);
    }
    println!("==> installing {NUMPY} from PyPI into {} (the host baseline)", dir.display());
    crate::cuda::pip_install(&dir, &[NUMPY])?;
    Ok(dir)
}
