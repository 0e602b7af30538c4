//! Reading the header's fields in order, each checked against the bytes left: a fixed-size field
//! that does not fit is [`GgufError::Truncated`], a count or length that the bytes left cannot
//! hold is [`GgufError::CountTooLarge`] (read before anything is allocated for it). Every field is
//! little-endian. `what` closures name the field and run only on an error.

use crate::error::{GgufError, Result};

/// A position in the file's bytes.
pub(crate) struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    /// The file's path as escaped text, for errors.
    pub(crate) path: &'a str,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(bytes: &'a [u8], path: &'a str) -> Cursor<'a> {
        Cursor { bytes, pos: 0, path }
    }

    /// The byte offset of the next field.
    pub(crate) fn offset(&self) -> u64 {
        self.pos as u64
    }

    pub(crate) fn position(&self) -> usize {
        self.pos
    }

    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    /// The next `n` bytes.
    pub(crate) fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                path: self.path.to_string(),
                what: what(),
                offset: self.offset(),
                need: n as u64,
                have: self.remaining() as u64,
            });
        }
        let out = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    /// The next `N` bytes as an array.
    pub(crate) fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    pub(crate) fn u8(&mut self, what: &dyn Fn() -> String) -> Result<u8> {
        Ok(self.array::<1>(what)?[0])
    }

    pub(crate) fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A u64 count of items taking at least `min_item` bytes each, checked to fit in the bytes
    /// left after it.
    pub(crate) fn count(&mut self, min_item: usize, what: &dyn Fn() -> String) -> Result<usize> {
        let offset = self.offset();
        let count = self.u64(what)?;
        let remaining = self.remaining();
        let max = remaining / min_item.max(1);
        match usize::try_from(count) {
            Ok(n) if n <= max => Ok(n),
            _ => Err(GgufError::CountTooLarge {
                path: self.path.to_string(),
                what: what(),
                offset,
                count,
                max: max as u64,
                remaining: remaining as u64,
            }),
        }
    }

    /// A string: its u64 length in bytes, then that many bytes of UTF-8. Returns the string and the
    /// offset of its first byte.
    pub(crate) fn string(&mut self, what: &dyn Fn() -> String) -> Result<(String, u64)> {
        let len = self.count(1, &|| format!("the length of {}", what()))?;
        let at = self.offset();
        let raw = self.take(len, what)?;
        match std::str::from_utf8(raw) {
            Ok(s) => Ok((s.to_string(), at)),
            Err(e) => Err(GgufError::InvalidUtf8 {
                path: self.path.to_string(),
                what: what(),
                offset: at,
                valid_up_to: e.valid_up_to() as u64,
            }),
        }
    }
}
