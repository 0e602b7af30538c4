//! The error type of `tp-kernels`.

/// Everything that can go wrong finding a GPU, loading kernels or launching them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
#[allow(missing_docs)] // variant fields: each variant's documentation and message name them
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

    /// A ggml type id with no CUDA quant kernels (the launchers of `kernels/quant_*.cu` take
    /// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q2_K..Q6_K).
    #[error(
        "ggml type id {id} has no CUDA quant kernels (supported: Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, \
         Q2_K=10, Q3_K=11, Q4_K=12, Q5_K=13, Q6_K=14)"
    )]
    UnsupportedQuantType { id: u32 },

    /// A launch's arguments break the kernel's contract (sizes, alignment, grid limits).
    #[error("invalid launch of {kernel}: {why}")]
    InvalidLaunch { kernel: &'static str, why: String },
}

/// Result alias of `tp-kernels`.
pub type Result<T> = std::result::Result<T, KernelError>;

/// Maps a cudarc driver error into [`KernelError::Driver`], naming the operation; a sticky error
/// gets [`STICKY_ERROR_NOTE`] appended.
pub(crate) fn driver(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> KernelError {
    move |e| {
        let mut message = format!("{e:?}");
        if message.contains("LAUNCH_FAILED") {
            // A trap in a kernel: the only deliberate one is the Hopper GEMM's stuck-pipeline guard.
            message.push_str(" (a kernel trapped; tp_gemm_wgmma traps when an mbarrier wait passes 10 s)");
        }
        if let Some(note) = sticky_error_note(&message) {
            message.push_str(&format!(" (note: {note})"));
        }
        KernelError::Driver { op, message }
    }
}

/// What a kernel fault means for the rest of the process, printed beside such an error.
pub const STICKY_ERROR_NOTE: &str = "a kernel fault (CUDA launch failure, illegal instruction or \
     address) poisons the CUDA context: every later CUDA call in this process fails the same way, \
     so the first failure (in a test binary, the first failing test) is the real one";

/// The driver's names of the sticky errors: after one, the context is unusable until the process
/// exits (`__trap()` reports `LAUNCH_FAILED`).
const STICKY_ERRORS: [&str; 8] = [
    "LAUNCH_FAILED",
    "ILLEGAL_INSTRUCTION",
    "ILLEGAL_ADDRESS",
    "MISALIGNED_ADDRESS",
    "HARDWARE_STACK_ERROR",
    "INVALID_PC",
    "INVALID_ADDRESS_SPACE",
    "CUDA_ERROR_ASSERT",
];

/// [`STICKY_ERROR_NOTE`] when `message` names a sticky CUDA error, else `None`.
pub fn sticky_error_note(message: &str) -> Option<&'static str> {
    STICKY_ERRORS.iter().any(|e| message.contains(e)).then_some(STICKY_ERROR_NOTE)
}

/// For test binaries and tools: installs (once per process) a panic hook that runs the previous
/// hook, then prints `note: ` [`STICKY_ERROR_NOTE`] to stderr when the panic message names a
/// sticky CUDA error and does not carry the note already. Errors that do not pass through
/// [`KernelError::Driver`] (NCCL's, a `cuEventQuery` status) get the note this way too.
pub fn note_sticky_errors_on_panic() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            previous(info);
            let payload = info.payload();
            let message = payload
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| payload.downcast_ref::<&str>().copied())
                .unwrap_or("");
            if let Some(note) = sticky_error_note(message)
                && !message.contains(note)
            {
                eprintln!("note: {note}");
            }
        }));
    });
}
