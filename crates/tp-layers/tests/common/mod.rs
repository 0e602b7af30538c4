//! Shared helpers: tolerances and loading; the random layers, the float64 references and the
//! ranks as threads are tp-testing's.
#![allow(dead_code, unused_imports)] // each test binary uses some of the helpers

use tp_core::{DType, Device, Tensor};
use tp_layers::Linear;
pub use tp_testing::ranks::on_ranks;
pub use tp_testing::reference::block::{MlpRef, f64s, layer_abs, mlp_f64, random_linear as linear};

pub const CPU: Device = Device::Cpu;

/// `(y, abs)`: `y = x W^T + b` in f64 and `Σ|x w| + |b|` per element, for `x: [m, k]`.
pub fn linear_f64(x: &Tensor, l: &Linear) -> (Vec<f64>, Vec<f64>) {
    layer_abs(&f64s(x), l)
}

/// Bound for a product rounded to `dtype` (and, for row-parallel, partials rounded before the
/// sum): `2u·Σ|x w| + u|y| + (k + 2)·2^-24·Σ|x w|` plus f16's half subnormal gap.
pub fn tol(dtype: DType, k: usize, y: f64, abs: f64) -> f64 {
    let u = dtype.unit_roundoff();
    2.0 * u * abs + u * y.abs() + (k as f64 + 2.0) * 2f64.powi(-24) * abs + 2f64.powi(-24)
}

pub fn assert_close(what: &str, got: &[f64], want: &[f64], tol: impl Fn(usize) -> f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for i in 0..got.len() {
        assert!(
            (got[i] - want[i]).abs() <= tol(i),
            "{what}: element {i}: got {} want {} tol {}",
            got[i],
            want[i],
            tol(i)
        );
    }
}

/// The SwiGLU MLP under `prefix` of `ckpt`, loaded for `g` with Hugging Face's names.
pub fn load_mlp(
    ckpt: &tp_layers::Checkpoint,
    prefix: &str,
    g: &tp_comm::DeviceGroup,
) -> tp_layers::Result<tp_layers::ParallelMlp> {
    let ld = tp_layers::Loader::new(ckpt, g, tp_layers::LoadOptions::new()).pp(prefix);
    tp_layers::ParallelMlp::load(&ld, tp_layers::MlpNames::default(), tp_core::Activation::Silu)
}
