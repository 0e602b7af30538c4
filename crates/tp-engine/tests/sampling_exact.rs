//! The sharded sampler against the full-row sampler: the same tokens at every world size and
//! split, logprobs within 1e-5, the collectives a step takes per parameter mix, and its errors.

mod sampling_common;

use sampling_common::{RowSpec, logits, row_spec, run_sharded, split};
use tp_core::rng::SplitMix64;
use tp_engine::sampling::{SampleError, SampleRow, Sampled, SamplingParams, sample_full};

fn full(logits: &[f32], vocab: usize, specs: &[RowSpec]) -> Vec<Sampled> {
    let rows: Vec<SampleRow<'_>> = specs.iter().map(RowSpec::row).collect();
    sample_full(logits, vocab, &rows).unwrap()
}

fn close(a: f32, b: f32) -> bool {
    a == b || (a - b).abs() <= 1e-5
}

/// Tokens equal, logprobs (chosen and top) within 1e-5 with the same ids.
fn assert_same(want: &[Sampled], got: &[Sampled], what: &str) {
    assert_eq!(want.len(), got.len(), "{what}");
    for (i, (w, g)) in want.iter().zip(got).enumerate() {
        assert_eq!(w.token, g.token, "{what}: row {i}");
        match (&w.logprobs, &g.logprobs) {
            (None, None) => {}
            (Some(a), Some(b)) => {
                assert!(close(a.logprob, b.logprob), "{what}: row {i}: logprob {} vs {}", a.logprob, b.logprob);
                assert_eq!(a.top.len(), b.top.len(), "{what}: row {i}");
                for (x, y) in a.top.iter().zip(&b.top) {
                    assert!(x.0 == y.0 && close(x.1, y.1), "{what}: row {i}: top {:?} vs {:?}", a.top, b.top);
                }
            }
            _ => panic!("{what}: row {i}: logprobs {:?} vs {:?}", w.logprobs, g.logprobs),
        }
    }
}

#[test]
fn sharded_equals_full_at_every_world_size_and_split() {
    let mut rng = SplitMix64::new(19);
    let mut checked = 0;
    for vocab in [1000, 37, 7] {
        for world in 1..=8 {
            for uneven in [false, true] {
                let n = 12;
                let l = logits(&mut rng, n, vocab);
                let specs: Vec<RowSpec> = (0..n).map(|_| row_spec(&mut rng, vocab)).collect();
                let want = full(&l, vocab, &specs);
                let cols = split(&mut rng, vocab, world, uneven);
                for (rank, got) in run_sharded(&l, vocab, &specs, &cols).into_iter().enumerate() {
                    let what = format!("V {vocab}, world {world}, split {cols:?}, rank {rank}");
                    assert_same(&want, &got.unwrap().0, &what);
                }
                checked += n;
            }
        }
    }
    assert_eq!(checked, 3 * 8 * 2 * 12);
}

#[test]
fn a_row_is_sampled_alike_alone_and_in_any_batch() {
    let mut rng = SplitMix64::new(7);
    let vocab = 300;
    let l = logits(&mut rng, 16, vocab);
    let specs: Vec<RowSpec> = (0..16).map(|_| row_spec(&mut rng, vocab)).collect();
    let cols = split(&mut rng, vocab, 3, false);
    let batch = run_sharded(&l, vocab, &specs, &cols).remove(0).unwrap().0;
    for i in [0, 5, 15] {
        let alone = run_sharded(&l[i * vocab..(i + 1) * vocab], vocab, &specs[i..=i], &cols).remove(0).unwrap().0;
        assert_eq!(alone, batch[i..=i], "row {i}");
    }
}

fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
    let mut p = SamplingParams::default();
    f(&mut p);
    p
}

/// Collectives one step takes at world size 4, per parameter mix (the figures the docs give).
#[test]
fn collectives_per_parameter_mix() {
    let vocab = 4096;
    let mut rng = SplitMix64::new(3);
    // Peaked logits: the top_p nucleus is a handful of ids.
    let peaked: Vec<f32> = (0..vocab).map(|_| (rng.normal() * 4.0) as f32).collect();
    let cols = split(&mut rng, vocab, 4, false);
    let count = |p: SamplingParams, l: &[f32]| {
        let spec = RowSpec { prompt: vec![1, 2], output: vec![3], ..RowSpec::new(p, 1) };
        let specs = vec![spec];
        let got = run_sharded(l, vocab, &specs, &cols);
        let want = full(l, vocab, &specs);
        let counts: Vec<usize> = got
            .into_iter()
            .map(|r| {
                let (s, c) = r.unwrap();
                assert_same(&want, &s, "mix");
                c
            })
            .collect();
        assert!(counts.iter().all(|&c| c == counts[0]), "{counts:?}");
        counts[0]
    };
    let flat: Vec<f32> = (0..vocab).map(|i| (i % 7) as f32 * 0.01).collect();
    assert_eq!(count(SamplingParams::greedy(), &peaked), 1, "greedy");
    assert_eq!(count(params(|p| p.logprobs = Some(5)), &peaked), 1, "temperature with logprobs");
    assert_eq!(count(params(|p| p.repetition_penalty = 1.3), &peaked), 1, "temperature with penalties");
    assert_eq!(count(params(|p| p.top_k = Some(40)), &peaked), 1, "top_k");
    assert_eq!(count(params(|p| (p.top_k, p.top_p, p.min_p) = (Some(40), 0.9, 0.1)), &peaked), 1, "top_k+top_p+min_p");
    assert_eq!(count(params(|p| p.min_p = 0.1), &peaked), 2, "min_p");
    assert_eq!(count(params(|p| p.top_p = 0.9), &peaked), 2, "top_p, small nucleus");
    // A flat row: the nucleus holds ~90% of 4096 ids; lists of 64, 256, then all 1024 per rank.
    assert_eq!(count(params(|p| p.top_p = 0.9), &flat), 4, "top_p, flat row");
    let one = run_sharded(&flat, vocab, &[RowSpec::new(params(|p| p.top_p = 0.9), 1)], &[(0, vocab)]);
    assert_eq!(one[0].as_ref().unwrap().1, 0, "world size 1 runs no collective");
}

#[test]
fn bad_inputs_are_typed_errors() {
    let vocab = 10;
    let l = vec![0.0f32; 2 * vocab];
    let spec = RowSpec::new(SamplingParams::default(), 0);
    let specs = vec![spec.clone(), spec.clone()];
    let rows: Vec<SampleRow<'_>> = specs.iter().map(RowSpec::row).collect();
    assert!(matches!(sample_full(&l[..15], vocab, &rows), Err(SampleError::Invalid(_))));
    assert!(matches!(sample_full(&l, 0, &rows), Err(SampleError::Invalid(_))));
    let bad = RowSpec { params: params(|p| p.top_p = 0.0), ..spec.clone() };
    let bad_rows = [bad.row()];
    let e = sample_full(&l[..vocab], vocab, &bad_rows).unwrap_err();
    assert!(e.to_string().contains("top_p"), "{e}");
    // Columns that do not tile the vocabulary: every rank says so, none hangs.
    for got in run_sharded(&l, vocab, &specs, &[(0, 4), (5, 5)]) {
        let e = got.unwrap_err();
        assert!(matches!(e, SampleError::Invalid(_)) && e.to_string().contains("tile"), "{e}");
    }
    // Columns past the vocabulary: refused before any collective.
    let t = tp_core::Tensor::from_vec(vec![0.0f32; 8], &[2, 4], &tp_core::Device::Cpu).unwrap();
    let g = tp_comm::DeviceGroup::local(1, std::time::Duration::from_secs(5), |_| tp_core::Device::Cpu).unwrap();
    let e = tp_engine::sampling::sample_sharded(&t, 8, vocab, &rows, &g[0]).unwrap_err();
    assert!(e.to_string().contains("exceed"), "{e}");
    let e = tp_engine::sampling::sample_sharded(&t, 0, vocab, &rows[..1], &g[0]).unwrap_err();
    assert!(e.to_string().contains("shape"), "{e}");
}

#[test]
fn half_precision_logits_sample_as_their_f32_values() {
    let mut rng = SplitMix64::new(11);
    let vocab = 97;
    let l: Vec<f32> = logits(&mut rng, 6, vocab).into_iter().map(|v| tp_core::bf16::from_f32(v).to_f32()).collect();
    let specs: Vec<RowSpec> = (0..6).map(|_| row_spec(&mut rng, vocab)).collect();
    let want = full(&l, vocab, &specs);
    let groups = tp_comm::DeviceGroup::local(2, std::time::Duration::from_secs(60), |_| tp_core::Device::Cpu).unwrap();
    let cols = split(&mut rng, vocab, 2, false);
    std::thread::scope(|s| {
        for (g, &(start, len)) in groups.into_iter().zip(&cols) {
            let (l, specs, want) = (&l, &specs, &want);
            s.spawn(move || {
                let mine: Vec<tp_core::bf16> = (0..6)
                    .flat_map(|r| {
                        l[r * vocab + start..r * vocab + start + len].iter().map(|&v| tp_core::bf16::from_f32(v))
                    })
                    .collect();
                let t = tp_core::Tensor::from_vec(mine, &[6, len], &tp_core::Device::Cpu).unwrap();
                let rows: Vec<SampleRow<'_>> = specs.iter().map(RowSpec::row).collect();
                let got = tp_engine::sampling::sample_sharded(&t, start, vocab, &rows, &g).unwrap();
                assert_same(want, &got, "bf16");
            });
        }
    });
}

/// A nucleus that reaches past one rank's list while another rank's list runs on below it: the
/// ids the short list leaves out come before the long list's tail, so the nucleus must wait for
/// longer lists (a walk down the merged lists alone would cut it wrongly).
#[test]
fn a_nucleus_past_a_truncated_list_waits_for_longer_lists() {
    let vocab = 256;
    // Rank 0 (ids 0..128): weight 1; rank 1 (ids 128..256): slightly less.
    let l: Vec<f32> = (0..vocab).map(|i| if i < 128 { 1.0 } else { 0.999 }).collect();
    for seed in 0..20 {
        let specs = vec![RowSpec::new(params(|p| p.top_p = 0.4), seed)];
        let want = full(&l, vocab, &specs);
        assert!(want[0].token < 103, "the nucleus is ids 0..103, drew {}", want[0].token);
        for got in run_sharded(&l, vocab, &specs, &[(0, 128), (128, 128)]) {
            let (got, collectives) = got.unwrap();
            assert_same(&want, &got, &format!("seed {seed}"));
            assert_eq!(collectives, 3, "lists of 64, then 128");
        }
    }
}

/// Ranks called with different parameters send messages of different lengths: every rank gets
/// an error (no rank waits for a round the others never run).
#[test]
fn ranks_given_different_rows_fail_instead_of_hanging() {
    let vocab = 20;
    let groups = tp_comm::DeviceGroup::local(2, std::time::Duration::from_secs(20), |_| tp_core::Device::Cpu).unwrap();
    let results: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, g)| {
                s.spawn(move || {
                    let p = if rank == 0 { SamplingParams::greedy() } else { params(|p| p.top_k = Some(5)) };
                    let spec = RowSpec::new(p, 0);
                    let t = tp_core::Tensor::from_vec(vec![0.5f32; 10], &[1, 10], &tp_core::Device::Cpu).unwrap();
                    tp_engine::sampling::sample_sharded(&t, rank * 10, vocab, &[spec.row()], &g)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in results {
        assert!(r.is_err(), "{r:?}");
    }
}

/// Masks, banned ids and `logit_bias` decide the token on every rank: a masked or banned id is
/// never drawn while any allowed id has a finite biased logit, and the sharded sampler draws
/// the full sampler's token at every world size.
#[test]
fn masks_banned_ids_and_biases_are_enforced_on_every_rank() {
    let mut rng = SplitMix64::new(23);
    let vocab = 301;
    let mut constrained = 0;
    for round in 0..40 {
        let n = 8;
        let l = logits(&mut rng, n, vocab);
        let specs: Vec<RowSpec> = (0..n)
            .map(|_| {
                let mut s = row_spec(&mut rng, vocab);
                let mut m = vec![0u64; vocab.div_ceil(64)];
                for _ in 0..rng.int_in(1, 20) {
                    let id = rng.int_in(0, vocab as i64 - 1) as usize;
                    m[id / 64] |= 1 << (id % 64);
                }
                s.mask = Some(m);
                s.banned = (0..rng.int_in(0, 3)).map(|_| rng.int_in(0, vocab as i64 - 1)).collect();
                s
            })
            .collect();
        let want = full(&l, vocab, &specs);
        for (i, (spec, got)) in specs.iter().zip(&want).enumerate() {
            let row = spec.row();
            let ok = |id: usize| row.allows(id) && !spec.banned.contains(&(id as i64));
            let biased = |id: usize| {
                let b = spec.params.logit_bias.iter().find(|(x, _)| *x == id as i64).map_or(0.0, |&(_, b)| b);
                l[i * vocab + id] + b
            };
            // Penalties keep a finite logit finite, so a finite allowed id exists after them too.
            if (0..vocab).any(|id| ok(id) && biased(id).is_finite()) {
                assert!(ok(got.token as usize), "round {round} row {i}: token {} is masked or banned", got.token);
                constrained += 1;
            }
        }
        let world = 1 + round % 8;
        let cols = split(&mut rng, vocab, world, round % 2 == 1);
        for got in run_sharded(&l, vocab, &specs, &cols) {
            assert_same(&want, &got.unwrap().0, &format!("round {round}, split {cols:?}"));
        }
    }
    assert!(constrained > 200, "only {constrained} rows had an allowed finite id");
    // A bias of +100 on one id makes it the greedy choice; -100 on the argmax removes it.
    let row = [0.5f32, 3.0, 1.0, -2.0];
    let pick = |bias: Vec<(i64, f32)>| {
        let spec = RowSpec::new(SamplingParams { logit_bias: bias, ..SamplingParams::greedy() }, 1);
        full(&row, 4, &[spec])[0].token
    };
    assert_eq!(pick(vec![]), 1);
    assert_eq!(pick(vec![(3, 100.0)]), 3);
    assert_eq!(pick(vec![(1, -100.0)]), 2);
}
