//! [`Shape`]: the dimensions of a contiguous, row-major tensor, with checked arithmetic.

use crate::{Error, Result};
use std::fmt;

/// Largest element size of any dtype; a shape is valid only if its bytes fit in `isize`
/// at that size, so every later `numel * size_in_bytes` is free of overflow.
const MAX_ELEM_BYTES: usize = 4;

/// Largest tensor tp holds: 2^40 bytes (1 TiB) at 4 bytes per element, so at most 2^38
/// elements. Far past any one GPU's or host's tensor, and small enough that a shape read from a
/// file (or computed from one, like a product with a `[2^40, 0]` weight) that no machine could
/// hold is a [`Error::ShapeOverflow`] before anything is allocated.
pub const MAX_TENSOR_BYTES: usize = 1 << 40;

/// Dimensions of a row-major tensor. The last dimension is contiguous.
///
/// A `Shape` can only be built through [`Shape::new`], which rejects any shape whose element
/// count (or byte size at 4 bytes per element) overflows, so `numel()` never wraps, or whose
/// elements would take more than [`MAX_TENSOR_BYTES`].
/// Zero-length dimensions are allowed (an empty tensor), as are zero dimensions (a scalar).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Shape {
    dims: Vec<usize>,
    numel: usize,
}

impl Shape {
    /// Validates `dims` and computes the element count.
    ///
    /// The product of the non-zero dims must fit in `isize` bytes too, so that every
    /// sub-product (`outer`, `inner`, strides) of a valid shape is free of overflow even when
    /// some other dim is zero. A shape with elements holds at most [`MAX_TENSOR_BYTES`] of them
    /// at 4 bytes each; an empty one (a zero dim) may have other dims up to the `isize` bound.
    pub fn new(dims: &[usize]) -> Result<Self> {
        let overflow = || Error::ShapeOverflow { dims: dims.to_vec() };
        let nonzero = dims.iter().filter(|&&d| d != 0).try_fold(1usize, |acc, &d| acc.checked_mul(d));
        match nonzero.and_then(|n| n.checked_mul(MAX_ELEM_BYTES)) {
            Some(bytes) if bytes <= isize::MAX as usize => {
                if dims.contains(&0) {
                    return Ok(Shape { dims: dims.to_vec(), numel: 0 });
                }
                if bytes > MAX_TENSOR_BYTES {
                    return Err(overflow());
                }
                Ok(Shape { dims: dims.to_vec(), numel: bytes / MAX_ELEM_BYTES })
            }
            _ => Err(overflow()),
        }
    }

    /// The dimensions, outermost first.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.dims.len()
    }

    /// Number of elements (the product of the dimensions; 1 for a scalar).
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Size of dimension `dim`, or [`Error::DimOutOfRange`].
    pub fn dim(&self, op: &'static str, dim: usize) -> Result<usize> {
        self.dims.get(dim).copied().ok_or(Error::DimOutOfRange { op, dim, ndim: self.ndim() })
    }

    /// Splits the shape around `dim` into `(outer, size, inner)`: the product of the dims before
    /// it, its own size, and the product of the dims after it. A contiguous tensor is then
    /// `outer` blocks, each holding `size` rows of `inner` elements.
    pub fn split_at_dim(&self, op: &'static str, dim: usize) -> Result<(usize, usize, usize)> {
        let size = self.dim(op, dim)?;
        // Sub-products of a valid shape cannot overflow.
        let outer = self.dims[..dim].iter().product();
        let inner = self.dims[dim + 1..].iter().product();
        Ok((outer, size, inner))
    }

    /// The same dims with dimension `dim` replaced by `len` (checked).
    pub fn with_dim(&self, dim: usize, len: usize) -> Result<Shape> {
        let mut dims = self.dims.clone();
        match dims.get_mut(dim) {
            Some(d) => *d = len,
            None => return Err(Error::DimOutOfRange { op: "with_dim", dim, ndim: self.ndim() }),
        }
        Shape::new(&dims)
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.dims)
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.dims)
    }
}
