//! The decoder layers at world sizes 1..=8 with uneven vocabularies and heads, against the
//! unsharded computation (float64 references from tp-testing); all ranks agree bit
//! for bit; and every bad input is a typed error.

mod common;
use common::*;
use tp_core::TensorShard;
use tp_core::{Activation, NormStyle};
use tp_core::{DType, Device, RopeScaling, RotaryEmbedding, Tensor};
use tp_layers::{
    AttentionConfig, AttentionHeads, AttentionNames, Block, Checkpoint, ColumnParallel, DecoderConfig, DecoderLayer,
    DecoderNames, KvCache, LayerError, Linear, LoadOptions, Loader, ParallelAttention, ParallelLmHead, RmsNorm,
    VocabParallelEmbedding, save,
};
use tp_testing::reference::block::*;

const VOCAB: usize = 1001; // uneven over every world size but 1 and 7
const HIDDEN: usize = 24;

fn ids(n: usize) -> Tensor {
    Tensor::from_vec((0..n as i64).map(|i| (i * 389 + 17) % VOCAB as i64).collect::<Vec<_>>(), &[n], &CPU).unwrap()
}

fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("tp-decoder-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn save_named(path: &std::path::Path, tensors: &[(String, Tensor)]) {
    let refs: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    save(path, &refs).unwrap();
}

#[test]
fn vocab_parallel_embedding_equals_the_full_lookup_bit_for_bit() {
    for dtype in DType::FLOATS {
        let table = Tensor::randn(&[VOCAB, HIDDEN], dtype, 1, &CPU).unwrap();
        let ids = ids(37);
        let want = table.embedding(&ids, 0).unwrap();
        for world in 1..=8 {
            let got = on_ranks(world, CPU, |g| {
                let e = VocabParallelEmbedding::from_full(&table, &g).unwrap();
                e.forward(&ids).unwrap()
            });
            for y in &got {
                assert_eq!(y, &want, "{dtype} world {world}");
            }
        }
    }
}

#[test]
fn out_of_vocabulary_ids_are_named() {
    let table = Tensor::randn(&[VOCAB, HIDDEN], DType::F32, 1, &CPU).unwrap();
    for (bad, at) in [(VOCAB as i64, 2), (-1, 0), (i64::MAX, 1)] {
        let mut v = vec![3i64, 4, 5];
        v[at] = bad;
        let ids = Tensor::from_vec(v, &[3], &CPU).unwrap();
        let errs = on_ranks(2, CPU, |g| VocabParallelEmbedding::from_full(&table, &g).unwrap().forward(&ids));
        for e in errs {
            let e = e.unwrap_err();
            assert!(
                matches!(e, LayerError::Tensor(tp_core::Error::TokenOutOfRange { id, position, vocab: VOCAB, .. }) if id == bad && position == at),
                "{e}"
            );
            assert!(e.to_string().contains(&bad.to_string()), "{e}");
        }
    }
    let floats = Tensor::rand(&[3], DType::F32, 1, &CPU).unwrap();
    let e = on_ranks(1, CPU, |g| VocabParallelEmbedding::from_full(&table, &g).unwrap().forward(&floats)).remove(0);
    assert!(matches!(e, Err(LayerError::Tensor(tp_core::Error::NotInteger { .. }))));
}

#[test]
fn lm_head_gathers_exact_logits_and_argmax_without_gathering_them() {
    for dtype in DType::FLOATS {
        let w = Tensor::randn(&[VOCAB, HIDDEN], dtype, 2, &CPU).unwrap();
        let x = Tensor::randn(&[9, HIDDEN], dtype, 3, &CPU).unwrap();
        let full = x.matmul_t(&w).unwrap();
        let (want, abs) = linear_f64(&x, &tp_layers::Linear::new(w.clone(), None).unwrap());
        for world in 1..=8 {
            let got = on_ranks(world, CPU, |g| {
                let head = ParallelLmHead::from_full(&w, &g).unwrap();
                (head.logits(&x).unwrap(), head.argmax(&x).unwrap())
            });
            for (logits, top) in &got {
                assert_eq!(logits.dims(), &[9, VOCAB]);
                assert_close(&format!("{dtype} world {world}"), &f64s(logits), &want, |i| {
                    tol(dtype, HIDDEN, want[i], abs[i])
                });
                // The vocab-parallel argmax is the argmax of the gathered logits, exactly.
                assert_eq!(top, &logits.argmax().unwrap(), "{dtype} world {world}");
                assert_eq!(top.dtype(), DType::I64);
            }
            assert!(got.iter().all(|r| r.0 == got[0].0 && r.1 == got[0].1), "ranks disagree");
        }
        assert_eq!(f64s(&full).len(), 9 * VOCAB);
    }
}

#[test]
fn tied_lm_head_reuses_the_embedding_shard() {
    let table = Tensor::randn(&[VOCAB, HIDDEN], DType::BF16, 4, &CPU).unwrap();
    let x = Tensor::randn(&[3, HIDDEN], DType::BF16, 5, &CPU).unwrap();
    for world in [1, 3, 8] {
        let got = on_ranks(world, CPU, |g| {
            let emb = VocabParallelEmbedding::from_full(&table, &g).unwrap();
            let head = ParallelLmHead::tied(&emb);
            assert_eq!(head.shard(), emb.shard());
            (head.logits(&x).unwrap(), head.argmax(&x).unwrap())
        });
        let one = on_ranks(1, CPU, |g| ParallelLmHead::from_full(&table, &g).unwrap().logits(&x).unwrap()).remove(0);
        for (l, a) in got {
            assert_close("tied", &f64s(&l), &f64s(&one), |i| 1e-2 * (1.0 + f64s(&one)[i].abs()));
            assert_eq!(a, l.argmax().unwrap());
        }
    }
}

fn config(nq: usize, nkv: usize, d: usize, window: Option<usize>) -> AttentionConfig {
    AttentionConfig {
        heads: AttentionHeads { num_heads: nq, num_kv_heads: nkv, head_dim: d },
        rope: RotaryEmbedding::new(d, 10_000.0, RopeScaling::Default).unwrap(),
        sliding_window: window,
        scale: None,
        qk_norm: None,
        sinks: false,
    }
}

/// Runs `steps` (token counts: a prefill, then decode steps) through an attention layer on
/// every rank and returns each rank's outputs joined along the tokens.
fn run_attention(w: &AttnWeights, cfg: &AttentionConfig, x: &Tensor, steps: &[usize], world: usize) -> Vec<Tensor> {
    on_ranks(world, CPU, |g| {
        let layer = ParallelAttention::from_full([&w.q, &w.k, &w.v, &w.o], None, cfg.clone(), &g).unwrap();
        let mut cache = layer.new_cache(steps.iter().sum()).unwrap();
        let mut outs = Vec::new();
        let mut at = 0;
        for &n in steps {
            outs.push(layer.forward(&x.narrow(0, at, n).unwrap(), &mut cache).unwrap());
            at += n;
        }
        assert_eq!(cache.len(), at);
        Tensor::cat(&outs, 0).unwrap()
    })
}

#[test]
fn attention_matches_f64_with_uneven_and_replicated_heads() {
    // (query heads, KV heads, head_dim, worlds): 12 heads of 10 over 1..8 ranks (uneven: at 8,
    // ranks hold 2,2,2,2,1,1,1,1 heads and o_proj's columns follow); 16/4 GQA with the 4 KV
    // heads replicated at 8 ranks; 12/4 GQA at every world size (at 3, 5..8 some ranks' query
    // heads straddle two KV heads); MQA.
    let cases: [(usize, usize, usize, Vec<usize>); 4] = [
        (12, 12, 10, (1..=8).collect()),
        (16, 4, 8, vec![1, 2, 4, 8]),
        (12, 4, 10, (1..=8).collect()),
        (6, 1, 16, vec![1, 2, 3, 4, 6]),
    ];
    for (nq, nkv, d, worlds) in cases {
        for bias in [false, true] {
            let w = AttnWeights::random(HIDDEN, nq, nkv, d, bias, DType::F32, 7);
            let x = Tensor::randn(&[8, HIDDEN], DType::F32, 8, &CPU).unwrap();
            let want = attention_block(&f64s(&x), &w, (nq, nkv, d), 10_000.0, &RopeScaling::Default, None);
            let cfg = config(nq, nkv, d, None);
            for world in worlds.iter().copied() {
                // A prefill of 5 tokens, then three decode steps.
                let got = run_attention(&w, &cfg, &x, &[5, 1, 1, 1], world);
                for y in &got {
                    assert_close(&format!("{nq}/{nkv} d{d} bias {bias} world {world}"), &f64s(y), &want, |i| {
                        2e-5 * (1.0 + want[i].abs())
                    });
                }
                assert!(got.iter().all(|y| y == &got[0]), "{nq}/{nkv} world {world}: ranks disagree");
            }
        }
    }
}

#[test]
fn attention_in_bf16_stays_close_to_f32_across_world_sizes() {
    let w = AttnWeights::random(HIDDEN, 12, 12, 10, true, DType::BF16, 9);
    let x = Tensor::randn(&[6, HIDDEN], DType::BF16, 10, &CPU).unwrap();
    let want = attention_block(&f64s(&x), &w, (12, 12, 10), 10_000.0, &RopeScaling::Default, None);
    let scale = want.iter().map(|v| v.abs()).fold(0.0, f64::max);
    for world in [1, 2, 5, 8] {
        let got = run_attention(&w, &config(12, 12, 10, None), &x, &[4, 1, 1], world);
        assert_close(&format!("bf16 world {world}"), &f64s(&got[0]), &want, |_| 0.05 * scale);
        assert!(got.iter().all(|y| y == &got[0]));
    }
}

#[test]
fn sliding_window_attention_matches_f64() {
    let w = AttnWeights::random(HIDDEN, 4, 2, 8, false, DType::F32, 11);
    let x = Tensor::randn(&[9, HIDDEN], DType::F32, 12, &CPU).unwrap();
    let want = attention_block(&f64s(&x), &w, (4, 2, 8), 10_000.0, &RopeScaling::Default, Some(3));
    for world in [1, 2] {
        let got = run_attention(&w, &config(4, 2, 8, Some(3)), &x, &[6, 1, 1, 1], world);
        assert_close("window 3", &f64s(&got[0]), &want, |i| 2e-5 * (1.0 + want[i].abs()));
    }
}

#[test]
fn decoder_layer_loads_hugging_face_names_and_matches_f64() {
    let (nq, nkv, d, inter) = (12, 12, 10, 37);
    let dir = tmpdir("block");
    let bw = BlockWeights::random(HIDDEN, inter, nq, nkv, d, true, DType::F32, 13);
    save_named(&dir.join("model.safetensors"), &bw.named("model.layers.0"));
    let ckpt = Checkpoint::open(&dir).unwrap();
    let x = Tensor::randn(&[7, HIDDEN], DType::F32, 14, &CPU).unwrap();
    let want = block(&f64s(&x), &bw, (nq, nkv, d), 10_000.0, 1e-6);
    let cfg = DecoderConfig {
        attention: config(nq, nkv, d, None),
        rms_norm_eps: 1e-6,
        norm_style: NormStyle::Weight,
        activation: Activation::Silu,
        moe: None,
    };
    let names = DecoderNames::default();
    for world in 1..=8 {
        let got = on_ranks(world, CPU, |g| {
            let ld = Loader::new(&ckpt, &g, LoadOptions::new()).pp("model").pp("layers").pp(0);
            let layer = DecoderLayer::load(&ld, &cfg, &names).unwrap();
            let mut cache = layer.new_cache(16).unwrap();
            let a = layer.forward(&x.narrow(0, 0, 4).unwrap(), &mut cache).unwrap();
            let b = layer.forward(&x.narrow(0, 4, 1).unwrap(), &mut cache).unwrap();
            let c = layer.forward(&x.narrow(0, 5, 2).unwrap(), &mut cache).unwrap();
            Tensor::cat(&[a, b, c], 0).unwrap()
        });
        for y in &got {
            assert_close(&format!("block world {world}"), &f64s(y), &want, |i| 5e-5 * (1.0 + want[i].abs()));
        }
        assert!(got.iter().all(|y| y == &got[0]), "world {world}: ranks disagree");
    }
    // The same through bf16 parameters (converted while loading): close to f64.
    let scale = want.iter().map(|v| v.abs()).fold(0.0, f64::max);
    let got = on_ranks(3, CPU, |g| {
        let ld = Loader::new(&ckpt, &g, LoadOptions::new().with_dtype(DType::BF16)).pp("model.layers.0");
        let layer = DecoderLayer::load(&ld, &cfg, &names).unwrap();
        let mut cache = layer.new_cache(7).unwrap();
        layer.forward(&x.to_dtype(DType::BF16).unwrap(), &mut cache).unwrap()
    });
    assert_eq!(got[0].dtype(), DType::BF16);
    assert_close("block bf16", &f64s(&got[0]), &want, |_| 0.05 * scale);
}

#[test]
fn rms_norm_layer_loads_and_normalises() {
    let dir = tmpdir("norm");
    let w = Tensor::rand(&[HIDDEN], DType::F32, 1, &CPU).unwrap();
    save_named(&dir.join("model.safetensors"), &[("model.norm.weight".into(), w.clone())]);
    let ckpt = Checkpoint::open(&dir).unwrap();
    let x = Tensor::randn(&[3, HIDDEN], DType::F32, 2, &CPU).unwrap();
    let norm = on_ranks(1, CPU, |g| {
        RmsNorm::load(&Loader::new(&ckpt, &g, LoadOptions::new()).pp("model.norm"), 1e-5, NormStyle::Weight).unwrap()
    })
    .remove(0);
    let want = tp_testing::reference::ops::rms(&f64s(&x), &f64s(&w), 1e-5, tp_core::NormStyle::Weight);
    assert_close("norm", &f64s(&norm.forward(&x).unwrap()), &want, |i| 1e-6 * (1.0 + want[i].abs()));
    assert!(RmsNorm::new(Tensor::zeros(&[2, 2], DType::F32, &CPU).unwrap(), 1e-5).is_err());
    assert!(RmsNorm::new(w, f64::NAN).is_err());
}

#[test]
fn kv_cache_misuse_is_a_typed_error_and_writes_nothing() {
    let w = AttnWeights::random(HIDDEN, 4, 2, 8, false, DType::F32, 15);
    let x = Tensor::randn(&[5, HIDDEN], DType::F32, 16, &CPU).unwrap();
    let cfg = config(4, 2, 8, None);
    on_ranks(2, CPU, |g| {
        let a = ParallelAttention::from_full([&w.q, &w.k, &w.v, &w.o], None, cfg.clone(), &g).unwrap();
        let b = ParallelAttention::from_full([&w.q, &w.k, &w.v, &w.o], None, cfg.clone(), &g).unwrap();
        // Full: 3 + 3 > 4 positions; the failed call leaves the cache as it was.
        let mut cache = a.new_cache(4).unwrap();
        a.forward(&x.narrow(0, 0, 3).unwrap(), &mut cache).unwrap();
        let e = a.forward(&x.narrow(0, 0, 3).unwrap(), &mut cache).unwrap_err();
        assert!(matches!(e, LayerError::CacheFull { capacity: 4, len: 3, adding: 3 }), "{e}");
        assert_eq!(cache.len(), 3);
        // Another layer's cache (same shapes).
        let e = b.forward(&x.narrow(0, 0, 1).unwrap(), &mut cache).unwrap_err();
        assert!(matches!(e, LayerError::CacheMismatch(_)), "{e}");
        // Another shape: a cache of 3 KV heads, or of another dtype.
        let mut wrong = KvCache::new(8, 3, 8, DType::F32, &Device::Cpu).unwrap();
        assert!(matches!(a.forward(&x, &mut wrong), Err(LayerError::CacheMismatch(_))));
        let mut wrong = KvCache::new(8, 1, 8, DType::BF16, &Device::Cpu).unwrap();
        assert!(matches!(a.forward(&x, &mut wrong), Err(LayerError::CacheMismatch(_))));
        // Reset keeps the binding and the capacity.
        cache.reset();
        assert!(cache.is_empty());
        a.forward(&x.narrow(0, 0, 4).unwrap(), &mut cache).unwrap();
        assert!(KvCache::new(4, 0, 8, DType::F32, &Device::Cpu).is_err());
    });
}

#[test]
fn layers_keep_their_group_and_refuse_parts_of_another_rank() {
    // A layer is built for the group it runs on and keeps it: a shard of another rank or
    // world size is refused when the layer is assembled, so it can never run on the wrong rank.
    let full = Linear::new(Tensor::randn(&[10, HIDDEN], DType::F32, 17, &CPU).unwrap(), None).unwrap();
    let table = Tensor::randn(&[VOCAB, HIDDEN], DType::F32, 19, &CPU).unwrap();
    let errs = on_ranks(2, CPU, |g| {
        let other = (g.rank() + 1) % 2;
        let s = TensorShard::new(0, 10, other, 2).unwrap();
        let local = Linear::new(s.shard(full.weight().unwrap()).unwrap(), None).unwrap();
        let a = ColumnParallel::new(local, s, &g).unwrap_err();
        let s3 = TensorShard::new(0, VOCAB, g.rank(), 3).unwrap();
        let e = VocabParallelEmbedding::new(s3.shard(&table).unwrap(), s3, &g).unwrap_err();
        let h = ParallelLmHead::new(s3.shard(&table).unwrap(), s3, &g).unwrap_err();
        let col = ColumnParallel::from_full(&full, &g).unwrap();
        assert_eq!((col.group().rank(), col.shard().rank()), (g.rank(), g.rank()));
        [a, e, h]
    });
    for e in errs.into_iter().flatten() {
        assert!(matches!(&e, LayerError::Config(m) if m.contains("cannot run on rank")), "{e}");
    }
}

#[test]
fn impossible_attention_layouts_and_shapes_are_typed_errors() {
    let dir = tmpdir("badattn");
    let w = AttnWeights::random(HIDDEN, 4, 2, 6, false, DType::F32, 20);
    let named: Vec<(String, Tensor)> = [("q", &w.q), ("k", &w.k), ("v", &w.v), ("o", &w.o)]
        .iter()
        .map(|(n, l)| (format!("a.{n}_proj.weight"), l.weight().unwrap().clone()))
        .collect();
    save_named(&dir.join("model.safetensors"), &named);
    let ckpt = Checkpoint::open(&dir).unwrap();
    on_ranks(1, CPU, |g| {
        let opts = LoadOptions::new();
        // head_dim 5 does not divide the 24-row q projection into 4 heads.
        let ld = Loader::new(&ckpt, &g, opts);
        let names = AttentionNames::default();
        let e = ParallelAttention::load(&ld.pp("a"), &config(4, 2, 4, None), names).unwrap_err();
        assert!(matches!(e, LayerError::WrongShape { .. }), "{e}");
        // 4 query heads over 3 KV heads.
        let e = ParallelAttention::load(&ld.pp("a"), &config(4, 3, 6, None), names).unwrap_err();
        assert!(matches!(e, LayerError::Config(_)), "{e}");
        // A rope of another head size.
        let mut c = config(4, 2, 6, None);
        c.rope = RotaryEmbedding::new(8, 10_000.0, RopeScaling::Default).unwrap();
        assert!(ParallelAttention::load(&ld.pp("a"), &c, names).is_err());
        // A missing tensor names itself.
        let e = ParallelAttention::load(&ld.pp("b"), &config(4, 2, 6, None), names).unwrap_err();
        assert!(matches!(&e, LayerError::MissingTensor { name, .. } if name == "b.q_proj.weight"), "{e}");
    });
    // 4 query heads cannot be placed on 5 ranks: every rank says so (none waits for the others).
    let errs = on_ranks(5, CPU, |g| {
        let ld = Loader::new(&ckpt, &g, LoadOptions::new());
        ParallelAttention::load(&ld.pp("a"), &config(4, 2, 6, None), AttentionNames::default()).unwrap_err().to_string()
    });
    assert!(errs.iter().all(|e| e.contains("4 query heads cannot be placed on 5 ranks")), "{errs:?}");
    // 2 KV heads over 3 ranks is fine: query heads 2,1,1, so rank 0 holds heads 0 and 1 (KV
    // head 0), ranks 1 and 2 heads 2 and 3 (both KV head 1).
    let ok = on_ranks(3, CPU, |g| {
        let ld = Loader::new(&ckpt, &g, LoadOptions::new());
        let a = ParallelAttention::load(&ld.pp("a"), &config(4, 2, 6, None), AttentionNames::default()).unwrap();
        (a.layout().kv_start, a.layout().kv_len)
    });
    assert_eq!(ok, vec![(0, 1), (1, 1), (1, 1)]);
}

/// Attention sinks (gpt-oss): each rank keeps its own heads' logits of the full `[heads]`
/// vector (5 heads over 2 ranks: 3 and 2); a layer configured without sinks, a vector of another
/// length or a non-finite logit is refused and leaves the layer without sinks.
#[test]
fn attention_sinks_are_split_by_head_and_bad_ones_refused() {
    let w = AttnWeights::random(HIDDEN, 5, 5, 8, false, DType::F32, 21);
    let full = Tensor::from_vec(vec![0.5f32, -1.0, 2.0, 0.25, -3.0], &[5], &CPU).unwrap();
    let got = on_ranks(2, CPU, |g| {
        let with = AttentionConfig { sinks: true, ..config(5, 5, 8, None) };
        let mut a = ParallelAttention::from_full([&w.q, &w.k, &w.v, &w.o], None, with, &g).unwrap();
        for bad in [vec![0.0f32; 4], vec![0.0, 1.0, f32::INFINITY, 0.0, 0.0]] {
            let n = bad.len();
            let e = a.set_sinks(&Tensor::from_vec(bad, &[n], &CPU).unwrap()).unwrap_err();
            assert!(e.to_string().contains("sinks"), "{e}");
            assert!(a.sinks().unwrap().is_none());
        }
        a.set_sinks(&full).unwrap();
        let mut without =
            ParallelAttention::from_full([&w.q, &w.k, &w.v, &w.o], None, config(5, 5, 8, None), &g).unwrap();
        assert!(without.set_sinks(&full).unwrap_err().to_string().contains("configured with sinks"));
        a.sinks().unwrap().unwrap().to_vec()
    });
    assert_eq!(got, vec![vec![0.5, -1.0, 2.0], vec![0.25, -3.0]]);
}
