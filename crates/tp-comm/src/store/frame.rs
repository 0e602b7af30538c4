//! The store's wire format, and socket reads and writes that keep a deadline.
//!
//! A frame is magic `TPS1`, an op byte, a little-endian u32 key length, the key, a u32 value
//! length and the value. Every read and write here retries on `EINTR` (a signal, or a process
//! stopped and resumed: sockets with a timeout then fail with "Interrupted system call") and
//! sets the socket's timeout to the time *left* before each attempt, so no retry extends the
//! deadline.

use super::{MAX_KEY_BYTES, MAX_VALUE_BYTES};
use crate::deadline::Deadline;
use std::io::{self, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};

pub(super) const MAGIC: &[u8; 4] = b"TPS1";

/// Requests.
pub(super) const OP_SET: u8 = 1;
/// value: u64 LE milliseconds to wait for the key.
pub(super) const OP_GET: u8 = 2;
/// Set if absent.
pub(super) const OP_CLAIM: u8 = 3;
/// key: a prefix; value: u64 LE milliseconds to wait, u64 LE count. Waits until every
/// `{prefix}/{r}` for `r` in `0..count` exists.
pub(super) const OP_WAIT_ALL: u8 = 4;

/// Replies.
pub(super) const R_OK: u8 = 10;
pub(super) const R_VALUE: u8 = 11;
/// For `OP_WAIT_ALL`, value: u64 LE number missing, then u32 LE ranks (the first few).
pub(super) const R_MISSING: u8 = 12;
pub(super) const R_EXISTS: u8 = 13;
/// value: the reason, as text.
pub(super) const R_ERROR: u8 = 14;

/// One decoded frame. A server's frame holds its value's share of the in-flight budget until it
/// is dropped.
pub(super) struct Frame<'a> {
    pub(super) op: u8,
    pub(super) key: Vec<u8>,
    pub(super) value: Vec<u8>,
    _held: Option<Reservation<'a>>,
}

/// Why a frame could not be read.
#[derive(Debug)]
pub(super) enum FrameError {
    /// The deadline passed before the frame was complete.
    TimedOut,
    /// The connection closed or failed mid-frame.
    Io(io::Error),
    /// The bytes are not a frame of this protocol, or break one of its limits.
    Protocol(String),
    /// A well-formed frame the reader will not take (a value over its limit, or its memory
    /// budget for frames in flight spent). The frame was read and dropped; the connection can
    /// go on, starting with an error reply.
    Refused(String),
}

/// Bytes of values being received at once, over all of a server's connections.
pub(super) struct InFlight {
    used: AtomicUsize,
    limit: usize,
}

impl InFlight {
    pub(super) fn new(limit: usize) -> Self {
        InFlight { used: AtomicUsize::new(0), limit }
    }

    /// Reserves `n` bytes, or `None` when that would pass the limit.
    fn reserve(&self, n: usize) -> Option<Reservation<'_>> {
        let mut cur = self.used.load(Ordering::Relaxed);
        loop {
            let next = cur.checked_add(n).filter(|&v| v <= self.limit)?;
            match self.used.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return Some(Reservation { budget: self, n }),
                Err(actual) => cur = actual,
            }
        }
    }
}

/// A reservation on an [`InFlight`] budget, returned when dropped.
pub(super) struct Reservation<'a> {
    budget: &'a InFlight,
    n: usize,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.n, Ordering::AcqRel);
    }
}

/// Sets `s`'s read timeout to the time left before `deadline` (`None`: wait as long as it takes).
fn read_timeout(s: &TcpStream, deadline: Option<Deadline>) -> io::Result<()> {
    match deadline {
        None => s.set_read_timeout(None),
        Some(d) => match d.remaining() {
            left if left.is_zero() => Err(ErrorKind::TimedOut.into()),
            left => s.set_read_timeout(Some(left)),
        },
    }
}

/// Fills `buf` from `s` by `deadline`, retrying on `EINTR` with the time left.
pub(super) fn read_exact_by(s: &mut TcpStream, buf: &mut [u8], deadline: Option<Deadline>) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        read_timeout(s, deadline)?;
        match s.read(&mut buf[done..]) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => done += n,
            // Interrupted: retry. A timeout: loop, and `read_timeout` reports it once the
            // deadline has really passed (a socket may wake a little early).
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) && deadline.is_some() => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes all of `buf` to `s` by `deadline`, retrying on `EINTR` with the time left.
pub(super) fn write_all_by(s: &mut TcpStream, mut buf: &[u8], deadline: Deadline) -> io::Result<()> {
    while !buf.is_empty() {
        let left = deadline.remaining();
        if left.is_zero() {
            return Err(ErrorKind::TimedOut.into());
        }
        s.set_write_timeout(Some(left))?;
        match s.write(buf) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A frame's bytes up to its value (all of it when `with_value`).
pub(super) fn frame_head(op: u8, key: &[u8], value: &[u8], with_value: bool) -> io::Result<Vec<u8>> {
    let len = |n: usize| u32::try_from(n).map_err(|_| io::Error::new(ErrorKind::InvalidInput, "frame too large"));
    let mut head = Vec::with_capacity(13 + key.len() + if with_value { value.len() } else { 0 });
    head.extend_from_slice(MAGIC);
    head.push(op);
    head.extend_from_slice(&len(key.len())?.to_le_bytes());
    head.extend_from_slice(key);
    head.extend_from_slice(&len(value.len())?.to_le_bytes());
    if with_value {
        head.extend_from_slice(value);
    }
    Ok(head)
}

/// Writes one frame by `deadline` (small ones in one write, large values without a copy).
pub(super) fn write_frame(s: &mut TcpStream, op: u8, key: &[u8], value: &[u8], deadline: Deadline) -> io::Result<()> {
    let small = value.len() <= 4096;
    write_all_by(s, &frame_head(op, key, value, small)?, deadline)?;
    if small { Ok(()) } else { write_all_by(s, value, deadline) }
}

fn io_err(e: io::Error) -> FrameError {
    if e.kind() == ErrorKind::TimedOut { FrameError::TimedOut } else { FrameError::Io(e) }
}

/// Reads and drops `n` bytes by `deadline`.
fn discard(s: &mut TcpStream, mut n: usize, deadline: Option<Deadline>) -> io::Result<()> {
    let mut sink = [0u8; 16 << 10];
    while n > 0 {
        let chunk = n.min(sink.len());
        read_exact_by(s, &mut sink[..chunk], deadline)?;
        n -= chunk;
    }
    Ok(())
}

/// Reads one frame. `Ok(None)` on a clean close before its first byte.
///
/// The first byte must come by `start_by` (`None`: no limit, an idle connection), the rest by
/// `rest_by(..)`, computed once that byte has arrived. Values are checked against
/// `max_value` before anything is allocated and, with a `budget`, reserved from it; a value
/// over either is read, dropped and [`FrameError::Refused`].
pub(super) fn read_frame<'a>(
    s: &mut TcpStream,
    start_by: Option<Deadline>,
    rest_by: impl FnOnce() -> Deadline,
    max_value: usize,
    budget: Option<&'a InFlight>,
) -> Result<Option<Frame<'a>>, FrameError> {
    let mut head = [0u8; 5];
    match read_exact_by(s, &mut head[..1], start_by) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(io_err(e)),
    }
    let deadline = Some(rest_by());
    read_exact_by(s, &mut head[1..], deadline).map_err(io_err)?;
    if &head[..4] != MAGIC {
        return Err(FrameError::Protocol(format!("bad magic {:02x?} (not a tp rendezvous peer?)", &head[..4])));
    }
    let read_len = |s: &mut TcpStream, what: &str, limit: usize| -> Result<usize, FrameError> {
        let mut len = [0u8; 4];
        read_exact_by(s, &mut len, deadline).map_err(io_err)?;
        let len = u32::from_le_bytes(len) as usize;
        if len > limit {
            return Err(FrameError::Protocol(format!("{what} of {len} bytes exceeds the {limit}-byte limit")));
        }
        Ok(len)
    };
    let key_len = read_len(s, "key", MAX_KEY_BYTES)?;
    let mut key = vec![0u8; key_len];
    read_exact_by(s, &mut key, deadline).map_err(io_err)?;
    let value_len = read_len(s, "value", MAX_VALUE_BYTES)?;
    let refuse = |s: &mut TcpStream, why: String| {
        discard(s, value_len, deadline).map_err(io_err)?;
        Err(FrameError::Refused(why))
    };
    if value_len > max_value {
        return refuse(s, format!("a value of {value_len} bytes exceeds the store's limit of {max_value}"));
    }
    let held = match budget.map(|b| (b.reserve(value_len), b.limit)) {
        None => None,
        Some((Some(r), _)) => Some(r),
        Some((None, limit)) => {
            return refuse(s, format!("the store is receiving too much at once (at most {limit} bytes in flight)"));
        }
    };
    let mut value = Vec::new();
    if value.try_reserve_exact(value_len).is_err() {
        return refuse(s, format!("cannot allocate {value_len} bytes"));
    }
    value.resize(value_len, 0);
    read_exact_by(s, &mut value, deadline).map_err(io_err)?;
    Ok(Some(Frame { op: head[4], key, value, _held: held }))
}
