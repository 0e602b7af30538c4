//! # tp-kernels
//!
//! The leaf crate of tp: it embeds the CUDA kernels in `kernels/*.cu`, compiled to PTX by the
//! workspace `build.rs` (with `nvcc` found through `NVCC`, `CUDA_HOME/bin` or `PATH`), and, once
//! the CUDA backend lands, loads them through `cudarc` and exposes typed launchers. All `unsafe`
//! of the GPU path will live here.
//!
//! Today it holds the list of embedded kernel modules, which is empty when the build had no
//! `nvcc` (the build prints a cargo warning) or when `kernels/` holds no `.cu` file yet.

/// A kernel module compiled at build time: its file stem and its PTX per target architecture.
#[derive(Debug, Clone, Copy)]
pub struct KernelModule {
    /// File stem of the `.cu` source in `kernels/`.
    pub name: &'static str,
    /// `(arch, ptx)` pairs, e.g. `("sm_80", "...")`.
    pub ptx: &'static [(&'static str, &'static str)],
}

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// Why no kernels are embedded, or `None` when the build compiled them.
pub fn build_note() -> Option<&'static str> {
    BUILD_NOTE
}
