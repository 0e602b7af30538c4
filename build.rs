//! Build script of `tp-kernels` (`build = "../../build.rs"`).
//!
//! Finds the `.cu` files in `kernels/` and writes `$OUT_DIR/kernels.rs`, the table of embedded
//! modules. Compiling them with nvcc for sm_80 and sm_90a is the CUDA backend's issue; until then
//! the table is empty and `BUILD_NOTE` says why. The script never panics: a missing directory or
//! compiler becomes a note and a cargo warning.

use std::path::{Path, PathBuf};
use std::{env, fs};

fn main() {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap_or_default()).join("../..");
    let kernels = root.join("kernels");
    println!("cargo::rerun-if-changed={}", kernels.display());
    let sources = cu_sources(&kernels);
    let note = if sources.is_empty() {
        "no kernels/*.cu sources yet".to_string()
    } else {
        format!("{} kernel sources found; nvcc compilation arrives with the CUDA backend", sources.len())
    };
    let out = PathBuf::from(env::var("OUT_DIR").unwrap_or_default()).join("kernels.rs");
    let code = format!(
        "/// Every embedded kernel module.\npub const MODULES: &[KernelModule] = &[];\nconst BUILD_NOTE: Option<&str> = Some({note:?});\n"
    );
    if let Err(e) = fs::write(&out, code) {
        println!("cargo::error=cannot write {}: {e}", out.display());
    }
}

fn cu_sources(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == "cu")).collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}
