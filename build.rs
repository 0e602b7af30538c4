//! Build script of `tp-kernels` (its Cargo.toml says `build = "../../build.rs"`).
//!
//! Compiles every `kernels/*.cu` with nvcc into one fatbin per file holding
//! * SASS for `sm_80` and PTX for `compute_80` (Ampere and later; the driver JITs the PTX on
//!   architectures with no matching SASS), and
//! * SASS for `sm_90a` (Hopper; the `a` features such as wgmma and setmaxnreg need it),
//!
//! and writes `$OUT_DIR/kernels.rs`, the table `tp-kernels` embeds with `include_bytes!`.
//! It also compiles `kernels/index_math.cuh` as host C++ (through `host/index_math.cpp`, with
//! the `cc` crate), so that CPU tests exercise the index arithmetic the kernels use.
//!
//! nvcc is found through `NVCC`, then `CUDA_HOME/bin/nvcc` (or `CUDA_PATH`), then `PATH`. Use
//! nvcc 13.0 (PTX `.version 9.0`): a CUDA 13.0 driver cannot load PTX from a newer nvcc.
//! `cargo xtask test` installs it from PyPI when none is found. With no nvcc at all the build
//! still succeeds, prints a cargo warning, and the kernels report "not compiled" at run time.
//! A kernel that fails to compile fails the build, with nvcc's message.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::{env, fs, thread};

/// `-gencode` flags: every fatbin carries these images.
const GENCODE: &[&str] = &["-gencode=arch=compute_80,code=[sm_80,compute_80]", "-gencode=arch=compute_90a,code=sm_90a"];

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap_or_default());
    let kernels = manifest.join("../../kernels");
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap_or_default());
    for var in ["NVCC", "CUDA_HOME", "CUDA_PATH", "PATH", "TP_NVCC_FLAGS"] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    println!("cargo::rerun-if-changed={}", kernels.display());

    let (sources, headers) = kernel_files(&kernels);
    for f in sources.iter().chain(&headers) {
        println!("cargo::rerun-if-changed={}", f.display());
    }
    // The kernels' index math, built as host C++ so CPU tests run the code the GPU runs.
    let host = manifest.join("host/index_math.cpp");
    println!("cargo::rerun-if-changed={}", host.display());
    cc::Build::new().cpp(true).file(&host).flag_if_supported("-std=c++17").warnings(true).compile("tp_index_math");
    let table = match find_nvcc() {
        None => {
            println!(
                "cargo::warning=tp-kernels: nvcc not found (set NVCC or CUDA_HOME, or run `cargo xtask test`, which \
                 installs nvcc 13.0 from PyPI); CUDA kernels will report \"not compiled\" at run time"
            );
            Table::NotCompiled("tp-kernels was built without nvcc (set NVCC or CUDA_HOME and rebuild)".into())
        }
        Some(nvcc) => match compile_all(&nvcc, &sources, &kernels, &out_dir) {
            Ok(modules) => Table::Compiled(modules),
            Err(e) => {
                // A kernel that does not compile is a bug in this repository: fail loudly.
                println!("cargo::error={}", e.replace('\n', "\ncargo::error="));
                return;
            }
        },
    };
    if let Err(e) = fs::write(out_dir.join("kernels.rs"), table.render()) {
        println!("cargo::error=cannot write kernels.rs in {}: {e}", out_dir.display());
    }
}

enum Table {
    NotCompiled(String),
    Compiled(Vec<(String, PathBuf)>),
}

impl Table {
    fn render(&self) -> String {
        match self {
            Table::NotCompiled(why) => format!(
                "/// Every embedded kernel module.\npub const MODULES: &[KernelModule] = &[];\n\
                 /// Why the kernels are missing, when they are.\npub const NOT_COMPILED: Option<&str> = Some({why:?});\n"
            ),
            Table::Compiled(mods) => {
                let mut s =
                    String::from("/// Every embedded kernel module.\npub const MODULES: &[KernelModule] = &[\n");
                for (name, path) in mods {
                    s += &format!(
                        "    KernelModule {{ name: {name:?}, fatbin: include_bytes!({:?}) }},\n",
                        path.display().to_string()
                    );
                }
                s + "];\n/// Why the kernels are missing, when they are.\npub const NOT_COMPILED: Option<&str> = None;\n"
            }
        }
    }
}

/// `.cu` sources and `.cuh` headers in `dir`, sorted.
fn kernel_files(dir: &Path) -> (Vec<PathBuf>, Vec<PathBuf>) {
    let mut all: Vec<PathBuf> =
        fs::read_dir(dir).map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect()).unwrap_or_default();
    all.sort();
    let ext = |p: &PathBuf, e: &str| p.extension().is_some_and(|x| x == e);
    let sources = all.iter().filter(|p| ext(p, "cu")).cloned().collect();
    let headers = all.iter().filter(|p| ext(p, "cuh")).cloned().collect();
    (sources, headers)
}

/// nvcc from `NVCC`, `CUDA_HOME`/`CUDA_PATH`, or `PATH`; `None` if none runs.
fn find_nvcc() -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = env::var_os("NVCC") {
        candidates.push(p.into());
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = env::var_os(var) {
            candidates.push(PathBuf::from(root).join("bin/nvcc"));
        }
    }
    if let Some(path) = env::var_os("PATH") {
        candidates.extend(env::split_paths(&path).map(|d| d.join("nvcc")));
    }
    candidates.into_iter().find(|c| Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success()))
}

/// Compiles every source to `$OUT_DIR/<stem>.fatbin`, one thread per source.
fn compile_all(
    nvcc: &Path,
    sources: &[PathBuf],
    include: &Path,
    out_dir: &Path,
) -> Result<Vec<(String, PathBuf)>, String> {
    let extra: Vec<String> =
        env::var("TP_NVCC_FLAGS").unwrap_or_default().split_whitespace().map(String::from).collect();
    let results: Vec<Result<(String, PathBuf), String>> = thread::scope(|s| {
        let handles: Vec<_> = sources
            .iter()
            .map(|src| {
                let extra = &extra;
                s.spawn(move || {
                    let stem = src.file_stem().and_then(|s| s.to_str()).unwrap_or("kernel").to_string();
                    let out = out_dir.join(format!("{stem}.fatbin"));
                    let output = Command::new(nvcc)
                        .arg("-fatbin")
                        .args(GENCODE)
                        .args(["-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr"])
                        .arg("-I")
                        .arg(include)
                        .args(extra)
                        .arg("-o")
                        .arg(&out)
                        .arg(src)
                        .output()
                        .map_err(|e| format!("cannot run {}: {e}", nvcc.display()))?;
                    if !output.status.success() {
                        return Err(format!(
                            "nvcc failed on {}:\n{}",
                            src.display(),
                            String::from_utf8_lossy(&output.stderr).trim()
                        ));
                    }
                    Ok((stem, out))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("nvcc thread panicked".into()))).collect()
    });
    results.into_iter().collect()
}
