//! Sampling exact under vocab parallelism.
//!
//! [`sample_full`] is the sampler on whole rows of logits (the reference); [`sample_sharded`]
//! computes the same tokens from each rank's columns with a few small collectives, never
//! gathering the logits unless a row's parameters need them (a flat `top_p` nucleus larger than
//! a rank's share of the vocabulary).
//!
//! How a token is chosen (the order [`SamplingParams`] defines):
//! * Penalised logits `l'` (f32; NaN counts as `-inf`, `-0` as `0`), ordered by value, the lower
//!   id first on ties.
//! * Greedy rows take the first id in that order.
//! * Otherwise `x = l' / T` in f64, `m = max x`, weights `w = exp(x - m)` (1 where `x == m`, so
//!   infinite logits are handled); `min_p` keeps `w >= min_p`, `top_k` the first `k` in order,
//!   `top_p` the shortest prefix whose weight reaches `top_p` of the kept total, the weights
//!   summed in 96-bit fixed point, so the sum is exact and the same in any order.
//! * The draw is the exponential race (Gumbel-max): each id gets its own uniform `u` from a
//!   counter-based hash of `(seed, step, id)`, and the kept id with the largest
//!   `x - ln(-ln u)` wins (the lower id on ties). Every rank computes its own ids' keys, so the
//!   token is the same at any TP degree and in any batch.
//! * Logprobs are `log_softmax` of the raw logits (before penalties), from each rank's maximum
//!   and sum of exponentials; the top alternatives are merged from each rank's own top `n`.

mod full;
mod local;
mod math;
mod merge;
mod noise;
mod params;
mod score;
mod sharded;
mod wire;

pub use full::sample_full;
pub use params::{MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams};
pub use score::score_sharded;
pub use sharded::{sample_sharded, sample_sharded_counted};

use crate::api::TokenLogprobs;

/// One row of logits to sample from, with what its parameters need to know.
#[derive(Debug, Clone, Copy)]
pub struct SampleRow<'a> {
    /// How the token is picked.
    pub params: &'a SamplingParams,
    /// The request's seed (its own, or one the engine drew for it).
    pub seed: u64,
    /// Index of the token being generated, 0-based (the noise is keyed by it).
    pub step: u64,
    /// The prompt's ids (for the repetition penalty).
    pub prompt: &'a [i64],
    /// The ids generated so far (for all three penalties).
    pub output: &'a [i64],
    /// Ids forbidden at this step whatever their logits (the end-of-sequence and stop ids while
    /// fewer than `min_tokens` were generated): they become `-inf`.
    pub banned: &'a [i64],
    /// A structured-output mask over the whole vocabulary: id `i` is allowed where bit `i % 64`
    /// of word `i / 64` is set; every other id (and every id past the mask) becomes `-inf`.
    /// `None`: no constraint. Each rank reads its own columns' bits.
    pub mask: Option<&'a [u64]>,
}

impl SampleRow<'_> {
    /// Whether the row's mask (if any) allows global id `id`.
    pub fn allows(&self, id: usize) -> bool {
        self.mask.is_none_or(|m| m.get(id / 64).is_some_and(|w| w >> (id % 64) & 1 == 1))
    }
}

/// The token chosen for one row.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    /// The id.
    pub token: i64,
    /// Its logprob and the top alternatives, when the row's parameters ask for them.
    pub logprobs: Option<TokenLogprobs>,
}

/// Why a batch could not be sampled.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SampleError {
    /// The logits, the vocabulary split or a row's parameters are not valid.
    #[error("sampling: {0}")]
    Invalid(String),
    /// The ranks' messages do not fit together (they were called with different batches).
    #[error("sampling: the ranks disagree: {0}")]
    Disagree(String),
    /// A collective failed.
    #[error("sampling: {0}")]
    Comm(#[from] tp_comm::CommError),
    /// Reading the logits failed.
    #[error("sampling: {0}")]
    Tensor(#[from] tp_core::Error),
}

/// Checks every row's parameters and the vocabulary size.
fn check_rows(vocab: usize, rows: &[SampleRow<'_>]) -> Result<(), SampleError> {
    if vocab == 0 {
        return Err(SampleError::Invalid("the vocabulary is empty".into()));
    }
    for (i, row) in rows.iter().enumerate() {
        row.params.validate().map_err(|(_, why)| SampleError::Invalid(format!("row {i}: {why}")))?;
    }
    Ok(())
}
