//! Packing GEMM operands into the panels the micro-kernels read.
//!
//! A packed panel holds `pr` rows (or columns) of one operand for a range of the depth `K`,
//! depth-major: `panel[d][r]`, one 32-bit lane per `(d, r)`, rows past the matrix's edge zero.
//! A lane is either
//! * an `f32` ([`Lanes::F32`]), widened from the source dtype (exact), one depth unit per `k`; or
//! * a pair of 16-bit values ([`Lanes::Pairs`]): `k = 2d` in the low half, `k = 2d + 1` in the high
//!   half (zero past the end of `K`). This is the layout `vdpbf16ps` reads from both operands, and
//!   the "VNNI" layout of AMX's B tile (`tdpbf16ps`, `tdpfp16ps`: each tile row is one pair index
//!   across 16 columns).
//!
//! Both GEMM operands here have `K` contiguous (x is `[M, K]`; an `[N, K]` weight too), so
//! packing them is a transpose: [`rows`] does it in 16 x 16 blocks of 32-bit lanes with AVX-512
//! shuffles where the CPU has them, else with scalar loops. A `[K, N]` weight is already
//! depth-major: [`cols`] copies (or, for pairs, interleaves two rows).

use crate::dispatch::Isa;
use crate::element::Float;

/// What one 32-bit lane of a panel holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lanes {
    /// One element widened to `f32`.
    F32,
    /// Two consecutive-`k` 16-bit elements (`f16` or `bf16` bits), low half first.
    Pairs,
}

impl Lanes {
    /// Depth units covering `len` elements of `K`.
    pub(crate) const fn depth(self, len: usize) -> usize {
        match self {
            Lanes::F32 => len,
            Lanes::Pairs => len.div_ceil(2),
        }
    }
}

/// A row-major source matrix: `rows x cols` elements at row stride `ld`.
#[derive(Clone, Copy)]
pub(crate) struct Src<'a, T> {
    pub(crate) data: &'a [T],
    pub(crate) ld: usize,
}

/// The 32-bit lane of one element (`F32`) or of the pair starting at `data[i]` (`Pairs`, with
/// `has_next` saying whether the second element exists).
#[inline(always)]
fn lane<T: Float>(lanes: Lanes, data: &[T], i: usize, has_next: bool) -> u32 {
    match lanes {
        Lanes::F32 => data[i].widen().to_bits(),
        Lanes::Pairs => {
            let lo = u32::from(bits16(data[i]));
            let hi = if has_next { u32::from(bits16(data[i + 1])) } else { 0 };
            lo | (hi << 16)
        }
    }
}

/// The raw bits of a 16-bit element (`f16`/`bf16`); callers use `Pairs` only for those.
#[inline(always)]
fn bits16<T: Float>(v: T) -> u16 {
    let b = bytemuck::bytes_of(&v);
    debug_assert_eq!(b.len(), 2, "pairs of a 32-bit element");
    u16::from_le_bytes([b[0], b.get(1).copied().unwrap_or(0)])
}

/// Packs rows `r0..r0 + nrows` of `src`, elements `c0..c0 + len` of each, into panels of `pr`
/// rows and `depth_pad >= depth` depth units (zero past `depth`):
/// `out[p * pr * depth_pad + d * pr + r]` is lane `d` of row `r0 + p * pr + r`. `out` must hold
/// `ceil(nrows / pr) * pr * depth_pad` lanes.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rows<T: Float>(
    isa: Isa,
    lanes: Lanes,
    src: Src<'_, T>,
    r0: usize,
    nrows: usize,
    c0: usize,
    len: usize,
    pr: usize,
    depth_pad: usize,
    out: &mut [u32],
) {
    let depth = lanes.depth(len);
    let panels = nrows.div_ceil(pr);
    assert!(depth_pad >= depth && out.len() >= panels * pr * depth_pad, "pack::rows: output too short");
    for p in 0..panels {
        out[(p * depth_pad + depth) * pr..(p + 1) * depth_pad * pr].fill(0);
    }
    if nrows > 0 && len > 0 {
        assert!((r0 + nrows - 1) * src.ld + c0 + len <= src.data.len(), "pack::rows: source too short");
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: `Isa::Avx512` is chosen only when the CPU has AVX-512 F/BW/VL/DQ and F16C
        // (dispatch.rs), all that `avx512::rows` requires beyond the bounds checked above.
        unsafe { avx512::rows(lanes, src, r0, nrows, c0, len, pr, depth_pad, out) };
        return;
    }
    let _ = isa;
    for p in 0..panels {
        let panel = &mut out[p * pr * depth_pad..(p * depth_pad + depth) * pr];
        for r in 0..pr {
            let row = p * pr + r;
            if row >= nrows {
                for d in 0..depth {
                    panel[d * pr + r] = 0;
                }
                continue;
            }
            let base = (r0 + row) * src.ld + c0;
            for d in 0..depth {
                let i = match lanes {
                    Lanes::F32 => d,
                    Lanes::Pairs => 2 * d,
                };
                panel[d * pr + r] = lane(lanes, src.data, base + i, i + 1 < len);
            }
        }
    }
}

/// Packs rows `r0..r0 + nrows` of a 16-bit source, elements `c0..c0 + len`, row-major in
/// pair lanes (not transposed; AMX's A tile): `out[p * pr * depth_pad + r * depth_pad + d]` is
/// pair `d` of row `r0 + p * pr + r`, zero past the row's end and for rows past the edge.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rows_plain<T: Float>(
    src: Src<'_, T>,
    r0: usize,
    nrows: usize,
    c0: usize,
    len: usize,
    pr: usize,
    depth_pad: usize,
    out: &mut [u32],
) {
    let depth = Lanes::Pairs.depth(len);
    let panels = nrows.div_ceil(pr);
    assert!(depth_pad >= depth && out.len() >= panels * pr * depth_pad, "pack::rows_plain: output too short");
    for (r, dst) in out[..panels * pr * depth_pad].chunks_exact_mut(depth_pad).enumerate() {
        if r >= nrows {
            dst.fill(0);
            continue;
        }
        let row = &src.data[(r0 + r) * src.ld + c0..][..len];
        let (pairs, tail) = row.split_at(len / 2 * 2);
        for (o, p) in dst.iter_mut().zip(pairs.chunks_exact(2)) {
            *o = u32::from(bits16(p[0])) | (u32::from(bits16(p[1])) << 16);
        }
        let mut d = len / 2;
        if let Some(&last) = tail.first() {
            dst[d] = u32::from(bits16(last));
            d += 1;
        }
        dst[d..].fill(0);
    }
}

/// Packs columns `j0..j0 + ncols` of a source whose rows are the depth (a `[K, N]` weight):
/// `out[p * pc * depth_pad + d * pc + c]` is lane `d` (rows `k0 + d`, or `k0 + 2d` and
/// `k0 + 2d + 1` for pairs) of column `j0 + p * pc + c`; columns past the edge and depth units
/// past `depth` are zero.
#[allow(clippy::too_many_arguments)]
pub(crate) fn cols<T: Float>(
    lanes: Lanes,
    src: Src<'_, T>,
    k0: usize,
    len: usize,
    j0: usize,
    ncols: usize,
    pc: usize,
    depth_pad: usize,
    out: &mut [u32],
) {
    let depth = lanes.depth(len);
    let panels = ncols.div_ceil(pc);
    assert!(depth_pad >= depth && out.len() >= panels * pc * depth_pad, "pack::cols: output too short");
    if ncols > 0 && len > 0 {
        assert!((k0 + len - 1) * src.ld + j0 + ncols <= src.data.len(), "pack::cols: source too short");
    }
    for p in 0..panels {
        let width = pc.min(ncols - p * pc);
        out[(p * depth_pad + depth) * pc..(p + 1) * depth_pad * pc].fill(0);
        let panel = &mut out[p * pc * depth_pad..(p * depth_pad + depth) * pc];
        for (d, dst) in panel.chunks_exact_mut(pc).enumerate() {
            let j = j0 + p * pc;
            match lanes {
                Lanes::F32 => {
                    let row = &src.data[(k0 + d) * src.ld + j..][..width];
                    for (o, v) in dst.iter_mut().zip(row) {
                        *o = v.widen().to_bits();
                    }
                }
                Lanes::Pairs => {
                    let lo = &src.data[(k0 + 2 * d) * src.ld + j..][..width];
                    let has_hi = 2 * d + 1 < len;
                    for (c, (o, v)) in dst.iter_mut().zip(lo).enumerate() {
                        let hi =
                            if has_hi { u32::from(bits16(src.data[(k0 + 2 * d + 1) * src.ld + j + c])) } else { 0 };
                        *o = u32::from(bits16(*v)) | (hi << 16);
                    }
                }
            }
            dst[width..].fill(0);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Lanes, Src};
    use crate::element::{Float, FloatKind};
    use std::arch::x86_64::*;

    /// How many vectors ahead along a row to prefetch (a prefetch never faults, even past the
    /// end of the data).
    const PREFETCH: usize = 4;

    /// [`super::rows`] with 16 x 16 register transposes. Same contract; the caller has checked
    /// that `src` holds rows `r0..r0 + nrows`, elements `c0..c0 + len` (row stride `src.ld`), and
    /// that `out` holds every panel.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rows<T: Float>(
        lanes: Lanes,
        src: Src<'_, T>,
        r0: usize,
        nrows: usize,
        c0: usize,
        len: usize,
        pr: usize,
        depth_pad: usize,
        out: &mut [u32],
    ) {
        let depth = lanes.depth(len);
        let per_vec = match lanes {
            Lanes::F32 => 16,
            Lanes::Pairs => 32,
        };
        let zero = _mm512_setzero_si512();
        for p in 0..nrows.div_ceil(pr) {
            let panel = &mut out[p * pr * depth_pad..(p * depth_pad + depth) * pr];
            for g0 in (0..pr).step_by(16) {
                let g = 16.min(pr - g0);
                let lane_mask: u16 = if g == 16 { u16::MAX } else { (1u16 << g) - 1 };
                for d0 in (0..depth).step_by(16) {
                    let dn = 16.min(depth - d0);
                    let e0 = d0 * per_vec / 16; // first element of this block
                    let n = (len - e0).min(per_vec);
                    let mut v = [zero; 16];
                    for (r, slot) in v.iter_mut().enumerate().take(g) {
                        let row = p * pr + g0 + r;
                        if row < nrows {
                            let start = (r0 + row) * src.ld + c0 + e0;
                            let ptr = src.data[start..start + n].as_ptr();
                            // Each row is a short stream (one depth block): prefetch ahead of it,
                            // and start the stream of the row 16 below (the next group) into L2.
                            _mm_prefetch::<_MM_HINT_T0>(ptr.wrapping_add(PREFETCH * per_vec).cast());
                            if row + 16 < nrows {
                                _mm_prefetch::<_MM_HINT_T1>(ptr.wrapping_add(16 * src.ld).cast());
                            }
                            // SAFETY: elements `start..start + n` are inside the row (`e0 + n <=
                            // len`, the caller checked the rows), and `load` reads no others.
                            *slot = unsafe { load(lanes, ptr, n) };
                        }
                    }
                    let t = transpose16(v);
                    for (d, tv) in t.iter().enumerate().take(dn) {
                        let dst = panel[(d0 + d) * pr + g0..][..g].as_mut_ptr();
                        // SAFETY: each store writes lanes `0..g` of `dst`, which has `g` lanes.
                        // (Full-width stores where possible: masked stores are slow on Zen 4.)
                        unsafe {
                            match g {
                                16 => _mm512_storeu_si512(dst.cast(), *tv),
                                8 => _mm256_storeu_si256(dst.cast(), _mm512_castsi512_si256(*tv)),
                                _ => _mm512_mask_storeu_epi32(dst.cast::<i32>(), lane_mask, *tv),
                            }
                        }
                    }
                }
            }
        }
    }

    /// 16 lanes from `n <= 16` (F32) or `n <= 32` (pairs: 16-bit elements) elements at `ptr`;
    /// lanes past `n` are zero.
    ///
    /// # Safety
    /// The `n` elements at `ptr` must be readable. Nothing past them is read.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    #[inline]
    unsafe fn load<T: Float>(lanes: Lanes, ptr: *const T, n: usize) -> __m512i {
        // SAFETY: (all arms) masked loads touch only the `n` elements the mask enables, which
        // the caller guarantees are readable.
        unsafe {
            match (lanes, T::KIND) {
                (Lanes::F32, FloatKind::F32) if n == 16 => _mm512_loadu_si512(ptr.cast()),
                (Lanes::F32, FloatKind::F16) if n == 16 => {
                    _mm512_castps_si512(_mm512_cvtph_ps(_mm256_loadu_si256(ptr.cast())))
                }
                (Lanes::F32, FloatKind::BF16) if n == 16 => {
                    _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(ptr.cast())))
                }
                (Lanes::Pairs, _) if n == 32 => _mm512_loadu_si512(ptr.cast()),
                (Lanes::F32, FloatKind::F32) => {
                    _mm512_castps_si512(_mm512_maskz_loadu_ps(mask16(n), ptr.cast::<f32>()))
                }
                (Lanes::F32, FloatKind::F16) => {
                    let h = _mm256_maskz_loadu_epi16(mask16(n), ptr.cast::<i16>());
                    _mm512_castps_si512(_mm512_cvtph_ps(h))
                }
                (Lanes::F32, FloatKind::BF16) => {
                    let h = _mm256_maskz_loadu_epi16(mask16(n), ptr.cast::<i16>());
                    _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h))
                }
                (Lanes::Pairs, _) => _mm512_maskz_loadu_epi16(mask32(n), ptr.cast::<i16>()),
            }
        }
    }

    #[inline(always)]
    fn mask16(n: usize) -> u16 {
        if n >= 16 { u16::MAX } else { (1u16 << n) - 1 }
    }

    #[inline(always)]
    fn mask32(n: usize) -> u32 {
        if n >= 32 { u32::MAX } else { (1u32 << n) - 1 }
    }

    /// `t[k]` lane `r` = `v[r]` lane `k`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(crate) fn transpose16(v: [__m512i; 16]) -> [__m512i; 16] {
        // SAFETY: `[__m512i; 16]` and `[__m512; 16]` have the same size and every bit pattern
        // is valid for both (the casts below are the same reinterpretation).
        let v = unsafe { std::mem::transmute::<[__m512i; 16], [__m512; 16]>(v) };
        {
            // 32-bit interleave of row pairs: (0,1), (2,3), ...
            let mut a = [_mm512_setzero_ps(); 16];
            for i in 0..8 {
                a[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
                a[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
            }
            // 64-bit interleave: rows (0..4) within each 128-bit lane.
            let mut b = [_mm512_setzero_ps(); 16];
            for i in 0..4 {
                let (x0, x1, x2, x3) = (a[4 * i], a[4 * i + 1], a[4 * i + 2], a[4 * i + 3]);
                let pd = _mm512_castps_pd;
                b[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(x0), pd(x2)));
                b[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(x0), pd(x2)));
                b[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(x1), pd(x3)));
                b[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(x1), pd(x3)));
            }
            // Now b[4i + j] holds, in 128-bit lane L, elements k = 4L + j of rows 4i..4i+4.
            // 128-bit shuffles gather lane L of the four groups into t[4L + j].
            let mut c = [_mm512_setzero_ps(); 16];
            for j in 0..4 {
                let (g0, g1, g2, g3) = (b[j], b[4 + j], b[8 + j], b[12 + j]);
                // lo/hi halves: lanes (0, 1) and (2, 3) of g0 with g1, g2 with g3.
                let p01_lo = _mm512_shuffle_f32x4::<0x44>(g0, g1); // g0.L0 g0.L1 g1.L0 g1.L1
                let p01_hi = _mm512_shuffle_f32x4::<0xEE>(g0, g1); // g0.L2 g0.L3 g1.L2 g1.L3
                let p23_lo = _mm512_shuffle_f32x4::<0x44>(g2, g3);
                let p23_hi = _mm512_shuffle_f32x4::<0xEE>(g2, g3);
                c[j] = _mm512_shuffle_f32x4::<0x88>(p01_lo, p23_lo); // L0 of g0 g1 g2 g3
                c[4 + j] = _mm512_shuffle_f32x4::<0xDD>(p01_lo, p23_lo); // L1
                c[8 + j] = _mm512_shuffle_f32x4::<0x88>(p01_hi, p23_hi); // L2
                c[12 + j] = _mm512_shuffle_f32x4::<0xDD>(p01_hi, p23_hi); // L3
            }
            // SAFETY: as above.
            unsafe { std::mem::transmute::<[__m512; 16], [__m512i; 16]>(c) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    fn check_rows<T: Float>(lanes: Lanes, make: impl Fn(f32) -> T) {
        let (total_rows, ld) = (41usize, 77usize);
        let data: Vec<T> = (0..total_rows * ld).map(|i| make((i % 251) as f32 - 125.0)).collect();
        let src = Src { data: &data, ld };
        for (r0, nrows, c0, len, pr) in
            [(0, 41usize, 0, 77, 16usize), (3, 17, 5, 33, 8), (1, 29, 2, 70, 48), (0, 5, 1, 1, 12)]
        {
            let depth = lanes.depth(len);
            let size = nrows.div_ceil(pr) * pr * (depth + 3);
            let mut want = vec![7u32; size];
            rows(Isa::Portable, lanes, src, r0, nrows, c0, len, pr, depth + 3, &mut want);
            let mut isas = vec![Isa::Portable];
            if crate::CpuKernel::Avx512.is_available() {
                isas.push(Isa::Avx512);
            }
            for isa in isas {
                let mut got = vec![9u32; size];
                rows(isa, lanes, src, r0, nrows, c0, len, pr, depth + 3, &mut got);
                assert_eq!(got, want, "{isa:?} {lanes:?} {:?}", (r0, nrows, c0, len, pr));
            }
            // The portable packing against the definition.
            for (idx, &w) in want.iter().enumerate() {
                let (p, rest) = (idx / (pr * (depth + 3)), idx % (pr * (depth + 3)));
                let (d, r) = (rest / pr, rest % pr);
                let row = p * pr + r;
                let expect = if row >= nrows || d >= depth {
                    0
                } else {
                    let at = |e: usize| data[(r0 + row) * ld + c0 + e];
                    match lanes {
                        Lanes::F32 => at(d).widen().to_bits(),
                        Lanes::Pairs => {
                            let hi = if 2 * d + 1 < len { u32::from(bits16(at(2 * d + 1))) } else { 0 };
                            u32::from(bits16(at(2 * d))) | hi << 16
                        }
                    }
                };
                assert_eq!(w, expect, "lane {idx}");
            }
        }
    }

    #[test]
    fn rows_packing_matches_definition_on_every_isa() {
        check_rows(Lanes::F32, |v| v);
        check_rows(Lanes::F32, f16::from_f32);
        check_rows(Lanes::F32, bf16::from_f32);
        check_rows(Lanes::Pairs, f16::from_f32);
        check_rows(Lanes::Pairs, bf16::from_f32);
    }

    #[test]
    fn plain_rows_packing_matches_definition() {
        let (nr, ld) = (7usize, 13usize);
        let data: Vec<bf16> = (0..nr * ld).map(|i| bf16::from_f32(i as f32)).collect();
        let src = Src { data: &data, ld };
        let (r0, nrows, c0, len, pr, pad) = (1, 5usize, 2, 9usize, 4, 8);
        let mut out = vec![3u32; nrows.div_ceil(pr) * pr * pad];
        rows_plain(src, r0, nrows, c0, len, pr, pad, &mut out);
        for (idx, &w) in out.iter().enumerate() {
            let (r, d) = (idx / pad, idx % pad);
            let at =
                |e: usize| if r < nrows && e < len { u32::from(data[(r0 + r) * ld + c0 + e].to_bits()) } else { 0 };
            assert_eq!(w, at(2 * d) | at(2 * d + 1) << 16, "lane {idx}");
        }
    }

    #[test]
    fn cols_packing_matches_definition() {
        let (k, n) = (9, 37);
        let data: Vec<bf16> = (0..k * n).map(|i| bf16::from_f32(i as f32)).collect();
        let src = Src { data: &data, ld: n };
        let (k0, len, j0, ncols, pc) = (1, 7usize, 3, 30usize, 16);
        for lanes in [Lanes::F32, Lanes::Pairs] {
            let depth = lanes.depth(len);
            let pad = depth + 2;
            let mut out = vec![5u32; ncols.div_ceil(pc) * pc * pad];
            cols(lanes, src, k0, len, j0, ncols, pc, pad, &mut out);
            for (idx, &w) in out.iter().enumerate() {
                let (p, rest) = (idx / (pc * pad), idx % (pc * pad));
                let (d, c) = (rest / pc, rest % pc);
                let col = p * pc + c;
                let at = |kk: usize| data[(k0 + kk) * n + j0 + col];
                let expect = if col >= ncols || d >= depth {
                    0
                } else {
                    match lanes {
                        Lanes::F32 => at(d).widen().to_bits(),
                        Lanes::Pairs => {
                            let hi = if 2 * d + 1 < len { u32::from(at(2 * d + 1).to_bits()) } else { 0 };
                            u32::from(at(2 * d).to_bits()) | hi << 16
                        }
                    }
                };
                assert_eq!(w, expect, "{lanes:?} lane {idx}");
            }
        }
    }
}
