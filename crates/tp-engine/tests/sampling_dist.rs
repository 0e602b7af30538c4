//! What the sampler draws, checked against independent computations: the softmax distribution
//! (chi-square over many seeds), the ids top_k / top_p / min_p allow, penalties, greedy, seeds.

mod sampling_common;

use sampling_common::{RowSpec, logits, row_spec};
use tp_core::rng::SplitMix64;
use tp_engine::sampling::{SamplingParams, sample_full};

fn sample_one(l: &[f32], spec: &RowSpec) -> i64 {
    sample_full(l, l.len(), &[spec.row()]).unwrap()[0].token
}

/// Counts of each id over `draws` seeds.
fn histogram(l: &[f32], params: &SamplingParams, draws: u64) -> Vec<u64> {
    let mut counts = vec![0u64; l.len()];
    for seed in 0..draws {
        counts[sample_one(l, &RowSpec::new(params.clone(), seed)) as usize] += 1;
    }
    counts
}

/// Pearson's chi-square of `counts` against probabilities `p` (ids with p = 0 must have no count).
fn chi_square(counts: &[u64], p: &[f64]) -> f64 {
    let n: u64 = counts.iter().sum();
    counts
        .iter()
        .zip(p)
        .map(|(&c, &p)| {
            if p == 0.0 {
                assert_eq!(c, 0, "an excluded id was drawn");
                0.0
            } else {
                let e = p * n as f64;
                (c as f64 - e).powi(2) / e
            }
        })
        .sum()
}

fn softmax(l: &[f64]) -> Vec<f64> {
    let m = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = l.iter().map(|&x| (x - m).exp()).collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|x| x / z).collect()
}

/// The sampler's distribution matches softmax(l / T) restricted and renormalised as each filter
/// says (computed here independently); 20,000 seeds, chi-square below the 0.1% critical value.
#[test]
fn draws_follow_the_filtered_softmax() {
    let l = [1.0f32, 2.0, 0.5, 3.0, -1.0, 2.5];
    let t = 0.8;
    let base = softmax(&l.iter().map(|&x| f64::from(x) / t).collect::<Vec<_>>());
    let renorm = |keep: &dyn Fn(usize) -> bool| {
        let z: f64 = (0..6).filter(|&i| keep(i)).map(|i| base[i]).sum();
        (0..6).map(|i| if keep(i) { base[i] / z } else { 0.0 }).collect::<Vec<f64>>()
    };
    let t32 = t as f32;
    // Sorted probabilities: id 3 (.44), 5 (.24), 1 (.13), 0 (.04) ... computed in `base`.
    let cases: Vec<(SamplingParams, Vec<f64>, f64)> = vec![
        (SamplingParams { temperature: t32, ..Default::default() }, base.clone(), 20.5),
        (
            SamplingParams { temperature: t32, top_k: Some(3), ..Default::default() },
            renorm(&|i| [3, 5, 1].contains(&i)),
            13.8,
        ),
        (
            SamplingParams { temperature: t32, top_p: 0.8, ..Default::default() },
            renorm(&|i| [3, 5, 1].contains(&i)),
            13.8,
        ),
        (
            SamplingParams { temperature: t32, min_p: 0.2, ..Default::default() },
            renorm(&|i| base[i] >= 0.2 * base[3]),
            13.8,
        ),
    ];
    // The cases' kept sets, checked against the probabilities themselves.
    assert_eq!((0..6).filter(|&i| base[i] >= 0.2 * base[3]).count(), 3);
    assert!(base[3] + base[5] < 0.8 && base[3] + base[5] + base[1] >= 0.8);
    for (params, p, critical) in cases {
        let counts = histogram(&l, &params, 20_000);
        let chi = chi_square(&counts, &p);
        assert!(chi < critical, "{params:?}: chi-square {chi} (counts {counts:?}, expected {p:?})");
    }
}

/// Independent penalties (the structured-output mask and banned ids, OpenAI's logit_bias,
/// transformers' repetition penalty, OpenAI's presence and frequency).
fn penalised(l: &[f32], s: &RowSpec) -> Vec<f64> {
    let p = &s.params;
    l.iter()
        .enumerate()
        .map(|(id, &v)| {
            let v = if v.is_nan() { f32::NEG_INFINITY } else { v };
            // The mask and banned ids first, then the bias, then the penalties.
            let allowed = s.row().allows(id) && !s.banned.contains(&(id as i64));
            let v = if allowed { v } else { f32::NEG_INFINITY };
            let v = v + p.logit_bias.iter().find(|b| b.0 == id as i64).map_or(0.0, |b| b.1);
            let v = if v.is_nan() { f32::NEG_INFINITY } else { v };
            let id = id as i64;
            let count = s.output.iter().filter(|&&o| o == id).count();
            let seen = count > 0 || s.prompt.contains(&id);
            let mut v = v;
            if seen && p.repetition_penalty != 1.0 {
                v = if v > 0.0 { v / p.repetition_penalty } else { v * p.repetition_penalty };
            }
            if count > 0 {
                v -= p.frequency_penalty * count as f32 + p.presence_penalty;
            }
            f64::from(if v.is_nan() { f32::NEG_INFINITY } else { v })
        })
        .collect()
}

/// On random rows, every drawn id is one the filters allow, checked from the probabilities with
/// a margin of 1e-9 for rounding: fewer than k ids above it, at least min_p of the best, and
/// the mass strictly above it below top_p.
#[test]
fn filters_are_honoured_on_random_rows() {
    let mut rng = SplitMix64::new(5);
    let vocab = 200;
    let mut checked = 0;
    for _ in 0..400 {
        let l = logits(&mut rng, 1, vocab);
        let s = row_spec(&mut rng, vocab);
        let tok = sample_one(&l, &s) as usize;
        let pen = penalised(&l, &s);
        let p = &s.params;
        let above = pen.iter().filter(|&&v| v > pen[tok]).count();
        if p.is_greedy() {
            assert_eq!(above, 0, "greedy took {tok}, not a maximum");
            assert!(pen[..tok].iter().all(|&v| v < pen[tok]), "greedy tie not broken to the lowest id");
            continue;
        }
        let m = pen.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if !m.is_finite() {
            continue; // infinite maxima: weights are 0/1, covered by the exactness tests
        }
        let probs = softmax(&pen.iter().map(|&v| v / f64::from(p.temperature)).collect::<Vec<_>>());
        let pmax = probs.iter().copied().fold(0.0, f64::max);
        if let Some(k) = p.top_k {
            assert!(above < k, "top_k {k}: {above} ids above the drawn {tok}");
        }
        assert!(probs[tok] >= f64::from(p.min_p) * pmax * (1.0 - 1e-9) || pmax == 0.0, "min_p {}: drew {tok}", p.min_p);
        if p.top_k.is_none() && p.min_p == 0.0 && p.top_p < 1.0 {
            let mass_above: f64 = probs.iter().filter(|&&q| q > probs[tok]).sum();
            assert!(mass_above < f64::from(p.top_p) + 1e-9, "top_p {}: {mass_above} above {tok}", p.top_p);
        }
        checked += 1;
    }
    assert!(checked > 200, "only {checked} sampled rows checked");
}

#[test]
fn penalties_steer_the_choice() {
    let l = [2.0f32, 1.9, -1.0, 0.5];
    let greedy = |s: &RowSpec| sample_one(&l, s);
    let mut s = RowSpec::new(SamplingParams::greedy(), 0);
    assert_eq!(greedy(&s), 0);
    s.params.repetition_penalty = 1.1;
    s.prompt = vec![0];
    assert_eq!(greedy(&s), 1, "2.0 / 1.1 < 1.9");
    s.params.repetition_penalty = 1.0;
    s.prompt = vec![];
    s.output = vec![0, 0];
    s.params.frequency_penalty = 0.06;
    assert_eq!(greedy(&s), 1, "2.0 - 2 * 0.06 < 1.9");
    s.params.frequency_penalty = -2.0;
    s.params.presence_penalty = -2.0;
    s.output = vec![2, 2];
    assert_eq!(greedy(&s), 2, "-1.0 + 2 * 2.0 + 2.0 = 5.0");
}

#[test]
fn seeds_reproduce_and_vary() {
    let mut rng = SplitMix64::new(1);
    let l = logits(&mut rng, 1, 500);
    let flat: Vec<f32> = (0..500).map(|i| (i % 3) as f32 * 0.1).collect();
    let at = |seed, step, l: &[f32]| {
        let s = RowSpec { step, ..RowSpec::new(SamplingParams::default(), seed) };
        sample_one(l, &s)
    };
    for seed in 0..5 {
        assert_eq!(at(seed, 3, &l), at(seed, 3, &l));
    }
    let by_seed: std::collections::HashSet<i64> = (0..50).map(|seed| at(seed, 0, &flat)).collect();
    let by_step: std::collections::HashSet<i64> = (0..50).map(|step| at(9, step, &flat)).collect();
    assert!(by_seed.len() > 30 && by_step.len() > 30, "{} {}", by_seed.len(), by_step.len());
    let same = RowSpec::new(SamplingParams::default(), 4);
    let rows = [same.row(), same.row()];
    let two: Vec<f32> = flat.iter().chain(&flat).copied().collect();
    let got = sample_full(&two, 500, &rows).unwrap();
    assert_eq!(got[0].token, got[1].token, "same seed, step and logits: same token whatever the row");
}

#[test]
fn logprobs_are_the_raw_log_softmax() {
    let l = [1.0f32, 3.0, 3.0, -2.0, f32::NEG_INFINITY];
    let mut s =
        RowSpec::new(SamplingParams { logprobs: Some(3), repetition_penalty: 2.0, ..SamplingParams::greedy() }, 0);
    s.prompt = vec![1];
    let got = sample_full(&l, 5, &[s.row()]).unwrap().remove(0);
    assert_eq!(got.token, 2, "id 1 penalised to 1.5");
    let want = softmax(&l.iter().map(|&v| f64::from(v)).collect::<Vec<_>>());
    let lp = got.logprobs.unwrap();
    assert!((f64::from(lp.logprob) - want[2].ln()).abs() < 1e-6);
    let ids: Vec<i64> = lp.top.iter().map(|t| t.0).collect();
    assert_eq!(ids, [1, 2, 0], "raw logits, lower id first on ties");
    for (id, v) in lp.top {
        assert!((f64::from(v) - want[id as usize].ln()).abs() < 1e-6);
    }
}
