//! The NCCL backend, wrapped here rather than through cudarc (see DESIGN.md: cudarc never
//! tries `libnccl.so.2`, which is all the NCCL wheel ships; its errors drop NCCL's text; its
//! `Drop` can panic; it does not check receive-buffer sizes).
//!
//! Layers, cudarc-style: [`sys`] is bindgen's output (`cargo xtask bindgen`), a struct of
//! function pointers loaded with libloading; [`Nccl`] loads it once and turns every status into
//! a [`CommError::Nccl`] carrying `ncclGetErrorString` and `ncclGetLastError`; [`NcclComm`]
//! (in `comm.rs`) is the safe communicator.

mod comm;
mod state;
mod watchdog;
/// The NCCL C API as bindgen writes it from `nccl.h` (names, types and constants are the
/// header's, documented there).
#[allow(clippy::all, missing_docs)]
#[rustfmt::skip] // generated: `cargo xtask bindgen --check` compares it byte for byte
pub mod sys;

pub use comm::NcclComm;

use crate::{CommError, Result};
use std::ffi::CStr;
use std::sync::OnceLock;
use sys::ncclResult_t;

/// Environment variable naming the NCCL library file to load first.
pub const NCCL_LIB_ENV: &str = "TP_NCCL_LIB";

/// The loaded NCCL library.
pub struct Nccl {
    lib: sys::NcclLib,
    path: String,
    version: i32,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Nccl({}, version {})", self.path, self.version)
    }
}

/// Where to look, in order: `$TP_NCCL_LIB`, then `libnccl.so.2` (the wheel's and the distro
/// package's soname), then `libnccl.so`, through the dynamic loader's search path.
fn candidates() -> Vec<String> {
    let mut v = Vec::new();
    if let Ok(p) = std::env::var(NCCL_LIB_ENV)
        && !p.is_empty()
    {
        v.push(p);
    }
    v.extend(["libnccl.so.2".to_string(), "libnccl.so".to_string()]);
    v
}

impl Nccl {
    /// The process-wide NCCL, loaded on first use.
    ///
    /// Errors: [`CommError::NcclUnavailable`] naming every file tried and how to install NCCL.
    pub fn get() -> Result<&'static Nccl> {
        static NCCL: OnceLock<std::result::Result<Nccl, String>> = OnceLock::new();
        NCCL.get_or_init(Nccl::load).as_ref().map_err(|e| CommError::NcclUnavailable(e.clone()))
    }

    fn load() -> std::result::Result<Nccl, String> {
        Self::open(&candidates()).map_err(|e| match e {
            CommError::NcclUnavailable(m) => m,
            other => other.to_string(),
        })
    }

    /// Loads the first of `paths` that opens and answers `ncclGetVersion` (file names go
    /// through the dynamic loader's search path). [`Nccl::get`] is this over `$TP_NCCL_LIB`,
    /// `libnccl.so.2`, `libnccl.so`, once per process.
    ///
    /// Errors: [`CommError::NcclUnavailable`] naming every path tried and how to install NCCL.
    pub fn open(paths: &[String]) -> Result<Nccl> {
        let mut tried = Vec::new();
        for path in paths.iter().cloned() {
            // SAFETY: loading a shared library runs its initialisers; NCCL's only set up
            // internal state. `NcclLib::new` resolves every symbol the bindings declare, with
            // the signatures bindgen took from nccl.h, and fails if one is missing.
            match unsafe { sys::NcclLib::new(&path) } {
                Ok(lib) => {
                    let mut version = 0;
                    // SAFETY: ncclGetVersion writes one int through a valid pointer.
                    let r = unsafe { lib.ncclGetVersion(&mut version) };
                    if r != ncclResult_t::ncclSuccess {
                        tried.push(format!("{path}: ncclGetVersion failed ({r})"));
                        continue;
                    }
                    return Ok(Nccl { lib, path, version });
                }
                Err(e) => tried.push(format!("{path}: {e}")),
            }
        }
        Err(CommError::NcclUnavailable(format!(
            "could not load the NCCL library ({}). Install it with `pip install nvidia-nccl-cu13` (then set \
             {NCCL_LIB_ENV}=<site-packages>/nvidia/nccl/lib/libnccl.so.2 or add that folder to LD_LIBRARY_PATH), \
             or the distribution package (libnccl2)",
            tried.join("; ")
        )))
    }

    /// The file that was loaded.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// `(major, minor, patch)` of the loaded library.
    pub fn version(&self) -> (i32, i32, i32) {
        let v = self.version;
        if v >= 10000 { (v / 10000, (v / 100) % 100, v % 100) } else { (v / 1000, (v / 100) % 10, v % 100) }
    }

    pub(crate) fn lib(&self) -> &sys::NcclLib {
        &self.lib
    }

    /// `Ok` for `ncclSuccess`, else an error with NCCL's own description and last message.
    pub(crate) fn check(&self, op: &'static str, r: ncclResult_t::Type, comm: sys::ncclComm_t) -> Result<()> {
        if r == ncclResult_t::ncclSuccess {
            return Ok(());
        }
        Err(CommError::Nccl { op, message: self.describe(r, comm) })
    }

    /// `"<ncclGetErrorString> (code N): <ncclGetLastError>"`.
    pub(crate) fn describe(&self, r: ncclResult_t::Type, comm: sys::ncclComm_t) -> String {
        // SAFETY: both functions return pointers to static or per-communicator NUL-terminated
        // strings owned by NCCL (or null); `comm` is null or a live communicator.
        let (what, last) = unsafe {
            let what = self.lib.ncclGetErrorString(r);
            let last = self.lib.ncclGetLastError(comm);
            (cstr(what), cstr(last))
        };
        if last.is_empty() { format!("{what} (code {r})") } else { format!("{what} (code {r}): {last}") }
    }

    /// The error NCCL status `code` becomes (for tests of the error path).
    pub fn error_for_test(&self, code: u32) -> CommError {
        match self.check("test", code, std::ptr::null_mut()) {
            Err(e) => e,
            Ok(()) => CommError::Nccl { op: "test", message: "success".into() },
        }
    }

    /// A fresh NCCL unique id (rank 0 creates it; the rendezvous carries it to the others).
    pub fn unique_id(&self) -> Result<[u8; 128]> {
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        // SAFETY: ncclUniqueId is 128 plain bytes; ncclGetUniqueId fills the struct it is given.
        let r = unsafe { self.lib.ncclGetUniqueId(&mut id) };
        self.check("ncclGetUniqueId", r, std::ptr::null_mut())?;
        Ok(id.internal.map(|c| c as u8))
    }
}

/// A NUL-terminated C string owned by NCCL, copied; empty for null.
///
/// # Safety
/// `p` is null or points to a valid NUL-terminated string.
unsafe fn cstr(p: *const std::os::raw::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: per this function's contract.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}
