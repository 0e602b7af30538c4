//! `matmul_tn` (`y = a^T · op(W)`, `a` given as `[k, m]`): every available kernel family, f32
//! and bf16, both weight layouts, shapes off every tile multiple, against a float64 loop over
//! the same (rounded) operands.

mod common;

use common::Rng;
use half::bf16;
use std::mem::MaybeUninit;
use tp_cpu::{CpuKernel, Float, GemmShape, Layout, matmul_tn, matmul_tn_acc, with_kernel};

fn run<T: Float>(a: &[T], w: &[T], layout: Layout, shape: GemmShape) -> Vec<f32> {
    let mut y = vec![MaybeUninit::<f32>::uninit(); shape.m * shape.n];
    matmul_tn(a, w, layout, None, shape, &mut y).unwrap();
    // SAFETY: matmul_tn succeeded, so it wrote all m * n outputs.
    y.into_iter().map(|v| unsafe { v.assume_init() }).collect()
}

/// `matmul_tn_acc` into a start of `3 (i - j) / (m + n)`, less that start: the product alone.
fn run_acc<T: Float>(a: &[T], w: &[T], layout: Layout, shape: GemmShape) -> Vec<f32> {
    let start = |i: usize| {
        let (r, c) = (i / shape.n, i % shape.n);
        3.0 * (r as f32 - c as f32) / (shape.m + shape.n) as f32
    };
    let mut y: Vec<f32> = (0..shape.m * shape.n).map(start).collect();
    matmul_tn_acc(a, w, layout, shape, &mut y).unwrap();
    y.iter().enumerate().map(|(i, v)| v - start(i)).collect()
}

fn check<T: Float>(rng: &mut Rng, conv: impl Fn(f32) -> T, back: impl Fn(T) -> f64, tol: f64) {
    // (70, 45, 1056): on AMX the transposed copy is read in place, over three depth blocks.
    for &(m, n, k) in &[(37, 53, 61), (1, 17, 5), (64, 48, 256), (131, 9, 300), (5, 200, 3), (70, 45, 1056)] {
        let a: Vec<T> = (0..k * m).map(|_| conv(rng.unit())).collect();
        for layout in [Layout::Kn, Layout::Nk] {
            let w: Vec<T> = (0..k * n).map(|_| conv(rng.unit())).collect();
            let shape = GemmShape { m, n, k };
            let kernels =
                [CpuKernel::Portable, CpuKernel::Avx2, CpuKernel::Avx512, CpuKernel::Avx512Bf16, CpuKernel::Amx];
            let runs = kernels.into_iter().filter(|k| k.is_available()).flat_map(|k| [(k, false), (k, true)]);
            for (kernel, acc) in runs {
                let y =
                    with_kernel(
                        kernel,
                        || {
                            if acc { run_acc(&a, &w, layout, shape) } else { run(&a, &w, layout, shape) }
                        },
                    )
                    .unwrap();
                for i in 0..m {
                    for j in 0..n {
                        let want: f64 = (0..k)
                            .map(|t| {
                                let wv = match layout {
                                    Layout::Kn => w[t * n + j],
                                    Layout::Nk => w[j * k + t],
                                };
                                back(a[t * m + i]) * back(wv)
                            })
                            .sum();
                        let got = f64::from(y[i * n + j]);
                        assert!(
                            (got - want).abs() <= tol * (k as f64).sqrt(),
                            "{kernel:?} {layout:?} accumulate {acc} {m}x{n}x{k} [{i}][{j}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn matmul_tn_matches_float64_on_every_kernel() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    check::<f32>(&mut rng, |v| v, f64::from, 1e-5);
    check::<bf16>(&mut rng, bf16::from_f32, |v| f64::from(v.to_f32()), 1e-5);
}

#[test]
fn matmul_tn_checks_lengths() {
    let a = vec![0f32; 10];
    let mut y = vec![MaybeUninit::<f32>::uninit(); 6];
    assert!(matmul_tn(&a, &[0f32; 9], Layout::Kn, None, GemmShape { m: 2, n: 3, k: 4 }, &mut y).is_err());
}
