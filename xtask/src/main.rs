//! `cargo xtask <task>`: project tasks in Rust, so they run wherever cargo does.
//!
//! * `cargo xtask test`: the whole test command: `cargo fmt --check`, `cargo clippy -D warnings`
//!   on every target, and `cargo test` on the workspace.
//! * `cargo xtask bench [--quick] [--cpu] [--out DIR]`: runs `tp-bench`: on a GPU our kernels
//!   beside cuBLAS and cuMemcpyDtoD, otherwise the host GEMM beside numpy.
//! * `cargo xtask ptx`: `ptxas -v` report of every kernel for sm_80 and sm_90a; fails on spills.
//! * `cargo xtask bundle [--out DIR]`: GPU suite + tp-bench + run.sh for a GPU host.
//! * `cargo xtask bindgen [--check]`: (re)generates tp-comm's NCCL bindings, or checks them.

mod bench;
mod bindgen;
mod book;
mod bundle;
mod cuda;
mod launch_consts;
mod ptx;
mod test;

use anyhow::{Context, Result, bail};
use std::path::PathBuf;
use std::process::Command;

const USAGE: &str =
    "usage: cargo xtask <test | bench [--quick] [--cpu] [--out DIR] | ptx | bundle [--out DIR] | bindgen [--check]>";

fn main() {
    if let Err(e) = run() {
        eprintln!("xtask: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (task, rest) = args.split_first().map(|(t, r)| (t.as_str(), r)).unwrap_or(("", &[]));
    match task {
        "test" => test::run(rest),
        "bench" => bench::run(rest),
        "ptx" => ptx::run(rest),
        "bundle" => bundle::run(rest),
        "bindgen" => bindgen::run(rest),
        "" | "-h" | "--help" | "help" => {
            println!("{USAGE}");
            Ok(())
        }
        other => bail!("unknown task {other:?}\n{USAGE}"),
    }
}

/// The workspace root (xtask lives one level below it).
pub fn workspace_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(PathBuf::from).unwrap_or(manifest)
}

/// `program args..` to run in the workspace root, with `NVCC` set to the compiler
/// [`cuda::ensure_nvcc`] settled on, if it ran.
pub fn command(program: &str, args: &[&str]) -> Command {
    let mut c = Command::new(program);
    c.args(args).current_dir(workspace_root());
    if let Some(nvcc) = cuda::NVCC.get() {
        c.env("NVCC", nvcc);
    }
    c
}

/// Runs `program args..` in the workspace root, echoing it, and fails if it fails.
pub fn run_step(program: &str, args: &[&str]) -> Result<()> {
    println!("\n==> {program} {}", args.join(" "));
    let status = command(program, args).status().with_context(|| format!("cannot start {program}"))?;
    if !status.success() {
        bail!("`{program} {}` failed ({status})", args.join(" "));
    }
    Ok(())
}
