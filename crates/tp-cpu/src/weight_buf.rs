//! [`WeightBuf`]: the bytes of a weight that decode streams once per token, on 2 MiB pages.
//!
//! A decode step reads every weight once, hundreds of megabytes, so with 4 KiB pages it takes a
//! TLB miss every 4 KiB (under a hypervisor each is a two-level page walk). A buffer of at least
//! 2 MiB is therefore allocated 2 MiB-aligned and, on Linux, advised `MADV_HUGEPAGE` before it is
//! written, so that the kernel backs its whole 2 MiB stretches with transparent huge pages where
//! the system allows them (`/sys/kernel/mm/transparent_hugepage/enabled` at `madvise` or
//! `always`). The advice is only advice: where it is refused the buffer works the same on small
//! pages. Smaller buffers are 64-byte aligned and not advised.

use std::alloc::{Layout, alloc, dealloc};
use std::ptr::NonNull;

/// Bytes of a huge page, and the size from which a buffer is placed on them.
const HUGE: usize = 2 << 20;

/// An immutable, owned byte buffer (see the module docs).
pub struct WeightBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a WeightBuf owns its allocation alone and never mutates it after construction, so it
// may move to and be read from any thread.
unsafe impl Send for WeightBuf {}
// SAFETY: as above: shared references only read.
unsafe impl Sync for WeightBuf {}

impl WeightBuf {
    /// A copy of `src`, written after the allocation is advised onto huge pages (pages touched
    /// before the advice would stay small).
    pub fn from_slice(src: &[u8]) -> WeightBuf {
        let len = src.len();
        let Some(layout) = Self::layout(len) else {
            return WeightBuf { ptr: NonNull::dangling(), len: 0 };
        };
        // SAFETY: `layout` has a non-zero size (`layout` returns None for 0).
        let raw = unsafe { alloc(layout) };
        let Some(ptr) = NonNull::new(raw) else { std::alloc::handle_alloc_error(layout) };
        advise_huge(ptr, len);
        // SAFETY: `ptr` is a fresh allocation of `len` bytes, which cannot overlap `src`; after
        // the copy all of them are initialised.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), ptr.as_ptr(), len) };
        WeightBuf { ptr, len }
    }

    /// The allocation's layout for `len` bytes; `None` for an empty buffer (no allocation).
    fn layout(len: usize) -> Option<Layout> {
        let align = if len >= HUGE { HUGE } else { 64 };
        (len > 0).then(|| Layout::from_size_align(len, align).unwrap_or_else(|_| capacity_overflow(len)))
    }
}

/// A size no allocation can have.
fn capacity_overflow(len: usize) -> ! {
    panic!("WeightBuf: {len} bytes exceed the address space")
}

impl std::ops::Deref for WeightBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` owns `len` bytes, all written by `from_slice` (dangling and 0 when
        // empty, which a slice allows), never mutated after.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for WeightBuf {
    fn drop(&mut self) {
        if let Some(layout) = Self::layout(self.len) {
            // SAFETY: `ptr` came from `alloc` with this very layout (`len` is unchanged).
            unsafe { dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

impl std::fmt::Debug for WeightBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WeightBuf({} bytes)", self.len)
    }
}

/// Advises the whole 2 MiB pages inside `len` bytes at `ptr` onto transparent huge pages.
#[cfg(target_os = "linux")]
fn advise_huge(ptr: NonNull<u8>, len: usize) {
    let start = ptr.as_ptr() as usize;
    let (lo, hi) = (start.next_multiple_of(HUGE), (start + len) / HUGE * HUGE);
    if hi > lo {
        // SAFETY: `lo..hi` lies inside this buffer's own allocation; MADV_HUGEPAGE changes no
        // contents and no permissions (an error, e.g. THP compiled out, leaves small pages).
        unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE) };
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge(_: NonNull<u8>, _: usize) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_its_bytes_at_every_size() {
        for len in [0, 1, 63, 4096, HUGE - 1, HUGE, HUGE + 4097, 3 * HUGE] {
            let src: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
            let buf = WeightBuf::from_slice(&src);
            assert_eq!(&buf[..], &src[..], "len {len}");
            if len >= HUGE {
                assert_eq!(buf.as_ptr() as usize % HUGE, 0, "len {len}: not 2 MiB aligned");
            }
        }
    }
}
