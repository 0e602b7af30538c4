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
//! The shapes are off the blocks at most TP degrees: 8 query heads of 32 over 2 KV heads, so at
//! 3, 5, 6 and 7 ranks the output projection's column ranges cut 32- and 256-element blocks; an
//! intermediate size of 768 (three 256-blocks) split in balanced, unaligned ranges; a vocabulary
//! of 1001.
//!
//! The script needs python3 with the `gguf` package (`pip install gguf==0.19.0`; `cargo xtask
//! test` installs it): without it these tests fail, naming it.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use tp_core::DType;
use tp_models::{Architecture, ModelOptions, ParallelCausalLm};
use tp_testing::synthetic::SyntheticModel;

const PROMPT: [i64; 9] = [1, 523, 17, 999, 1000, 4, 311, 77, 2];

fn spec(architecture: Architecture, tie: bool, seed: u64) -> SyntheticModel {
    SyntheticModel {
        architecture,
        vocab_size: 1001,
        hidden_size: 256,
        intermediate_size: 768,
        num_hidden_layers: 2,
        num_attention_heads: 8,
        num_key_value_heads: 2,
        head_dim: Some(32),
        tie_word_embeddings: tie,
        max_position_embeddings: 64,
        files: 1,
        seed,
        ..SyntheticModel::tiny()
    }
}

/// The script beside tp-testing's sources.
fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tp-testing/gguf/write_gguf.py")
}

/// Writes `spec` as a Hugging Face folder, then as a GGUF file of `qtype` with its dequantized
/// reference folder; returns `(gguf file, reference folder)`.
fn write(test: &str, spec: &SyntheticModel, qtype: &str) -> (PathBuf, PathBuf) {
    let dir = tmpdir(&format!("gguf-{test}-{qtype}"));
    let hf = dir.join("hf");
    spec.write(&hf).unwrap();
    let (gguf, reference) = (dir.join("model.gguf"), dir.join("ref"));
    let out = Command::new("python3")
        .arg(script())
        .args([hf.as_os_str(), gguf.as_os_str()])
        .args(["--type", qtype, "--ref"])
        .arg(&reference)
        .output()
        .expect("python3 must be installed for the GGUF tests");
    assert!(
        out.status.success(),
        "write_gguf.py failed (the GGUF tests need python3 with `pip install gguf==0.19.0`): {}",
        String::from_utf8_lossy(&out.stderr)
    );
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
    ];
    for (name, spec, qtype) in cases {
        let (gguf, reference) = write(name, &spec, qtype);
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
