//! Host buffers whose size comes from input (a shape, a file), reserved fallibly: a size the
//! machine cannot provide is [`Error::OutOfMemory`], never an abort of the process.
//!
//! [`Shape`](crate::Shape) bounds every size these are asked for (its byte size fits in
//! `isize`), so no size computation here overflows; whether the memory exists is up to the
//! allocator. Every host op allocates its output through these.

use crate::{Error, Result};

fn out_of_memory<T>(op: &'static str, n: usize) -> Error {
    Error::OutOfMemory { op, bytes: n.saturating_mul(size_of::<T>()) }
}

/// `n` zeroed elements (one `calloc`: pages cost nothing until written).
pub(crate) fn zeroed<T: bytemuck::Zeroable>(op: &'static str, n: usize) -> Result<Vec<T>> {
    bytemuck::allocation::try_zeroed_vec(n).map_err(|()| out_of_memory::<T>(op, n))
}

/// An empty vector with room for exactly `n` elements.
pub(crate) fn with_capacity<T>(op: &'static str, n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| out_of_memory::<T>(op, n))?;
    Ok(v)
}

/// The items of `it` (exactly `n` of them) in a vector reserved up front.
pub(crate) fn collect<T>(op: &'static str, n: usize, it: impl Iterator<Item = T>) -> Result<Vec<T>> {
    let mut v = with_capacity(op, n)?;
    v.extend(it);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn impossible_sizes_are_errors() {
        let n = isize::MAX as usize / 4;
        assert_eq!(zeroed::<f32>("t", n).unwrap_err(), Error::OutOfMemory { op: "t", bytes: n * 4 });
        assert!(matches!(with_capacity::<f32>("t", n), Err(Error::OutOfMemory { .. })));
        assert!(matches!(collect("t", n, std::iter::empty::<f32>()), Err(Error::OutOfMemory { .. })));
        assert_eq!(zeroed::<f32>("t", 3).unwrap(), vec![0.0; 3]);
        assert_eq!(collect("t", 2, [1, 2].into_iter()).unwrap(), vec![1, 2]);
    }
}
