//! Micro-kernels: one `MR x NR` tile of `C` from an `MR`-row panel of A and an `NR`-column panel
//! of B, both packed depth-major ([`super::pack`]).
//!
//! Each keeps the whole tile in registers for the panel's depth, then adds it into `C` (or, on
//! the first depth block, stores it with the bias added). The `MR` lanes of A are broadcast, B is
//! loaded as `NR / 16` vectors, and the tile is `MR x NR/16` vector accumulators:
//!
//! * AVX-512 `f32`: `vfmadd231ps`, 8 x 48 (24 accumulators, 3 B vectors, 1 broadcast).
//! * AVX512-BF16: `vdpbf16ps`, the same shape over pairs of `k`: each instruction multiplies 16
//!   pairs of `bf16` exactly and adds both products into the `f32` lanes (bf16 denormal inputs
//!   read as zero and denormal results flush to zero, as the instruction defines).
//! * Portable and AVX2: one generic body over arrays, compiled twice (baseline; AVX2 + FMA).

/// Where a tile goes: `mr x nr` of `C` (row stride `ldc`); on the first depth block the tile is
/// stored (plus `bias[0..nr]` if given), on later ones added.
#[derive(Clone, Copy)]
pub(crate) struct Tile {
    pub(crate) c: *mut f32,
    pub(crate) ldc: usize,
    pub(crate) mr: usize,
    pub(crate) nr: usize,
    pub(crate) first: bool,
    pub(crate) bias: Option<*const f32>,
}

/// The generic body: `acc[i][j] += a[d][i] * b[d][j]` over the depth, then the tile update.
///
/// # Safety
/// `a` and `b` must hold `depth * MR` and `depth * NR` lanes (f32 bits); `t` must describe a
/// writable `mr x nr` block (`mr <= MR`, `nr <= NR`) with `nr` readable bias entries if any.
#[inline(always)]
unsafe fn generic<const MR: usize, const NR: usize, const FMA: bool>(depth: usize, a: &[u32], b: &[u32], t: Tile) {
    let mut acc = [[0f32; NR]; MR];
    for (ad, bd) in a.chunks_exact(MR).zip(b.chunks_exact(NR)).take(depth) {
        let bv: [f32; NR] = std::array::from_fn(|j| f32::from_bits(bd[j]));
        for i in 0..MR {
            let av = f32::from_bits(ad[i]);
            for j in 0..NR {
                acc[i][j] = if FMA { av.mul_add(bv[j], acc[i][j]) } else { acc[i][j] + av * bv[j] };
            }
        }
    }
    for (i, row) in acc.iter().enumerate().take(t.mr) {
        for (j, v) in row.iter().enumerate().take(t.nr) {
            // SAFETY: (i, j) is inside the `mr x nr` block and the bias has `nr` entries (the
            // caller's contract).
            unsafe {
                let c = t.c.add(i * t.ldc + j);
                *c = if t.first { v + t.bias.map_or(0.0, |b| *b.add(j)) } else { *c + v };
            }
        }
    }
}

/// Portable tile shape: 4 x 16.
pub(crate) const PORTABLE: (usize, usize) = (4, 16);
/// AVX2 tile shape: 6 x 16 (12 ymm accumulators).
pub(crate) const AVX2: (usize, usize) = (6, 16);
/// AVX-512 tile shape (f32 and bf16 pairs): 8 x 48.
pub(crate) const AVX512: (usize, usize) = (8, 48);

/// # Safety
/// As [`generic`] with the [`PORTABLE`] shape.
pub(crate) unsafe fn f32_portable(depth: usize, a: &[u32], b: &[u32], t: Tile) {
    // SAFETY: forwarded contract.
    unsafe { generic::<{ PORTABLE.0 }, { PORTABLE.1 }, false>(depth, a, b, t) }
}

/// # Safety
/// As [`generic`] with the [`AVX2`] shape; the CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn f32_avx2(depth: usize, a: &[u32], b: &[u32], t: Tile) {
    // SAFETY: forwarded contract.
    unsafe { generic::<{ AVX2.0 }, { AVX2.1 }, true>(depth, a, b, t) }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use avx512::{bf16_avx512, f32_avx512, f32_avx512_rows};

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{AVX512, Tile};
    use std::arch::x86_64::*;

    const MR: usize = AVX512.0;
    const NV: usize = AVX512.1 / 16;
    /// Depth steps ahead to prefetch B (streamed from L2).
    const PREFETCH_B: usize = 24;

    /// The tile update shared by both AVX-512 kernels.
    ///
    /// # Safety
    /// `t` describes a writable `mr x nr` block with `nr` readable bias entries if any.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn finish(acc: &[[__m512; NV]; MR], t: Tile) {
        let full = t.nr == 16 * NV;
        for (i, row) in acc.iter().enumerate().take(t.mr) {
            for (v, &val) in row.iter().enumerate() {
                let lanes = t.nr.saturating_sub(16 * v).min(16);
                if lanes == 0 {
                    break;
                }
                // SAFETY: both branches touch columns `16v..16v + lanes`, all below `nr`, of row
                // `i < mr`: inside the block (and the bias) by the caller's contract.
                unsafe {
                    let c = t.c.add(i * t.ldc + 16 * v);
                    // Full tiles use plain loads and stores (masked ones are slow on Zen 4).
                    // No closures here: they would not inherit the target features.
                    if full {
                        let old = match (t.first, t.bias) {
                            (true, Some(b)) => _mm512_loadu_ps(b.add(16 * v)),
                            (true, None) => _mm512_setzero_ps(),
                            (false, _) => _mm512_loadu_ps(c),
                        };
                        _mm512_storeu_ps(c, _mm512_add_ps(old, val));
                    } else {
                        let mask: u16 = if lanes == 16 { u16::MAX } else { (1 << lanes) - 1 };
                        let old = match (t.first, t.bias) {
                            (true, Some(b)) => _mm512_maskz_loadu_ps(mask, b.add(16 * v)),
                            (true, None) => _mm512_setzero_ps(),
                            (false, _) => _mm512_maskz_loadu_ps(mask, c),
                        };
                        _mm512_mask_storeu_ps(c, mask, _mm512_add_ps(old, val));
                    }
                }
            }
        }
    }

    /// Prefetches the tile of `C` the kernel will add into, so it arrives while the kernel runs.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn prefetch_c(t: &Tile) {
        if t.first {
            return;
        }
        for i in 0..t.mr {
            let row = t.c.wrapping_add(i * t.ldc);
            for line in 0..(16 * NV).div_ceil(16) {
                // Prefetching never faults; the addresses are inside `C` anyway.
                _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(16 * line).cast());
            }
        }
    }

    /// `f32` lanes, `vfmadd231ps`.
    ///
    /// # Safety
    /// `a` and `b` must hold `depth * 8` and `depth * 48` lanes, 64-byte aligned; `t` as in
    /// [`finish`]. The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f,fma")]
    pub(crate) unsafe fn f32_avx512(depth: usize, a: &[u32], b: &[u32], t: Tile) {
        debug_assert!(a.len() >= depth * MR && b.len() >= depth * 16 * NV);
        prefetch_c(&t);
        let mut acc = [[_mm512_setzero_ps(); NV]; MR];
        let (mut pa, mut pb) = (a.as_ptr().cast::<f32>(), b.as_ptr().cast::<f32>());
        for _ in 0..depth {
            // SAFETY: `depth` steps of `MR` and `16 NV` lanes stay inside `a` and `b`; B is
            // 64-byte aligned (each step is 192 bytes from an aligned start).
            unsafe {
                let mut bv = [_mm512_setzero_ps(); NV];
                for (v, slot) in bv.iter_mut().enumerate() {
                    _mm_prefetch::<_MM_HINT_T0>(pb.wrapping_add(16 * (NV * PREFETCH_B + v)).cast());
                    *slot = _mm512_load_ps(pb.add(16 * v));
                }
                for (i, row) in acc.iter_mut().enumerate() {
                    let ai = _mm512_set1_ps(*pa.add(i));
                    for (r, &bb) in row.iter_mut().zip(&bv) {
                        *r = _mm512_fmadd_ps(ai, bb, *r);
                    }
                }
                pa = pa.add(MR);
                pb = pb.add(16 * NV);
            }
        }
        // SAFETY: forwarded contract.
        unsafe { finish(&acc, t) }
    }

    /// [`f32_avx512`] with A read in place from `MR` rows of x, `lda` lanes apart (no packed
    /// panel): each step broadcasts one element of each row, so the rows are `MR` sequential
    /// streams.
    ///
    /// # Safety
    /// `a` must hold `(MR - 1) * lda + depth` lanes, `b` `depth * 48` lanes, 64-byte aligned;
    /// `t` as in [`finish`]. The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f,fma")]
    pub(crate) unsafe fn f32_avx512_rows(depth: usize, a: &[u32], lda: usize, b: &[u32], t: Tile) {
        debug_assert!(a.len() >= (MR - 1) * lda + depth && b.len() >= depth * 16 * NV);
        prefetch_c(&t);
        let mut acc = [[_mm512_setzero_ps(); NV]; MR];
        let pa = a.as_ptr().cast::<f32>();
        let rows: [*const f32; MR] = std::array::from_fn(|i| pa.wrapping_add(i * lda));
        let mut pb = b.as_ptr().cast::<f32>();
        for d in 0..depth {
            // SAFETY: row `i`'s element `d < depth` is inside `a`; B as in `f32_avx512`.
            unsafe {
                let mut bv = [_mm512_setzero_ps(); NV];
                for (v, slot) in bv.iter_mut().enumerate() {
                    _mm_prefetch::<_MM_HINT_T0>(pb.wrapping_add(16 * (NV * PREFETCH_B + v)).cast());
                    *slot = _mm512_load_ps(pb.add(16 * v));
                }
                for (row, &r) in acc.iter_mut().zip(&rows) {
                    let ai = _mm512_set1_ps(*r.add(d));
                    for (acc, &bb) in row.iter_mut().zip(&bv) {
                        *acc = _mm512_fmadd_ps(ai, bb, *acc);
                    }
                }
                pb = pb.add(16 * NV);
            }
        }
        // SAFETY: forwarded contract.
        unsafe { finish(&acc, t) }
    }

    /// Pairs of `bf16` lanes, `vdpbf16ps`.
    ///
    /// # Safety
    /// As [`f32_avx512`], with pair lanes; the CPU must have AVX512-BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(crate) unsafe fn bf16_avx512(depth: usize, a: &[u32], b: &[u32], t: Tile) {
        debug_assert!(a.len() >= depth * MR && b.len() >= depth * 16 * NV);
        prefetch_c(&t);
        let mut acc = [[_mm512_setzero_ps(); NV]; MR];
        let (mut pa, mut pb) = (a.as_ptr().cast::<i32>(), b.as_ptr().cast::<i32>());
        for _ in 0..depth {
            // SAFETY: as in `f32_avx512`.
            unsafe {
                let mut bv = [std::mem::transmute::<__m512, __m512bh>(_mm512_setzero_ps()); NV];
                for (v, slot) in bv.iter_mut().enumerate() {
                    _mm_prefetch::<_MM_HINT_T0>(pb.wrapping_add(16 * (NV * PREFETCH_B + v)).cast());
                    *slot = std::mem::transmute::<__m512i, __m512bh>(_mm512_load_si512(pb.add(16 * v).cast()));
                }
                for (i, row) in acc.iter_mut().enumerate() {
                    let ai = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(*pa.add(i)));
                    for (r, &bb) in row.iter_mut().zip(&bv) {
                        *r = _mm512_dpbf16_ps(*r, ai, bb);
                    }
                }
                pa = pa.add(MR);
                pb = pb.add(16 * NV);
            }
        }
        // SAFETY: forwarded contract.
        unsafe { finish(&acc, t) }
    }
}
