//! `cargo xtask test`: formatting, lints on every target, the book and the API docs, then the
//! whole workspace's tests.
//! This is the test command README.md gives and `.ci/run` calls. It ends with one line
//! `tests: N passed, N failed` summed over every test binary and doc-test run.

use anyhow::{Context, Result, bail};
use std::io::{BufRead, BufReader};
use std::process::Stdio;

pub fn run(args: &[String]) -> Result<()> {
    if let Some(a) = args.first() {
        bail!("cargo xtask test takes no arguments (got {a:?})");
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    crate::run_step(&cargo, &["fmt", "--all", "--", "--check"])?;
    // The kernels are compiled and resource-checked on every machine, GPU or not.
    let nvcc = crate::cuda::ensure_nvcc()?;
    println!("\n==> nvcc: {}", nvcc.display());
    crate::ptx::check(&nvcc)?;
    // The real NCCL library (the pinned wheel) for tp-comm's loader tests, and the bindings'
    // freshness against its header.
    let nccl = crate::bindgen::ensure_nccl()?;
    let nccl_lib = nccl.join("lib/libnccl.so.2");
    println!("\n==> NCCL: {}", nccl_lib.display());
    if crate::bindgen::libclang_available() {
        crate::bindgen::check()?;
    } else {
        println!(
            "\n!!! NCCL bindings freshness NOT checked: libclang missing (apt-get install libclang-dev); CI installs it"
        );
    }
    // Open MPI and a one-node SLURM (slurmctld, slurmd, munge) for the MPI backend's tests
    // across processes: installed from the OS packages and started when missing.
    crate::run_step("bash", &[".ci/slurm.sh"])?;
    // Lints every target, the GPU suites included: they are compiled here even where they
    // cannot run.
    crate::run_step(
        &cargo,
        &["clippy", "--workspace", "--all-targets", "--features", FEATURES, "--locked", "--", "-D", "warnings"],
    )?;
    // The book builds, and the API docs have no warning.
    crate::book::check(&cargo)?;
    // Python packages the tests run as references (pinned, under target/): the official
    // `openai` client for tp serve's client test; `gguf` (llama.cpp's Python package, with
    // numpy) writes the GGUF files the reader and model tests open and dequantizes their blocks.
    let python = [
        ensure_pip(OPENAI, "openai", "tp serve's client test")?,
        ensure_pip(GGUF, "gguf", "the GGUF tests")?,
        ensure_pip(JSONSCHEMA, "jsonschema", "validating structured outputs")?,
        ensure_pip(TOKENIZERS, "tokenizers", "checking /tokenize")?,
    ];
    let (passed, failed, ok) = cargo_test(
        &cargo,
        &["test", "--workspace", "--locked", "--features", "tp-comm/nccl-tests,tp-comm/mpi-tests,tp-cli/mpi-tests"],
        &nccl_lib,
        &python,
    )?;
    println!("\ntests: {passed} passed, {failed} failed");
    if !ok || failed > 0 {
        bail!("cargo test failed");
    }
    if passed == 0 {
        bail!("cargo test ran no test");
    }
    Ok(())
}

/// Runs `cargo test`, echoing its output, and sums the `test result:` lines.
/// Features compiled by clippy: the GPU suites (compiled, not run, here) and the NCCL tests.
const FEATURES: &str = "tp-core/gpu-tests,tp-comm/gpu-tests,tp-comm/nccl-tests,tp-comm/mpi-tests,tp-cli/mpi-tests,tp-layers/gpu-tests,tp-models/gpu-tests,tp-models/tokenizers,tp-benches/gpu";

/// The `openai` package the server's client test runs (with its dependencies).
const OPENAI: &str = "openai==3.60.0";

/// The `gguf` package the GGUF tests run (with its dependencies, numpy among them).
const GGUF: &str = "gguf==0.19.0";

/// The `jsonschema` package that validates structured outputs in the client test.
const JSONSCHEMA: &str = "jsonschema==4.25.1";

/// The `tokenizers` package `/tokenize` is checked against in the client test.
const TOKENIZERS: &str = "tokenizers==0.22.1";

/// The pinned package `spec` (`name==version`, importable as `module`), installed from PyPI
/// into `target/<name>-<version>/` the first time; the folder to put on `PYTHONPATH`.
fn ensure_pip(spec: &str, module: &str, why: &str) -> Result<std::path::PathBuf> {
    let dir = crate::workspace_root().join(format!("target/{}", spec.replace("==", "-")));
    if dir.join(module).join("__init__.py").exists() {
        return Ok(dir);
    }
    println!("\n==> installing {spec} from PyPI into {} ({why})", dir.display());
    let status = std::process::Command::new("python3")
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target"])
        .arg(&dir)
        .arg(spec)
        .status()
        .context("cannot run python3 -m pip")?;
    if !status.success() {
        bail!("pip could not install {spec} ({status})");
    }
    Ok(dir)
}

/// Runs `cargo test` with `TP_NCCL_LIB` set and the `python` folders on `PYTHONPATH`, echoing
/// its output, and sums the `test result:` lines.
fn cargo_test(
    cargo: &str,
    args: &[&str],
    nccl_lib: &std::path::Path,
    python: &[std::path::PathBuf],
) -> Result<(u64, u64, bool)> {
    println!("\n==> TP_NCCL_LIB={} {cargo} {}", nccl_lib.display(), args.join(" "));
    let mut paths = python.to_vec();
    paths.extend(
        std::env::var_os("PYTHONPATH").map(|p| std::env::split_paths(&p).collect::<Vec<_>>()).unwrap_or_default(),
    );
    let mut child = crate::command(cargo, args)
        .env("TP_NCCL_LIB", nccl_lib)
        .env("PYTHONPATH", std::env::join_paths(paths).context("PYTHONPATH")?)
        .stdout(Stdio::piped())
        .spawn()
        .context("cannot start cargo test")?;
    let (mut passed, mut failed) = (0, 0);
    if let Some(out) = child.stdout.take() {
        for line in BufReader::new(out).lines() {
            let line = line?;
            println!("{line}");
            if let Some(rest) = line.strip_prefix("test result: ") {
                passed += count(rest, " passed");
                failed += count(rest, " failed");
            }
        }
    }
    Ok((passed, failed, child.wait()?.success()))
}

/// The number before `label` in a `test result:` line (`ok. 5 passed; 0 failed; ...`).
fn count(line: &str, label: &str) -> u64 {
    line.split(';')
        .find_map(|part| {
            part.trim().trim_start_matches("ok. ").trim_start_matches("FAILED. ").strip_suffix(label.trim())
        })
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}
