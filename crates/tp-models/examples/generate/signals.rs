//! Removing a half-written temporary file when SIGINT or SIGTERM ends the program.
//!
//! [`RemoveOnSignal::install`] stores the file's path as a C string in a static, then installs
//! handlers for SIGINT and SIGTERM that `unlink` it, say so on stderr (`write(2)` of a fixed
//! message naming the signal) and `_exit(128 + signal)` (130, 143: the status a shell reports for
//! a death by that signal). The three calls are async-signal-safe, and the handler reads the
//! path with one atomic load and allocates nothing. Dropping the guard puts the
//! previous handlers back. A signal that was ignored when the guard was made stays ignored (as
//! for a program started in the background by a non-interactive shell).

use std::ffi::{CString, c_int};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicPtr, Ordering};

/// The NUL-terminated path the handlers remove, or null. Each one stored is a leaked
/// [`CString`], never freed: a handler running on another thread may still be reading it after
/// the guard is dropped (a few bytes per file written).
static PATH: AtomicPtr<libc::c_char> = AtomicPtr::new(std::ptr::null_mut());

/// The signals that end the program with the file removed.
const SIGNALS: [c_int; 2] = [libc::SIGINT, libc::SIGTERM];

extern "C" fn remove_and_exit(signal: c_int) {
    let path = PATH.load(Ordering::Acquire);
    if !path.is_null() {
        // SAFETY: a non-null PATH is a leaked CString's pointer: NUL-terminated and never freed.
        // unlink is async-signal-safe; its failure (the file not created yet, or renamed
        // already) leaves nothing to clean up.
        unsafe { libc::unlink(path) };
    }
    let message: &[u8] = if signal == libc::SIGINT {
        b"generate: interrupted by SIGINT while writing the logits file; the partial file was removed\n"
    } else {
        b"generate: terminated by SIGTERM while writing the logits file; the partial file was removed\n"
    };
    // SAFETY: write is async-signal-safe; the buffer is a static byte string of that length. A
    // failed write (stderr closed) changes nothing: the exit below follows either way.
    unsafe { libc::write(libc::STDERR_FILENO, message.as_ptr().cast(), message.len()) };
    // SAFETY: _exit is async-signal-safe and ends the process at once, running no destructors
    // and no atexit handlers that could touch state the interrupted code holds.
    unsafe { libc::_exit(128 + signal) }
}

/// While alive: SIGINT and SIGTERM remove the file and exit. See the module doc.
pub struct RemoveOnSignal {
    /// The handlers replaced, to put back on drop.
    previous: Vec<(c_int, libc::sigaction)>,
}

impl RemoveOnSignal {
    /// Installs the handlers for `path`; call it before the file is created.
    pub fn install(path: &Path) -> Result<RemoveOnSignal, String> {
        let c_path = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| format!("{}: a path with a NUL byte", path.display()))?;
        PATH.store(c_path.into_raw(), Ordering::Release); // an earlier one is leaked, see PATH
        let mut guard = RemoveOnSignal { previous: Vec::new() };
        for signal in SIGNALS {
            // SAFETY: sigaction is plain data; all-zero is a valid value (SIG_DFL, no flags,
            // an empty mask) that the calls below fill in.
            let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
            // SAFETY: a null new action only reads the current one into `old`, a valid pointer.
            if unsafe { libc::sigaction(signal, std::ptr::null(), &mut old) } != 0 {
                return Err(format!("cannot read the handler of signal {signal}: {}", std::io::Error::last_os_error()));
            }
            if old.sa_sigaction == libc::SIG_IGN {
                continue;
            }
            // SAFETY: as above, all-zero is a valid sigaction.
            let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
            action.sa_sigaction = remove_and_exit as extern "C" fn(c_int) as libc::sighandler_t;
            // SAFETY: sa_mask is a valid sigset_t owned by `action`; both signals are valid,
            // so neither call can fail. Blocking both while the handler runs keeps it from
            // being re-entered by the other.
            unsafe {
                libc::sigemptyset(&mut action.sa_mask);
                for s in SIGNALS {
                    libc::sigaddset(&mut action.sa_mask, s);
                }
            }
            // SAFETY: `action` is fully initialised; remove_and_exit has the one-int signature
            // that sa_flags without SA_SIGINFO calls, and only does async-signal-safe work.
            if unsafe { libc::sigaction(signal, &action, std::ptr::null_mut()) } != 0 {
                return Err(format!("cannot handle signal {signal}: {}", std::io::Error::last_os_error()));
            }
            guard.previous.push((signal, old));
        }
        Ok(guard)
    }
}

impl Drop for RemoveOnSignal {
    fn drop(&mut self) {
        for (signal, old) in &self.previous {
            // SAFETY: `old` is the action sigaction itself returned for this signal.
            unsafe { libc::sigaction(*signal, old, std::ptr::null_mut()) };
        }
        PATH.store(std::ptr::null_mut(), Ordering::Release);
    }
}
