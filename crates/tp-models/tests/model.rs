//! Whole models written by the tests in Hugging Face's layout (config.json, several safetensors
//! files and an index; uneven vocabulary and heads; tied and untied; Llama, Qwen2 and Mistral
//! flavours; both config forms), run at world sizes 1..=8 against an independent float64
//! forward and against each other.

mod common;
use common::*;
use serde_json::json;
use std::path::PathBuf;
use tp_core::DType;
use tp_models::{Architecture, GenerateOptions, ModelError, ModelOptions, ParallelCausalLm};
use tp_testing::synthetic::SyntheticModel;

/// A named model flavour and the world sizes its heads can be placed on.
struct Flavour {
    name: &'static str,
    spec: SyntheticModel,
    worlds: Vec<usize>,
}

fn flavours() -> Vec<Flavour> {
    let tiny = SyntheticModel::tiny(); // Llama, 12 heads (MHA) of 4, vocab 1001, untied, 2 files
    vec![
        Flavour { name: "llama", spec: tiny.clone(), worlds: (1..=8).collect() },
        Flavour {
            name: "llama-gqa-tied-llama3",
            spec: SyntheticModel {
                num_attention_heads: 16,
                num_key_value_heads: 4,
                head_dim: Some(6),
                tie_word_embeddings: true,
                attention_bias: true,
                rope_theta: 500_000.0,
                rope_scaling: Some(json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
                files: 3,
                seed: 2,
                ..tiny.clone()
            },
            // 16 query heads over 4 KV heads at every world size: at 3, 5, 6 and 7 ranks
            // some ranks' query heads straddle two KV heads, and they hold both.
            worlds: (1..=8).collect(),
        },
        Flavour {
            name: "qwen2-tied-v5",
            spec: SyntheticModel {
                architecture: Architecture::Qwen2,
                tie_word_embeddings: true,
                transformers_v5: true,
                rope_theta: 1_000_000.0,
                num_key_value_heads: 6,
                seed: 3,
                ..tiny.clone()
            },
            worlds: vec![1, 2, 3, 4, 5, 6, 7, 8],
        },
        Flavour {
            // Qwen2 with use_sliding_window: a window of 4 on the layers from
            // max_window_layers (1) on, layer 0 full, as transformers' Qwen2 builds them.
            name: "qwen2-sliding-from-layer-1",
            spec: SyntheticModel {
                architecture: Architecture::Qwen2,
                sliding_window: Some(4),
                num_key_value_heads: 4,
                seed: 10,
                extra: Some(json!({"max_window_layers": 1})),
                ..tiny.clone()
            },
            worlds: vec![1, 2, 3],
        },
        Flavour {
            name: "mistral-window",
            spec: SyntheticModel {
                architecture: Architecture::Mistral,
                sliding_window: Some(5),
                num_key_value_heads: 4,
                num_attention_heads: 8,
                head_dim: Some(6),
                files: 1,
                seed: 4,
                ..tiny.clone()
            },
            worlds: vec![1, 2, 3, 5, 8],
        },
        Flavour {
            // Qwen3: per-head q/k norm, 12 query over 4 KV heads (straddled at 5..8), biases.
            name: "qwen3-qknorm-bias",
            spec: SyntheticModel {
                architecture: Architecture::Qwen3,
                num_key_value_heads: 4,
                head_dim: Some(8),
                attention_bias: true,
                rope_theta: 1_000_000.0,
                seed: 5,
                ..tiny.clone()
            },
            worlds: (1..=8).collect(),
        },
        Flavour {
            // Gemma 3: (1 + w) norms, sandwich norms, GeGLU, scaled embeddings, its attention
            // scale, sliding layers with their own rope base (layers 0 and 1; 2 is global),
            // final-logit soft-capping low enough to bend the logits.
            name: "gemma3-sandwich-window-softcap",
            spec: SyntheticModel {
                architecture: Architecture::Gemma3,
                num_attention_heads: 8,
                num_key_value_heads: 2,
                head_dim: Some(8),
                tie_word_embeddings: true,
                sliding_window: Some(4),
                seed: 6,
                extra: Some(json!({"query_pre_attn_scalar": 12, "sliding_window_pattern": 3,
                    "rope_local_base_freq": 500.0, "final_logit_softcapping": 3.0})),
                ..tiny.clone()
            },
            worlds: (1..=8).collect(),
        },
        Flavour {
            // Phi-3: fused qkv_proj and gate_up_proj, each part sharded on its own.
            name: "phi3-fused",
            spec: SyntheticModel {
                architecture: Architecture::Phi3,
                num_key_value_heads: 4,
                head_dim: Some(8),
                seed: 7,
                ..tiny.clone()
            },
            worlds: (1..=8).collect(),
        },
        Flavour {
            // Phi-3 with LongRoPE: the prompt (9) is past the original length (8), so the long
            // factors rotate every call; cos/sin times sqrt(1 + ln 8 / ln 8).
            // As Phi-4-mini: partial rotary (0.75: 6 of the 8 features of a head turn, so the
            // LongRoPE lists hold 3 pairs).
            name: "phi3-longrope-partial",
            spec: SyntheticModel {
                architecture: Architecture::Phi3,
                num_key_value_heads: 6,
                head_dim: Some(8),
                seed: 9,
                extra: Some(json!({"original_max_position_embeddings": 8, "partial_rotary_factor": 0.75,
                    "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.5, 3.0],
                        "long_factor": [1.0, 2.0, 9.0]}})),
                ..tiny.clone()
            },
            worlds: vec![1, 2, 5, 8],
        },
        Flavour {
            // OLMo 2: norms after attention and the MLP, q/k norm over the full width with
            // uneven and replicated KV heads (6 KV heads over 8 ranks; 12/6 at 5 and 7).
            name: "olmo2-full-width-qk",
            spec: SyntheticModel {
                architecture: Architecture::Olmo2,
                num_key_value_heads: 6,
                head_dim: Some(8),
                seed: 8,
                ..tiny
            },
            worlds: (1..=8).collect(),
        },
    ]
}

/// Writes the flavour into a folder of its own for test `test` (tests run concurrently).
fn write(test: &str, f: &Flavour) -> PathBuf {
    let dir = tmpdir(&format!("{test}-{}", f.name));
    f.spec.write(&dir).unwrap();
    dir
}

const PROMPT: [i64; 9] = [1, 523, 17, 999, 1000, 4, 311, 77, 2];

fn prefill_on(dir: &PathBuf, world: usize, dtype: DType, ids: &[i64]) -> Vec<Vec<f64>> {
    on_ranks(world, CPU, |g| {
        let mut lm = ParallelCausalLm::load(dir, &g, &ModelOptions::new().with_dtype(dtype)).unwrap();
        f64s(&lm.prefill(ids).unwrap())
    })
}

#[test]
fn tp1_logits_match_the_f64_forward_and_tp_n_matches_tp1() {
    for f in flavours() {
        let dir = write("tp1_logits_match_the", &f);
        let want = reference_logits(&dir, &PROMPT);
        let one = prefill_on(&dir, 1, DType::F32, &PROMPT).remove(0);
        assert_close(&format!("{} TP 1 vs f64", f.name), &one, &want, 2e-5);
        for &world in &f.worlds[1..] {
            let got = prefill_on(&dir, world, DType::F32, &PROMPT);
            for logits in &got {
                assert_close(&format!("{} TP {world} vs TP 1", f.name), logits, &one, 1e-5);
            }
            assert!(got.iter().all(|l| l == &got[0]), "{} TP {world}: ranks disagree", f.name);
        }
    }
}

#[test]
fn bf16_stays_within_its_rounding_at_every_world_size() {
    for f in flavours().into_iter().take(2) {
        let dir = write("bf16_stays_within_it", &f);
        let want = reference_logits(&dir, &PROMPT);
        for &world in &f.worlds {
            let got = prefill_on(&dir, world, DType::BF16, &PROMPT);
            assert_close(&format!("{} bf16 TP {world} vs f64", f.name), &got[0], &want, 0.06);
        }
    }
}

#[test]
fn prefill_then_decode_steps_equal_recomputing_the_sequence() {
    for f in flavours() {
        let dir = write("prefill_then_decode_", &f);
        let world = f.worlds[f.worlds.len() / 2];
        let full: Vec<i64> = PROMPT.iter().copied().chain([8, 900, 13, 5]).collect();
        let out = on_ranks(world, CPU, |g| {
            let mut lm = ParallelCausalLm::load(&dir, &g, &ModelOptions::new()).unwrap();
            let all = f64s(&lm.prefill(&full).unwrap());
            let mut rows = vec![f64s(&lm.prefill(&PROMPT).unwrap())];
            for &id in &full[PROMPT.len()..] {
                rows.push(f64s(&lm.decode_step(id).unwrap()));
                assert_eq!(lm.position(), rows.len() + PROMPT.len() - 1);
            }
            (all, rows.concat())
        });
        for (all, steps) in out {
            assert_close(&format!("{} decode vs recompute", f.name), &steps, &all, 1e-5);
        }
    }
}

#[test]
fn greedy_tokens_are_identical_on_every_rank_and_follow_the_reference() {
    for f in flavours() {
        let dir = write("greedy_tokens_are_id", &f);
        let n = 6;
        for &world in &f.worlds {
            let got = on_ranks(world, CPU, |g| {
                let mut lm = ParallelCausalLm::load(&dir, &g, &ModelOptions::new()).unwrap();
                let opts = GenerateOptions::new().ignore_eos(true);
                (
                    lm.generate(&PROMPT, n, &opts).unwrap().tokens,
                    lm.generate(&PROMPT, n, &opts.keep_logits(true)).unwrap(),
                )
            });
            let tokens = &got[0].0;
            assert_eq!(tokens.len(), n);
            for (t, with_logits) in &got {
                assert_eq!(t, tokens, "{} TP {world}: ranks disagree", f.name);
                assert_eq!(&with_logits.tokens, tokens, "keeping logits changes nothing");
                let (p, d) =
                    (with_logits.prefill_logits.as_ref().unwrap(), with_logits.decode_logits.as_ref().unwrap());
                assert_eq!((p.dims(), d.dims()), (&[PROMPT.len(), 1001][..], &[n - 1, 1001][..]));
            }
            // Each token is the reference's argmax given the tokens before it (or within
            // rounding of it, should two logits nearly tie).
            let mut seq = PROMPT.to_vec();
            for &t in tokens {
                let logits = reference_logits(&dir, &seq);
                let last = &logits[(seq.len() - 1) * 1001..];
                let best = argmax(last);
                assert!(last[t as usize] >= last[best] - 1e-4 * last[best].abs().max(1.0), "{} TP {world}", f.name);
                seq.push(t);
            }
        }
    }
}

#[test]
fn generation_stops_at_end_of_sequence_unless_told_not_to() {
    let f = &flavours()[0];
    let dir = write("generation_stops_at_", f);
    let free = on_ranks(1, CPU, |g| {
        let mut lm = ParallelCausalLm::load(&dir, &g, &ModelOptions::new()).unwrap();
        lm.generate(&PROMPT, 5, &GenerateOptions::new().ignore_eos(true)).unwrap().tokens
    })
    .remove(0);
    // Make the third generated token the end of sequence (through generation_config.json,
    // which wins over config.json as in transformers).
    let eos = free[2];
    std::fs::write(dir.join("generation_config.json"), json!({"eos_token_id": [99999, eos]}).to_string()).unwrap();
    let got = on_ranks(2, CPU, |g| {
        let mut lm = ParallelCausalLm::load(&dir, &g, &ModelOptions::new()).unwrap();
        let stop = lm.generate(&PROMPT, 5, &GenerateOptions::new().keep_logits(true)).unwrap();
        let go = lm.generate(&PROMPT, 5, &GenerateOptions::new().ignore_eos(true)).unwrap();
        (stop, go.tokens)
    });
    for (stop, go) in got {
        assert_eq!(stop.tokens, free[..3].to_vec(), "stops after the eos token, which is kept");
        assert_eq!(stop.decode_logits.unwrap().dims(), &[2, 1001]);
        assert_eq!(go, free);
    }
}

#[track_caller]
fn load_err(dir: &PathBuf, world: usize) -> ModelError {
    on_ranks(world, CPU, |g| ParallelCausalLm::load(dir, &g, &ModelOptions::new()).err()).remove(0).expect("an error")
}

#[test]
fn bad_models_are_typed_errors_naming_the_problem() {
    let f = &flavours()[0];
    let good = write("bad_models_are_typed", f);
    let copy = |name: &str| {
        let d = tmpdir(name);
        for e in std::fs::read_dir(&good).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
        }
        d
    };
    // Missing, invalid, unknown architecture.
    let d = copy("noconfig");
    std::fs::remove_file(d.join("config.json")).unwrap();
    assert!(matches!(load_err(&d, 1), ModelError::ConfigFile { .. }));
    std::fs::write(d.join("config.json"), "{\"vocab_size\": 10,").unwrap();
    let e = load_err(&d, 1);
    assert!(matches!(&e, ModelError::ConfigFile { why, .. } if why.contains("invalid JSON")), "{e}");
    let mut c = f.spec.config_json();
    c["architectures"] = json!(["GPT2LMHeadModel"]);
    std::fs::write(d.join("config.json"), c.to_string()).unwrap();
    let e = load_err(&d, 1);
    assert!(matches!(&e, ModelError::UnknownArchitecture { name, .. } if name == "GPT2LMHeadModel"), "{e}");
    // Config and tensors disagree: a hidden size the files do not have.
    let mut c = f.spec.config_json();
    c["intermediate_size"] = json!(78);
    std::fs::write(d.join("config.json"), c.to_string()).unwrap();
    let e = load_err(&d, 1);
    assert!(
        matches!(&e, tp_models::ModelError::Layer(tp_layers::LayerError::WrongShape { name, .. }) if name.contains("gate_proj")),
        "{e}"
    );
    // A missing layer tensor: an index naming a tensor that no file holds, or a file without it.
    let d = copy("missing");
    let mut c = f.spec.config_json();
    c["num_hidden_layers"] = json!(4);
    std::fs::write(d.join("config.json"), c.to_string()).unwrap();
    let e = load_err(&d, 1);
    assert!(e.to_string().contains("model.layers.3."), "{e}");
    // Heads that cannot be placed: 16 query heads over 17 ranks (one would hold none).
    let g = &flavours()[1];
    let d = tmpdir("placement");
    g.spec.write(&d).unwrap();
    let e = load_err(&d, 17);
    assert!(matches!(e, ModelError::Layer(tp_layers::LayerError::Config(_))), "{e}");
    assert!(e.to_string().contains("16 query heads cannot be placed on 17 ranks"), "{e}");
}

#[test]
fn bad_requests_are_typed_errors() {
    let f = &flavours()[0];
    let dir = write("bad_requests_are_typ", f);
    on_ranks(2, CPU, |g| {
        let mut lm = ParallelCausalLm::load(&dir, &g, &ModelOptions::new()).unwrap();
        let opts = GenerateOptions::new();
        let msg = |r: tp_models::Result<tp_models::Generation>| r.unwrap_err().to_string();
        assert!(msg(lm.generate(&[1, 1001], 2, &opts)).contains("1001"));
        assert!(msg(lm.generate(&[1, -3], 2, &opts)).contains("-3"));
        assert!(msg(lm.generate(&PROMPT, 0, &opts)).contains("at least 1"));
        assert!(msg(lm.generate(&[], 3, &opts)).contains("empty"));
        // max_position_embeddings is 64: 9 + 56 > 64.
        assert!(msg(lm.generate(&PROMPT, 56, &opts)).contains("max_position_embeddings"));
        assert_eq!(lm.generate(&PROMPT, 55, &opts.ignore_eos(true)).unwrap().tokens.len(), 55);
        // Past the cache: prefill of 60, then decode steps up to 64 positions, then an error.
        lm.prefill(&[5; 60]).unwrap();
        for _ in 0..4 {
            lm.decode_step(7).unwrap();
        }
        assert!(lm.decode_step(7).is_err());
        assert!(matches!(lm.prefill(&[1, 5000]), Err(ModelError::Layer(_))), "id past the vocabulary");
    });
}
