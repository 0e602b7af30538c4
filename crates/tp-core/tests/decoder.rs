//! The decoder ops on the host backend against float64 references (the checks live in
//! `common/decoder.rs` and run on the GPU too), plus integer tensors and bad inputs.

mod common;
use common::decoder::*;
use tp_core::{AttentionSpec, DType, Device, Error, KvGroups, RopeScaling, RotaryEmbedding, Tensor};

const CPU: Device = Device::Cpu;

fn llama3() -> RopeScaling {
    RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192.0,
    }
}

#[test]
fn rms_norm_rounds_where_hugging_face_does() {
    for dtype in DType::FLOATS {
        for (rows, h) in [(1, 1), (3, 17), (5, 129), (2, 4099)] {
            check_rms_norm(CPU, rows, h, dtype, 3 + h as u64);
        }
    }
}

#[test]
fn norm_styles_glu_scale_and_softcap_round_where_pytorch_does() {
    common::block_ops::check_block_ops(CPU);
}

#[test]
fn longrope_picks_short_or_long_factors_per_call() {
    for dtype in DType::FLOATS {
        for d in [2, 10, 64, 128] {
            // Within the original 64 positions (short factors), and past them (long).
            check_rope(CPU, &[0, 5, 63], 2, d, longrope(d), dtype, d as u64);
            check_rope(CPU, &[0, 1, 2, 7, 100, 4097], 3, d, longrope(d), dtype, 1 + d as u64);
        }
    }
    // A list of another length than the head's pairs is refused by name.
    let e = RotaryEmbedding::new(16, 1e4, longrope(8)).unwrap_err();
    assert!(e.to_string().contains("short_factor has 4 entries; head_dim 16 needs 8"), "{e}");
}

#[test]
fn partial_rotary_turns_the_first_features_and_passes_the_rest() {
    for dtype in DType::FLOATS {
        // Phi-4-mini's 0.75 of 128, and odd leftovers; LongRoPE lists of the rotated pairs.
        for (d, r) in [(128, 96), (10, 6), (8, 2)] {
            check_partial_rope(CPU, &[0, 1, 2, 7, 100, 4097], 3, (d, r), RopeScaling::Default, dtype, d as u64);
            check_partial_rope(CPU, &[0, 5, 70], 2, (d, r), longrope(r), dtype, 1 + d as u64);
        }
    }
    // An embedding wider than the head is refused.
    let x = Tensor::randn(&[1, 2, 8], DType::F32, 1, &CPU).unwrap();
    assert!(x.rope(&[0], &RotaryEmbedding::new(10, 1e4, RopeScaling::Default).unwrap()).is_err());
}

#[test]
fn rope_default_and_llama3_match_the_rotation() {
    for dtype in DType::FLOATS {
        for scaling in [RopeScaling::Default, llama3()] {
            for d in [2, 10, 64, 128] {
                check_rope(CPU, &[0, 1, 2, 7, 100, 4097], 3, d, scaling.clone(), dtype, d as u64);
            }
        }
    }
}

#[test]
fn rope_places_each_token_at_its_own_position() {
    // A decode step at position L equals row L of a prefill over 0..=L.
    let rope = RotaryEmbedding::new(64, 10_000.0, llama3()).unwrap();
    let x = Tensor::randn(&[13, 4, 64], DType::BF16, 2, &CPU).unwrap();
    let all: Vec<usize> = (0..13).collect();
    let prefill = x.rope(&all, &rope).unwrap();
    for l in [0, 5, 12] {
        let step = x.narrow(0, l, 1).unwrap().rope(&[l], &rope).unwrap();
        assert_eq!(step, prefill.narrow(0, l, 1).unwrap(), "position {l}");
    }
}

#[test]
fn llama3_scaling_moves_only_the_low_frequencies() {
    let plain = RotaryEmbedding::new(128, 500_000.0, RopeScaling::Default).unwrap();
    let scaled = RotaryEmbedding::new(128, 500_000.0, llama3()).unwrap();
    let want = inv_freq_f64(128, 500_000.0, &llama3());
    for (i, (&p, &s)) in plain.inv_freq().iter().zip(scaled.inv_freq()).enumerate() {
        assert!((f64::from(s) - want[i]).abs() <= 4e-7 * want[i], "frequency {i}: {s} vs {}", want[i]);
        let wavelen = 2.0 * std::f64::consts::PI / f64::from(p);
        if wavelen < 2048.0 {
            assert_eq!(p, s, "high frequency {i} must be kept");
        } else if wavelen > 8192.0 {
            assert!((f64::from(s) * 8.0 - f64::from(p)).abs() <= 1e-6 * f64::from(p), "low frequency {i} / 8");
        }
    }
}

#[test]
fn bad_rotary_embeddings_are_refused() {
    assert!(RotaryEmbedding::new(7, 10_000.0, RopeScaling::Default).is_err(), "odd head_dim");
    assert!(RotaryEmbedding::new(8, f64::NAN, RopeScaling::Default).is_err());
}

#[test]
fn attention_matches_f64_at_mha_gqa_and_mqa() {
    for dtype in DType::FLOATS {
        // (hq, hkv): MHA, groups of 3, all heads on one KV head (MQA).
        for (hq, hkv) in [(4, 4), (6, 2), (5, 1)] {
            for d in [10, 64, 128] {
                check_attention(CPU, 7, 7, hq, hkv, d, None, dtype, d as u64); // prefill
                check_attention(CPU, 1, 19, hq, hkv, d, None, dtype, 1 + d as u64); // decode step
                check_attention(CPU, 3, 11, hq, hkv, d, None, dtype, 2 + d as u64); // chunk after a prefix
                // A long prefill on this machine's path, and as GEMMs and row by row.
                check_attention(CPU, 37, 41, hq, hkv, d, None, dtype, 3 + d as u64);
                for gemms in [true, false] {
                    tp_core::cpu::set_prefill_attention_gemms(Some(gemms));
                    check_attention(CPU, 37, 41, hq, hkv, d, None, dtype, 4 + d as u64);
                    tp_core::cpu::set_prefill_attention_gemms(None);
                }
            }
        }
    }
}

/// A tensor-parallel rank's query heads may start inside a KV group (12 query over 4 KV heads
/// at TP 8: rank 1 holds query heads 2, 3, which use KV heads 0 and 1); both paths follow the
/// stated grouping.
#[test]
fn attention_follows_kv_groups_that_start_mid_group() {
    // (hq, hkv, size, offset): heads 2..4 of groups of 3; heads 4..8 of groups of 3 (KV 1, 2);
    // one head at the end of a group of 7; heads spanning three groups of 2.
    for (hq, hkv, size, offset) in [(2, 2, 3, 2), (4, 2, 3, 1), (1, 1, 7, 6), (5, 3, 2, 1)] {
        for (t, kv_len, window) in [(1, 19, None), (3, 11, None), (37, 41, None), (9, 20, Some(4))] {
            let spec = AttentionSpec {
                kv_len,
                scale: 0.3,
                sliding_window: window,
                kv_groups: Some(KvGroups { size, offset }),
                sinks: None,
            };
            for gemms in [None, Some(true), Some(false)] {
                tp_core::cpu::set_prefill_attention_gemms(gemms);
                check_attention_spec(CPU, t, (hq, hkv, 24), &spec, DType::F32, (hq * 100 + t) as u64);
                check_attention_spec(CPU, t, (hq, hkv, 24), &spec, DType::BF16, (hq * 100 + t) as u64);
            }
            tp_core::cpu::set_prefill_attention_gemms(None);
        }
    }
}

/// gpt-oss's attention sinks against the f64 reference on every host path (row loop, grouped
/// rows, score tiles), with windows and groups starting mid-group; a wrong count is refused.
#[test]
fn attention_sinks_join_each_heads_softmax() {
    for (hq, hkv, groups) in [(6, 2, None), (5, 3, Some(KvGroups { size: 3, offset: 2 }))] {
        let sinks: Vec<f32> = (0..hq).map(|h| [2.5, -0.7, 0.0, -30.0, 6.0][h % 5]).collect();
        for (t, kv_len, window) in [(1, 19, None), (3, 11, Some(4)), (37, 41, None), (37, 41, Some(6))] {
            let spec = AttentionSpec {
                kv_len,
                scale: 0.3,
                sliding_window: window,
                kv_groups: groups,
                sinks: Some(sinks.clone().into()),
            };
            for gemms in [None, Some(true), Some(false)] {
                tp_core::cpu::set_prefill_attention_gemms(gemms);
                for dtype in [DType::F32, DType::BF16] {
                    check_attention_spec(CPU, t, (hq, hkv, 24), &spec, dtype, (hq * 10 + t) as u64);
                }
            }
            tp_core::cpu::set_prefill_attention_gemms(None);
        }
    }
    let q = Tensor::randn(&[2, 4, 8], DType::F32, 1, &CPU).unwrap();
    let k = Tensor::randn(&[2, 2, 8], DType::F32, 2, &CPU).unwrap();
    for bad in [vec![0.0; 3], vec![0.0, 1.0, f32::NAN, 0.0]] {
        let spec = AttentionSpec { sinks: Some(bad.into()), ..AttentionSpec::causal(2, 8) };
        assert!(matches!(q.attention(&k, &k, &spec), Err(Error::InvalidArgument { .. })));
    }
}

#[test]
fn attention_respects_a_sliding_window() {
    for w in [1, 3, 64] {
        for gemms in [None, Some(true), Some(false)] {
            tp_core::cpu::set_prefill_attention_gemms(gemms);
            check_attention(CPU, 9, 20, 4, 2, 16, Some(w), DType::F32, w as u64);
        }
        tp_core::cpu::set_prefill_attention_gemms(None);
        check_attention(CPU, 3, 20, 4, 2, 16, Some(w), DType::F32, w as u64); // the row loop
    }
}

#[test]
fn prefill_equals_decode_steps_through_the_cache() {
    for (hq, hkv, d) in [(4, 4, 10), (6, 2, 64), (3, 1, 128)] {
        check_prefill_equals_decode(CPU, 9, hq, hkv, d);
    }
}

#[test]
fn vocab_parallel_embedding_shards_sum_to_the_full_lookup() {
    for dtype in DType::FLOATS {
        for world in 1..=8 {
            check_embedding(CPU, 1001, 13, dtype, world);
        }
    }
}

#[test]
fn argmax_breaks_ties_low_and_counts_nan_as_max() {
    for dtype in DType::FLOATS {
        check_argmax(CPU, 3, 1001, dtype);
        check_argmax(CPU, 1, 1, dtype);
    }
}

#[test]
fn add_and_add_assign_round_once() {
    for dtype in DType::FLOATS {
        check_add(CPU, dtype);
    }
}

#[test]
fn integer_tensors_copy_slice_join_and_refuse_arithmetic() {
    let ids = Tensor::from_vec(vec![5i64, -1, 7, 1 << 40, 2, 3], &[2, 3], &CPU).unwrap();
    assert_eq!(ids.dtype(), DType::I64);
    assert_eq!(ids.narrow(1, 1, 2).unwrap().to_vec::<i64>().unwrap(), vec![-1, 7, 2, 3]);
    let small = Tensor::from_vec(vec![1i32, 2, 3], &[3], &CPU).unwrap();
    let joined = Tensor::cat(&[&small, &small.narrow(0, 0, 1).unwrap()], 0).unwrap();
    assert_eq!(joined.to_vec::<i32>().unwrap(), vec![1, 2, 3, 1]);
    assert_eq!(joined.to_i64_vec().unwrap(), vec![1, 2, 3, 1]);
    let bytes = Tensor::from_bytes(ids.as_bytes().unwrap(), &[6], DType::I64, &CPU).unwrap();
    assert_eq!(bytes.to_vec::<i64>().unwrap(), vec![5, -1, 7, 1 << 40, 2, 3]);
    let mut target = Tensor::zeros(&[4, 3], DType::I64, &CPU).unwrap();
    target.slice_set(&ids, 0, 1).unwrap();
    assert_eq!(target.to_vec::<i64>().unwrap(), vec![0, 0, 0, 5, -1, 7, 1 << 40, 2, 3, 0, 0, 0]);
    // Arithmetic refuses integers with a typed error.
    let w = Tensor::zeros(&[3, 3], DType::I64, &CPU).unwrap();
    assert_eq!(ids.matmul_t(&w).unwrap_err(), Error::NotFloat { dtype: DType::I64 });
    assert!(matches!(ids.to_dtype(DType::F32), Err(Error::NotFloat { .. })));
    assert!(matches!(small.rms_norm(&small, 1e-5), Err(Error::NotFloat { .. })));
    assert!(matches!(ids.argmax(), Err(Error::NotFloat { .. })));
    let f = Tensor::rand(&[2, 3], DType::F32, 1, &CPU).unwrap();
    assert!(matches!(f.to_i64_vec(), Err(Error::NotInteger { .. })));
    assert!(matches!(f.embedding(&f, 0), Err(Error::NotInteger { .. })));
    assert!(matches!(f.add(&ids), Err(Error::NotFloat { .. } | Error::DTypeMismatch { .. })));
}

#[test]
fn decoder_ops_refuse_bad_shapes() {
    let x = Tensor::randn(&[3, 4, 8], DType::F32, 1, &CPU).unwrap();
    let k = Tensor::randn(&[5, 2, 8], DType::F32, 2, &CPU).unwrap();
    let spec = AttentionSpec::causal(5, 8);
    assert!(matches!(x.attention(&k, &k.narrow(2, 0, 4).unwrap(), &spec), Err(Error::ShapeMismatch { .. })));
    let k3 = Tensor::randn(&[5, 3, 8], DType::F32, 2, &CPU).unwrap();
    assert!(matches!(x.attention(&k3, &k3, &spec), Err(Error::ShapeMismatch { .. })), "3 KV heads do not divide 4");
    assert!(matches!(x.attention(&k, &k, &AttentionSpec::causal(6, 8)), Err(Error::InvalidArgument { .. })));
    assert!(matches!(x.attention(&k, &k, &AttentionSpec::causal(2, 8)), Err(Error::InvalidArgument { .. })));
    let w0 = AttentionSpec { sliding_window: Some(0), ..spec.clone() };
    assert!(matches!(x.attention(&k, &k, &w0), Err(Error::InvalidArgument { .. })));
    // Groups that send a query head past the KV heads, or an offset outside its group.
    for (size, offset) in [(2, 1), (1, 0), (3, 3), (0, 0)] {
        let bad = AttentionSpec { kv_groups: Some(KvGroups { size, offset }), ..spec.clone() };
        assert!(
            matches!(x.attention(&k, &k, &bad), Err(Error::ShapeMismatch { .. })),
            "4 query heads over 2 KV heads with groups of {size} from {offset}"
        );
    }
    let rope = RotaryEmbedding::new(10, 10_000.0, RopeScaling::Default).unwrap();
    assert!(matches!(x.rope(&[0, 1, 2], &rope), Err(Error::ShapeMismatch { .. })), "head_dim 8 vs 10");
    let rope8 = RotaryEmbedding::new(8, 10_000.0, RopeScaling::Default).unwrap();
    assert!(matches!(x.rope(&[0, 1], &rope8), Err(Error::ShapeMismatch { .. })), "2 positions for 3 tokens");
    assert!(matches!(
        x.rms_norm(&Tensor::rand(&[7], DType::F32, 3, &CPU).unwrap(), 1e-5),
        Err(Error::ShapeMismatch { .. })
    ));
    let w = Tensor::rand(&[8], DType::F32, 3, &CPU).unwrap();
    assert!(matches!(x.rms_norm(&w, -1.0), Err(Error::InvalidArgument { .. })));
    assert!(matches!(x.add(&k), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(Tensor::zeros(&[2, 0], DType::F32, &CPU).unwrap().argmax(), Err(Error::InvalidArgument { .. })));
    let mut cache = Tensor::zeros(&[4, 2, 8], DType::F32, &CPU).unwrap();
    let before = cache.clone();
    assert!(matches!(cache.slice_set(&k, 0, 0), Err(Error::NarrowOutOfBounds { .. })), "5 rows into 4");
    assert!(matches!(cache.slice_set(&x, 0, 0), Err(Error::ShapeMismatch { .. })));
    assert_eq!(cache, before, "a failed write changes nothing");
}
