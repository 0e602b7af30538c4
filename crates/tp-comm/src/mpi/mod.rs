//! The MPI backend: ranks as processes started by `mpirun` or `srun`, over Open MPI loaded at
//! run time (`libmpi.so.40`, as the OS package `libopenmpi3`/`openmpi-bin` installs it), for
//! machines without GPUs. Nothing is linked at build time: a build runs without MPI installed,
//! and [`Mpi::get`] says so when `--backend mpi` is asked for on a machine without it.
//!
//! Layers, as the NCCL backend's: [`sys`] resolves the C functions and Open MPI's predefined
//! handles; [`Mpi`] loads the library once per process, calls `MPI_Init_thread`, and holds the
//! one lock every MPI call goes through (`MPI_THREAD_SERIALIZED`); [`MpiComm`] is the
//! [`Communicator`](crate::Communicator).
//!
//! MPI is used only to move bytes (nonblocking point-to-point messages); the collectives are
//! tp's own, over those messages, so that
//!
//! * every wait has the group's deadline: requests are polled, never waited on inside MPI, and
//!   a peer whose message has not come by then is named in the error;
//! * a failed rank tells the others: [`Communicator::abort`](crate::Communicator::abort) sends its reason to every rank of
//!   the group, and a rank waiting in any call of that group returns
//!   [`CommError::Poisoned`] with it at once;
//! * reductions give the thread backend's bits: element `i` is folded in rank order in `f32`
//!   (see `reduce.rs`) by the rank that owns its chunk, and every rank receives those same
//!   bytes, so `--backend mpi` and `--backend local` agree bit for bit, whatever the dtype.
//!
//! A collective is first an exchange of fixed-size headers between every pair of ranks (which
//! collective, its sequence number, dtype, dims and argument), so ranks that call different
//! collectives, or pass incompatible tensors, all return the same
//! [`CommError::Mismatch`] instead of hanging; then the data.
//! See `comm.rs` for each collective's messages.

mod comm;
mod inner;
mod round;
pub mod sys;
mod wire;

pub use comm::MpiComm;

use crate::{CommError, Result};
use std::os::raw::{c_char, c_int};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// Environment variable naming the MPI library file to load first.
pub const MPI_LIB_ENV: &str = "TP_MPI_LIB";

/// The loaded and initialised MPI library (one per process).
pub struct Mpi {
    lib: sys::MpiLib,
    path: String,
    version: String,
    lock: Mutex<()>,
    finalized: AtomicBool,
}

impl std::fmt::Debug for Mpi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mpi({}, {})", self.path, self.version)
    }
}

/// Where to look: `$TP_MPI_LIB` alone when it is set, else `libmpi.so.40` (Open MPI 4 and 5)
/// then `libmpi.so`, through the dynamic loader's search path.
fn candidates() -> Vec<String> {
    match std::env::var(MPI_LIB_ENV) {
        Ok(p) if !p.is_empty() => vec![p],
        _ => vec!["libmpi.so.40".to_string(), "libmpi.so".to_string()],
    }
}

/// Whether this process was started by an MPI launcher: `mpirun` (`OMPI_COMM_WORLD_SIZE`) or a
/// PMIx launcher such as `srun --mpi=pmix` (`PMIX_RANK`).
pub fn launched() -> bool {
    std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() || std::env::var_os("PMIX_RANK").is_some()
}

impl Mpi {
    /// The process-wide MPI, loaded and initialised (`MPI_Init_thread`) on first use.
    ///
    /// Errors: [`CommError::MpiUnavailable`] naming every file tried and how to install Open
    /// MPI, or why initialisation failed.
    pub fn get() -> Result<&'static Mpi> {
        static MPI: OnceLock<std::result::Result<Mpi, String>> = OnceLock::new();
        MPI.get_or_init(Mpi::load).as_ref().map_err(|e| CommError::MpiUnavailable(e.clone()))
    }

    fn load() -> std::result::Result<Mpi, String> {
        Self::open(&candidates()).map_err(|e| match e {
            CommError::MpiUnavailable(m) => m,
            other => other.to_string(),
        })
    }

    /// Loads the first of `paths` that opens and is Open MPI, and initialises it. [`Mpi::get`]
    /// is this over `$TP_MPI_LIB` (alone, when set), else `libmpi.so.40` and `libmpi.so`, once
    /// per process; call `open` yourself only to check a library (a second initialisation in
    /// one process is skipped by MPI_Initialized).
    ///
    /// Errors: [`CommError::MpiUnavailable`] naming every path tried and how to install Open MPI.
    pub fn open(paths: &[String]) -> Result<Mpi> {
        let mut tried = Vec::new();
        for path in paths.iter().cloned() {
            // SAFETY: loading Open MPI runs its initialisers, which set up internal state only;
            // `MpiLib::new` checks that it is Open MPI before any function is called.
            match unsafe { sys::MpiLib::new(&path) } {
                Ok(lib) => return Self::init(lib, path).map_err(CommError::MpiUnavailable),
                Err(e) => tried.push(format!("{path}: {e}")),
            }
        }
        Err(CommError::MpiUnavailable(format!(
            "could not load Open MPI ({}). Install it (Debian/Ubuntu: `apt-get install openmpi-bin`), or set \
             {MPI_LIB_ENV} to its libmpi.so.40",
            tried.join("; ")
        )))
    }

    fn init(lib: sys::MpiLib, path: String) -> std::result::Result<Mpi, String> {
        let (mut initialized, mut provided) = (0, 0);
        // SAFETY: MPI_Initialized may be called at any time and writes one int; MPI_Init_thread
        // accepts null argc/argv and writes the provided level through a valid pointer;
        // MPI_Comm_set_errhandler is given the world communicator and a predefined handler.
        let code = unsafe {
            (lib.MPI_Initialized)(&mut initialized);
            if initialized == 0 {
                let c = (lib.MPI_Init_thread)(
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    sys::MPI_THREAD_SERIALIZED,
                    &mut provided,
                );
                if c == sys::MPI_SUCCESS { (lib.MPI_Comm_set_errhandler)(lib.comm_world, lib.errors_return) } else { c }
            } else {
                sys::MPI_SUCCESS
            }
        };
        if code != sys::MPI_SUCCESS {
            return Err(format!("{path}: MPI_Init_thread failed (code {code})"));
        }
        if initialized == 0 && provided < sys::MPI_THREAD_SERIALIZED {
            return Err(format!(
                "{path}: MPI provides thread level {provided}, tp needs MPI_THREAD_SERIALIZED ({})",
                sys::MPI_THREAD_SERIALIZED
            ));
        }
        let mut buf = [0 as c_char; sys::MPI_MAX_STRING + 1];
        let mut len: c_int = 0;
        // SAFETY: the buffer holds MPI_MAX_LIBRARY_VERSION_STRING characters plus one.
        unsafe { (lib.MPI_Get_library_version)(buf.as_mut_ptr(), &mut len) };
        let version = c_text(&buf, len).lines().next().unwrap_or_default().trim().to_string();
        Ok(Mpi { lib, path, version, lock: Mutex::new(()), finalized: AtomicBool::new(false) })
    }

    /// The file that was loaded.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The library's own version line (`MPI_Get_library_version`), e.g. `Open MPI v4.1.4, ...`.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The lock every MPI call holds (the library is initialised `MPI_THREAD_SERIALIZED`).
    pub(crate) fn lock(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn lib(&self) -> &sys::MpiLib {
        &self.lib
    }

    /// `Ok` for `MPI_SUCCESS`, else [`CommError::Mpi`] with `MPI_Error_string`'s text.
    pub(crate) fn check(&self, op: &'static str, code: c_int) -> Result<()> {
        if code == sys::MPI_SUCCESS {
            return Ok(());
        }
        let mut buf = [0 as c_char; sys::MPI_MAX_STRING + 1];
        let mut len: c_int = 0;
        // SAFETY: the buffer holds MPI_MAX_ERROR_STRING characters plus one.
        let known = unsafe { (self.lib.MPI_Error_string)(code, buf.as_mut_ptr(), &mut len) } == sys::MPI_SUCCESS;
        let text = if known { c_text(&buf, len) } else { "unknown error".into() };
        Err(CommError::Mpi { op, message: format!("{text} (code {code})") })
    }
}

/// `len` characters of `buf` (bounded by the buffer), lossily as UTF-8.
fn c_text(buf: &[c_char], len: c_int) -> String {
    let n = usize::try_from(len).unwrap_or(0).min(buf.len());
    let bytes: Vec<u8> = buf[..n].iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Ends MPI in this process (`MPI_Finalize`), once every communicator's work is done: a job's
/// processes call it before they exit normally (Open MPI's launcher reports a process that
/// exits without it). Does nothing if MPI was never loaded or is already finalised.
///
/// Errors: [`CommError::Mpi`] from `MPI_Finalize`.
pub fn finalize() -> Result<()> {
    let Ok(mpi) = Mpi::get() else { return Ok(()) };
    let _guard = mpi.lock();
    if mpi.finalized.swap(true, Ordering::SeqCst) {
        return Ok(());
    }
    let mut done = 0;
    // SAFETY: MPI_Finalized writes one int; MPI_Finalize is called once, under the lock, after
    // which no MPI call is made (`finalized` is checked by `round::call`).
    let code = unsafe {
        (mpi.lib.MPI_Finalized)(&mut done);
        if done != 0 { sys::MPI_SUCCESS } else { (mpi.lib.MPI_Finalize)() }
    };
    mpi.check("MPI_Finalize", code)
}

/// Whether [`finalize`] has run (every later call on a communicator is refused).
pub(crate) fn is_finalized(mpi: &Mpi) -> bool {
    mpi.finalized.load(Ordering::SeqCst)
}
