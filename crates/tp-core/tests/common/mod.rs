//! Helpers shared by the integration tests: an independent float64 reference and tolerances.
#![allow(dead_code)]

pub mod block_ops;
pub mod decoder;
pub mod paged;
pub mod paged_gpu;
pub mod quant;
pub mod sampling;

use tp_core::{DType, Device, Tensor, WeightLayout};
#[allow(unused_imports)] // each test binary uses some
pub use tp_testing::reference::ops::matmul_f64;

/// The start of every GPU suite: sticky CUDA errors explained on panic, a device and the
/// compiled kernels required (a suite FAILS, never skips, without them), allocations poisoned
/// (NaN) so that an element a kernel does not write shows.
pub fn gpu_setup() {
    tp_kernels::note_sticky_errors_on_panic();
    let n = tp_kernels::device_count().expect("the GPU suite needs a CUDA device and driver");
    assert!(n > 0, "no CUDA device");
    assert!(tp_kernels::NOT_COMPILED.is_none(), "kernels not compiled: {:?}", tp_kernels::NOT_COMPILED);
    tp_kernels::set_poison_allocations(true);
}

/// Error bound of an f32-accumulated dot product of length `k` rounded once to `dtype`:
/// `u_dtype·|ref| + (k + 2)·2^-24·Σ|x·w|` (the standard `γ_k` bound plus the output rounding),
/// plus half the subnormal spacing of `dtype`, where relative rounding no longer holds.
pub fn matmul_tol(dtype: DType, k: usize, reference: f64, abs_sum: f64) -> f64 {
    let half_subnormal_gap = match dtype {
        DType::F16 => 2f64.powi(-25),
        DType::BF16 | DType::F32 => 2f64.powi(-150),
        DType::I32 | DType::I64 => 0.0,
    };
    dtype.unit_roundoff() * reference.abs()
        + (k as f64 + 2.0) * DType::F32.unit_roundoff() * abs_sum
        + half_subnormal_gap
}

/// Asserts every element of `got` is within `tol(i)` of `want[i]`; reports the first failure.
pub fn assert_close(what: &str, got: &[f64], want: &[f64], tol: impl Fn(usize) -> f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let t = tol(i);
        assert!((g - w).abs() <= t, "{what}: element {i}: got {g}, want {w}, |diff| {} > tol {t}", (g - w).abs());
    }
}

/// The tensor's elements as f64, panicking on error (tests only).
pub fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_f64_vec().expect("to_f64_vec")
}

/// Asserts the data is not degenerate (random tests must not run on all zeros).
pub fn assert_nonzero(t: &Tensor) {
    let v = f64s(t);
    assert!(v.iter().filter(|x| **x != 0.0).count() * 2 >= v.len(), "test data is mostly zeros");
}

/// One `matmul_layout` on `device` (random `x: [m, k]`, weight in `layout`, optional bias, all
/// of `dtype`, made on the host and moved over) against the f64 reference, every element.
#[allow(clippy::too_many_arguments)]
pub fn check_matmul(
    device: Device,
    m: usize,
    k: usize,
    n: usize,
    dtype: DType,
    layout: WeightLayout,
    with_bias: bool,
    seed: u64,
) {
    let cpu = Device::Cpu;
    let x = Tensor::randn(&[m, k], dtype, seed, &cpu).unwrap();
    let w_dims = match layout {
        WeightLayout::Nk => [n, k],
        WeightLayout::Kn => [k, n],
    };
    let w = Tensor::randn(&w_dims, dtype, seed + 1, &cpu).unwrap();
    let b = Tensor::randn(&[n], dtype, seed + 2, &cpu).unwrap();
    let on = |t: &Tensor| t.to_device(&device).unwrap();
    let bias = with_bias.then(|| on(&b));
    let y = on(&x).matmul_layout(&on(&w), layout, bias.as_ref()).unwrap().to_device(&cpu).unwrap();
    assert_eq!(y.dims(), &[m, n]);
    assert_eq!(y.dtype(), dtype);

    let (mut want, abs) = matmul_f64(&f64s(&x), &f64s(&w), m, k, n, layout == WeightLayout::Nk);
    if with_bias {
        let bv = f64s(&b);
        want.iter_mut().enumerate().for_each(|(i, v)| *v += bv[i % n]);
    }
    let what = format!("{device} {m}x{k}x{n} {dtype} {layout:?} bias={with_bias}");
    assert_close(&what, &f64s(&y), &want, |i| matmul_tol(dtype, k + 1, want[i], abs[i] + want[i].abs()));
}
