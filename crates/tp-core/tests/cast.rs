//! Dtype casts: exact widening, round-to-nearest-even narrowing, one rounding only.

mod common;
use common::*;
use tp_core::{DType, Device, Tensor, bf16, f16};

const CPU: Device = Device::Cpu;

fn cast_f32(values: &[f32], to: DType) -> Vec<f64> {
    let t = Tensor::from_slice(values, &[values.len()], &CPU).unwrap();
    f64s(&t.to_dtype(to).unwrap())
}

#[test]
fn f32_to_f16_rounds_to_nearest_even() {
    let ulp = 2f32.powi(-10); // f16 spacing in [1, 2)
    let got = cast_f32(
        &[1.0 + ulp / 2.0, 1.0 + 1.5 * ulp, 1.0 + 0.75 * ulp, 1.0 + 0.25 * ulp, 65520.0, -65519.0],
        DType::F16,
    );
    let want = [1.0, 1.0 + 2.0 * ulp as f64, 1.0 + ulp as f64, 1.0, f64::INFINITY, -65504.0];
    assert_eq!(got, want);
}

#[test]
fn f32_to_bf16_rounds_to_nearest_even() {
    let ulp = 2f32.powi(-7); // bf16 spacing in [1, 2)
    let got = cast_f32(&[1.0 + ulp / 2.0, 1.0 + 1.5 * ulp, 1.0 + 0.51 * ulp, -3.0 - ulp / 2.0], DType::BF16);
    let want = [1.0, 1.0 + 2.0 * ulp as f64, 1.0 + ulp as f64, -3.0];
    assert_eq!(got, want);
}

#[test]
fn widening_is_exact_and_round_trips() {
    for dtype in [DType::F16, DType::BF16] {
        let t = Tensor::randn(&[3, 129], dtype, 4, &CPU).unwrap();
        let wide = t.to_dtype(DType::F32).unwrap();
        assert_eq!(f64s(&wide), f64s(&t));
        assert_eq!(wide.to_dtype(dtype).unwrap(), t);
    }
}

#[test]
fn f16_to_bf16_rounds_once() {
    // Every f16 value is exact in f32, so f16 -> bf16 must equal bf16::from_f64 of the exact value.
    let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).filter(|v| v.is_finite()).collect();
    let t = Tensor::from_slice(&all, &[all.len()], &CPU).unwrap();
    let got = t.to_dtype(DType::BF16).unwrap().to_vec::<bf16>().unwrap();
    for (a, g) in all.iter().zip(&got) {
        assert_eq!(g.to_bits(), bf16::from_f64(f64::from(a.to_f32())).to_bits(), "{a}");
    }
}

#[test]
fn random_casts_are_within_half_an_ulp() {
    let t = Tensor::randn(&[1000], DType::F32, 9, &CPU).unwrap();
    let v = f64s(&t);
    for to in [DType::F16, DType::BF16] {
        let got = f64s(&t.to_dtype(to).unwrap());
        assert_close("cast", &got, &v, |i| to.unit_roundoff() * v[i].abs() + 2f64.powi(-25));
    }
}

#[test]
fn bulk_bf16_conversion_matches_scalar_rounding_on_edge_patterns() {
    // Ties, near-ties, the largest finite values (which round to infinity), subnormals, NaN.
    let mut values = vec![f32::MAX, -f32::MAX, f32::MIN_POSITIVE, 1e-40, -1e-42, 0.0, -0.0, f32::INFINITY];
    for base in [0x3f80_0000u32, 0x4049_0fdb, 0x7f7f_0000, 0x0080_0000] {
        for low in [0x7fff, 0x8000, 0x8001, 0x18000, 0x17fff, 0xffff] {
            values.push(f32::from_bits(base | low));
        }
    }
    // And a spread of about a million bit patterns across every exponent.
    values.extend((0..u32::MAX / 4093).map(|i| f32::from_bits(i * 4093)).filter(|v| !v.is_nan()));
    let t = Tensor::from_slice(&values, &[values.len()], &CPU).unwrap();
    let got = t.to_dtype(DType::BF16).unwrap().to_vec::<bf16>().unwrap();
    for (v, g) in values.iter().zip(&got) {
        assert_eq!(g.to_bits(), bf16::from_f32(*v).to_bits(), "{v:e} ({:#x})", v.to_bits());
    }
    let nan = Tensor::from_slice(&[f32::NAN], &[1], &CPU).unwrap().to_dtype(DType::BF16).unwrap();
    assert!(nan.to_vec::<bf16>().unwrap()[0].is_nan());
}
