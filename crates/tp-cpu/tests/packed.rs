//! `matmul_packed` against `matmul`: bitwise the same products, on every kernel family this
//! machine runs, in every element type.
//!
//! The packed path is observed from outside by handing `matmul_packed` a decoy `w` (zeros) next
//! to the weight packed from the real one: where the GEMM reads the packed panels the result is
//! `matmul` of the real weight, where it falls back (few rows, another kernel) `matmul` of the
//! decoy.

use half::{bf16, f16};
use std::mem::MaybeUninit;
use tp_cpu::{
    CpuKernel, Error, Float, FloatKind, GemmShape, Layout, PackedWeight, matmul, matmul_packed, set_batch_invariant,
    with_kernel,
};

/// Random values in [-1, 1) (inexact in every dtype, so any change in the order of sums shows).
fn random<T: Float>(len: usize, seed: u64, make: impl Fn(f32) -> T) -> Vec<T> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            make(((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
        })
        .collect()
}

fn bits(y: Vec<MaybeUninit<f32>>) -> Vec<u32> {
    // SAFETY: only called after a successful product, which wrote every element (they were
    // initialised anyway).
    y.into_iter().map(|v| unsafe { v.assume_init() }.to_bits()).collect()
}

/// `matmul` with an `[N, K]` weight, as bits.
fn plain<T: Float>(x: &[T], w: &[T], bias: Option<&[f32]>, shape: GemmShape) -> Vec<u32> {
    let mut y = vec![MaybeUninit::new(f32::NAN); shape.m * shape.n];
    matmul(x, w, Layout::Nk, bias, shape, &mut y).unwrap();
    bits(y)
}

/// `matmul_packed`, as bits.
fn packed<T: Float>(x: &[T], w: &[T], p: &PackedWeight, bias: Option<&[f32]>, shape: GemmShape) -> Vec<u32> {
    let mut y = vec![MaybeUninit::new(f32::NAN); shape.m * shape.n];
    matmul_packed(x, w, p, bias, shape, &mut y).unwrap();
    bits(y)
}

/// Shapes off every tile multiple (MR 4/6/8/32, NR 16/48/32): odd `n` and `k`, `k` spanning
/// several depth blocks (512 `f32` lanes, 1024 elements in pairs) in two of them.
const SHAPES: [(usize, usize, usize); 4] = [(9, 37, 2101), (17, 101, 611), (33, 75, 129), (64, 131, 1500)];

/// One product: `matmul_packed` with the decoy against `matmul` with the real weight.
fn bitwise_case<T: Float>(make: impl Fn(f32) -> T + Copy, shape: GemmShape, with_bias: bool) {
    let GemmShape { m, n, k } = shape;
    let x = random(m * k, 1 + m as u64, make);
    let w = random(n * k, 2 + n as u64, make);
    let decoy = vec![make(0.0); n * k];
    let b: Vec<f32> = random(n, 3, |v| v);
    let bias = with_bias.then_some(&b[..]);
    let p = PackedWeight::new(&w, n, k).unwrap();
    let (got, want) = (packed(&x, &decoy, &p, bias, shape), plain(&x, &w, bias, shape));
    let first_diff = got.iter().zip(&want).position(|(a, b)| a != b);
    let case = (T::KIND, m, n, k, with_bias, CpuKernel::current());
    assert_eq!(first_diff, None, "{case:?}: first differing element");
}

/// Every kernel family, dtype and shape, with and without bias: bitwise `matmul`, and the
/// weight's panels come from the packed form (the decoy is never read).
#[test]
fn packed_products_are_bitwise_matmul_on_every_kernel() {
    for kernel in CpuKernel::available() {
        with_kernel(kernel, || {
            for (i, &(m, n, k)) in SHAPES.iter().enumerate() {
                let shape = GemmShape { m, n, k };
                // Bias on alternate shapes and dtypes: both cases on every kernel, half the cost.
                bitwise_case(|v| v, shape, i % 2 == 0);
                bitwise_case(f16::from_f32, shape, i % 2 == 1);
                bitwise_case(bf16::from_f32, shape, i % 2 == 0);
            }
        })
        .unwrap();
    }
}

/// Few rows run the decode kernel on `w` (the decoy), as `matmul` does; on a batch-invariant
/// thread they run the GEMM on the packed panels, bitwise as `matmul` there.
#[test]
fn few_rows_take_the_gemv_unless_batch_invariant() {
    let (n, k) = (45, 333);
    let w = random(n * k, 7, bf16::from_f32);
    let decoy = random(n * k, 8, bf16::from_f32);
    let p = PackedWeight::new(&w, n, k).unwrap();
    for m in [1, 3, 8] {
        let shape = GemmShape { m, n, k };
        let x = random(m * k, 9, bf16::from_f32);
        assert_eq!(packed(&x, &decoy, &p, None, shape), plain(&x, &decoy, None, shape), "m = {m}");
        set_batch_invariant(true);
        let got = packed(&x, &decoy, &p, None, shape);
        let want = plain(&x, &w, None, shape);
        set_batch_invariant(false);
        assert_eq!(got, want, "batch-invariant m = {m}");
    }
    // Batch-invariant and many rows: still the packed panels, still bitwise.
    set_batch_invariant(true);
    let shape = GemmShape { m: 20, n, k };
    let x = random(20 * k, 10, bf16::from_f32);
    let (got, want) = (packed(&x, &decoy, &p, Some(&[0.5; 45]), shape), plain(&x, &w, Some(&[0.5; 45]), shape));
    set_batch_invariant(false);
    assert_eq!(got, want);
}

/// A weight packed for one micro-kernel (the AMX tiles, modelled) used under another (portable
/// `f32`): the product falls back to `matmul` on `w`.
#[test]
fn a_weight_packed_for_another_kernel_falls_back_to_matmul() {
    let shape = GemmShape { m: 12, n: 50, k: 70 };
    let w = random(50 * 70, 11, bf16::from_f32);
    let decoy = random(50 * 70, 12, bf16::from_f32);
    let x = random(12 * 70, 13, bf16::from_f32);
    let p = with_kernel(CpuKernel::AmxEmulated, || PackedWeight::new(&w, 50, 70).unwrap()).unwrap();
    let (got, want) =
        with_kernel(CpuKernel::Portable, || (packed(&x, &decoy, &p, None, shape), plain(&x, &decoy, None, shape)))
            .unwrap();
    assert_eq!(got, want);
    // Under the kernel it was packed for, the packed panels are used.
    let (got, want) =
        with_kernel(CpuKernel::AmxEmulated, || (packed(&x, &decoy, &p, None, shape), plain(&x, &w, None, shape)))
            .unwrap();
    assert_eq!(got, want);
}

/// Portable `f32` panels are 16 columns wide and `K` deep (5 blocks of at most 432, 2101 in
/// all, no padding): 112 x 2101 lanes for `n = 101`.
#[test]
fn bytes_count_the_padded_panels() {
    let w = vec![0f32; 101 * 2101];
    let p = with_kernel(CpuKernel::Portable, || PackedWeight::new(&w, 101, 2101).unwrap()).unwrap();
    assert_eq!(p.bytes(), 112 * 2101 * 4);
}

#[test]
fn k_zero_writes_the_bias() {
    let p = PackedWeight::new::<f32>(&[], 2, 0).unwrap();
    assert_eq!(p.bytes(), 0);
    let shape = GemmShape { m: 10, n: 2, k: 0 };
    let want = [1.5f32, -2.0].repeat(10).iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(packed::<f32>(&[], &[], &p, Some(&[1.5, -2.0]), shape), want);
}

#[test]
fn bad_inputs_are_errors() {
    let w = vec![bf16::ZERO; 6 * 4];
    assert_eq!(
        PackedWeight::new(&w[..23], 6, 4).unwrap_err(),
        Error::OperandLength { operand: "w", expected: 24, got: 23 }
    );
    assert_eq!(PackedWeight::new(&w, usize::MAX, 2).unwrap_err(), Error::ShapeOverflow { m: 0, n: usize::MAX, k: 2 });

    let p = PackedWeight::new(&w, 6, 4).unwrap();
    let x = vec![bf16::ZERO; 9 * 4];
    let mut y = vec![MaybeUninit::uninit(); 9 * 6];
    let shape = GemmShape { m: 9, n: 6, k: 4 };
    let err = matmul_packed(&x[..35], &w, &p, None, shape, &mut y).unwrap_err();
    assert_eq!(err, Error::OperandLength { operand: "x", expected: 36, got: 35 });
    let err = matmul_packed(&x, &w, &p, Some(&[0.0; 5]), shape, &mut y).unwrap_err();
    assert_eq!(err, Error::OperandLength { operand: "bias", expected: 6, got: 5 });

    // Another shape with the same number of weight elements, another dtype.
    let other = GemmShape { m: 9, n: 4, k: 6 };
    let (x6, mut y4) = (vec![bf16::ZERO; 9 * 6], vec![MaybeUninit::uninit(); 9 * 4]);
    let err = matmul_packed(&x6, &w, &p, None, other, &mut y4).unwrap_err();
    let wanted = (FloatKind::BF16, 4, 6);
    assert_eq!(err, Error::PackedMismatch { packed: (FloatKind::BF16, 6, 4), wanted });
    let (xf, wf) = (vec![0f32; 9 * 4], vec![0f32; 6 * 4]);
    let err = matmul_packed(&xf, &wf, &p, None, shape, &mut y).unwrap_err();
    assert_eq!(err, Error::PackedMismatch { packed: (FloatKind::BF16, 6, 4), wanted: (FloatKind::F32, 6, 4) });
}
