//! Shared by the sampling tests: random logits and parameters, and running the sharded sampler
//! on a local group of threads.

#![allow(dead_code)]

use tp_comm::DeviceGroup;
use tp_core::rng::SplitMix64;
use tp_core::{Device, Tensor};
use tp_engine::sampling::{SampleError, SampleRow, Sampled, SamplingParams, sample_sharded_counted};

/// One request's row: parameters, seed, step, prompt and output ids.
#[derive(Debug, Clone)]
pub struct RowSpec {
    pub params: SamplingParams,
    pub seed: u64,
    pub step: u64,
    pub prompt: Vec<i64>,
    pub output: Vec<i64>,
    pub banned: Vec<i64>,
    pub mask: Option<Vec<u64>>,
}

impl RowSpec {
    /// A row of `params` and `seed` at step 0, with no prompt, output, banned ids or mask.
    pub fn new(params: SamplingParams, seed: u64) -> RowSpec {
        RowSpec { params, seed, step: 0, prompt: vec![], output: vec![], banned: vec![], mask: None }
    }

    pub fn row(&self) -> SampleRow<'_> {
        SampleRow {
            params: &self.params,
            seed: self.seed,
            step: self.step,
            prompt: &self.prompt,
            output: &self.output,
            banned: &self.banned,
            mask: self.mask.as_deref(),
        }
    }
}

/// Random logits for `n` rows of `vocab`: normal values of a random spread, with repeated values
/// (ties), `-inf` entries, and now and then a NaN, a `+inf` or a row of all `-inf`.
pub fn logits(rng: &mut SplitMix64, n: usize, vocab: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n * vocab);
    for _ in 0..n {
        let spread = [0.1, 1.0, 3.0, 30.0][rng.int_in(0, 3) as usize];
        let mut row: Vec<f32> = (0..vocab).map(|_| (rng.normal() * spread) as f32).collect();
        for _ in 0..vocab / 5 + 1 {
            let (a, b) = (rng.int_in(0, vocab as i64 - 1) as usize, rng.int_in(0, vocab as i64 - 1) as usize);
            row[a] = row[b];
        }
        for _ in 0..vocab / 10 {
            row[rng.int_in(0, vocab as i64 - 1) as usize] = f32::NEG_INFINITY;
        }
        match rng.int_in(0, 19) {
            0 => row[rng.int_in(0, vocab as i64 - 1) as usize] = f32::NAN,
            1 => row[rng.int_in(0, vocab as i64 - 1) as usize] = f32::INFINITY,
            2 => row.iter_mut().for_each(|v| *v = f32::NEG_INFINITY),
            3 => row.iter_mut().for_each(|v| *v = (*v * 4.0).round() / 4.0), // many ties
            _ => {}
        }
        out.extend(row);
    }
    out
}

/// Random parameters covering every mode, huge and tiny temperatures included.
pub fn row_spec(rng: &mut SplitMix64, vocab: usize) -> RowSpec {
    let pick = |rng: &mut SplitMix64, n: usize| rng.int_in(0, n as i64 - 1) as usize;
    let temperature = [0.0, 1.0, 0.7, 1e-4, 1e3, 2.0][pick(rng, 6)];
    let top_k = [None, None, Some(1), Some(2), Some(5), Some(50), Some(vocab + 3)][pick(rng, 7)];
    let top_p = [1.0, 1.0, 0.9, 0.5, 0.05, 0.999_999][pick(rng, 6)];
    let min_p = [0.0, 0.0, 0.05, 0.5, 1.0][pick(rng, 5)];
    let penalties = pick(rng, 3) == 0;
    let (repetition_penalty, presence_penalty, frequency_penalty) = if penalties {
        (rng.uniform(0.5, 2.0) as f32, rng.uniform(-2.0, 2.0) as f32, rng.uniform(-2.0, 2.0) as f32)
    } else {
        (1.0, 0.0, 0.0)
    };
    let logprobs = [None, None, Some(0), Some(3), Some(20)][pick(rng, 5)];
    let ids = |rng: &mut SplitMix64, n: usize| (0..n).map(|_| rng.int_in(0, vocab as i64 - 1)).collect::<Vec<_>>();
    let (np, no) = (pick(rng, 8), pick(rng, 8));
    // A structured-output mask now and then: a random set (often sparse), never empty.
    let mask = (pick(rng, 3) == 0).then(|| {
        let density = [0.02, 0.3, 0.9][pick(rng, 3)];
        let mut m = vec![0u64; vocab.div_ceil(64)];
        for id in 0..vocab {
            if rng.uniform(0.0, 1.0) < density {
                m[id / 64] |= 1 << (id % 64);
            }
        }
        let id = pick(rng, vocab);
        m[id / 64] |= 1 << (id % 64);
        m
    });
    let mut logit_bias: Vec<(i64, f32)> = if pick(rng, 3) == 0 {
        (0..pick(rng, 6)).map(|_| (rng.int_in(0, vocab as i64 - 1), rng.uniform(-100.0, 100.0) as f32)).collect()
    } else {
        Vec::new()
    };
    logit_bias.sort_by_key(|&(id, _)| id);
    logit_bias.dedup_by_key(|&mut (id, _)| id);
    let nb = if pick(rng, 4) == 0 { pick(rng, 4) } else { 0 };
    let banned = ids(rng, nb);
    RowSpec {
        params: SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            presence_penalty,
            frequency_penalty,
            seed: None,
            logprobs,
            min_tokens: 0,
            logit_bias,
            prompt_logprobs: None,
        },
        seed: rng.next_u64(),
        step: rng.int_in(0, 100) as u64,
        prompt: ids(rng, np),
        output: ids(rng, no),
        banned,
        mask,
    }
}

/// Columns of each of `world` ranks: balanced, or (`uneven`) random cut points, empty ranks allowed.
pub fn split(rng: &mut SplitMix64, vocab: usize, world: usize, uneven: bool) -> Vec<(usize, usize)> {
    if !uneven {
        return tp_core::TensorShard::for_all_ranks(1, vocab, world)
            .unwrap()
            .iter()
            .map(|s| (s.start(), s.len()))
            .collect();
    }
    let mut cuts: Vec<usize> = (0..world - 1).map(|_| rng.int_in(0, vocab as i64) as usize).collect();
    cuts.sort_unstable();
    let mut bounds = vec![0];
    bounds.extend(cuts);
    bounds.push(vocab);
    bounds.windows(2).map(|w| (w[0], w[1] - w[0])).collect()
}

/// Runs the sharded sampler on `world` threads with columns `split`; every rank's result.
pub fn run_sharded(
    logits: &[f32],
    vocab: usize,
    specs: &[RowSpec],
    split: &[(usize, usize)],
) -> Vec<Result<(Vec<Sampled>, usize), SampleError>> {
    let n = specs.len();
    let groups = DeviceGroup::local(split.len(), std::time::Duration::from_secs(60), |_| Device::Cpu).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .zip(split)
            .map(|(g, &(start, len))| {
                s.spawn(move || {
                    let cols: Vec<f32> = (0..n)
                        .flat_map(|r| logits[r * vocab + start..r * vocab + start + len].iter().copied())
                        .collect();
                    let t = Tensor::from_vec(cols, &[n, len], &Device::Cpu).unwrap();
                    let rows: Vec<SampleRow<'_>> = specs.iter().map(RowSpec::row).collect();
                    sample_sharded_counted(&t, start, vocab, &rows, &g)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}
