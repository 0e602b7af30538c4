//! The rope scalings `linear`, `dynamic` and `yarn`: frequencies and attention factor against
//! float64 formulas, the rotation against the f64 reference at every dtype (dynamic scaling
//! also past `max_position_embeddings`). Reading transformers' parameter names, and the
//! frequencies against transformers' own values, are tp-models' tests (`rope_kinds.rs`).

mod common;
use common::decoder::*;
use tp_core::{DType, Device, Error, RopeScaling, RotaryEmbedding, Tensor};

const CPU: Device = Device::Cpu;

fn linear(factor: f64) -> RopeScaling {
    RopeScaling::Linear { factor }
}

fn dynamic(factor: f64, max_position_embeddings: f64) -> RopeScaling {
    RopeScaling::Dynamic { factor, max_position_embeddings }
}

/// YaRN with transformers' defaults (beta 32/1, truncated ramp, attention factor from `factor`).
fn yarn(factor: f64, original: f64) -> RopeScaling {
    tp_testing::reference::ops::yarn_defaults(factor, original)
}

/// YaRN of `factor` over `original` with the ramp between `beta_fast` and `beta_slow`.
fn yarn_beta(factor: f64, original: f64, (beta_fast, beta_slow): (f64, f64), truncate: bool) -> RopeScaling {
    match yarn(factor, original) {
        RopeScaling::Yarn { attention_factor, .. } => RopeScaling::Yarn {
            factor,
            original_max_position_embeddings: original,
            beta_fast,
            beta_slow,
            truncate,
            attention_factor,
        },
        other => other,
    }
}

/// `got` (f32) within `ulps` ulps of the f64 value, relative, plus `|ln f|` ulps for the f32
/// exponent `2i/D` of `base^(2i/D)` (exact only when `D` is a power of two).
fn assert_freqs(what: &str, got: &[f32], want: &[f64], ulps: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let tol = (ulps + w.ln().abs()) * 2f64.powi(-24) * w;
        assert!((f64::from(g) - w).abs() <= tol, "{what}: frequency {i}: {g} vs {w} (tol {tol})");
    }
}

#[test]
fn linear_divides_every_frequency_by_the_factor() {
    for (d, theta, factor) in [(2, 10_000.0, 2.0), (10, 10_000.0, 4.0), (64, 500_000.0, 8.0), (128, 1e6, 2.5)] {
        let rope = RotaryEmbedding::new(d, theta, linear(factor)).unwrap();
        let want: Vec<f64> = (0..d / 2).map(|i| theta.powf(-((2 * i) as f64) / d as f64) / factor).collect();
        assert_freqs(&format!("linear d{d} factor {factor}"), rope.inv_freq(), &want, 4.0);
        assert_eq!(rope.attention_scaling(), 1.0);
        assert_eq!(rope.inv_freq_for(1 << 20).as_ref(), rope.inv_freq(), "linear does not depend on the length");
    }
}

#[test]
fn dynamic_rescales_the_base_only_past_max_position_embeddings() {
    for (d, theta, factor, m) in [(4, 10_000.0, 2.0, 16.0), (10, 10_000.0, 4.0, 64.0), (128, 500_000.0, 8.0, 4096.0)] {
        let s = dynamic(factor, m);
        let rope = RotaryEmbedding::new(d, theta, s.clone()).unwrap();
        let plain = RotaryEmbedding::new(d, theta, RopeScaling::Default).unwrap();
        // Within the trained length: the unscaled frequencies, bit for bit.
        assert_eq!(rope.inv_freq(), plain.inv_freq());
        for len in [0, 1, m as usize - 1, m as usize] {
            assert_eq!(rope.inv_freq_for(len).as_ref(), plain.inv_freq(), "length {len}");
        }
        for len in [m as usize + 1, m as usize + 7, 3 * m as usize, 40 * m as usize] {
            let l = len as f64;
            let base = theta * (factor * l / m - (factor - 1.0)).powf(d as f64 / (d as f64 - 2.0));
            let want: Vec<f64> = (0..d / 2).map(|i| base.powf(-((2 * i) as f64) / d as f64)).collect();
            assert_eq!(want, inv_freq_f64_at(d, theta, &s, len));
            // The f32 base: 4 roundings, the subtraction's cancellation amplifying them ~factor times.
            assert_freqs(&format!("dynamic d{d} len {len}"), &rope.inv_freq_for(len), &want, 8.0 + 4.0 * factor);
            assert!(rope.inv_freq_for(len)[d / 2 - 1] < plain.inv_freq()[d / 2 - 1], "a longer context lowers f");
        }
        assert_eq!(rope.attention_scaling(), 1.0);
    }
    let e = RotaryEmbedding::new(2, 10_000.0, dynamic(2.0, 16.0)).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "D/(D-2) with D = 2: {e}");
    assert!(RotaryEmbedding::new(8, 10_000.0, dynamic(2.0, 16.5)).is_err(), "fractional max_position_embeddings");
}

#[test]
fn yarn_ramps_between_extrapolation_and_interpolation() {
    for (d, theta, factor, orig) in [(16, 10_000.0, 4.0, 64.0), (64, 500_000.0, 8.0, 2048.0), (128, 1e6, 4.0, 32_768.0)]
    {
        let s = yarn(factor, orig);
        let rope = RotaryEmbedding::new(d, theta, s.clone()).unwrap();
        // Written again here from the YaRN paper's ramp, transformers' defaults (beta 32/1).
        let pair = |r: f64| d as f64 * (orig / (2.0 * std::f64::consts::PI * r)).ln() / (2.0 * theta.ln());
        let (lo, hi) = (pair(32.0).floor().max(0.0), pair(1.0).ceil().min(d as f64 - 1.0));
        let want: Vec<f64> = (0..d / 2)
            .map(|i| {
                let f = theta.powf(-((2 * i) as f64) / d as f64);
                let ramp = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
                f * (1.0 - ramp) + f / factor * ramp
            })
            .collect();
        assert_freqs(&format!("yarn d{d}"), rope.inv_freq(), &want, 8.0);
        assert_freqs(&format!("yarn d{d} (shared reference)"), rope.inv_freq(), &inv_freq_f64(d, theta, &s), 8.0);
        // The highest frequencies untouched, the lowest divided by the factor.
        let plain = RotaryEmbedding::new(d, theta, RopeScaling::Default).unwrap();
        assert_eq!(rope.inv_freq()[0], plain.inv_freq()[0]);
        let last = d / 2 - 1;
        assert!((f64::from(rope.inv_freq()[last]) * factor / f64::from(plain.inv_freq()[last]) - 1.0).abs() < 1e-6);
        // mscale: 0.1 ln(factor) + 1, rounded to f32 as transformers' f32 product rounds it.
        assert_eq!(rope.attention_scaling(), (0.1 * factor.ln() + 1.0) as f32);
        assert_eq!(rope.inv_freq_for(1 << 20).as_ref(), rope.inv_freq(), "yarn does not depend on the length");
    }
    // A degenerate ramp (lo == hi == 0 after clamping: transformers adds 0.001) and an
    // untruncated, custom-beta ramp.
    let s = yarn(2.0, 4.0);
    assert_freqs(
        "yarn short",
        RotaryEmbedding::new(8, 10_000.0, s.clone()).unwrap().inv_freq(),
        &inv_freq_f64(8, 10_000.0, &s),
        8.0,
    );
    let s = yarn_beta(3.7, 512.0, (16.0, 2.0), true);
    let untruncated = yarn_beta(3.7, 512.0, (16.0, 2.0), false);
    for s in [s.clone(), untruncated.clone()] {
        let got = RotaryEmbedding::new(24, 12_345.678, s.clone()).unwrap();
        assert_freqs(&format!("{s:?}"), got.inv_freq(), &inv_freq_f64(24, 12_345.678, &s), 8.0);
    }
    assert_ne!(
        RotaryEmbedding::new(24, 12_345.678, s).unwrap().inv_freq(),
        RotaryEmbedding::new(24, 12_345.678, untruncated).unwrap().inv_freq()
    );
}

#[test]
fn rope_with_linear_dynamic_and_yarn_matches_the_rotation() {
    // Positions within and far past the trained lengths (64 for dynamic, 64 for yarn).
    let far = [0, 1, 2, 7, 100, 4097];
    for dtype in DType::FLOATS {
        for d in [4, 10, 64, 128] {
            check_rope(CPU, &far, 3, d, linear(4.0), dtype, d as u64);
            check_rope(CPU, &far, 3, d, yarn(4.0, 64.0), dtype, 1 + d as u64);
            check_rope(CPU, &far, 3, d, dynamic(4.0, 64.0), dtype, 2 + d as u64);
            // A decode step just past the trained length, and a prefill exactly filling it.
            check_rope(CPU, &[64], 2, d, dynamic(4.0, 64.0), dtype, 3 + d as u64);
            check_rope(CPU, &[0, 5, 63], 2, d, dynamic(4.0, 64.0), dtype, 4 + d as u64);
        }
    }
}

#[test]
fn dynamic_rope_uses_each_calls_length() {
    let (m, d) = (16usize, 32);
    let rope = RotaryEmbedding::new(d, 10_000.0, dynamic(2.0, m as f64)).unwrap();
    let plain = RotaryEmbedding::new(d, 10_000.0, RopeScaling::Default).unwrap();
    let x = Tensor::randn(&[40, 2, d], DType::F32, 9, &CPU).unwrap();
    // Within the trained length it is plain RoPE, bit for bit.
    let short: Vec<usize> = (0..m).collect();
    let xs = x.narrow(0, 0, m).unwrap();
    assert_eq!(xs.rope(&short, &rope).unwrap(), xs.rope(&short, &plain).unwrap());
    // Past it, a decode step at L equals row L of a prefill over 0..=L (the same length), and
    // differs from row L of a longer prefill (whose base is larger).
    let all: Vec<usize> = (0..40).collect();
    let long = x.rope(&all, &rope).unwrap();
    for l in [m, m + 3, 30] {
        let upto: Vec<usize> = (0..=l).collect();
        let prefill = x.narrow(0, 0, l + 1).unwrap().rope(&upto, &rope).unwrap();
        let step = x.narrow(0, l, 1).unwrap().rope(&[l], &rope).unwrap();
        assert_eq!(step, prefill.narrow(0, l, 1).unwrap(), "position {l}");
        assert_ne!(step, long.narrow(0, l, 1).unwrap(), "position {l} in a 40-token call");
    }
    // cos_sin is a decode step's: position p with the frequencies of p + 1 tokens.
    let p = 30;
    let f = rope.inv_freq_for(p + 1);
    let angle = f64::from(p as f32 * f[3]);
    assert_eq!(rope.cos_sin(p, 3), (angle.cos() as f32, angle.sin() as f32));
}

#[test]
fn yarn_scales_cos_and_sin_before_rounding() {
    let s = yarn(16.0, 64.0);
    let rope = RotaryEmbedding::new(8, 10_000.0, s).unwrap();
    let m = rope.attention_scaling();
    assert_eq!(m, (0.1 * 16f64.ln() + 1.0) as f32);
    for (p, i) in [(0, 0), (5, 1), (1000, 3)] {
        let angle = f64::from(p as f32 * rope.inv_freq()[i]);
        assert_eq!(rope.cos_sin(p, i), ((angle.cos() as f32) * m, (angle.sin() as f32) * m));
    }
    // Position 0 of x = e_0 in bf16: y = round_bf16(round_f32(cos 0 · m)) = round_bf16(m).
    let mut v = vec![0.0f32; 8];
    v[0] = 1.0;
    let x = Tensor::from_vec(v, &[1, 1, 8], &CPU).unwrap().to_dtype(DType::BF16).unwrap();
    let y = x.rope(&[0], &rope).unwrap().to_f64_vec().unwrap();
    assert_eq!(y[0], tp_core::bf16::from_f32(m).to_f64());
}
