//! Opening the file a user names without ever blocking in `open`: only a regular file is read,
//! after following symlinks. A named pipe, a device, a socket or a directory is a
//! [`GgufError::NotRegularFile`] saying what it is, before anything is opened. The file is then
//! opened non-blocking and checked again, so a path swapped for a pipe between the two looks
//! cannot block either.
//!
//! [`non_blocking`] and [`file_kind`] are public: `tp-layers` opens checkpoint files (and
//! checks files it writes) the same way, with its own errors.

use crate::error::{GgufError, Result};
use std::fs::{File, FileType, Metadata, OpenOptions};

/// `O_NONBLOCK` for `open(2)`: opening a FIFO then returns at once instead of waiting for a
/// writer; regular files ignore it. The kernel's value on Linux (all but MIPS and SPARC) and on
/// the BSDs and macOS; elsewhere no flag is added, and the check before opening still refuses
/// every file that is not regular.
#[cfg_attr(not(unix), allow(dead_code))]
const O_NONBLOCK: i32 = if cfg!(all(
    any(target_os = "linux", target_os = "android"),
    not(any(
        target_arch = "mips",
        target_arch = "mips64",
        target_arch = "mips32r6",
        target_arch = "mips64r6",
        target_arch = "sparc",
        target_arch = "sparc64"
    ))
)) {
    0o4000
} else if cfg!(any(
    target_os = "macos",
    target_os = "ios",
    target_os = "freebsd",
    target_os = "openbsd",
    target_os = "netbsd",
    target_os = "dragonfly"
)) {
    0x0004
} else {
    0
};

/// What a file that is not a regular file is, in words ("a named pipe (FIFO)", "a directory",
/// ...).
pub fn file_kind(t: FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a named pipe (FIFO)";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if t.is_dir() { "a directory" } else { "not a regular file" }
}

fn regular(shown: &str, meta: &Metadata) -> Result<()> {
    if meta.is_file() {
        Ok(())
    } else {
        Err(GgufError::NotRegularFile { path: shown.to_string(), kind: file_kind(meta.file_type()) })
    }
}

/// `opts` with `O_NONBLOCK` where the platform has it (see the constant): opening a FIFO then
/// returns at once instead of waiting for the other end.
pub fn non_blocking(opts: &mut OpenOptions) -> &mut OpenOptions {
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.custom_flags(O_NONBLOCK);
    }
    opts
}

fn io<'a>(shown: &'a str, action: &'static str) -> impl FnOnce(std::io::Error) -> GgufError + 'a {
    move |source| GgufError::Io { path: shown.to_string(), action, source }
}

/// Opens `path` (shown in errors as `shown`) for reading if it is, after following symlinks, a
/// regular file, and returns it with its length.
pub(crate) fn open_regular(path: &std::path::Path, shown: &str) -> Result<(File, u64)> {
    regular(shown, &std::fs::metadata(path).map_err(io(shown, "open"))?)?;
    let file = non_blocking(OpenOptions::new().read(true)).open(path).map_err(io(shown, "open"))?;
    // What was opened, not what the name pointed at a moment ago.
    let meta = file.metadata().map_err(io(shown, "stat"))?;
    regular(shown, &meta)?;
    Ok((file, meta.len()))
}
