//! The kernel modules embedded at build time: [`MODULES`] (the table build.rs generates, empty
//! when the build had no nvcc, with the reason in [`NOT_COMPILED`]) and [`module`] to find one.

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
