//! Hugging Face's rope kinds read into tp-core's scalings: the parameter names and defaults
//! transformers 5 uses for each kind, refused kinds and parameters named, and the resulting
//! frequencies against transformers' own values, bit for bit.

use tp_core::{RopeScaling, RotaryEmbedding};
use tp_models::{RopeKindError, rope_scaling_from_kind};
use tp_testing::reference::ops::yarn_defaults;

fn linear(factor: f64) -> RopeScaling {
    RopeScaling::Linear { factor }
}

fn dynamic(factor: f64, max_position_embeddings: f64) -> RopeScaling {
    RopeScaling::Dynamic { factor, max_position_embeddings }
}

/// A parameter reader over `(name, value)` pairs.
fn params(kv: &[(&'static str, f64)]) -> impl Fn(&str) -> Option<f64> + use<> {
    let kv = kv.to_vec();
    move |name| kv.iter().find(|(k, _)| *k == name).map(|&(_, v)| v)
}

#[test]
fn yarn_without_extras_takes_transformers_defaults() {
    for (factor, original) in [(4.0, 64.0), (16.0, 64.0), (0.5, 128.0), (3.7, 512.0)] {
        let kv = [("factor", factor), ("original_max_position_embeddings", original)];
        assert_eq!(rope_scaling_from_kind("yarn", params(&kv)).unwrap(), yarn_defaults(factor, original));
    }
}

#[test]
fn unsupported_rope_scalings_are_named() {
    for kind in ["longrope", "su", ""] {
        let e = rope_scaling_from_kind(kind, |_| Some(1.0)).unwrap_err();
        assert!(matches!(&e, RopeKindError { kind: k, .. } if k == kind), "{e}");
        assert!(e.to_string().contains(&format!("{kind:?}")), "{e}");
    }
    let e = rope_scaling_from_kind("llama3", |k| (k != "low_freq_factor").then_some(2.0)).unwrap_err();
    assert!(e.to_string().contains("low_freq_factor"), "{e}");
    assert_eq!(e.param.as_deref(), Some("low_freq_factor"));
    assert!(rope_scaling_from_kind("llama3", |k| Some(if k == "factor" { -1.0 } else { 2.0 })).is_err());
    let e = rope_scaling_from_kind("llama3", |_| Some(2.0)).unwrap_err();
    assert!(e.to_string().contains("low_freq_factor must differ from high_freq_factor"), "{e}");
    assert_eq!(rope_scaling_from_kind("default", |_| None).unwrap(), RopeScaling::Default);
}

#[test]
fn yarn_attention_factor_follows_transformers_defaults() {
    let mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
    let yarn_with = |extra: &[(&'static str, f64)]| {
        let mut kv = vec![("factor", 3.7), ("original_max_position_embeddings", 512.0)];
        kv.extend_from_slice(extra);
        match rope_scaling_from_kind("yarn", params(&kv)).unwrap() {
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
    let s = rope_scaling_from_kind("yarn", params(&[("factor", 1.0), ("original_max_position_embeddings", 64.0)]));
    assert!(matches!(s, Ok(RopeScaling::Yarn { attention_factor: 1.0, .. })), "{s:?}");
    // beta 0 means the default (Python's `or`), and no factor means max / original.
    let s = rope_scaling_from_kind(
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
    let s = rope_scaling_from_kind("yarn", params(&[("factor", 4.0), ("max_position_embeddings", 1024.0)])).unwrap();
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
        let rope = RotaryEmbedding::new(d, theta, rope_scaling_from_kind(kind, params(kv)).unwrap()).unwrap();
        let got: Vec<u32> = rope.inv_freq_for(seq_len).iter().map(|f| f.to_bits()).collect();
        assert_eq!(got, want, "{kind} d{d} theta {theta} {kv:?} seq_len {seq_len}");
        assert_eq!(rope.attention_scaling().to_bits(), scale, "{kind} {kv:?} attention scaling");
    }
}

#[test]
fn from_kind_reads_each_kinds_parameters() {
    assert_eq!(rope_scaling_from_kind("linear", params(&[("factor", 4.0)])).unwrap(), linear(4.0));
    assert_eq!(
        rope_scaling_from_kind("dynamic", params(&[("factor", 2.0), ("max_position_embeddings", 4096.0)])).unwrap(),
        dynamic(2.0, 4096.0)
    );
    // llama3 falls back to max_position_embeddings as well.
    assert_eq!(
        rope_scaling_from_kind(
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
        let e = rope_scaling_from_kind(kind, params(kv)).expect_err(&format!("{kind} {kv:?}"));
        assert!(matches!(&e, RopeKindError { kind: k, .. } if k == kind), "{e}");
        assert!(e.to_string().contains(named), "{kind} {kv:?}: {e}");
    }
    // Kinds tp does not implement stay refused, by name.
    for kind in ["longrope", "su", "proportional", ""] {
        let e = rope_scaling_from_kind(kind, |_| Some(1.0)).unwrap_err();
        assert!(matches!(&e, RopeKindError { kind: k, .. } if k == kind), "{e}");
        assert!(e.to_string().contains(&format!("{kind:?}")), "{e}");
    }
}
