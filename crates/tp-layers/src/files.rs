//! Opening the files a user names, without ever blocking in `open` (non-blocking opens and the
//! file kinds from `tp-gguf`, which opens GGUF files the same way).
//!
//! Only regular files are read, after following symlinks (so a Hugging Face cache, whose
//! `snapshots/<rev>/*.safetensors` are symlinks into `blobs/`, loads as usual). A named pipe,
//! a device (`/dev/zero`), a socket or a directory is a [`LayerError::Checkpoint`] saying what
//! it is, before anything is opened. The file is then opened non-blocking and checked again,
//! so a path swapped for a pipe between the two looks cannot block either.
//!
//! Writing, too, goes only to a regular file (or a new one): safetensors writes a sibling
//! temporary file and renames it over the path, which would replace a device node such as
//! `/dev/null` (when run as root) or a pipe, so those are refused.

use crate::error::{LayerError, Result};
use crate::text::path_text;
use std::fs::{File, Metadata, OpenOptions};
use std::io::Read;
use std::path::Path;
use tp_gguf::{file_kind, non_blocking};

/// An error about `path`, named escaped and bounded ([`crate::text`]): a path is the user's, but
/// an index entry's file name within it comes from a file.
fn err(path: &Path, why: impl std::fmt::Display) -> LayerError {
    LayerError::Checkpoint { path: path_text(path), why: why.to_string() }
}

/// `Err(why)` unless `meta` is a regular file's.
fn regular_or(meta: &Metadata) -> std::result::Result<(), String> {
    if meta.is_file() { Ok(()) } else { Err(format!("is {}, not a regular file", file_kind(meta.file_type()))) }
}

fn regular(path: &Path, meta: &Metadata) -> Result<()> {
    regular_or(meta).map_err(|why| err(path, why))
}

/// Opens `path` for reading if it is, after following symlinks, a regular file.
pub(crate) fn open_regular(path: &Path) -> Result<File> {
    let meta = std::fs::metadata(path).map_err(|e| err(path, format!("cannot open: {e}")))?;
    regular(path, &meta)?;
    let file =
        non_blocking(OpenOptions::new().read(true)).open(path).map_err(|e| err(path, format!("cannot open: {e}")))?;
    // What was opened, not what the name pointed at a moment ago.
    regular(path, &file.metadata().map_err(|e| err(path, format!("cannot stat: {e}")))?)?;
    Ok(file)
}

/// The contents of the regular file `path`, as UTF-8, if it holds at most `limit` bytes.
pub(crate) fn read_text(path: &Path, limit: u64) -> Result<String> {
    let mut text = String::new();
    open_regular(path)?
        .take(limit.saturating_add(1))
        .read_to_string(&mut text)
        .map_err(|e| err(path, format!("cannot read: {e}")))?;
    if text.len() as u64 > limit {
        return Err(err(path, format!("is larger than {limit} bytes")));
    }
    Ok(text)
}

/// Checks that `path` names a regular file (after following symlinks) or nothing yet, so that
/// writing it can neither block nor replace a device; opening it (created if absent)
/// non-blocking confirms that.
pub(crate) fn check_writable(path: &Path) -> Result<()> {
    let write_err = |why: String| LayerError::Write { path: path_text(path), why };
    match std::fs::metadata(path) {
        Ok(meta) => regular_or(&meta).map_err(write_err)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(write_err(e.to_string())),
    }
    let file =
        non_blocking(OpenOptions::new().write(true).create(true)).open(path).map_err(|e| write_err(e.to_string()))?;
    let meta = file.metadata().map_err(|e| write_err(format!("cannot stat: {e}")))?;
    regular_or(&meta).map_err(write_err)
}
