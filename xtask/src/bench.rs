//! `cargo xtask bench [--quick] [--cpu] [--out DIR]`: builds and runs `tp-bench` (benches/bin) in
//! release mode. On a GPU it measures our kernels beside cuBLAS and cuMemcpyDtoD; without one it
//! says why and runs the host GEMM table beside numpy. Results go to `target/bench/` by default.

use anyhow::Result;

pub fn run(args: &[String]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // Kernels are embedded at build time: make sure there is an nvcc to build them with.
    if let Err(e) = crate::cuda::ensure_nvcc() {
        println!("warning: no nvcc ({e:#}); the GPU kernels will not be built");
    }
    let mut cmd: Vec<&str> =
        vec!["run", "--quiet", "--release", "--locked", "-p", "tp-benches", "--bin", "tp-bench", "--"];
    cmd.extend(args.iter().map(String::as_str));
    crate::run_step(&cargo, &cmd)
}
