//! The `#[target_feature]` entry points of the x86 integer dot products: one per instruction set
//! ([`avx2`], [`vnni`]), each compiling every type's kernel (`dot_legacy`, `dot_kquant`) for
//! 1, 2 and 4 activation rows at a time.

use super::act::XRow;
use super::types::QuantType;

/// Defines module `$isa` with `row_dots`, the kernels compiled with `$features` and `$dot`.
macro_rules! isa_entry {
    ($isa:ident, $features:literal, $dot:ty) => {
        pub(crate) mod $isa {
            use super::super::act::XRow;
            use super::super::dot_kquant::{self as kq, KQuant};
            use super::super::dot_legacy::{self as lg, Legacy};
            use super::super::types::QuantType;

            /// One weight row of a legacy type against `M` activation rows.
            ///
            /// # Safety
            /// As `dot_legacy::row`, and the CPU must have `$features`.
            #[target_feature(enable = $features)]
            unsafe fn legacy<L: Legacy, const M: usize>(w: &[u8], xs: &[XRow<'_>; M]) -> [f32; M] {
                // SAFETY: the caller guarantees the operands and the features.
                unsafe { lg::row::<$dot, L, M>(w.as_ptr(), w.len() / L::BYTES, xs) }
            }

            /// One weight row of a K-quant against `M` activation rows.
            ///
            /// # Safety
            /// As `dot_kquant::row`, and the CPU must have `$features`.
            #[target_feature(enable = $features)]
            unsafe fn kquant<K: KQuant, const M: usize>(w: &[u8], xs: &[XRow<'_>; M]) -> [f32; M] {
                // SAFETY: as above.
                unsafe { kq::row::<$dot, K, M>(w.as_ptr(), w.len() / K::BYTES, xs) }
            }

            /// `M` activation rows at once.
            ///
            /// # Safety
            /// As [`row_dots`].
            unsafe fn rows_m<const M: usize>(t: QuantType, w: &[u8], xs: &[XRow<'_>; M]) -> [f32; M] {
                // SAFETY: forwarded from the caller.
                unsafe {
                    match t {
                        QuantType::Q4_0 => legacy::<lg::Q40, M>(w, xs),
                        QuantType::Q4_1 => legacy::<lg::Q41, M>(w, xs),
                        QuantType::Q5_0 => legacy::<lg::Q50, M>(w, xs),
                        QuantType::Q5_1 => legacy::<lg::Q51, M>(w, xs),
                        QuantType::Q8_0 => legacy::<lg::Q80, M>(w, xs),
                        QuantType::Q2K => kquant::<kq::Q2, M>(w, xs),
                        QuantType::Q3K => kquant::<kq::Q3, M>(w, xs),
                        QuantType::Q4K => kquant::<kq::Q4, M>(w, xs),
                        QuantType::Q5K => kquant::<kq::Q5, M>(w, xs),
                        QuantType::Q6K => kquant::<kq::Q6, M>(w, xs),
                        QuantType::F32 | QuantType::F16 | QuantType::BF16 => unreachable!("row_dots: float type"),
                    }
                }
            }

            /// `out[i] = Σ_e w[e] x_i[e]` for one weight row `w` (whole blocks of the quantized
            /// type `t`) and the activation rows `xs` (Q8_0 / Q8_K to match `t`), 4, 2 or 1 rows
            /// at a time.
            ///
            /// # Safety
            /// The CPU must have `$features`. (Operands are checked.)
            pub(crate) unsafe fn row_dots(t: QuantType, w: &[u8], xs: &[XRow<'_>], out: &mut [f32]) {
                super::check(t, w, xs, out);
                let mut i = 0;
                while i < xs.len() {
                    // SAFETY: `check` verified the operands; the caller, the CPU.
                    unsafe {
                        match xs.len() - i {
                            1 => out[i] = rows_m::<1>(t, w, &[xs[i]])[0],
                            2 | 3 => {
                                out[i..i + 2].copy_from_slice(&rows_m::<2>(t, w, &[xs[i], xs[i + 1]]));
                                i += 1;
                            }
                            _ => {
                                let x4 = [xs[i], xs[i + 1], xs[i + 2], xs[i + 3]];
                                out[i..i + 4].copy_from_slice(&rows_m::<4>(t, w, &x4));
                                i += 3;
                            }
                        }
                    }
                    i += 1;
                }
            }
        }
    };
}

/// Checks what the kernels rely on: `w` whole blocks of the quantized type `t`, each activation
/// row as long as `w` with its scales (and sums), one output per activation row.
fn check(t: QuantType, w: &[u8], xs: &[XRow<'_>], out: &[f32]) {
    let (bb, be) = (t.block_bytes(), t.block_elems());
    let nb = w.len() / bb;
    assert!(!t.is_float() && w.len() == nb * bb && xs.len() == out.len(), "row_dots: operands");
    for x in xs {
        assert!(x.qs.len() == nb * be && x.d.len() >= nb, "row_dots: activations");
        if t.is_k_quant() {
            assert!(x.bsums.len() == 16 * nb, "row_dots: activation sums");
        } else {
            assert!(x.sx.len() >= nb, "row_dots: activation sums");
        }
    }
}

isa_entry!(avx2, "avx2,fma,f16c", super::super::simd::Avx2);
isa_entry!(vnni, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni", super::super::simd::Vnni);
