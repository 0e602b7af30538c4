//! The error type of `tp-kernels`.

/// Everything that can go wrong finding a GPU, loading kernels or launching them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KernelError {
    /// No CUDA driver library (libcuda) could be loaded, or it has no usable device.
    #[error("CUDA unavailable: {reason}")]
    CudaUnavailable { reason: String },

    /// The requested device ordinal does not exist.
    #[error("no CUDA device {ordinal}: {count} device(s) present")]
    NoSuchDevice { ordinal: usize, count: usize },

    /// tp-kernels was built without nvcc, so there is nothing to load.
    #[error("CUDA kernels not compiled: {reason}")]
    NotCompiled { reason: &'static str },

    /// A kernel module or function is missing from the embedded fatbins.
    #[error("kernel {name} not found in the embedded modules")]
    MissingKernel { name: String },

    /// A CUDA driver call failed.
    #[error("CUDA driver error in {op}: {message}")]
    Driver { op: &'static str, message: String },

    /// A launch's arguments break the kernel's contract (sizes, alignment, grid limits).
    #[error("invalid launch of {kernel}: {why}")]
    InvalidLaunch { kernel: &'static str, why: String },
}

/// Result alias of `tp-kernels`.
pub type Result<T> = std::result::Result<T, KernelError>;

/// Maps a cudarc driver error into [`KernelError::Driver`], naming the operation.
pub(crate) fn driver(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> KernelError {
    move |e| {
        let mut message = format!("{e:?}");
        if message.contains("LAUNCH_FAILED") {
            // A trap in a kernel: the only deliberate one is the Hopper GEMM's stuck-pipeline guard.
            message.push_str(" (a kernel trapped; tp_gemm_wgmma traps when an mbarrier wait passes 10 s)");
        }
        KernelError::Driver { op, message }
    }
}
