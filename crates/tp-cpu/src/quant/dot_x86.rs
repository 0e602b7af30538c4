//! The `#[target_feature]` entry points of the x86 integer dot products: one per instruction set
//! ([`avx2`], [`vnni`]), each compiling every type's kernel (`dot_legacy`, `dot_kquant`) for
//! 1, 2 and 4 activation rows at a time (the interleaved layouts' kernels up to 8), inside a
//! loop over a task's weight rows (so a row costs no call, dispatch or check of its own).

use super::act::XRow;
use super::types::QuantType;

/// The loop over weight rows: each row of `$w` (`$row_bytes` bytes) against the activation rows
/// `$xs`, 4, 2 or 1 at a time, through the kernel `$kernel::<$ty, M>`, into `$out` (row-major by
/// weight row).
macro_rules! row_loop {
    ($kernel:ident, $ty:ty, $w:expr, $row_bytes:expr, $xs:expr, $out:expr) => {{
        let (xs, m) = ($xs, $xs.len());
        let nb = $row_bytes / <$ty>::BYTES;
        for (row, out) in $w.chunks_exact($row_bytes).zip($out.chunks_exact_mut(m)) {
            let p = row.as_ptr();
            let mut i = 0;
            while i < m {
                // SAFETY: `check` verified the operands (every row `nb` blocks, every activation
                // row as long, with its scales and sums); the caller guarantees the CPU.
                unsafe {
                    match m - i {
                        1 => {
                            out[i] = $kernel::<$ty, 1>(p, nb, &[xs[i]])[0];
                            i += 1;
                        }
                        2 | 3 => {
                            out[i..i + 2].copy_from_slice(&$kernel::<$ty, 2>(p, nb, &[xs[i], xs[i + 1]]));
                            i += 2;
                        }
                        _ => {
                            let x4 = [xs[i], xs[i + 1], xs[i + 2], xs[i + 3]];
                            out[i..i + 4].copy_from_slice(&$kernel::<$ty, 4>(p, nb, &x4));
                            i += 4;
                        }
                    }
                }
            }
        }
    }};
}

/// Defines module `$isa` with `rows_dots`, the kernels compiled with `$features` and `$dot`.
macro_rules! isa_entry {
    ($isa:ident, $features:literal, $dot:ty) => {
        pub(crate) mod $isa {
            use super::super::act::XRow;
            use super::super::dot_kquant::{self as kq, KQuant};
            use super::super::dot_legacy::{self as lg, Legacy};
            use super::super::dot_q4kx8 as q4k;
            use super::super::dot_q4x8 as q4;
            use super::super::dot_q6kx8 as q6k;
            use super::super::interleave::RowLayout;
            use super::super::types::QuantType;

            /// `dot_legacy::row` with this instruction set.
            ///
            /// # Safety
            /// As `dot_legacy::row`.
            #[inline(always)]
            unsafe fn legacy_m<L: Legacy, const M: usize>(w: *const u8, nb: usize, xs: &[XRow<'_>; M]) -> [f32; M] {
                // SAFETY: forwarded.
                unsafe { lg::row::<$dot, L, M>(w, nb, xs) }
            }

            /// `dot_kquant::row` (the same code for every instruction set, compiled with this
            /// one's features).
            ///
            /// # Safety
            /// As `dot_kquant::row`.
            #[inline(always)]
            unsafe fn kquant_m<K: KQuant, const M: usize>(w: *const u8, nb: usize, xs: &[XRow<'_>; M]) -> [f32; M] {
                // SAFETY: forwarded.
                unsafe { kq::row::<K, M>(w, nb, xs) }
            }

            /// The rows of a legacy type.
            ///
            /// # Safety
            /// Operands as [`super::check`] verifies them; the CPU must have `$features`.
            #[target_feature(enable = $features)]
            unsafe fn legacy<L: Legacy>(w: &[u8], row_bytes: usize, xs: &[XRow<'_>], out: &mut [f32]) {
                row_loop!(legacy_m, L, w, row_bytes, xs, out)
            }

            /// Rows interleaved eight at a time (`RowLayout::Q4_0x8`, `Q4Kx8`, `Q6Kx8`): whole groups
            /// through `G`'s kernel (1, 2, 4, 6 or 8 activation rows at a time, at most
            /// `G::WIDEST`); the rows past the last group (ggml's layout) go to `tail`.
            ///
            /// # Safety
            /// As [`legacy`]; `tail` must be the one-row kernel of the same type.
            #[target_feature(enable = $features)]
            unsafe fn grouped<G: q4::Group>(
                w: &[u8],
                row_bytes: usize,
                xs: &[XRow<'_>],
                out: &mut [f32],
                tail: unsafe fn(&[u8], usize, &[XRow<'_>], &mut [f32]),
            ) {
                let m = xs.len();
                let nb = row_bytes / G::BLOCK_BYTES;
                let whole = w.len() / (8 * row_bytes) * 8 * row_bytes;
                for (g, out) in w[..whole].chunks_exact(8 * row_bytes).zip(out.chunks_exact_mut(8 * m)) {
                    let p = g.as_ptr();
                    let mut i = 0;
                    while i < m {
                        let take = match (m - i).min(G::WIDEST) {
                            1 => 1,
                            2 | 3 => 2,
                            4 | 5 => 4,
                            6 | 7 => 6,
                            _ => 8,
                        };
                        // SAFETY: `check` verified the operands (a group is 8 whole rows of
                        // `nb` blocks; every activation row as long, with its scales and
                        // sums); the caller guarantees the CPU.
                        let sums: [[f32; 8]; 8] = unsafe {
                            let z = [0.0; 8];
                            match take {
                                1 => {
                                    let r = G::group::<$dot, 1>(p, nb, &[xs[i]]);
                                    [r[0], z, z, z, z, z, z, z]
                                }
                                2 => {
                                    let r = G::group::<$dot, 2>(p, nb, &[xs[i], xs[i + 1]]);
                                    [r[0], r[1], z, z, z, z, z, z]
                                }
                                4 => {
                                    let r = G::group::<$dot, 4>(p, nb, &[xs[i], xs[i + 1], xs[i + 2], xs[i + 3]]);
                                    [r[0], r[1], r[2], r[3], z, z, z, z]
                                }
                                6 => {
                                    let x6 = [xs[i], xs[i + 1], xs[i + 2], xs[i + 3], xs[i + 4], xs[i + 5]];
                                    let r = G::group::<$dot, 6>(p, nb, &x6);
                                    [r[0], r[1], r[2], r[3], r[4], r[5], z, z]
                                }
                                _ => {
                                    let x8: [XRow<'_>; 8] = [
                                        xs[i],
                                        xs[i + 1],
                                        xs[i + 2],
                                        xs[i + 3],
                                        xs[i + 4],
                                        xs[i + 5],
                                        xs[i + 6],
                                        xs[i + 7],
                                    ];
                                    G::group::<$dot, 8>(p, nb, &x8)
                                }
                            }
                        };
                        for (j, row_sums) in sums.iter().enumerate().take(take) {
                            for (r, &v) in row_sums.iter().enumerate() {
                                out[r * m + i + j] = v;
                            }
                        }
                        i += take;
                    }
                }
                // SAFETY: as above, for the rows past the last group.
                unsafe { tail(&w[whole..], row_bytes, xs, &mut out[whole / row_bytes * m..]) }
            }

            /// The rows of a K-quant.
            ///
            /// # Safety
            /// As [`legacy`].
            #[target_feature(enable = $features)]
            unsafe fn kquant<K: KQuant>(w: &[u8], row_bytes: usize, xs: &[XRow<'_>], out: &mut [f32]) {
                row_loop!(kquant_m, K, w, row_bytes, xs, out)
            }

            /// `out[r * m + i] = Σ_e w_r[e] x_i[e]` for the weight rows `w_r` of `w` (`row_bytes`
            /// each, whole blocks of the quantized type `t`) and the `m` activation rows `xs`
            /// (Q8_0 / Q8_K to match `t`), the rows stored in `layout`.
            ///
            /// # Safety
            /// The CPU must have `$features`. (Operands are checked.)
            pub(crate) unsafe fn rows_dots(
                t: QuantType,
                layout: RowLayout,
                w: &[u8],
                row_bytes: usize,
                xs: &[XRow<'_>],
                out: &mut [f32],
            ) {
                super::check(t, w, row_bytes, xs, out);
                let interleaved = layout.applies(t);
                // SAFETY: `check` verified the operands; the caller, the CPU.
                unsafe {
                    match t {
                        QuantType::Q4_0 if interleaved => {
                            grouped::<q4::Q40x8>(w, row_bytes, xs, out, legacy::<lg::Q40>)
                        }
                        QuantType::Q4K if interleaved => grouped::<q4k::Q4Kx8>(w, row_bytes, xs, out, kquant::<kq::Q4>),
                        QuantType::Q6K if interleaved => grouped::<q6k::Q6Kx8>(w, row_bytes, xs, out, kquant::<kq::Q6>),
                        QuantType::Q4_0 => legacy::<lg::Q40>(w, row_bytes, xs, out),
                        QuantType::Q4_1 => legacy::<lg::Q41>(w, row_bytes, xs, out),
                        QuantType::Q5_0 => legacy::<lg::Q50>(w, row_bytes, xs, out),
                        QuantType::Q5_1 => legacy::<lg::Q51>(w, row_bytes, xs, out),
                        QuantType::Q8_0 if interleaved => {
                            grouped::<q4::Q80x8>(w, row_bytes, xs, out, legacy::<lg::Q80>)
                        }
                        QuantType::Q8_0 => legacy::<lg::Q80>(w, row_bytes, xs, out),
                        QuantType::Mxfp4 if interleaved => {
                            grouped::<q4::Mxfp4x8>(w, row_bytes, xs, out, legacy::<lg::Mxfp4>)
                        }
                        QuantType::Mxfp4 => legacy::<lg::Mxfp4>(w, row_bytes, xs, out),
                        QuantType::Q2K => kquant::<kq::Q2>(w, row_bytes, xs, out),
                        QuantType::Q3K => kquant::<kq::Q3>(w, row_bytes, xs, out),
                        QuantType::Q4K => kquant::<kq::Q4>(w, row_bytes, xs, out),
                        QuantType::Q5K => kquant::<kq::Q5>(w, row_bytes, xs, out),
                        QuantType::Q6K => kquant::<kq::Q6>(w, row_bytes, xs, out),
                        QuantType::F32 | QuantType::F16 | QuantType::BF16 => unreachable!("rows_dots: float type"),
                    }
                }
            }
        }
    };
}

/// Checks what the kernels rely on: `w` whole rows of `row_bytes`, each whole blocks of the
/// quantized type `t`; each activation row as long as a weight row, with its scales (and sums);
/// one output per weight row and activation row.
fn check(t: QuantType, w: &[u8], row_bytes: usize, xs: &[XRow<'_>], out: &[f32]) {
    let (bb, be) = (t.block_bytes(), t.block_elems());
    let nb = row_bytes / bb;
    assert!(!t.is_float() && row_bytes == nb * bb && nb > 0, "rows_dots: row size");
    assert!(w.len().is_multiple_of(row_bytes) && out.len() == w.len() / row_bytes * xs.len(), "rows_dots: operands");
    for x in xs {
        assert!(x.qs.len() == nb * be && x.d.len() >= nb, "rows_dots: activations");
        if t.is_k_quant() {
            assert!(x.bsums.len() == 16 * nb, "rows_dots: activation sums");
        } else {
            assert!(x.sx.len() >= nb, "rows_dots: activation sums");
        }
    }
}

isa_entry!(avx2, "avx2,fma,f16c", super::super::simd::Avx2);
isa_entry!(vnni, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni", super::super::simd::Vnni);
