//! `matmul_rounded` / `matmul_packed_rounded` against `matmul` / `matmul_packed` rounded after
//! with `half`'s own conversion (round to nearest even): bitwise the same, on every kernel family
//! this machine runs, for f16 and bf16, both layouts, with and without bias, at decode and
//! GEMM row counts, shapes off every tile multiple (and k a multiple of 32, where AMX reads x in
//! place), and lengths checked before anything is written.

mod common;

use half::{bf16, f16};
use std::mem::MaybeUninit;
use tp_cpu::{
    CpuKernel, Error, Float, GemmShape, Layout, PackedWeight, matmul, matmul_packed, matmul_packed_rounded,
    matmul_rounded, set_batch_invariant, with_kernel,
};

/// `len` values in [-4, 4) from seed `seed` (inexact in every dtype, so rounding shows).
fn random<T: Float>(len: usize, seed: u64, make: impl Fn(f32) -> T) -> Vec<T> {
    let mut rng = common::Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    (0..len).map(|_| make(4.0 * rng.unit())).collect()
}

fn init<T: Copy>(y: Vec<MaybeUninit<T>>) -> Vec<T> {
    // SAFETY: only called after a successful product, which wrote every element.
    y.into_iter().map(|v| unsafe { v.assume_init() }).collect()
}

const SHAPES: [(usize, usize, usize); 5] = [(3, 37, 211), (33, 75, 129), (70, 45, 1024), (64, 131, 1500), (97, 33, 64)];

fn case<T: Float + PartialEq + std::fmt::Debug>(make: impl Fn(f32) -> T + Copy, round: impl Fn(f32) -> T) {
    for (i, &(m, n, k)) in SHAPES.iter().enumerate() {
        let shape = GemmShape { m, n, k };
        let x = random(m * k, 1 + i as u64, make);
        let w = random(n * k, 100 + i as u64, make);
        let b: Vec<f32> = (0..n).map(|j| j as f32 * 0.25 - 3.0).collect();
        for layout in [Layout::Nk, Layout::Kn] {
            for bias in [None, Some(&b[..])] {
                let mut y32 = vec![MaybeUninit::new(0f32); m * n];
                matmul(&x, &w, layout, bias, shape, &mut y32).unwrap();
                let want: Vec<T> = init(y32).into_iter().map(&round).collect();
                let mut y = vec![MaybeUninit::uninit(); m * n];
                matmul_rounded(&x, &w, layout, bias, shape, &mut y).unwrap();
                let ctx = (layout, m, n, k, bias.is_some(), CpuKernel::current());
                assert_eq!(init(y), want, "matmul_rounded {ctx:?}");
            }
        }
        let p = PackedWeight::new(&w, n, k).unwrap();
        let mut y32 = vec![MaybeUninit::new(0f32); m * n];
        matmul_packed(&x, &w, &p, Some(&b), shape, &mut y32).unwrap();
        let want: Vec<T> = init(y32).into_iter().map(&round).collect();
        let mut y = vec![MaybeUninit::uninit(); m * n];
        matmul_packed_rounded(&x, &w, &p, Some(&b), shape, &mut y).unwrap();
        assert_eq!(init(y), want, "matmul_packed_rounded {m}x{n}x{k} {}", CpuKernel::current());
    }
}

#[test]
fn rounded_products_are_matmul_rounded_after_on_every_kernel() {
    for kernel in CpuKernel::available() {
        with_kernel(kernel, || {
            for invariant in [false, true] {
                set_batch_invariant(invariant);
                case(bf16::from_f32, bf16::from_f32);
                case(f16::from_f32, f16::from_f32);
            }
            set_batch_invariant(false);
        })
        .unwrap();
    }
}

#[test]
fn wrong_lengths_are_errors_before_anything_is_written() {
    let (x, w) = (vec![bf16::ONE; 6], vec![bf16::ONE; 12]);
    let mut y = vec![MaybeUninit::new(bf16::from_f32(7.0)); 7];
    let shape = GemmShape { m: 2, n: 4, k: 3 };
    let e = matmul_rounded(&x, &w, Layout::Nk, None, shape, &mut y).unwrap_err();
    assert!(matches!(e, Error::OperandLength { operand: "y", expected: 8, got: 7 }), "{e}");
    assert!(init(y).iter().all(|v| v.to_f32() == 7.0));
    let p = PackedWeight::new(&[bf16::ONE; 15], 5, 3).unwrap();
    let mut y = vec![MaybeUninit::uninit(); 8];
    let e = matmul_packed_rounded(&x, &w, &p, None, shape, &mut y).unwrap_err();
    assert!(matches!(e, Error::PackedMismatch { .. }), "{e}");
}
