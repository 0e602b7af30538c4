//! The batched forward over paged KV caches against the single-sequence path: several
//! sequences of different prompt lengths, some prefilled in two or three chunks across steps,
//! some decoding, joining at different steps, with non-contiguous block ids, give per step the
//! logits that `prefill` and `decode_step` give each sequence alone, for several families at
//! TP 1 to 4 (uneven heads and vocabulary) and two block sizes.

mod common;
use common::*;
use serde_json::json;
use tp_core::KvQuant;
use tp_core::rng::SplitMix64;
use tp_models::{Architecture, ModelOptions, ParallelCausalLm};
use tp_testing::synthetic::SyntheticModel;

/// One sequence's part in the test: the step it joins at, how its prompt is fed (chunk sizes),
/// and how many decode steps follow.
struct Plan {
    start: usize,
    chunks: &'static [usize],
    decodes: usize,
}

const PLANS: [Plan; 5] = [
    Plan { start: 0, chunks: &[5], decodes: 4 },
    Plan { start: 0, chunks: &[6, 7], decodes: 3 },
    Plan { start: 1, chunks: &[1], decodes: 4 },
    Plan { start: 0, chunks: &[7, 7, 6], decodes: 2 },
    Plan { start: 2, chunks: &[9], decodes: 2 },
];

const VOCAB: usize = 1001;

impl Plan {
    fn prompt_len(&self) -> usize {
        self.chunks.iter().sum()
    }
    /// Tokens fed at each of its steps: the prompt's chunks, then one per decode.
    fn feeds(&self) -> Vec<usize> {
        self.chunks.iter().copied().chain(std::iter::repeat_n(1, self.decodes)).collect()
    }
}

/// Every sequence's ids (prompt, then the tokens its decode steps feed), seeded.
fn sequences(plans: &[Plan]) -> Vec<Vec<i64>> {
    let mut rng = SplitMix64::new(77);
    plans.iter().map(|p| (0..p.prompt_len() + p.decodes).map(|_| rng.int_in(0, VOCAB as i64 - 1)).collect()).collect()
}

fn flavours() -> Vec<(&'static str, SyntheticModel)> {
    let tiny = SyntheticModel::tiny(); // Llama, 12 heads (MHA) of 4, vocab 1001, untied
    vec![
        ("llama", tiny.clone()),
        (
            "qwen3-qknorm-bias",
            SyntheticModel {
                architecture: Architecture::Qwen3,
                num_key_value_heads: 4,
                head_dim: Some(8),
                attention_bias: true,
                seed: 5,
                ..tiny.clone()
            },
        ),
        (
            "gemma3-sliding-softcap",
            SyntheticModel {
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
        ),
        (
            "olmo2-full-width-qk",
            SyntheticModel {
                architecture: Architecture::Olmo2,
                num_key_value_heads: 6,
                head_dim: Some(8),
                seed: 8,
                ..tiny.clone()
            },
        ),
        (
            "phi3-fused",
            SyntheticModel {
                architecture: Architecture::Phi3,
                num_key_value_heads: 4,
                head_dim: Some(8),
                seed: 7,
                ..tiny.clone()
            },
        ),
        (
            "gpt-oss-sinks-experts",
            SyntheticModel {
                architecture: Architecture::GptOss,
                num_attention_heads: 8,
                num_key_value_heads: 2,
                head_dim: Some(8),
                attention_bias: true,
                sliding_window: Some(4),
                seed: 9,
                extra: Some(json!({"num_local_experts": 5, "num_experts_per_tok": 2, "swiglu_limit": 1.0})),
                ..tiny.clone()
            },
        ),
        (
            "mistral-window",
            SyntheticModel {
                architecture: Architecture::Mistral,
                sliding_window: Some(5),
                num_key_value_heads: 4,
                num_attention_heads: 8,
                head_dim: Some(6),
                seed: 4,
                ..tiny
            },
        ),
    ]
}

/// Each sequence's logits at every position through the single-sequence path: `prefill` of its
/// prompt, then `decode_step` per later token; `[len, V]` each, row-major.
fn single_sequence(lm: &mut ParallelCausalLm, plans: &[Plan], seqs: &[Vec<i64>]) -> Vec<Vec<f64>> {
    plans
        .iter()
        .zip(seqs)
        .map(|(plan, ids)| {
            let mut rows = f64s(&lm.prefill(&ids[..plan.prompt_len()]).unwrap());
            for &id in &ids[plan.prompt_len()..] {
                rows.extend(f64s(&lm.decode_step(id).unwrap()));
            }
            rows
        })
        .collect()
}

/// One output row of the batched run: sequence, position, this rank's logits columns.
type Row = (usize, usize, Vec<f64>);

/// Runs the plans as steps of flat batches (`only` limits them to some sequences) with blocks
/// of `block_size` taken from a shuffled pool; asks for every row's logits on even steps and
/// only each sequence's last row on odd ones.
fn batched(lm: &ParallelCausalLm, plans: &[Plan], seqs: &[Vec<i64>], only: &[usize], block_size: usize) -> Vec<Row> {
    batched_in(lm, plans, seqs, only, block_size, None)
}

/// [`batched`] with the keys and values cached in the model dtype or (`quant`) in 8 bits.
fn batched_in(
    lm: &ParallelCausalLm,
    plans: &[Plan],
    seqs: &[Vec<i64>],
    only: &[usize],
    block_size: usize,
    quant: Option<KvQuant>,
) -> Vec<Row> {
    let num_blocks = 40;
    let mut caches = lm.new_paged_caches(num_blocks, block_size, quant).unwrap();
    let mut pool: Vec<u32> = (0..num_blocks as u32).collect();
    let mut rng = SplitMix64::new(block_size as u64);
    for i in (1..pool.len()).rev() {
        pool.swap(i, rng.int_in(0, i as i64) as usize);
    }
    let feeds: Vec<Vec<usize>> = plans.iter().map(Plan::feeds).collect();
    let (mut done, mut tables) = (vec![0usize; plans.len()], vec![Vec::<u32>::new(); plans.len()]);
    let steps = plans.iter().map(|p| p.start + p.chunks.len() + p.decodes).max().unwrap();
    let mut out = Vec::new();
    for step in 0..steps {
        let (mut bseqs, mut ids, mut who) = (Vec::new(), Vec::new(), Vec::new());
        for &i in only {
            let Some(&n) = step.checked_sub(plans[i].start).and_then(|k| feeds[i].get(k)) else { continue };
            while tables[i].len() * block_size < done[i] + n {
                tables[i].push(pool.pop().unwrap());
            }
            bseqs.push(tp_layers::BatchSeq { tokens: n, context: done[i], blocks: tables[i].clone() });
            ids.extend_from_slice(&seqs[i][done[i]..done[i] + n]);
            who.extend((done[i]..done[i] + n).map(|p| (i, p)));
            done[i] += n;
        }
        if bseqs.is_empty() {
            continue;
        }
        let batch = tp_layers::TokenBatch::new(bseqs, block_size).unwrap();
        let rows: Vec<usize> = if step % 2 == 0 { (0..batch.num_tokens()).collect() } else { batch.last_rows() };
        let logits = lm.forward_batch(&ids, &batch, &mut caches, &rows).unwrap();
        let width = lm.vocab_shard().1;
        assert_eq!(logits.dims(), &[rows.len(), width]);
        for (r, vals) in rows.iter().zip(f64s(&logits).chunks(width.max(1))) {
            let (i, p) = who[*r];
            out.push((i, p, vals.to_vec()));
        }
    }
    out
}

#[test]
fn a_mixed_batch_gives_the_logits_of_each_sequence_alone_at_tp_1_to_4() {
    let seqs = sequences(&PLANS);
    let all: Vec<usize> = (0..PLANS.len()).collect();
    for (name, spec) in flavours() {
        let dir = tmpdir(&format!("batch-{name}"));
        spec.write(&dir).unwrap();
        for world in 1..=4 {
            let per_rank = on_ranks(world, CPU, |g| {
                let mut lm = ParallelCausalLm::load(&dir, &g, &ModelOptions::new()).unwrap();
                let single = single_sequence(&mut lm, &PLANS, &seqs);
                let runs: Vec<Vec<Row>> = [16, 5].iter().map(|&bs| batched(&lm, &PLANS, &seqs, &all, bs)).collect();
                (single, lm.vocab_shard(), runs)
            });
            let single = &per_rank[0].0;
            assert_eq!(per_rank.iter().map(|r| r.1.1).sum::<usize>(), VOCAB, "the shards cover the vocabulary");
            for (b, bs) in [16, 5].iter().enumerate() {
                let (mut got, mut want) = (Vec::new(), Vec::new());
                for k in 0..per_rank[0].2[b].len() {
                    let (i, p, _) = per_rank[0].2[b][k];
                    // Gather the row: each rank's columns, in rank order.
                    let mut row = vec![0.0; VOCAB];
                    for (_, (start, len), runs) in &per_rank {
                        assert_eq!(runs[b][k].0, i);
                        row[*start..start + len].copy_from_slice(&runs[b][k].2);
                    }
                    got.extend(row);
                    want.extend_from_slice(&single[i][p * VOCAB..(p + 1) * VOCAB]);
                }
                assert!(got.len() > 30 * VOCAB, "{name}: too few rows compared");
                assert_close(&format!("{name} TP {world} block size {bs}: batch vs alone"), &got, &want, 1e-5);
            }
        }
    }
}

/// Plans whose every step runs on the same side of the host GEMM's row threshold alone and in
/// the batch: all prompts go in chunks of at least 9 tokens in the same steps, then everyone
/// decodes together (at most 8 rows a step).
const SAME_PATH_PLANS: [Plan; 3] = [
    Plan { start: 0, chunks: &[9, 10], decodes: 3 },
    Plan { start: 0, chunks: &[12, 9], decodes: 4 },
    Plan { start: 0, chunks: &[9, 11], decodes: 2 },
];

/// Batch invariance of the whole model (f32, host): a sequence's logits are bitwise the same
/// alone and in the batch. Attention is batch-invariant by construction and the norms and the
/// embedding are per row; the linear layers are too, as long as both runs take the same host
/// GEMM path for every step of the sequence: tp-cpu multiplies up to 8 rows with its GEMV
/// kernel and more with a packed GEMM, which round differently (measured: every row of an f32
/// `matmul_t` is bitwise the same for all M <= 8 and for all M >= 9, and differs across; bf16
/// agreed everywhere). So the plans here keep every step on one side in both runs; with the
/// mixed plans of the test above (a decode alone beside prefill chunks in the batch), rows
/// differ by up to ~2e-6 (~5e-7 of the largest logit), within that test's tolerance.
#[test]
fn a_rows_logits_are_bitwise_the_same_alone_and_in_a_batch_on_one_gemm_path() {
    let plans = &SAME_PATH_PLANS;
    let seqs = sequences(plans);
    let all: Vec<usize> = (0..plans.len()).collect();
    for (name, spec) in flavours().into_iter().take(4) {
        let dir = tmpdir(&format!("invariant-{name}"));
        spec.write(&dir).unwrap();
        for world in [1, 2] {
            let per_rank = on_ranks(world, CPU, |g| {
                let lm = ParallelCausalLm::load(&dir, &g, &ModelOptions::new()).unwrap();
                let batch = batched(&lm, plans, &seqs, &all, 16);
                let alone: Vec<Row> = (0..plans.len()).flat_map(|i| batched(&lm, plans, &seqs, &[i], 16)).collect();
                (batch, alone)
            });
            for (rank, (batch, alone)) in per_rank.iter().enumerate() {
                let mut compared = 0;
                for (i, p, row) in alone {
                    let Some((_, _, in_batch)) = batch.iter().find(|(j, q, _)| (j, q) == (i, p)) else { continue };
                    let same = row.iter().zip(in_batch).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{name} TP {world} rank {rank}: sequence {i} position {p} differs alone and in the batch"
                    );
                    compared += 1;
                }
                assert!(compared >= 40, "{name} TP {world}: only {compared} rows compared");
            }
        }
    }
}

#[test]
fn bad_batched_calls_are_typed_errors_naming_the_problem() {
    let (_, spec) = flavours().remove(0);
    let dir = tmpdir("batch-errors");
    spec.write(&dir).unwrap();
    on_ranks(2, CPU, |g| {
        let lm = ParallelCausalLm::load(&dir, &g, &ModelOptions::new()).unwrap();
        let mut caches = lm.new_paged_caches(8, 4, None).unwrap();
        let seq = |tokens, context, blocks: &[u32]| tp_layers::BatchSeq { tokens, context, blocks: blocks.to_vec() };
        let batch = tp_layers::TokenBatch::new(vec![seq(3, 0, &[5])], 4).unwrap();
        let msg = |r: tp_models::Result<tp_core::Tensor>| r.unwrap_err().to_string();
        assert!(
            msg(lm.forward_batch(&[1, 2], &batch, &mut caches, &[2])).contains("2 token ids given for a batch of 3")
        );
        assert!(
            msg(lm.forward_batch(&[1, 2, 3], &batch, &mut caches[1..], &[2])).contains("2 paged caches given for 3")
        );
        assert!(msg(lm.forward_batch(&[1, 2, 3], &batch, &mut caches, &[3])).contains("row 3 of a batch of 3"));
        let e = msg(lm.forward_batch(&[1, 2, 3000], &batch, &mut caches, &[2]));
        assert!(e.contains("3000"), "{e}");
        let far = tp_layers::TokenBatch::new(vec![seq(1, 64, &[0; 17])], 4).unwrap();
        assert!(msg(lm.forward_batch(&[1], &far, &mut caches, &[0])).contains("past max_position_embeddings (64)"));
        let past = tp_layers::TokenBatch::new(vec![seq(1, 0, &[8])], 4).unwrap();
        assert!(
            msg(lm.forward_batch(&[1], &past, &mut caches, &[0]))
                .contains("sequence 0 of the batch names block 8, past the cache's 8 blocks")
        );
        let other_size = tp_layers::TokenBatch::new(vec![seq(1, 0, &[0])], 16).unwrap();
        assert!(msg(lm.forward_batch(&[1], &other_size, &mut caches, &[0])).contains("blocks of 16 positions"));
        // Caches of another layer, and a valid call with no logits wanted.
        caches.swap(0, 1);
        assert!(msg(lm.forward_batch(&[1, 2, 3], &batch, &mut caches, &[2])).contains("another attention layer"));
        caches.swap(0, 1);
        let none = lm.forward_batch(&[1, 2, 3], &batch, &mut caches, &[]).unwrap();
        assert_eq!(none.dims(), &[0, lm.vocab_shard().1]);
        assert!(lm.new_paged_caches(0, 4, None).is_err());
        let per_block = 2 * 12 * 4 * 4 * 3 * 16 / 2; // 12 heads of 4 over 2 ranks, f32, 3 layers
        assert_eq!(lm.kv_bytes_per_block(16, None).unwrap(), per_block);
        assert_eq!(lm.kv_bytes_per_block(16, Some(KvQuant::Fp8E4M3)).unwrap(), per_block / 4);
        let e = lm.kv_bytes_per_block(16, Some(KvQuant::Q8_0)).unwrap_err().to_string();
        assert!(e.contains("head_dim") && e.contains("multiple of 32"), "{e}");
        assert!(lm.new_paged_caches(8, 4, Some(KvQuant::Q8_0)).is_err());
    });
}

/// Keys and values cached in 8 bits (FP8 E4M3, Q8_0) at TP 1 and 2 (uneven KV heads): every
/// row's logits stay near those over the model-dtype cache, as far as the format's step allows.
#[test]
fn eight_bit_kv_caches_keep_the_logits_near_the_dense_caches() {
    let seqs = sequences(&PLANS);
    let all: Vec<usize> = (0..PLANS.len()).collect();
    let spec = SyntheticModel {
        num_attention_heads: 6,
        num_key_value_heads: 3,
        head_dim: Some(32),
        seed: 12,
        ..SyntheticModel::tiny()
    };
    let dir = tmpdir("batch-kv8");
    spec.write(&dir).unwrap();
    for world in [1, 2] {
        let per_rank = on_ranks(world, CPU, |g| {
            let lm = ParallelCausalLm::load(&dir, &g, &ModelOptions::new()).unwrap();
            let run = |q| batched_in(&lm, &PLANS, &seqs, &all, 5, q);
            (run(None), run(Some(KvQuant::Fp8E4M3)), run(Some(KvQuant::Q8_0)))
        });
        for (rank, (dense, fp8, q8)) in per_rank.iter().enumerate() {
            let scale = dense.iter().flat_map(|r| r.2.iter()).fold(0f64, |m, v| m.max(v.abs()));
            for (name, got, tol) in [("fp8", fp8, 0.06), ("q8_0", q8, 0.015)] {
                assert_eq!(got.len(), dense.len());
                let worst = got
                    .iter()
                    .zip(dense)
                    .flat_map(|(a, b)| {
                        assert_eq!((a.0, a.1), (b.0, b.1));
                        a.2.iter().zip(&b.2).map(|(x, y)| (x - y).abs())
                    })
                    .fold(0f64, f64::max);
                assert!(
                    worst > 0.0 && worst <= tol * scale,
                    "{name} TP {world} rank {rank}: logits off by {worst} (largest {scale})"
                );
            }
        }
    }
}
