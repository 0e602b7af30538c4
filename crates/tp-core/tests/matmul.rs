//! Host matmul against an independent float64 reference, at shapes off every tile multiple.

mod common;
use common::*;
use tp_core::cpu::{CpuKernel, with_kernel};
use tp_core::{DType, Device, Tensor, WeightLayout};

const SIZES: [usize; 5] = [1, 3, 17, 64, 129];
const CPU: Device = Device::Cpu;

fn check(m: usize, k: usize, n: usize, dtype: DType, layout: WeightLayout, with_bias: bool, seed: u64) {
    check_matmul(CPU, m, k, n, dtype, layout, with_bias, seed);
}

#[test]
fn matmul_matches_f64_reference_at_every_size_and_dtype() {
    let mut seed = 100;
    for dtype in DType::FLOATS {
        for m in SIZES {
            for k in SIZES {
                for n in SIZES {
                    for layout in [WeightLayout::Nk, WeightLayout::Kn] {
                        seed += 3;
                        check(m, k, n, dtype, layout, seed % 2 == 0, seed);
                    }
                }
            }
        }
    }
}

/// The size sweep, the decode shapes (M up to 8, threaded and not), both layouts and the bias,
/// on every host kernel family this machine can run, each forced with `with_kernel`. A family
/// the CPU lacks is reported as NOT TESTED and does not count; the portable one always runs.
#[test]
fn every_available_cpu_kernel_matches_reference() {
    let mut tested = Vec::new();
    for kernel in CpuKernel::ALL {
        let run = || {
            println!("host kernel {kernel}: running the sweep");
            let mut seed = 1000;
            for dtype in DType::FLOATS {
                for m in SIZES {
                    for k in SIZES {
                        for n in SIZES {
                            for layout in [WeightLayout::Nk, WeightLayout::Kn] {
                                seed += 3;
                                check(m, k, n, dtype, layout, seed % 2 == 0, seed);
                            }
                        }
                    }
                }
                for (m, k, n) in [(5, 1031, 301), (8, 47, 2053), (2, 4099, 67), (9, 301, 517), (263, 67, 129)] {
                    seed += 3;
                    check(m, k, n, dtype, WeightLayout::Nk, true, seed);
                    check(m, k, n, dtype, WeightLayout::Kn, false, seed + 1);
                }
            }
        };
        match with_kernel(kernel, run) {
            Ok(()) => tested.push(kernel),
            Err(e) => println!("NOT TESTED: host kernel {kernel}: {e}"),
        }
    }
    println!("host kernels tested: {tested:?}");
    assert!(tested.contains(&CpuKernel::Portable) && tested.contains(&CpuKernel::AmxEmulated), "{tested:?}");
    assert_eq!(tested.len(), CpuKernel::available().len(), "every available family must run");
}

#[test]
fn large_threaded_shapes_match_reference() {
    // Big enough to split the host GEMM by rows and by columns, off tile sizes; and the decode
    // path (M <= 8), threaded by output columns.
    for (m, k, n) in [(263, 301, 257), (5, 1031, 1543), (1, 517, 1031), (4, 333, 901)] {
        check(m, k, n, DType::F32, WeightLayout::Nk, true, 7);
        check(m, k, n, DType::BF16, WeightLayout::Nk, false, 8);
    }
    // f16/bf16 widen the weight in K blocks of at most 2048 (fewer for wide weights): K = 3001
    // with N = 2100 takes two blocks, in both layouts.
    for dtype in [DType::BF16, DType::F16] {
        check(7, 3001, 2100, dtype, WeightLayout::Nk, true, 9);
        check(7, 3001, 2100, dtype, WeightLayout::Kn, false, 10);
    }
}

#[test]
fn small_integers_are_exact_in_f32() {
    let (m, k, n) = (37, 129, 65);
    let x = Tensor::rand_int(&[m, k], DType::F32, -4, 4, 1, &CPU).unwrap();
    let w = Tensor::rand_int(&[n, k], DType::F32, -4, 4, 2, &CPU).unwrap();
    assert_nonzero(&x);
    let (want, _) = matmul_f64(&f64s(&x), &f64s(&w), m, k, n, true);
    assert_eq!(f64s(&x.matmul_t(&w).unwrap()), want);
}

#[test]
fn leading_dims_are_flattened_into_m() {
    let x = Tensor::randn(&[2, 3, 17, 33], DType::F32, 5, &CPU).unwrap();
    let w = Tensor::randn(&[19, 33], DType::F32, 6, &CPU).unwrap();
    let y = x.matmul_t(&w).unwrap();
    assert_eq!(y.dims(), &[2, 3, 17, 19]);
    let flat = x.reshape(&[102, 33]).unwrap().matmul_t(&w).unwrap();
    assert_eq!(f64s(&y), f64s(&flat));
    // A 1-D x is one row.
    let v = Tensor::randn(&[33], DType::F32, 7, &CPU).unwrap();
    let y = v.matmul_t(&w).unwrap();
    assert_eq!(y.dims(), &[19]);
    let (want, abs) = matmul_f64(&f64s(&v), &f64s(&w), 1, 33, 19, true);
    assert_close("1-D x", &f64s(&y), &want, |i| matmul_tol(DType::F32, 33, want[i], abs[i]));
}

#[test]
fn nk_and_kn_layouts_agree() {
    let x = Tensor::randn(&[17, 64], DType::F32, 9, &CPU).unwrap();
    let w_nk = Tensor::randn(&[129, 64], DType::F32, 10, &CPU).unwrap();
    // Transpose by hand: w_kn[l, j] = w_nk[j, l].
    let v = f64s(&w_nk);
    let w_kn = Tensor::from_fn_f64(&[64, 129], DType::F32, &CPU, |i| v[(i % 129) * 64 + i / 129]).unwrap();
    let (a, b) = (f64s(&x.matmul_t(&w_nk).unwrap()), f64s(&x.matmul(&w_kn).unwrap()));
    let (want, abs) = matmul_f64(&f64s(&x), &v, 17, 64, 129, true);
    assert_close("nk", &a, &want, |i| matmul_tol(DType::F32, 64, want[i], abs[i]));
    assert_close("kn", &b, &want, |i| matmul_tol(DType::F32, 64, want[i], abs[i]));
}

#[test]
fn empty_dimensions_give_empty_or_bias_only_results() {
    let w = Tensor::randn(&[5, 0], DType::F32, 1, &CPU).unwrap();
    let x = Tensor::randn(&[3, 0], DType::F32, 2, &CPU).unwrap();
    let b = Tensor::randn(&[5], DType::F32, 3, &CPU).unwrap();
    // K = 0: the product is all zeros, plus the bias when given.
    assert_eq!(f64s(&x.matmul_t(&w).unwrap()), vec![0.0; 15]);
    let with_bias = f64s(&x.linear(&w, Some(&b)).unwrap());
    let bv = f64s(&b);
    assert_eq!(with_bias, (0..15).map(|i| bv[i % 5]).collect::<Vec<_>>());
    // M = 0.
    let x = Tensor::randn(&[0, 4], DType::BF16, 4, &CPU).unwrap();
    let w = Tensor::randn(&[6, 4], DType::BF16, 5, &CPU).unwrap();
    assert_eq!(x.matmul_t(&w).unwrap().dims(), &[0, 6]);
}
