//! The part of Open MPI's C ABI that tp calls, resolved by hand from `libmpi.so.40`.
//!
//! Open MPI's handles are pointers: `MPI_Comm`, `MPI_Datatype`, `MPI_Errhandler` and
//! `MPI_Request` point to library objects, and the predefined ones (`MPI_COMM_WORLD`,
//! `MPI_BYTE`, `MPI_ERRORS_RETURN`) are the addresses of exported variables
//! (`ompi_mpi_comm_world`, ...), which is what `mpi.h`'s macros expand to. That holds for Open
//! MPI 4 and 5 (both `libmpi.so.40`); MPICH's integer handles are a different ABI, and a library
//! without these variables is refused when it is loaded. Constants are `mpi.h`'s (checked
//! against Open MPI 4.1's header: `MPI_ANY_SOURCE` -1, `MPI_THREAD_SERIALIZED` 2).
//!
//! Statuses are never read: every call passes `MPI_STATUS_IGNORE` (null in Open MPI), and a
//! message's sender is carried in its own bytes, so the layout of `MPI_Status` does not matter.

#![allow(non_camel_case_types, non_snake_case, missing_docs)]

use std::os::raw::{c_char, c_int, c_void};

/// `MPI_Comm`.
pub type MPI_Comm = *mut c_void;
/// `MPI_Datatype`.
pub type MPI_Datatype = *mut c_void;
/// `MPI_Errhandler`.
pub type MPI_Errhandler = *mut c_void;
/// `MPI_Request`.
pub type MPI_Request = *mut c_void;

/// `MPI_SUCCESS`.
pub const MPI_SUCCESS: c_int = 0;
/// `MPI_THREAD_SERIALIZED`: any thread may call, one at a time (tp holds a lock around calls).
pub const MPI_THREAD_SERIALIZED: c_int = 2;
/// `MPI_MAX_ERROR_STRING` and `MPI_MAX_LIBRARY_VERSION_STRING` (both 256 in Open MPI).
pub const MPI_MAX_STRING: usize = 256;
/// `MPI_STATUS_IGNORE` (a null pointer in Open MPI).
pub const MPI_STATUS_IGNORE: *mut c_void = std::ptr::null_mut();

type Init = unsafe extern "C" fn(*mut c_int, *mut *mut *mut c_char, c_int, *mut c_int) -> c_int;
type Flag = unsafe extern "C" fn(*mut c_int) -> c_int;
type Void = unsafe extern "C" fn() -> c_int;
type CommInt = unsafe extern "C" fn(MPI_Comm, *mut c_int) -> c_int;
type Split = unsafe extern "C" fn(MPI_Comm, c_int, c_int, *mut MPI_Comm) -> c_int;
type SetErr = unsafe extern "C" fn(MPI_Comm, MPI_Errhandler) -> c_int;
type Isend =
    unsafe extern "C" fn(*const c_void, c_int, MPI_Datatype, c_int, c_int, MPI_Comm, *mut MPI_Request) -> c_int;
type Irecv = unsafe extern "C" fn(*mut c_void, c_int, MPI_Datatype, c_int, c_int, MPI_Comm, *mut MPI_Request) -> c_int;
type Test = unsafe extern "C" fn(*mut MPI_Request, *mut c_int, *mut c_void) -> c_int;
type Iprobe = unsafe extern "C" fn(c_int, c_int, MPI_Comm, *mut c_int, *mut c_void) -> c_int;
type Recv = unsafe extern "C" fn(*mut c_void, c_int, MPI_Datatype, c_int, c_int, MPI_Comm, *mut c_void) -> c_int;
type Abort = unsafe extern "C" fn(MPI_Comm, c_int) -> c_int;
type Text = unsafe extern "C" fn(*mut c_char, *mut c_int) -> c_int;
type ErrText = unsafe extern "C" fn(c_int, *mut c_char, *mut c_int) -> c_int;

/// The loaded library: its functions and the addresses of its predefined handles.
pub struct MpiLib {
    _lib: libloading::Library,
    pub MPI_Init_thread: Init,
    pub MPI_Initialized: Flag,
    pub MPI_Finalized: Flag,
    pub MPI_Finalize: Void,
    pub MPI_Comm_rank: CommInt,
    pub MPI_Comm_size: CommInt,
    pub MPI_Comm_split: Split,
    pub MPI_Comm_set_errhandler: SetErr,
    pub MPI_Isend: Isend,
    pub MPI_Irecv: Irecv,
    pub MPI_Test: Test,
    pub MPI_Iprobe: Iprobe,
    pub MPI_Recv: Recv,
    pub MPI_Abort: Abort,
    pub MPI_Get_library_version: Text,
    pub MPI_Error_string: ErrText,
    /// `MPI_COMM_WORLD`.
    pub comm_world: MPI_Comm,
    /// `MPI_BYTE`.
    pub byte: MPI_Datatype,
    /// `MPI_ERRORS_RETURN`.
    pub errors_return: MPI_Errhandler,
}

// SAFETY: the struct holds function pointers and the addresses of the library's static
// objects, valid for as long as `_lib` is loaded (the struct's life); calls are serialised by
// the caller (`super::call`).
unsafe impl Send for MpiLib {}
// SAFETY: as above.
unsafe impl Sync for MpiLib {}

impl MpiLib {
    /// Opens `path` with `RTLD_NOW | RTLD_GLOBAL` (Open MPI's plugins resolve symbols of
    /// `libmpi` and `libopen-pal` from the global scope) and resolves every symbol above.
    ///
    /// # Safety
    /// Loading runs the library's initialisers; `path` must be an Open MPI `libmpi`, whose
    /// functions have the signatures declared here (the presence of `ompi_mpi_comm_world` is
    /// checked, which an MPICH library lacks).
    pub unsafe fn new(path: &str) -> Result<MpiLib, String> {
        use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
        // SAFETY: per this function's contract.
        let lib: libloading::Library =
            unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }.map_err(|e| e.to_string())?.into();
        // SAFETY: each symbol is looked up by its exported name and given the type `mpi.h`
        // declares for it (function signatures above; variables as untyped addresses).
        unsafe {
            let addr = |name: &str| -> Result<*mut c_void, String> {
                let s: libloading::Symbol<*mut c_void> = lib
                    .get(name.as_bytes())
                    .map_err(|_| format!("{name} is missing: not an Open MPI library (tp binds Open MPI's ABI)"))?;
                Ok(*s)
            };
            let comm_world = addr("ompi_mpi_comm_world")?;
            let byte = addr("ompi_mpi_byte")?;
            let errors_return = addr("ompi_mpi_errors_return")?;
            macro_rules! f {
                ($name:ident) => {
                    *lib.get(concat!(stringify!($name), "\0").as_bytes())
                        .map_err(|e| format!("{}: {e}", stringify!($name)))?
                };
            }
            Ok(MpiLib {
                MPI_Init_thread: f!(MPI_Init_thread),
                MPI_Initialized: f!(MPI_Initialized),
                MPI_Finalized: f!(MPI_Finalized),
                MPI_Finalize: f!(MPI_Finalize),
                MPI_Comm_rank: f!(MPI_Comm_rank),
                MPI_Comm_size: f!(MPI_Comm_size),
                MPI_Comm_split: f!(MPI_Comm_split),
                MPI_Comm_set_errhandler: f!(MPI_Comm_set_errhandler),
                MPI_Isend: f!(MPI_Isend),
                MPI_Irecv: f!(MPI_Irecv),
                MPI_Test: f!(MPI_Test),
                MPI_Iprobe: f!(MPI_Iprobe),
                MPI_Recv: f!(MPI_Recv),
                MPI_Abort: f!(MPI_Abort),
                MPI_Get_library_version: f!(MPI_Get_library_version),
                MPI_Error_string: f!(MPI_Error_string),
                comm_world,
                byte,
                errors_return,
                _lib: lib,
            })
        }
    }
}
