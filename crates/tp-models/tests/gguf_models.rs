//! Whole models from GGUF files, written by the `gguf` Python package (llama.cpp's own writer
//! and quantizers) from Hugging Face folders (`crates/tp-testing/gguf/write_gguf.py`), at world
//! sizes 1..=8:
//!
//! * dequantized while loading (`--dtype f32`), a GGUF model equals, bit for bit, the same model
//!   loaded from the Hugging Face folder of its dequantized weights that the script writes beside
//!   it (`--ref`): the weights `gguf.quants.dequantize` gives, with llama.cpp's Q/K row order
//!   undone, which is what transformers' GGUF loader holds for the same file;
//! * run on its quantized blocks (no dtype), it stays within 6% of the largest
//!   logit of that model (the activations are quantized to 8 bits per block; each layer's bound
//!   is tp-cpu's `quant_matmul`'s) and picks the same greedy tokens wherever the reference's
//!   best two logits are further apart than the error seen.
//!
//! Gemma 3, Phi-3 and OLMo 2 run through what llama.cpp changes for them: Gemma's norms stored
//! as `1 + w`, its sliding layers (a window shorter than the prompt, a per-layer pattern), local
//! rope base, linear scaling of the global layers and final soft-capping; Phi-3's fused QKV and
//! gate-up tensors, partial rotary embedding (24 of 32 features), LongRoPE factors as tensors
//! (long ones in use: the prompt is longer than its original context of 4) and sliding window;
//! OLMo 2's post-norms. Files tp must refuse are refused with errors naming what it cannot read.
//!
//! The shapes are off the blocks at most TP degrees: 8 query heads of 32 over 2 KV heads, so at
//! 3, 5, 6 and 7 ranks the output projection's column ranges cut 32- and 256-element blocks; an
//! intermediate size of 768 (three 256-blocks) split in balanced, unaligned ranges; a vocabulary
//! of 1001.
//!
//! The script needs python3 with the `gguf` package (`pip install gguf==0.19.0`; `cargo xtask
//! test` installs it): without it these tests fail, naming it.

mod common;
use common::*;
use serde_json::json;
use std::path::{Path, PathBuf};
use tp_core::DType;
use tp_models::{Architecture, ModelConfig, ModelOptions, ParallelCausalLm};
use tp_testing::synthetic::SyntheticModel;

const PROMPT: [i64; 9] = [1, 523, 17, 999, 1000, 4, 311, 77, 2];

fn spec(architecture: Architecture, tie: bool, seed: u64) -> SyntheticModel {
    gguf_spec(architecture, tie, seed)
}

/// Gemma 3 with a sliding window of 4 (shorter than the prompt) on llama.cpp's default layers
/// (every 6th full: here both slide); with `extras`, layers that slide and attend fully in turn,
/// a local rope base of 20000, linear scaling 8 on the global layers, soft-capping at 30.
fn gemma3(tie: bool, seed: u64, extras: bool) -> SyntheticModel {
    let mut extra = json!({"query_pre_attn_scalar": 32, "sliding_window": 4});
    if extras {
        extra["layer_types"] = json!(["sliding_attention", "full_attention"]);
        extra["rope_local_base_freq"] = json!(20_000.0);
        extra["final_logit_softcapping"] = json!(30.0);
    }
    SyntheticModel {
        extra: Some(extra),
        rope_scaling: extras.then(|| json!({"rope_type": "linear", "factor": 8.0})),
        ..spec(Architecture::Gemma3, tie, seed)
    }
}

/// Phi-3 rotating 24 of 32 features per head, a sliding window of 4; with `longrope`, LongRoPE
/// factors (not f32 values: the file rounds them) over an original context of 4.
fn phi3(seed: u64, longrope: bool) -> SyntheticModel {
    let factors = |a: f64| (0..12).map(|i| a + 0.1 * i as f64).collect::<Vec<_>>();
    SyntheticModel {
        extra: Some(json!({"partial_rotary_factor": 0.75, "original_max_position_embeddings": 4})),
        rope_scaling: longrope
            .then(|| json!({"type": "longrope", "long_factor": factors(1.3), "short_factor": factors(0.9)})),
        sliding_window: Some(4),
        ..spec(Architecture::Phi3, false, seed)
    }
}

/// Writes `spec` as a Hugging Face folder, then as a GGUF file of `qtype` with its dequantized
/// reference folder; returns `(gguf file, reference folder)`.
fn write(test: &str, spec: &SyntheticModel, qtype: &str) -> (PathBuf, PathBuf) {
    write_with(test, spec, qtype, &[])
}

/// [`write`] with more arguments to the script (`--meta`, `--drop-tensor`, `--extra-tensor`,
/// `--pad`).
fn write_with(test: &str, spec: &SyntheticModel, qtype: &str, args: &[&str]) -> (PathBuf, PathBuf) {
    let dir = tmpdir(&format!("gguf-{test}-{qtype}"));
    let hf = dir.join("hf");
    spec.write(&hf).unwrap();
    let (gguf, reference) = (dir.join("model.gguf"), dir.join("ref"));
    write_gguf(&hf, &gguf, qtype, &reference, args);
    (gguf, reference)
}

fn prefill(path: &Path, world: usize, opts: ModelOptions) -> Vec<Vec<f64>> {
    on_ranks(world, CPU, |g| {
        let mut lm = ParallelCausalLm::load(path, &g, &opts).unwrap();
        f64s(&lm.prefill(&PROMPT).unwrap())
    })
}

/// Rows of `[T, V]` logits.
fn rows(logits: &[f64], vocab: usize) -> Vec<&[f64]> {
    logits.chunks(vocab).collect()
}

#[test]
fn dequantized_gguf_equals_its_reference_bit_for_bit_at_every_world_size() {
    let cases = [
        ("llama-Q4_0", spec(Architecture::Llama, false, 11), "Q4_0"),
        ("llama-mixed-legacy", spec(Architecture::Llama, true, 12), "MIXED_LEGACY"),
        ("llama-mixed-k", spec(Architecture::Llama, false, 13), "MIXED_K"),
        ("qwen2-Q8_0", spec(Architecture::Qwen2, false, 14), "Q8_0"),
        ("qwen3-Q5_K", spec(Architecture::Qwen3, true, 15), "Q5_K"),
        ("gemma3-mixed-k", gemma3(true, 16, true), "MIXED_K"),
        ("phi3-longrope-Q4_0", phi3(17, true), "Q4_0"),
        ("olmo2-Q5_1", spec(Architecture::Olmo2, false, 18), "Q5_1"),
    ];
    for (name, spec, qtype) in cases {
        let (gguf, reference) = write(name, &spec, qtype);
        let read = tp_models::gguf::GgufModel::open(&gguf).unwrap().config;
        assert_eq!(read, ModelConfig::from_dir(&reference).unwrap(), "{name}: the file's config");
        for world in 1..=8 {
            let f32s = ModelOptions::new().with_dtype(DType::F32);
            let got = prefill(&gguf, world, f32s);
            let want = prefill(&reference, world, f32s);
            for (rank, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(g == w, "{name} TP {world} rank {rank}: GGUF logits differ from the reference folder's");
            }
        }
    }
}

#[test]
fn every_block_type_loads_dequantized() {
    let spec = spec(Architecture::Llama, false, 21);
    for qtype in ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
    {
        let (gguf, reference) = write("types", &spec, qtype);
        let f32s = ModelOptions::new().with_dtype(DType::F32);
        let (got, want) = (prefill(&gguf, 3, f32s), prefill(&reference, 3, f32s));
        assert!(got == want, "{qtype} at TP 3: GGUF logits differ from the reference folder's");
    }
}

#[test]
fn quantized_runs_stay_near_the_dequantized_model_and_pick_its_tokens() {
    let cases = [
        ("llama-Q4_0", spec(Architecture::Llama, false, 31), "Q4_0"),
        ("llama-Q8_0-tied", spec(Architecture::Llama, true, 32), "Q8_0"),
        ("llama-mixed-k", spec(Architecture::Llama, false, 33), "MIXED_K"),
        ("qwen2-mixed-legacy", spec(Architecture::Qwen2, false, 34), "MIXED_LEGACY"),
        ("gemma3-Q8_0-tied", gemma3(true, 35, false), "Q8_0"),
        ("phi3-mixed-k", phi3(36, false), "MIXED_K"),
    ];
    for (name, spec, qtype) in cases {
        let (gguf, reference) = write(name, &spec, qtype);
        let want = prefill(&reference, 1, ModelOptions::new().with_dtype(DType::F32)).remove(0);
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        let one = prefill(&gguf, 1, ModelOptions::new()).remove(0);
        for world in 1..=8 {
            let got = prefill(&gguf, world, ModelOptions::new());
            assert!(got.iter().all(|l| l == &got[0]), "{name} TP {world}: ranks disagree");
            let err = got[0].iter().zip(&want).fold(0f64, |m, (g, w)| m.max((g - w).abs()));
            assert!(err > 0.0, "{name} TP {world}: the 8-bit activations must change something");
            eprintln!("{name} TP {world}: max |error| {err:.4} of largest logit {scale:.3}");
            assert!(err <= 0.06 * scale, "{name} TP {world}: max |error| {err} of largest logit {scale}");
            // The same greedy token wherever the reference's best two are further apart than
            // twice the error.
            for (t, (g, w)) in rows(&got[0], spec.vocab_size).into_iter().zip(rows(&want, spec.vocab_size)).enumerate()
            {
                let best = argmax(w);
                let second =
                    w.iter().enumerate().filter(|&(i, _)| i != best).fold(f64::NEG_INFINITY, |m, (_, &v)| m.max(v));
                if w[best] - second > 2.0 * err {
                    assert_eq!(argmax(g), best, "{name} TP {world} position {t}");
                }
            }
            // Different TP degrees quantize the activations over the same blocks (a rank's
            // column range is padded to whole blocks, never re-blocked), so they agree closely.
            let drift = got[0].iter().zip(&one).fold(0f64, |m, (g, w)| m.max((g - w).abs()));
            assert!(drift <= 0.06 * scale, "{name} TP {world} vs TP 1: {drift}");
        }
    }
}

/// transformers reads `tokenizer.ggml.padding_token_id` as the config's `pad_token_id` (the
/// embedding's `padding_idx`, which training leaves untrained); one past the vocabulary is left
/// out, as llama.cpp ignores a bad special id.
#[test]
fn the_files_padding_token_is_the_models_pad_token_id() {
    let pad =
        |id: i64| SyntheticModel { extra: Some(json!({"pad_token_id": id})), ..spec(Architecture::Llama, true, 19) };
    let (gguf, reference) = write("llama-pad", &pad(76), "F32");
    let read = tp_models::gguf::GgufModel::open(&gguf).unwrap().config;
    assert_eq!(read.pad_token_id, Some(76));
    assert_eq!(read, ModelConfig::from_dir(&reference).unwrap());
    let (gguf, _) = write_with("llama-pad-outside", &spec(Architecture::Llama, true, 19), "F32", &["--pad", "5000"]);
    assert_eq!(tp_models::gguf::GgufModel::open(&gguf).unwrap().config.pad_token_id, None);
}

#[test]
fn a_folder_holding_one_gguf_file_loads_as_the_file() {
    let spec = spec(Architecture::Llama, false, 41);
    let (gguf, _) = write("folder", &spec, "Q8_0");
    let folder = gguf.parent().unwrap().join("only");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::copy(&gguf, folder.join("tiny-q8_0.gguf")).unwrap();
    let f32s = ModelOptions::new().with_dtype(DType::F32);
    assert!(prefill(&folder, 2, f32s) == prefill(&gguf, 2, f32s));
    // Two GGUF files: which one to run is the user's to say.
    std::fs::copy(&gguf, folder.join("other.gguf")).unwrap();
    let err = on_ranks(1, CPU, |g| ParallelCausalLm::load(&folder, &g, &f32s).map(|_| ()).unwrap_err().to_string());
    assert!(err[0].contains("2 GGUF files"), "{}", err[0]);
}

/// Files llama.cpp writes or reads that tp cannot run as they say are refused by name.
#[test]
fn files_tp_cannot_read_are_refused_naming_why() {
    let cases: [(&str, SyntheticModel, &[&str], &str); 5] = [
        ("olmo3-window", spec(Architecture::Olmo2, false, 51), &["--meta", "attention.sliding_window=8"], "OLMo 3"),
        ("phi3-bias", phi3(52, false), &["--extra-tensor", "blk.0.attn_qkv.bias"], "blk.0.attn_qkv.bias"),
        ("phi3-one-factor", phi3(53, true), &["--drop-tensor", "rope_factors_short.weight"], "LongRoPE needs both"),
        (
            "gemma3-partial",
            gemma3(true, 54, false),
            &["--meta", "rope.dimension_count=16"],
            "rotates part of each head",
        ),
        (
            "llama-rope-factors",
            spec(Architecture::Llama, false, 55),
            &["--extra-tensor", "rope_factors_long.weight"],
            "no place",
        ),
    ];
    for (name, spec, args, want) in cases {
        let (gguf, _) = write_with(name, &spec, "Q8_0", args);
        let err = tp_models::gguf::GgufModel::open(&gguf).map(|_| ()).unwrap_err().to_string();
        assert!(err.contains(want), "{name}: {err}");
        eprintln!("{name}: {err}");
    }
}

/// A GGUF model opened once (`ModelSource`) loads on every rank from that one open file: the
/// file can be gone from the disk by then, and the ranks still load, with the logits of a model
/// loaded from the path, and the config the file gave.
#[test]
fn every_rank_loads_from_the_file_opened_once() {
    let (gguf, _) = write("opened-once", &spec(Architecture::Llama, false, 31), "Q8_0");
    let want = prefill(&gguf, 2, ModelOptions::new());
    let source = tp_models::ModelSource::open(&gguf).unwrap();
    assert_eq!(source.config().unwrap(), tp_models::ModelConfig::from_dir(&gguf).unwrap());
    assert_eq!(source.path(), gguf.as_path());
    std::fs::remove_file(&gguf).unwrap();
    assert!(tp_models::ModelSource::open(&gguf).is_err(), "the path is gone");
    let config = source.config().unwrap();
    let got = on_ranks(2, CPU, |g| {
        let whole = tp_models::StagePart::whole(config.num_hidden_layers);
        let mut lm = ParallelCausalLm::load_part_from(&source, &config, &g, &ModelOptions::new(), &whole).unwrap();
        f64s(&lm.prefill(&PROMPT).unwrap())
    });
    assert_eq!(got, want);
}

/// A mixture of experts of `architecture` (8 experts of 256 features, 2 per token) with the
/// family's quirks: Qwen3-MoE renormalised with a dense first layer's MLP missing (all MoE, as
/// llama.cpp writes it), Qwen2-MoE with a shared expert, Mixtral, OLMoE.
fn moe(architecture: Architecture, seed: u64) -> SyntheticModel {
    let extra = match architecture {
        Architecture::Mixtral => json!({"num_local_experts": 8, "num_experts_per_tok": 2}),
        Architecture::Qwen3Moe => {
            json!({"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256, "norm_topk_prob": true})
        }
        Architecture::Qwen2Moe => json!({"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
            "shared_expert_intermediate_size": 512, "norm_topk_prob": false}),
        _ => json!({"num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": false}),
    };
    SyntheticModel { intermediate_size: 256, extra: Some(extra), ..spec(architecture, false, seed) }
}

/// MoE GGUF files (llama.cpp's layout: the router `ffn_gate_inp`, each projection's experts
/// stacked in one 3-D tensor, Qwen2-MoE's `*_shexp`): the config the metadata implies equals the
/// original's, the dequantized model equals its reference folder bit for bit at TP 1 to 4 (the
/// experts' blocks read per expert and per rank), and the quantized run (the experts' products on
/// their blocks) stays near it, picking its tokens.
#[test]
fn moe_gguf_files_load_as_their_originals() {
    let cases = [
        ("qwen3moe-Q8_0", moe(Architecture::Qwen3Moe, 41), "Q8_0"),
        ("qwen2moe-mixed-k", moe(Architecture::Qwen2Moe, 42), "MIXED_K"),
        ("mixtral-Q4_0", moe(Architecture::Mixtral, 43), "Q4_0"),
        ("olmoe-mixed-legacy", moe(Architecture::Olmoe, 44), "MIXED_LEGACY"),
    ];
    for (name, spec, qtype) in cases {
        let (gguf, reference) = write(name, &spec, qtype);
        let read = tp_models::gguf::GgufModel::open(&gguf).unwrap().config;
        assert!(read.moe.is_some(), "{name}: experts");
        assert_eq!(read, ModelConfig::from_dir(&reference).unwrap(), "{name}: the file's config");
        let f32s = ModelOptions::new().with_dtype(DType::F32);
        let want = prefill(&reference, 1, f32s).remove(0);
        for world in 1..=4 {
            let (got, theirs) = (prefill(&gguf, world, f32s), prefill(&reference, world, f32s));
            assert!(got == theirs, "{name} TP {world}: GGUF logits differ from the reference's");
        }
        // The quantized run (8-bit activations into the experts' blocks) stays near the
        // dequantized model at every position whose routing it keeps; a router near a tie may
        // send one token elsewhere, which moves that position's logits more (one position of
        // the prompt at most).
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        for world in [1, 3] {
            let got = prefill(&gguf, world, ModelOptions::new()).remove(0);
            let per: Vec<f64> = rows(&got, spec.vocab_size)
                .iter()
                .zip(rows(&want, spec.vocab_size))
                .map(|(g, w)| g.iter().zip(w.iter()).fold(0f64, |m, (a, b)| m.max((a - b).abs())) / scale)
                .collect();
            let off = per.iter().filter(|&&e| e > 0.06).count();
            assert!(
                off <= 1,
                "{name} quantized TP {world}: positions off by more than 6% of the largest logit: {per:?}"
            );
            let mut sorted = per.clone();
            sorted.sort_by(f64::total_cmp);
            assert!(sorted[sorted.len() / 2] <= 0.03, "{name} quantized TP {world}: median error {per:?}");
        }
    }
}

/// An MoE file whose metadata disagrees with its tensors is refused at load, naming the key or
/// the tensor: more experts per token than experts, or an expert count the stacked tensors do
/// not have.
#[test]
fn moe_files_that_disagree_are_refused_by_name() {
    let spec = moe(Architecture::Qwen3Moe, 45);
    let (gguf, _) = write_with("moe-topk", &spec, "Q8_0", &["--meta", "expert_used_count=9"]);
    let e = tp_models::gguf::GgufModel::open(&gguf).unwrap_err().to_string();
    assert!(e.contains("num_experts_per_tok") && e.contains("exceeds the 8 experts"), "{e}");
    let (gguf, _) = write_with("moe-count", &spec, "Q8_0", &["--meta", "expert_count=6"]);
    let e = on_ranks(2, CPU, |g| ParallelCausalLm::load(&gguf, &g, &ModelOptions::new()).unwrap_err().to_string())
        .remove(0);
    assert!(e.contains("gate.weight") && e.lines().count() == 1, "{e}");
}
