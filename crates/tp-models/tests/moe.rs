//! Mixture-of-experts models against transformers: tiny random checkpoints of Qwen3-MoE,
//! Qwen2-MoE, Mixtral and OLMoE, written by transformers with their quirks on, and
//! transformers' float64 logits and greedy tokens on them (`benches/reference/moe_fixtures.py`
//! wrote both into `tests/data/moe/`). tp loads each at TP 1, 2, 3, 4 and 8 (experts' features,
//! heads and vocabulary split unevenly), from the Hub's one-tensor-per-expert layout and from
//! transformers 5's fused expert tensors, and must match.

mod common;

use common::{CPU, on_ranks};
use std::path::Path;
use tp_core::DType;
use tp_models::{ModelOptions, ParallelCausalLm};

use common::moe_case as case;
use common::moe_reference as reference;

/// `max |got - want| / max |want|`.
fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f64, f64::max) / scale
}

/// Rank 0's prefill logits of the prompt, then the logits of each greedy step (the token
/// picked by the previous logits fed back), and the tokens.
fn run(dir: &Path, world: usize, dtype: DType, prompt: &[i64], steps: usize) -> (Vec<f64>, Vec<Vec<f64>>, Vec<i64>) {
    run_with(dir, world, ModelOptions::new().with_dtype(dtype), prompt, steps)
}

fn run_with(
    dir: &Path,
    world: usize,
    opts: ModelOptions,
    prompt: &[i64],
    steps: usize,
) -> (Vec<f64>, Vec<Vec<f64>>, Vec<i64>) {
    let mut out = on_ranks(world, CPU, |g| {
        let mut lm = ParallelCausalLm::load(dir, &g, &opts).unwrap();
        let vocab = lm.config().vocab_size;
        let prefill = lm.prefill(prompt).unwrap().to_f64_vec().unwrap();
        let mut last = prefill[prefill.len() - vocab..].to_vec();
        let (mut decode, mut tokens) = (Vec::new(), Vec::new());
        for _ in 0..steps {
            let t = common::argmax(&last) as i64;
            tokens.push(t);
            decode.push(last.clone());
            last = lm.decode_step(t).unwrap().to_f64_vec().unwrap();
        }
        (prefill, decode, tokens)
    });
    out.swap_remove(0)
}

fn check(name: &str, folder: &Path, worlds: &[usize]) {
    check_with(name, folder, worlds, ModelOptions::new().with_dtype(DType::F32));
}

fn check_with(name: &str, folder: &Path, worlds: &[usize], opts: ModelOptions) {
    let want = reference(&case(name));
    let prompt: Vec<i64> = want["prompt"].iter().map(|&v| v as i64).collect();
    let tokens: Vec<i64> = want["tokens"].iter().map(|&v| v as i64).collect();
    let vocab = want["prefill"].len() / prompt.len();
    for &world in worlds {
        let ep = if opts.expert_parallel { " EP" } else { "" };
        let at = format!("{name} ({}) TP {world}{ep}", folder.display());
        let (prefill, decode, got) = run_with(folder, world, opts, &prompt, tokens.len());
        let e = rel_err(&prefill, &want["prefill"]);
        assert!(e < 2e-5, "{at}: prefill logits off by {e:e}");
        assert_eq!(got, tokens, "{at}: greedy tokens");
        for (i, row) in decode.iter().enumerate() {
            let e = rel_err(row, &want["decode"][i * vocab..(i + 1) * vocab]);
            assert!(e < 2e-5, "{at}: decode step {i} logits off by {e:e}");
        }
    }
}

#[test]
fn qwen3_moe_matches_transformers_at_every_tp_degree_in_both_layouts() {
    check("qwen3_moe", &case("qwen3_moe"), &[1, 2, 3, 4, 8]);
    check("qwen3_moe", &case("qwen3_moe").join("fused"), &[1, 3]);
}

#[test]
fn qwen2_moe_with_its_shared_expert_matches_transformers() {
    check("qwen2_moe", &case("qwen2_moe"), &[1, 2, 3, 4, 8]);
}

#[test]
fn mixtral_matches_transformers_in_both_layouts() {
    check("mixtral", &case("mixtral"), &[1, 2, 3, 4, 8]);
    check("mixtral", &case("mixtral").join("fused"), &[2, 8]);
}

/// gpt-oss: attention sinks, biases everywhere, alternating windows, YaRN, a router bias and
/// clamped-SwiGLU experts with biases in its interleaved fused layout; heads (8 over 3: 3, 3, 2)
/// and experts' features split unevenly, and experts whole on ranks.
#[test]
fn gpt_oss_matches_transformers_at_every_tp_degree_and_with_expert_parallelism() {
    check("gpt_oss", &case("gpt_oss"), &[1, 2, 3, 4, 8]);
    let ep = ModelOptions::new().with_dtype(DType::F32).with_expert_parallel(true);
    check_with("gpt_oss", &case("gpt_oss"), &[3, 8], ep);
}

/// gpt-oss's experts as the Hub ships them, MXFP4 blocks and scales (`mxfp4/`), load to the
/// weights of the dense checkpoint beside them (which MXFP4 holds exactly) and give
/// transformers' logits and tokens, split and whole on ranks.
#[test]
fn gpt_oss_mxfp4_experts_load_as_transformers_dequantizes_them() {
    let name = "gpt_oss_mxfp4";
    check(name, &case(name), &[1, 3]);
    check(name, &case(name).join("mxfp4"), &[1, 2, 3, 8]);
    let ep = ModelOptions::new().with_dtype(DType::F32).with_expert_parallel(true);
    check_with(name, &case(name).join("mxfp4"), &[3], ep);
}

/// gpt-oss as llama.cpp's converter writes it (`gpt-oss`: experts split into
/// `ffn_{gate,up,down}_exps` with their biases, MXFP4 experts, sinks as `attn_sinks`, the MLP's
/// input norm as `post_attention_norm`), written from the MXFP4 fixture by tp-testing's
/// `write_gguf.py`: the config the metadata implies is the original's; dequantized, it gives
/// transformers' float64 logits and tokens at TP 1 to 4 and with expert parallelism (the experts
/// read per expert from the stacked blocks); on its MXFP4 blocks (8-bit activations) it stays
/// near them and picks the same tokens.
#[test]
fn gpt_oss_gguf_with_mxfp4_experts_matches_transformers() {
    let name = "gpt_oss_mxfp4";
    let dir = common::tmpdir("gpt-oss-gguf");
    let gguf = dir.join("model.gguf");
    common::write_gguf(&case(name), &gguf, "MXFP4_EXPERTS", &dir.join("ref"), &["--tokenizer", "bpe"]);
    let read = tp_models::gguf::GgufModel::open(&gguf).unwrap().config;
    let original = tp_models::ModelConfig::from_dir(case(name)).unwrap();
    assert_eq!(read.architecture, original.architecture);
    assert_eq!((read.moe.as_ref(), read.layer_types.clone()), (original.moe.as_ref(), original.layer_types.clone()));
    assert_eq!((read.rope_theta, &read.rope_scaling), (original.rope_theta, &original.rope_scaling));
    assert_eq!((read.sliding_window, read.qkv_bias, read.o_bias), (original.sliding_window, true, true));
    check(name, &gguf, &[1, 2, 3, 4]);
    check_with(name, &gguf, &[3], ModelOptions::new().with_dtype(DType::F32).with_expert_parallel(true));
    // On the blocks: the experts' products with 8-bit activations.
    let want = reference(&case(name));
    let prompt: Vec<i64> = want["prompt"].iter().map(|&v| v as i64).collect();
    let tokens: Vec<i64> = want["tokens"].iter().map(|&v| v as i64).collect();
    // Per prompt position, the largest error over the largest logit: 8-bit activations move a
    // position by a few percent (a router near a tie may send one token elsewhere: one position
    // may move more), and the tokens stay.
    let v = want["prefill"].len() / prompt.len();
    for world in [1, 3] {
        let (prefill, _, got) = run_with(&gguf, world, ModelOptions::new(), &prompt, tokens.len());
        let mut per: Vec<f64> = (0..prompt.len())
            .map(|p| rel_err(&prefill[p * v..(p + 1) * v], &want["prefill"][p * v..(p + 1) * v]))
            .collect();
        per.sort_by(f64::total_cmp);
        assert!(per[per.len() - 2] <= 0.06 && per[per.len() / 2] <= 0.03, "MXFP4 blocks TP {world}: {per:?}");
        assert!(per[per.len() - 1] > 0.0, "MXFP4 blocks TP {world}: the blocks' products must be the quantized ones");
        assert_eq!(got, tokens, "MXFP4 blocks TP {world}: greedy tokens");
    }
}

/// The Hub's MXFP4 experts kept as blocks (no `--dtype`: nothing dequantized, as vLLM keeps
/// them): near transformers' float64 logits (8-bit activations) with its greedy tokens, each
/// expert split over the ranks in whole groups of 32 or whole under expert parallelism; the
/// same logits as the GGUF file holding the same blocks.
#[test]
fn gpt_oss_hub_mxfp4_experts_stay_blocks_without_a_dtype() {
    let name = "gpt_oss_mxfp4";
    let folder = case(name).join("mxfp4");
    let want = reference(&case(name));
    let prompt: Vec<i64> = want["prompt"].iter().map(|&v| v as i64).collect();
    let tokens: Vec<i64> = want["tokens"].iter().map(|&v| v as i64).collect();
    let v = want["prefill"].len() / prompt.len();
    let dir = common::tmpdir("gpt-oss-hub-blocks");
    let gguf = dir.join("model.gguf");
    common::write_gguf(&case(name), &gguf, "MXFP4_EXPERTS", &dir.join("ref"), &["--tokenizer", "bpe"]);
    for (world, opts) in
        [(1, ModelOptions::new()), (2, ModelOptions::new()), (3, ModelOptions::new().with_expert_parallel(true))]
    {
        let (prefill, _, got) = run_with(&folder, world, opts, &prompt, tokens.len());
        let mut per: Vec<f64> = (0..prompt.len())
            .map(|p| rel_err(&prefill[p * v..(p + 1) * v], &want["prefill"][p * v..(p + 1) * v]))
            .collect();
        per.sort_by(f64::total_cmp);
        let at = format!("Hub MXFP4 blocks TP {world} (EP {})", opts.expert_parallel);
        assert!(per[per.len() - 2] <= 0.06 && per[per.len() / 2] <= 0.03, "{at}: {per:?}");
        // f32 products of dequantized experts stay within 1e-5; 8-bit activations do not.
        assert!(per[per.len() - 1] > 1e-4, "{at}: the experts' products must be the quantized ones: {per:?}");
        assert_eq!(got, tokens, "{at}: greedy tokens");
        let (from_gguf, _, _) = run_with(&gguf, world, opts, &prompt, tokens.len());
        let worst = prefill.iter().zip(&from_gguf).map(|(a, b)| (a - b).abs()).fold(0f64, f64::max);
        let scale = from_gguf.iter().fold(0f64, |m, x| m.max(x.abs()));
        assert!(worst <= 1e-5 * scale, "{at}: {worst:e} from the GGUF file's logits on the same blocks");
    }
}

/// MXFP4 tensors whose shapes disagree with the config (scales for too few rows, codes of the
/// wrong group count) are refused at load, naming the tensor.
#[test]
fn gpt_oss_mxfp4_tensors_of_the_wrong_shape_are_refused_by_name() {
    let src = case("gpt_oss_mxfp4").join("mxfp4");
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for (bad, shape) in [
        ("model.layers.1.mlp.experts.gate_up_proj_scales", vec![8, 63, 1]),
        ("model.layers.2.mlp.experts.down_proj_blocks", vec![8, 32, 2, 8]),
    ] {
        let dir = common::tmpdir(&format!("mxfp4-bad-{}", shape.len()));
        std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
        let tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| {
                if n == bad {
                    let data = &v.data()[..shape.iter().product::<usize>()];
                    (n, safetensors::tensor::TensorView::new(v.dtype(), shape.clone(), data).unwrap())
                } else {
                    (n, v)
                }
            })
            .collect();
        safetensors::serialize_to_file(tensors, None, &dir.join("model.safetensors")).unwrap();
        let errs = on_ranks(1, CPU, |g| {
            ParallelCausalLm::load(&dir, &g, &ModelOptions::new()).map(|_| ()).unwrap_err().to_string()
        });
        assert!(errs[0].contains(bad), "{bad}: {}", errs[0]);
    }
}

/// Experts kept as MXFP4 blocks have no tensor to train: asking for the parameters says so and
/// how to get one (a dtype, which dequantizes them); with one, the same folder trains.
#[test]
fn hub_mxfp4_blocks_are_not_trained_but_a_dtype_dequantizes_them() {
    let errs = on_ranks(1, CPU, |g| {
        let folder = case("gpt_oss_mxfp4").join("mxfp4");
        let mut lm = ParallelCausalLm::load(&folder, &g, &ModelOptions::new()).unwrap();
        let err = lm.params_mut().map(|_| ()).unwrap_err().to_string();
        let mut lm = ParallelCausalLm::load(&folder, &g, &ModelOptions::new().with_dtype(DType::F32)).unwrap();
        let row = tp_models::TrainRow { input_ids: &[1, 2, 3], labels: &[1, 2, 3] };
        let loss = lm.train_micro_batch(&[row], 1.0, tp_models::Recompute::None).unwrap().loss_sum;
        (err, loss)
    });
    let (err, loss) = &errs[0];
    assert!(err.contains("quantized weight cannot be trained") && err.contains("dtype"), "{err}");
    assert!(loss.is_finite() && *loss > 0.0, "{loss}");
}

#[test]
fn olmoe_matches_transformers() {
    check("olmoe", &case("olmoe"), &[1, 2, 3, 4]);
}

/// In bf16 the logits stay within bf16's rounding of transformers' float64 ones (per prompt
/// position, at most 1.5x transformers' own bf16 error on the prompt), and the greedy tokens are
/// its, at TP 1 and at an uneven degree. (The fixtures' prompts route clear of ties, so bf16 routes
/// as float64 does.)
#[test]
fn bf16_stays_within_bf16s_rounding_in_every_family() {
    for name in ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss"] {
        let want = reference(&case(name));
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(case(name).join("reference.json")).unwrap()).unwrap();
        let theirs = meta["transformers_bf16_error"].as_f64().unwrap();
        let prompt: Vec<i64> = want["prompt"].iter().map(|&v| v as i64).collect();
        let tokens: Vec<i64> = want["tokens"].iter().map(|&v| v as i64).collect();
        let v = want["prefill"].len() / prompt.len();
        for world in [1, 3] {
            let (prefill, _, got) = run(&case(name), world, DType::BF16, &prompt, tokens.len());
            let worst = (0..prompt.len())
                .map(|p| rel_err(&prefill[p * v..(p + 1) * v], &want["prefill"][p * v..(p + 1) * v]))
                .fold(0f64, f64::max);
            assert!(worst <= 1.5 * theirs, "{name} bf16 TP {world}: {worst:e} against transformers' {theirs:e}");
            assert_eq!(got, tokens, "{name} bf16 TP {world}: greedy tokens");
        }
    }
}

/// Expert parallelism: whole experts on ranks, 8 experts over 2, 3 (3, 3, 2), 5 (2, 2, 2, 1, 1)
/// and 8 ranks, from both layouts and with a shared expert (split as an MLP), gives
/// transformers' logits and tokens.
#[test]
fn expert_parallelism_at_uneven_placements_matches_transformers() {
    let ep = ModelOptions::new().with_dtype(DType::F32).with_expert_parallel(true);
    check_with("qwen3_moe", &case("qwen3_moe"), &[2, 3, 5, 8], ep);
    check_with("mixtral", &case("mixtral").join("fused"), &[3], ep);
    check_with("qwen2_moe", &case("qwen2_moe"), &[3, 5], ep);
}
