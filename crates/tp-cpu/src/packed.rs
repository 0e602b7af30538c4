//! [`PackedWeight`]: an `[N, K]` weight packed once into the panels the GEMM driver would build
//! from it on every call, for [`crate::matmul_packed`].

use crate::dispatch::CpuKernel;
use crate::element::{Float, FloatKind};
use crate::error::{Error, Result};
use crate::gemm::{self, Micro};

/// An `[N, K]` row-major weight ([`crate::Layout::Nk`]) packed once for the GEMM micro-kernel
/// that the calling thread's [`CpuKernel`] picks for its element type: for every depth block of
/// `K`, every column panel, exactly as [`crate::matmul`] packs them on each call (same block
/// sizes, same padding). About the weight's size (`f16` under a family without `f16`
/// instructions is widened, so twice it); see [`PackedWeight::bytes`].
///
/// Opaque: it is only read by [`crate::matmul_packed`], which checks that it was built for the
/// product's element type, `n` and `k`, and uses it only while that micro-kernel is still the
/// one chosen.
pub struct PackedWeight {
    kind: FloatKind,
    n: usize,
    k: usize,
    micro: Micro,
    /// The panels start at `off`, 64-byte aligned, and run for `len` lanes.
    buf: Vec<u32>,
    off: usize,
    len: usize,
}

impl PackedWeight {
    /// Packs `w`, `n` rows of `k` elements, for this thread's kernel family (a [`with_kernel`]
    /// override included). Multi-threaded on the pool for large weights.
    ///
    /// Errors: [`Error::ShapeOverflow`] if `n * k` or the packed size overflows `usize`;
    /// [`Error::OperandLength`] if `w` does not hold `n * k` elements.
    ///
    /// [`with_kernel`]: crate::with_kernel
    pub fn new<T: Float>(w: &[T], n: usize, k: usize) -> Result<PackedWeight> {
        let overflow = Error::ShapeOverflow { m: 0, n, k };
        let expected = n.checked_mul(k).ok_or(overflow.clone())?;
        if w.len() != expected {
            return Err(Error::OperandLength { operand: "w", expected, got: w.len() });
        }
        let micro = Micro::choose(CpuKernel::current(), T::KIND);
        // With `k = 0` there is nothing to pack (products are the bias alone).
        let len = if k == 0 { 0 } else { gemm::packed_len(micro, n, k).ok_or(overflow.clone())? };
        let mut buf = vec![0u32; len.checked_add(16).ok_or(overflow)?];
        let off = buf.as_ptr().align_offset(64).min(16);
        if len > 0 {
            gemm::pack_weight(micro, w, n, k, &mut buf[off..off + len]);
        }
        Ok(PackedWeight { kind: T::KIND, n, k, micro, buf, off, len })
    }

    /// Bytes the packed panels take.
    pub fn bytes(&self) -> usize {
        self.len * 4
    }

    /// The element type, `n` and `k` the weight was packed from.
    pub(crate) fn dims(&self) -> (FloatKind, usize, usize) {
        (self.kind, self.n, self.k)
    }

    /// The panels, if they were packed for `micro` (else `None`): 64-byte aligned, as
    /// [`gemm::pack_weight`] lays them out.
    pub(crate) fn panels(&self, micro: Micro) -> Option<&[u32]> {
        (micro == self.micro && self.len > 0).then(|| &self.buf[self.off..self.off + self.len])
    }
}

impl std::fmt::Debug for PackedWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedWeight")
            .field("kind", &self.kind)
            .field("n", &self.n)
            .field("k", &self.k)
            .field("micro", &self.micro)
            .field("bytes", &self.bytes())
            .finish()
    }
}
