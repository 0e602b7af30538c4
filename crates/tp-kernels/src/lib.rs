//! # tp-kernels
//!
//! The leaf crate of tp: it embeds the CUDA kernels in `kernels/*.cu`, compiled to fatbins by the
//! workspace `build.rs` (nvcc found through `NVCC`, `CUDA_HOME/bin` or `PATH`; SASS for sm_80
//! and sm_90a plus compute_80 PTX), and will load them through `cudarc` with typed launchers.
//! All `unsafe` of the GPU path lives here.
//!
//! When the build had no nvcc, [`MODULES`] is empty and [`NOT_COMPILED`] says why.

/// A kernel module compiled at build time.
#[derive(Debug, Clone, Copy)]
pub struct KernelModule {
    /// File stem of the `.cu` source in `kernels/` (e.g. `gemm_mma`).
    pub name: &'static str,
    /// The fatbin nvcc produced: SASS for sm_80 and sm_90a, PTX for compute_80.
    pub fatbin: &'static [u8],
}

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// The embedded module named `name`, if the build compiled it.
pub fn module(name: &str) -> Option<&'static KernelModule> {
    MODULES.iter().find(|m| m.name == name)
}
