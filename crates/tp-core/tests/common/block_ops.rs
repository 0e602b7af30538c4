//! Checks of the ops the model families beyond Llama need (RMSNorm's three weight styles and
//! an outside statistic, per-row sums of squares, GeGLU, the scalar scale, soft-capping)
//! against float64 references with each op's rounding points, written once and run on every
//! device: the host suite calls them with `Device::Cpu`, the GPU suite with `Device::Cuda(0)`.

use super::decoder::{norm_row, round_to, rstd, ulp};
use super::{assert_close, f64s};
use tp_core::{Activation, DType, Device, NormStyle, Tensor};
use tp_testing::reference::ops::{act_f64, up_f64};

fn on(t: &Tensor, device: Device) -> Tensor {
    t.to_device(&device).expect("to device")
}

/// RMSNorm in `style` against f64 with the style's rounding points; with `outside`, each row's
/// mean of squares comes from a sum over `n > h` features (the rest on other ranks).
pub fn check_norm_style(device: Device, (rows, h): (usize, usize), dtype: DType, style: NormStyle, outside: bool) {
    let seed = 40 + h as u64;
    let x = Tensor::randn(&[rows, h], dtype, seed, &Device::Cpu).unwrap();
    let w = Tensor::randn(&[h], dtype, seed + 1, &Device::Cpu).unwrap();
    let eps = 1e-6;
    let (xv, wv) = (f64s(&x), f64s(&w));
    // The outside statistic: the row's own squares plus those of 2h more features elsewhere.
    let n = if outside { 3 * h } else { h };
    let others = f64s(&Tensor::randn(&[rows, 2 * h], DType::F32, seed + 2, &Device::Cpu).unwrap());
    let sums: Vec<f64> = (0..rows)
        .map(|r| {
            let own: f64 = xv[r * h..(r + 1) * h].iter().map(|v| v * v).sum();
            own + if outside { others[r * 2 * h..(r + 1) * 2 * h].iter().map(|v| v * v).sum() } else { 0.0 }
        })
        .collect();
    let stats = Tensor::from_vec(sums.iter().map(|&s| s as f32).collect::<Vec<f32>>(), &[rows], &Device::Cpu).unwrap();
    let (xd, wd, sd) = (on(&x, device), on(&w, device), on(&stats, device));
    let y = xd.rms_norm_with(&wd, eps, style, outside.then_some((&sd, n))).unwrap();
    assert_eq!((y.dims(), y.dtype()), (x.dims(), dtype));
    let mut want = Vec::with_capacity(rows * h);
    for (r, row) in xv.chunks(h).enumerate() {
        want.extend(norm_row(row, &wv, rstd(f64::from(sums[r] as f32), n, eps), style, Some(dtype)));
    }
    let ulps = if dtype == DType::F32 { 8.0 } else { 1.0 };
    assert_close(&format!("rms_norm {style:?} outside {outside} {device} {rows}x{h} {dtype}"), &f64s(&y), &want, |i| {
        ulps * ulp(dtype, want[i])
    });
}

/// Per-row sums of squares (f32) against f64.
pub fn check_sum_squares(device: Device, (rows, h): (usize, usize), dtype: DType) {
    let x = Tensor::randn(&[rows, h], dtype, 50 + h as u64, &Device::Cpu).unwrap();
    let s = on(&x, device).sum_squares().unwrap();
    assert_eq!((s.dims(), s.dtype()), (&[rows][..], DType::F32));
    let want: Vec<f64> = f64s(&x).chunks(h).map(|r| r.iter().map(|v| v * v).sum()).collect();
    assert_close(&format!("sum_squares {device} {rows}x{h} {dtype}"), &f64s(&s), &want, |i| {
        (h as f64 + 2.0) * f64::from(f32::EPSILON) * want[i]
    });
}

/// `act(gate) * up` on `[gate | up]` rows against f64: `round(round(act(g)) · u)`.
pub fn check_glu(device: Device, (rows, inner): (usize, usize), dtype: DType, act: Activation) {
    let x = Tensor::randn(&[rows, 2 * inner], dtype, 60 + inner as u64, &Device::Cpu).unwrap();
    let y = on(&x, device).glu(act).unwrap();
    assert_eq!(y.dims(), &[rows, inner]);
    let xv = f64s(&x);
    let f = |g: f64| act_f64(act, g);
    let pairs: Vec<(f64, f64)> =
        xv.chunks(2 * inner).flat_map(|r| (0..inner).map(move |j| (r[j], r[inner + j]))).collect();
    let want: Vec<f64> =
        pairs.iter().map(|&(g, u)| round_to(dtype, round_to(dtype, f(g)) * round_to(dtype, up_f64(act, u)))).collect();
    // The activation in f32 may round to the neighbouring value of the dtype: 2 ulps of the
    // product (half types), a few f32 ulps (expf, tanhf); GELU's `1 + tanh(..)` cancels for
    // negative gates, so its f32 error is relative to `|g·u|`, not to the result.
    let ulps = if dtype == DType::F32 { 16.0 } else { 2.0 };
    assert_close(&format!("glu {act:?} {device} {rows}x{inner} {dtype}"), &f64s(&y), &want, |i| {
        let (g, u) = pairs[i];
        ulps * ulp(dtype, want[i]) + 8.0 * f64::from(f32::EPSILON) * (g * u).abs()
    });
}

/// `round(x · round(s))` and soft-capping `round(round(tanh(round(x / c))) · c)` against f64.
pub fn check_scale_softcap(device: Device, n: usize, dtype: DType) {
    let x = Tensor::randn(&[n], dtype, 70 + n as u64, &Device::Cpu).unwrap();
    let x = x.scale(6.0).unwrap(); // logits of a few units, so the cap bends them
    let xv = f64s(&x);
    let s = 48f64.sqrt();
    let y = on(&x, device).scale(s as f32).unwrap();
    let want: Vec<f64> = xv.iter().map(|v| round_to(dtype, v * round_to(dtype, f64::from(s as f32)))).collect();
    assert_close(&format!("scale {device} {dtype}"), &f64s(&y), &want, |i| ulp(dtype, want[i]));
    let cap = 5.0f32;
    let c = f64::from(cap);
    let y = on(&x, device).softcap(cap).unwrap();
    let want: Vec<f64> =
        xv.iter().map(|v| round_to(dtype, round_to(dtype, round_to(dtype, v / c).tanh()) * c)).collect();
    let ulps = if dtype == DType::F32 { 8.0 } else { 2.0 };
    assert_close(&format!("softcap {device} {dtype}"), &f64s(&y), &want, |i| ulps * ulp(dtype, want[i]));
    assert!(f64s(&y).iter().all(|v| v.abs() <= c), "soft-capped values stay within the cap");
}

/// Every check above on `device`, for every float dtype.
pub fn check_block_ops(device: Device) {
    for dtype in DType::FLOATS {
        for shape in [(1, 2), (3, 17), (5, 130), (2, 4099)] {
            for style in [NormStyle::Weight, NormStyle::OnePlusWeight, NormStyle::WeightF32] {
                check_norm_style(device, shape, dtype, style, false);
                check_norm_style(device, shape, dtype, style, true);
            }
            check_sum_squares(device, shape, dtype);
            check_glu(device, shape, dtype, Activation::Silu);
            check_glu(device, shape, dtype, Activation::GeluTanh);
            // gpt-oss's, with a low clamp so that randn's gates and ups reach it.
            check_glu(device, shape, dtype, Activation::ClampedSwiglu { alpha: 1.702, limit: 1.0 });
        }
        check_scale_softcap(device, 1000, dtype);
    }
}
