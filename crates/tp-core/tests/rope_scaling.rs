//! The Hugging Face rope kinds `linear`, `dynamic` and `yarn`: frequencies and attention factor
//! against float64 formulas and against transformers' own values, the rotation against the f64
//! reference at every dtype (dynamic scaling also past `max_position_embeddings`), and the
//! parameters `RopeScaling::from_kind` reads.

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
    RopeScaling::from_kind("yarn", |k| match k {
        "factor" => Some(factor),
        "original_max_position_embeddings" => Some(original),
        _ => None,
    })
    .unwrap()
}

/// A parameter reader over `(name, value)` pairs.
fn params(kv: &[(&'static str, f64)]) -> impl Fn(&str) -> Option<f64> + use<> {
    let kv = kv.to_vec();
    move |name| kv.iter().find(|(k, _)| *k == name).map(|&(_, v)| v)
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
            assert_eq!(want, inv_freq_f64_at(d, theta, s.clone(), len));
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
        assert_freqs(&format!("yarn d{d} (shared reference)"), rope.inv_freq(), &inv_freq_f64(d, theta, s), 8.0);
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
    let s =
        RopeScaling::from_kind("yarn", params(&[("factor", 2.0), ("original_max_position_embeddings", 4.0)])).unwrap();
    assert_freqs(
        "yarn short",
        RotaryEmbedding::new(8, 10_000.0, s.clone()).unwrap().inv_freq(),
        &inv_freq_f64(8, 10_000.0, s),
        8.0,
    );
    let s = RopeScaling::from_kind(
        "yarn",
        params(&[
            ("factor", 3.7),
            ("original_max_position_embeddings", 512.0),
            ("beta_fast", 16.0),
            ("beta_slow", 2.0),
        ]),
    )
    .unwrap();
    let untruncated = RopeScaling::from_kind(
        "yarn",
        params(&[
            ("factor", 3.7),
            ("original_max_position_embeddings", 512.0),
            ("beta_fast", 16.0),
            ("beta_slow", 2.0),
            ("truncate", 0.0),
        ]),
    )
    .unwrap();
    for s in [s.clone(), untruncated.clone()] {
        let got = RotaryEmbedding::new(24, 12_345.678, s.clone()).unwrap();
        assert_freqs(&format!("{s:?}"), got.inv_freq(), &inv_freq_f64(24, 12_345.678, s), 8.0);
    }
    assert_ne!(
        RotaryEmbedding::new(24, 12_345.678, s).unwrap().inv_freq(),
        RotaryEmbedding::new(24, 12_345.678, untruncated).unwrap().inv_freq()
    );
}

#[test]
fn yarn_attention_factor_follows_transformers_defaults() {
    let mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
    let yarn_with = |extra: &[(&'static str, f64)]| {
        let mut kv = vec![("factor", 3.7), ("original_max_position_embeddings", 512.0)];
        kv.extend_from_slice(extra);
        match RopeScaling::from_kind("yarn", params(&kv)).unwrap() {
            RopeScaling::Yarn { attention_factor, .. } => attention_factor,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(yarn_with(&[]), 0.1 * 3.7f64.ln() + 1.0);
    // DeepSeek's pair: the ratio of the two mscales.
    assert_eq!(yarn_with(&[("mscale", 0.707), ("mscale_all_dim", 1.0)]), mscale(3.7, 0.707) / mscale(3.7, 1.0));
    assert_eq!(yarn_with(&[("mscale", 1.0), ("mscale_all_dim", 1.0)]), 1.0);
    // Only one of them, or a zero one: ignored (Python's truthiness).
    assert_eq!(yarn_with(&[("mscale", 0.707)]), mscale(3.7, 1.0));
    assert_eq!(yarn_with(&[("mscale", 0.707), ("mscale_all_dim", 0.0)]), mscale(3.7, 1.0));
    // An explicit attention_factor wins.
    assert_eq!(yarn_with(&[("attention_factor", 1.25), ("mscale", 0.707), ("mscale_all_dim", 1.0)]), 1.25);
    // factor <= 1: no scaling.
    let s = RopeScaling::from_kind("yarn", params(&[("factor", 1.0), ("original_max_position_embeddings", 64.0)]));
    assert!(matches!(s, Ok(RopeScaling::Yarn { attention_factor: 1.0, .. })), "{s:?}");
    // beta 0 means the default (Python's `or`), and no factor means max / original.
    let s = RopeScaling::from_kind(
        "yarn",
        params(&[
            ("max_position_embeddings", 4096.0),
            ("original_max_position_embeddings", 1024.0),
            ("beta_fast", 0.0),
        ]),
    )
    .unwrap();
    let want = RopeScaling::Yarn {
        factor: 4.0,
        original_max_position_embeddings: 1024.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
        attention_factor: 0.1 * 4f64.ln() + 1.0,
    };
    assert_eq!(s, want);
    // original_max_position_embeddings absent: max_position_embeddings.
    let s = RopeScaling::from_kind("yarn", params(&[("factor", 4.0), ("max_position_embeddings", 1024.0)])).unwrap();
    assert_eq!(s, want);
}

/// Bit patterns printed by transformers 5.24 (`ROPE_INIT_FUNCTIONS[kind](config, seq_len=...)`,
/// torch 2.15 on x86-64): head sizes of at most 15 pairs, which PyTorch's `pow` computes with
/// the C library's `powf` (longer rows go through SLEEF, which can differ by an ulp).
#[test]
fn frequencies_equal_transformers_bit_for_bit() {
    type Case = (&'static str, usize, f64, &'static [(&'static str, f64)], usize, u32, &'static [u32]);
    const CASES: &[Case] = &[
        (
            "linear",
            16,
            10_000.0,
            &[("factor", 4.0)],
            0,
            0x3f800000,
            &[0x3e800000, 0x3da1e89b, 0x3ccccccd, 0x3c0186e3, 0x3b23d70a, 0x3a4f3e38, 0x3983126f, 0x38a5cb60],
        ),
        (
            "linear",
            24,
            12_345.678,
            &[("factor", 2.5)],
            0,
            0x3f800000,
            &[
                0x3ecccccd, 0x3e3acf62, 0x3daa6684, 0x3d1b6eaa, 0x3c8dc766, 0x3c01532b, 0x3b6bedfb, 0x3ad7348e,
                0x3a444d23, 0x39b30ed8, 0x39235450, 0x3894fb73,
            ],
        ),
        (
            "dynamic",
            16,
            10_000.0,
            &[("factor", 4.0), ("max_position_embeddings", 64.0)],
            0,
            0x3f800000,
            &[0x3f800000, 0x3ea1e89b, 0x3dcccccd, 0x3d0186e3, 0x3c23d70a, 0x3b4f3e38, 0x3a83126f, 0x39a5cb60],
        ),
        (
            "dynamic",
            16,
            10_000.0,
            &[("factor", 4.0), ("max_position_embeddings", 64.0)],
            65,
            0x3f800000,
            &[0x3f800000, 0x3ea0832f, 0x3dc9487c, 0x3cfc68e5, 0x3c1e42e7, 0x3b4675d3, 0x3a78deae, 0x399c0ab4],
        ),
        (
            "dynamic",
            16,
            10_000.0,
            &[("factor", 4.0), ("max_position_embeddings", 64.0)],
            4098,
            0x3f800000,
            &[0x3f800000, 0x3e12e19a, 0x3ca88c35, 0x3b4168fe, 0x39ddf0a4, 0x387eada7, 0x37121f7a, 0x35a7ad72],
        ),
        (
            "dynamic",
            24,
            12_345.678,
            &[("factor", 2.5), ("max_position_embeddings", 100.0)],
            317,
            0x3f800000,
            &[
                0x3f800000, 0x3ec52e9b, 0x3e17e0c2, 0x3d69f738, 0x3cb435d4, 0x3c0ace3d, 0x3b55d3f1, 0x3aa4b308,
                0x39fdb77b, 0x39436c65, 0x38968600, 0x37e7e102,
            ],
        ),
        (
            "yarn",
            16,
            10_000.0,
            &[("factor", 4.0), ("original_max_position_embeddings", 64.0)],
            0,
            0x3f91be9c,
            &[0x3f800000, 0x3e72dce8, 0x3d4ccccc, 0x3c0186e3, 0x3b23d70a, 0x3a4f3e38, 0x3983126f, 0x38a5cb60],
        ),
        (
            "yarn",
            24,
            12_345.678,
            &[
                ("factor", 3.7),
                ("original_max_position_embeddings", 512.0),
                ("beta_fast", 16.0),
                ("beta_slow", 2.0),
                ("truncate", 0.0),
                ("mscale", 0.707),
                ("mscale_all_dim", 1.0),
            ],
            0,
            0x3f775265,
            &[
                0x3f800000, 0x3ee9833b, 0x3e550025, 0x3d90b1d6, 0x3ca650e7, 0x3baec36b, 0x3b1f6972, 0x3a9168b3,
                0x3a04a2d3, 0x3971f863, 0x38dcb720, 0x384953cd,
            ],
        ),
        (
            "yarn",
            16,
            500_000.0,
            &[("factor", 8.0), ("original_max_position_embeddings", 2048.0), ("attention_factor", 1.25)],
            0,
            0x3fa00000,
            &[0x3f800000, 0x3e4693b0, 0x3cda371b, 0x3b47236c, 0x39395d21, 0x380fc8f8, 0x36df10c4, 0x35ad07a7],
        ),
    ];
    for &(kind, d, theta, kv, seq_len, scale, want) in CASES {
        let rope = RotaryEmbedding::new(d, theta, RopeScaling::from_kind(kind, params(kv)).unwrap()).unwrap();
        let got: Vec<u32> = rope.inv_freq_for(seq_len).iter().map(|f| f.to_bits()).collect();
        assert_eq!(got, want, "{kind} d{d} theta {theta} {kv:?} seq_len {seq_len}");
        assert_eq!(rope.attention_scaling().to_bits(), scale, "{kind} {kv:?} attention scaling");
    }
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

#[test]
fn from_kind_reads_each_kinds_parameters() {
    assert_eq!(RopeScaling::from_kind("linear", params(&[("factor", 4.0)])).unwrap(), linear(4.0));
    assert_eq!(
        RopeScaling::from_kind("dynamic", params(&[("factor", 2.0), ("max_position_embeddings", 4096.0)])).unwrap(),
        dynamic(2.0, 4096.0)
    );
    // llama3 falls back to max_position_embeddings as well.
    assert_eq!(
        RopeScaling::from_kind(
            "llama3",
            params(&[
                ("factor", 8.0),
                ("low_freq_factor", 1.0),
                ("high_freq_factor", 4.0),
                ("max_position_embeddings", 8192.0)
            ])
        )
        .unwrap(),
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0
        }
    );
    // Bad or missing parameters name themselves.
    type Case = (&'static str, &'static [(&'static str, f64)], &'static str);
    let cases: &[Case] = &[
        ("linear", &[], "factor"),
        ("linear", &[("factor", 0.0)], "factor"),
        ("linear", &[("factor", f64::NAN)], "factor"),
        ("dynamic", &[("factor", 2.0)], "max_position_embeddings"),
        ("dynamic", &[("max_position_embeddings", 64.0)], "factor"),
        ("dynamic", &[("factor", 2.0), ("max_position_embeddings", 64.5)], "max_position_embeddings"),
        ("yarn", &[("factor", 2.0)], "original_max_position_embeddings"),
        ("yarn", &[("original_max_position_embeddings", 64.0)], "factor"),
        ("yarn", &[("factor", -2.0), ("original_max_position_embeddings", 64.0)], "factor"),
        ("yarn", &[("factor", 2.0), ("original_max_position_embeddings", 0.0)], "original_max_position_embeddings"),
        (
            "yarn",
            &[("factor", 2.0), ("original_max_position_embeddings", 64.0), ("attention_factor", 0.0)],
            "attention_factor",
        ),
        (
            "yarn",
            &[("factor", 2.0), ("original_max_position_embeddings", 64.0), ("beta_fast", f64::INFINITY)],
            "beta_fast",
        ),
    ];
    for &(kind, kv, named) in cases {
        let e = RopeScaling::from_kind(kind, params(kv)).expect_err(&format!("{kind} {kv:?}"));
        assert!(matches!(&e, Error::UnsupportedRopeScaling { kind: k, .. } if k == kind), "{e}");
        assert!(e.to_string().contains(named), "{kind} {kv:?}: {e}");
    }
    // Kinds tp does not implement stay refused, by name.
    for kind in ["longrope", "su", "proportional", ""] {
        let e = RopeScaling::from_kind(kind, |_| Some(1.0)).unwrap_err();
        assert!(matches!(&e, Error::UnsupportedRopeScaling { kind: k, .. } if k == kind), "{e}");
        assert!(e.to_string().contains(&format!("{kind:?}")), "{e}");
    }
}
