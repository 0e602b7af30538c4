//! Finding, or installing, the pinned CUDA compiler.
//!
//! nvcc 13.0 is pinned: its PTX (`.version 9.0`) loads on CUDA 13.0 drivers, newer nvcc's does
//! not. When none is found it is installed from PyPI (no GPU needed) into
//! `target/cuda-13.0/`, with `pip install --target`, as DESIGN.md gives.

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The nvcc that [`ensure_nvcc`] found or installed; passed to child cargo runs as `NVCC`.
pub static NVCC: OnceLock<PathBuf> = OnceLock::new();

/// The pip requirements of the pinned compiler.
const PIP_PACKAGES: &[&str] = &[
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-cuda-runtime==13.0.*",
    "nvidia-cuda-cccl==13.0.*",
    "nvidia-nvvm==13.0.88",
];

/// `python3 -m pip install --target root packages..` (no dependencies pulled in: every pinned
/// package is named), failing with the package list when pip fails.
pub fn pip_install(root: &Path, packages: &[&str]) -> Result<()> {
    let status = Command::new("python3")
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps", "--target"])
        .arg(root)
        .args(packages)
        .status()
        .context("cannot run python3 -m pip (a Python with pip is needed to install the CUDA tools)")?;
    if !status.success() {
        bail!("pip could not install {} ({status})", packages.join(" "));
    }
    Ok(())
}

/// The pip cache of the pinned compiler, under the workspace's target directory.
pub fn pip_root() -> PathBuf {
    crate::workspace_root().join("target/cuda-13.0")
}

fn runs(nvcc: &Path) -> bool {
    Command::new(nvcc).arg("--version").output().is_ok_and(|o| o.status.success())
}

/// nvcc as build.rs finds it (`NVCC`, `CUDA_HOME/bin`, `PATH`), else the cached pip install.
pub fn find_nvcc() -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("NVCC") {
        candidates.push(p.into());
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = std::env::var_os(var) {
            candidates.push(PathBuf::from(root).join("bin/nvcc"));
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path).map(|d| d.join("nvcc")));
    }
    candidates.push(pip_root().join("nvidia/cu13/bin/nvcc"));
    candidates.into_iter().find(|c| runs(c))
}

/// nvcc, installing the pinned one from PyPI first if none is found.
pub fn ensure_nvcc() -> Result<PathBuf> {
    let nvcc = find_or_install()?;
    Ok(NVCC.get_or_init(|| nvcc).clone())
}

fn find_or_install() -> Result<PathBuf> {
    if let Some(nvcc) = find_nvcc() {
        return Ok(nvcc);
    }
    let root = pip_root();
    println!("==> no nvcc found: installing CUDA 13.0 nvcc from PyPI into {}", root.display());
    pip_install(&root, PIP_PACKAGES)?;
    let nvcc = root.join("nvidia/cu13/bin/nvcc");
    if !runs(&nvcc) {
        bail!("installed nvcc at {} does not run (it needs the host g++)", nvcc.display());
    }
    Ok(nvcc)
}

/// The pinned SASS tools (cuobjdump + nvdisasm from PyPI; 13.2 reads sm_90a cubins from nvcc 13.0).
const SASS_PACKAGES: &[&str] = &["nvidia-cuda-cuobjdump==13.2.86", "nvidia-cuda-nvdisasm==13.2.86"];

/// `cuobjdump` (with `nvdisasm` beside it), installed from PyPI into `target/cuda-tools/` when
/// missing. Returns the folder holding both.
pub fn ensure_sass_tools() -> Result<PathBuf> {
    let root = crate::workspace_root().join("target/cuda-tools");
    let bin = root.join("nvidia/cu13/bin");
    if bin.join("cuobjdump").exists() && bin.join("nvdisasm").exists() {
        return Ok(bin);
    }
    println!("==> installing cuobjdump and nvdisasm from PyPI into {}", root.display());
    pip_install(&root, SASS_PACKAGES)?;
    if !bin.join("cuobjdump").exists() {
        bail!("{} installed no cuobjdump under {}", SASS_PACKAGES.join(" "), root.display());
    }
    Ok(bin)
}
