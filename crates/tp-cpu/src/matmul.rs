//! The public products: [`matmul`] checks the buffers against the shape, then runs the decode
//! kernel ([`crate::gemv`]) for few rows against an `[N, K]` weight and the packed GEMM
//! ([`crate::gemm`]) otherwise (always, on a thread made batch-invariant), with the
//! micro-kernel the calling thread's [`CpuKernel`] picks for the element type.
//! [`matmul_packed`] is the same product with the weight's panels packed once beforehand
//! ([`PackedWeight`]).

use crate::dispatch::CpuKernel;
use crate::element::Float;
use crate::error::{Error, Result};
use crate::gemm::{self, ASource, BSource, Micro};
use crate::gemv;
use crate::packed::PackedWeight;
use crate::shape::{GemmShape, Layout};
use std::cell::Cell;
use std::mem::MaybeUninit;

thread_local! {
    static BATCH_INVARIANT: Cell<bool> = const { Cell::new(false) };
}

/// Makes this thread's products batch-invariant (`true`) or not (the default): every product
/// then runs on the packed GEMM, never the few-row GEMV, whose `f32` sums run in another order.
/// The packed GEMM sums each output over `k` in the same order whatever `m` and wherever the row
/// sits, so a row's result no longer depends on how many rows share its product. Small-`m`
/// products cost more (the weight is packed on every call).
pub fn set_batch_invariant(on: bool) {
    BATCH_INVARIANT.with(|b| b.set(on));
}

/// Whether this thread's products are batch-invariant ([`set_batch_invariant`]).
pub fn batch_invariant() -> bool {
    BATCH_INVARIANT.with(Cell::get)
}

/// `y = x · op(W) + bias` in `f32`: `x` is `m x k` row-major, `w` is `n x k` ([`Layout::Nk`],
/// `op(W) = W^T`) or `k x n` ([`Layout::Kn`]), `bias` has `n` entries, `y` is `m x n`
/// row-major. `f16`/`bf16` operands are multiplied exactly (widened, or in `vdpbf16ps` /
/// `tdpbf16ps` / `tdpfp16ps` pairs) and accumulated in `f32`. `y` need not be initialised: on
/// success every one of its `m * n` elements has been written (with `k = 0`, the bias or zero).
///
/// Errors: [`Error::ShapeOverflow`] if a buffer size of the shape overflows `usize`;
/// [`Error::OperandLength`] if a buffer's length is not what the shape needs.
pub fn matmul<T: Float>(
    x: &[T],
    w: &[T],
    layout: Layout,
    bias: Option<&[f32]>,
    shape: GemmShape,
    y: &mut [MaybeUninit<f32>],
) -> Result<()> {
    check_lengths(x, w, bias, shape, y.len())?;
    let GemmShape { m, n, k } = shape;
    if k == 0 {
        for row in y.chunks_exact_mut(n.max(1)) {
            match bias {
                Some(b) => row.iter_mut().zip(b).for_each(|(o, &v)| *o = MaybeUninit::new(v)),
                None => row.fill(MaybeUninit::new(0.0)),
            }
        }
        return Ok(());
    }
    let kernel = CpuKernel::current();
    if decodes(layout, m) {
        gemv::gemv(kernel, x, w, bias, m, k, n, y);
    } else {
        gemm::gemm(Micro::choose(kernel, T::KIND), ASource::Rows(x), BSource::Pack(w, layout), bias, m, k, n, y);
    }
    Ok(())
}

/// [`matmul`] with an `[N, K]` weight ([`Layout::Nk`]) that was also packed once into `packed`
/// (from this same `w`): the same result, bitwise, without packing W on the call. Few rows (not
/// batch-invariant) still run the decode kernel on `w`; the packed GEMM reads W's panels from
/// `packed` when it was built for the micro-kernel this thread's [`CpuKernel`] picks for `T`,
/// and otherwise (another family chosen since, e.g. under [`crate::with_kernel`]) the call is a
/// plain [`matmul`], which packs `w`.
///
/// Errors: those of [`matmul`]; [`Error::PackedMismatch`] if `packed` holds another element
/// type or another `[n, k]` than the call's.
pub fn matmul_packed<T: Float>(
    x: &[T],
    w: &[T],
    packed: &PackedWeight,
    bias: Option<&[f32]>,
    shape: GemmShape,
    y: &mut [MaybeUninit<f32>],
) -> Result<()> {
    check_lengths(x, w, bias, shape, y.len())?;
    let GemmShape { m, n, k } = shape;
    let (kind, pn, pk) = packed.dims();
    if (kind, pn, pk) != (T::KIND, n, k) {
        return Err(Error::PackedMismatch { packed: (kind, pn, pk), wanted: (T::KIND, n, k) });
    }
    let micro = Micro::choose(CpuKernel::current(), T::KIND);
    match packed.panels(micro) {
        Some(panels) if k > 0 && !decodes(Layout::Nk, m) => {
            gemm::gemm(micro, ASource::Rows(x), BSource::Packed(panels), bias, m, k, n, y);
            Ok(())
        }
        _ => matmul(x, w, Layout::Nk, bias, shape, y),
    }
}

/// Whether an `m`-row product with a weight in `layout` runs the decode kernel (few rows of an
/// `[N, K]` weight, not batch-invariant) rather than the packed GEMM.
fn decodes(layout: Layout, m: usize) -> bool {
    layout == Layout::Nk && m <= gemv::MAX_ROWS && !batch_invariant()
}

/// [`matmul`] with the sums rounded once (to nearest even) to `T` into `y`, bitwise
/// `matmul` followed by [`Float::narrow_slice`], but without an `f32` copy of the whole
/// product: the packed GEMM rounds each panel's block of sums as soon as it is final, while it
/// is still in cache. Same contract and errors as [`matmul`] (`y`'s length checked as `m * n`).
pub fn matmul_rounded<T: Float>(
    x: &[T],
    w: &[T],
    layout: Layout,
    bias: Option<&[f32]>,
    shape: GemmShape,
    y: &mut [MaybeUninit<T>],
) -> Result<()> {
    rounded(x, w, bias, shape, y, |y32| matmul(x, w, layout, bias, shape, y32), BSource::Pack(w, layout))
}

/// [`matmul_packed`] rounded as [`matmul_rounded`] rounds [`matmul`].
pub fn matmul_packed_rounded<T: Float>(
    x: &[T],
    w: &[T],
    packed: &PackedWeight,
    bias: Option<&[f32]>,
    shape: GemmShape,
    y: &mut [MaybeUninit<T>],
) -> Result<()> {
    let micro = Micro::choose(CpuKernel::current(), T::KIND);
    let GemmShape { n, k, .. } = shape;
    let panels = match packed.panels(micro) {
        Some(p) if packed.dims() == (T::KIND, n, k) => p,
        // Not built for this kernel (or mismatched, which matmul_packed reports): no panels.
        _ => return rounded_via_f32(shape, y, |y32| matmul_packed(x, w, packed, bias, shape, y32)),
    };
    rounded(x, w, bias, shape, y, |y32| matmul_packed(x, w, packed, bias, shape, y32), BSource::Packed(panels))
}

/// The packed GEMM rounding into `y` where [`matmul`] would run it, else `f32` sums from
/// `plain` rounded after.
fn rounded<T: Float>(
    x: &[T],
    w: &[T],
    bias: Option<&[f32]>,
    shape: GemmShape,
    y: &mut [MaybeUninit<T>],
    plain: impl FnOnce(&mut [MaybeUninit<f32>]) -> Result<()>,
    b: BSource<'_, T>,
) -> Result<()> {
    check_lengths(x, w, bias, shape, y.len())?;
    let GemmShape { m, n, k } = shape;
    let layout = match b {
        BSource::Pack(_, layout) => layout,
        BSource::Packed(_) => Layout::Nk,
    };
    if k == 0 || m == 0 || n == 0 || decodes(layout, m) {
        return rounded_via_f32(shape, y, plain);
    }
    let micro = Micro::choose(CpuKernel::current(), T::KIND);
    gemm::gemm_dest(micro, ASource::Rows(x), b, bias, m, k, n, gemm::Dest::Rounded(y));
    Ok(())
}

/// `f32` sums from `plain`, rounded into `y` (few rows, `k = 0`, or no panels to read).
fn rounded_via_f32<T: Float>(
    GemmShape { m, n, .. }: GemmShape,
    y: &mut [MaybeUninit<T>],
    plain: impl FnOnce(&mut [MaybeUninit<f32>]) -> Result<()>,
) -> Result<()> {
    let mut y32: Vec<f32> = Vec::with_capacity(m * n);
    plain(&mut y32.spare_capacity_mut()[..m * n])?;
    // SAFETY: `plain` (a product with `matmul`'s contract) succeeded, so it wrote every one of
    // the `m * n` elements.
    unsafe { y32.set_len(m * n) };
    T::narrow_slice(&y32, y);
    Ok(())
}

/// `y = a^T · op(W) + bias` for `a` given as `[k, m]` row-major (so `a^T` is the `m x k`
/// operand): the weight gradient `dW = dY^T X` of `Y = X W^T` is `matmul_tn(dY, X, Kn, ..)`
/// with `dY: [T, out]` (`k = T`, `m = out`) and `X: [T, in]` read as a `[K, N]` weight. The
/// packed GEMM packs `a`'s panels straight from its columns, so no transposed copy is made
/// (on AMX, whose tiles take rows, `a` is transposed into a scratch copy first). Same contract
/// and errors as [`matmul`] otherwise (`a`'s length is checked as `m * k`).
pub fn matmul_tn<T: Float>(
    a: &[T],
    w: &[T],
    layout: Layout,
    bias: Option<&[f32]>,
    shape: GemmShape,
    y: &mut [MaybeUninit<f32>],
) -> Result<()> {
    check_lengths(a, w, bias, shape, y.len())?;
    let GemmShape { m, n, k } = shape;
    if k == 0 || m == 0 || n == 0 {
        // Nothing is read from `a`: the plain product gives the bias (or zeros).
        return matmul(a, w, layout, bias, shape, y);
    }
    tn_gemm(a, w, layout, bias, shape, y, false);
    Ok(())
}

/// The GEMM of [`matmul_tn`] (storing) and [`matmul_tn_acc`] (`accumulate`): `a`'s panels
/// packed from its columns; or as `y^T = op(W)^T a` written back transposed, on AMX (whose
/// tiles take rows along k) and for tall products (`m >= 4n`, where `a` is the big operand);
/// or on AMX from a transposed copy of `a`. `m`, `n` and `k` nonzero; lengths checked.
fn tn_gemm<T: Float>(
    a: &[T],
    w: &[T],
    layout: Layout,
    bias: Option<&[f32]>,
    GemmShape { m, n, k }: GemmShape,
    y: &mut [MaybeUninit<f32>],
    accumulate: bool,
) {
    let micro = Micro::choose(CpuKernel::current(), T::KIND);
    let amx = matches!(micro, Micro::Amx { .. });
    // `y^T = op(W)^T a`, written back transposed: AMX tiles take their left operand by rows
    // along k, where `a` has its columns, and an `[N, K]` weight's rows already run along k
    // while a `[K, N]` one is transposed, the smaller copy when `n < m`; on the vector kernels,
    // for a tall product (`m >= 4n`, a weight gradient against a vocabulary's worth of rows)
    // the big `a` then streams through the tasks' L2-sized panels instead of being packed
    // whole, and the small operand is packed once.
    let transposed = bias.is_none() && if amx { layout == Layout::Nk || n < m } else { 4 * n <= m };
    if transposed {
        let yt = |wt: ASource<'_, T>, y: &mut [MaybeUninit<f32>]| {
            let dest = gemm::Dest::F32T { y, accumulate };
            gemm::gemm_dest(micro, wt, BSource::Pack(a, Layout::Kn), None, n, k, m, dest)
        };
        match (layout, amx) {
            (Layout::Nk, _) => yt(ASource::Rows(w), y),
            (Layout::Kn, false) => yt(ASource::Cols(w), y),
            (Layout::Kn, true) => crate::transpose::with_transposed(w, k, n, |wt| yt(ASource::Rows(wt), y)),
        }
    } else if amx {
        crate::transpose::with_transposed(a, k, m, |t| {
            gemm::gemm_into(micro, ASource::Rows(t), BSource::Pack(w, layout), bias, m, k, n, y, accumulate)
        });
    } else {
        gemm::gemm_into(micro, ASource::Cols(a), BSource::Pack(w, layout), bias, m, k, n, y, accumulate);
    }
}

/// `y += a^T · op(W)` into an initialised `y: [m, n]`: [`matmul_tn`] accumulating in place (the
/// GEMM's first depth block adds into `y` as the later ones do), for a weight gradient summed
/// over chunks or micro-batches without an `[m, n]` temporary. `k = 0` adds nothing.
///
/// Errors: those of [`matmul_tn`].
pub fn matmul_tn_acc<T: Float>(a: &[T], w: &[T], layout: Layout, shape: GemmShape, y: &mut [f32]) -> Result<()> {
    // SAFETY: `MaybeUninit<f32>` has `f32`'s layout, and every value the GEMM writes through
    // this view is an initialised `f32` (it reads `y` and stores sums), so `y` stays initialised.
    let view = unsafe { std::slice::from_raw_parts_mut(y.as_mut_ptr().cast::<MaybeUninit<f32>>(), y.len()) };
    check_lengths(a, w, None, shape, view.len())?;
    let GemmShape { m, n, k } = shape;
    if k == 0 || m == 0 || n == 0 {
        return Ok(());
    }
    tn_gemm(a, w, layout, None, shape, view, true);
    Ok(())
}

/// Checks every buffer's length against `shape` (an `[N, K]` or `[K, N]` weight alike).
fn check_lengths<T>(x: &[T], w: &[T], bias: Option<&[f32]>, shape: GemmShape, y_len: usize) -> Result<()> {
    let GemmShape { m, n, k } = shape;
    let size = |a: usize, b: usize| a.checked_mul(b).ok_or(Error::ShapeOverflow { m, n, k });
    let lengths = [
        ("x", x.len(), size(m, k)?),
        ("w", w.len(), size(n, k)?),
        ("y", y_len, size(m, n)?),
        ("bias", bias.map_or(n, <[f32]>::len), n),
    ];
    match lengths.iter().find(|(_, got, want)| got != want) {
        Some(&(operand, got, expected)) => Err(Error::OperandLength { operand, expected, got }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn run<T: Float>(x: &[T], w: &[T], layout: Layout, bias: Option<&[f32]>, shape: GemmShape) -> Result<Vec<f32>> {
        let mut y = vec![MaybeUninit::new(f32::NAN); shape.m * shape.n];
        matmul(x, w, layout, bias, shape, &mut y)?;
        // SAFETY: `matmul` succeeded, so every element was written (they were initialised anyway).
        Ok(y.into_iter().map(|v| unsafe { v.assume_init() }).collect())
    }

    /// Both layouts, the decode and the packed path, with and without bias, in every element
    /// type on every kernel family this machine runs (the AMX model included), against a plain
    /// triple loop in `f64` on small integers (every product and sum exact in `f32`).
    #[test]
    fn products_match_a_triple_loop_on_every_kernel() {
        fn check<T: Float>(make: impl Fn(f32) -> T) {
            // (45, 70, 1024): AMX reads x in place (k a multiple of 32) over two depth blocks, the
            // last 13 rows packed.
            for (m, n, k) in [(1, 5, 3), (8, 17, 33), (9, 17, 33), (40, 70, 100), (45, 70, 1024)] {
                let x: Vec<T> = (0..m * k).map(|i| make(((i * 7 + 3) % 9) as f32 - 4.0)).collect();
                let w: Vec<T> = (0..n * k).map(|i| make(((i * 5 + 1) % 7) as f32 - 3.0)).collect();
                let b: Vec<f32> = (0..n).map(|j| j as f32 - 2.0).collect();
                for layout in [Layout::Nk, Layout::Kn] {
                    let at = |j: usize, l: usize| if layout == Layout::Nk { w[j * k + l] } else { w[l * n + j] };
                    for bias in [None, Some(&b[..])] {
                        let got = run(&x, &w, layout, bias, GemmShape { m, n, k }).unwrap();
                        for i in 0..m {
                            for j in 0..n {
                                let dot = (0..k).map(|l| f64::from(x[i * k + l].widen()) * f64::from(at(j, l).widen()));
                                let want = dot.sum::<f64>() + bias.map_or(0.0, |b| f64::from(b[j]));
                                let case = (T::KIND, layout, m, n, k, i, j, CpuKernel::current());
                                assert_eq!(f64::from(got[i * n + j]), want, "{case:?}");
                            }
                        }
                    }
                }
            }
        }
        for kernel in CpuKernel::available() {
            crate::with_kernel(kernel, || {
                check(|v| v);
                check(half::f16::from_f32);
                check(bf16::from_f32);
            })
            .unwrap();
        }
    }

    #[test]
    fn k_zero_writes_the_bias_or_zeros() {
        let shape = GemmShape { m: 3, n: 2, k: 0 };
        assert_eq!(run::<bf16>(&[], &[], Layout::Nk, Some(&[1.5, -2.0]), shape).unwrap(), [1.5, -2.0].repeat(3));
        assert_eq!(run::<f32>(&[], &[], Layout::Kn, None, shape).unwrap(), vec![0.0; 6]);
    }

    #[test]
    fn wrong_lengths_and_overflow_are_errors() {
        let shape = GemmShape { m: 2, n: 3, k: 4 };
        let (x, w) = (vec![0f32; 8], vec![0f32; 12]);
        let err = |x: &[f32], w: &[f32], bias: Option<&[f32]>, y: usize, shape| {
            matmul(x, w, Layout::Nk, bias, shape, &mut vec![MaybeUninit::uninit(); y]).unwrap_err()
        };
        assert_eq!(err(&x[..7], &w, None, 6, shape), Error::OperandLength { operand: "x", expected: 8, got: 7 });
        assert_eq!(err(&x, &w[..11], None, 6, shape), Error::OperandLength { operand: "w", expected: 12, got: 11 });
        assert_eq!(err(&x, &w, None, 5, shape), Error::OperandLength { operand: "y", expected: 6, got: 5 });
        let bias = Some(&[0f32; 2][..]);
        assert_eq!(err(&x, &w, bias, 6, shape), Error::OperandLength { operand: "bias", expected: 3, got: 2 });
        let huge = GemmShape { m: usize::MAX, n: 2, k: 2 };
        assert_eq!(err(&x, &w, None, 6, huge), Error::ShapeOverflow { m: usize::MAX, n: 2, k: 2 });
    }
    /// On a batch-invariant thread, a row's output is bitwise the same at every `m` (1..=40) and
    /// at every position among the rows, in each element type, on random (inexact) data; off, the
    /// few-row path and the packed GEMM may differ (that is what the setting is for).
    #[test]
    fn batch_invariant_products_give_each_row_the_same_bits() {
        fn check<T: Float>(make: impl Fn(f32) -> T) {
            let (n, k) = (37, 301);
            let mut s = 0x9E37_79B9_7F4A_7C15u64;
            let mut rnd = || {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            };
            let rows: Vec<Vec<T>> = (0..40).map(|_| (0..k).map(|_| make(rnd())).collect()).collect();
            let w: Vec<T> = (0..n * k).map(|_| make(rnd())).collect();
            set_batch_invariant(true);
            let alone = run(&rows[0], &w, Layout::Nk, None, GemmShape { m: 1, n, k }).unwrap();
            for m in 1..=40 {
                // Row 0's data at position m - 1 of an m-row product.
                let mut x: Vec<T> = Vec::new();
                for i in 0..m {
                    x.extend_from_slice(&rows[(i + 1) % 40 * usize::from(i + 1 != m)]);
                }
                let got = run(&x, &w, Layout::Nk, None, GemmShape { m, n, k }).unwrap();
                let row = &got[(m - 1) * n..m * n];
                assert!(row.iter().zip(&alone).all(|(a, b)| a.to_bits() == b.to_bits()), "m = {m}");
            }
            set_batch_invariant(false);
        }
        check(|v| v);
        check(bf16::from_f32);
        check(half::f16::from_f32);
    }
}
