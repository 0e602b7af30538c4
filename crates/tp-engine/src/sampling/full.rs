//! [`sample_full`]: the sampler on whole rows of logits, written plainly (sort the row, filter,
//! cut, draw); the reference the sharded sampler must match.

use super::math::{Cand, LogNorm, Penalties, by_pen, by_raw, clean, draw, fixed, lse_part, min_p_keeps, nucleus_len};
use super::math::{scaled, weight};
use super::{SampleError, SampleRow, Sampled, check_rows};
use crate::api::TokenLogprobs;

/// Samples one token per row from full logits, row-major `rows.len() x vocab` f32, as the
/// module docs define.
///
/// Errors: [`SampleError::Invalid`] for an empty vocabulary, a logits length other than
/// `rows.len() * vocab`, or a row whose parameters fail [`SamplingParams::validate`](super::SamplingParams::validate).
pub fn sample_full(logits: &[f32], vocab: usize, rows: &[SampleRow<'_>]) -> Result<Vec<Sampled>, SampleError> {
    check_rows(vocab, rows)?;
    if rows.len().checked_mul(vocab) != Some(logits.len()) {
        return Err(SampleError::Invalid(format!(
            "{} logits for {} rows of a vocabulary of {vocab}",
            logits.len(),
            rows.len()
        )));
    }
    logits
        .chunks_exact(vocab)
        .zip(rows)
        .map(|(l, row)| full_row(l, row).ok_or_else(|| SampleError::Invalid("an empty row of logits".into())))
        .collect()
}

/// One row: `raw` holds all `vocab` logits; `None` if it is empty.
fn full_row(raw: &[f32], row: &SampleRow<'_>) -> Option<Sampled> {
    let p = row.params;
    let mut pen = raw.to_vec();
    Penalties::new(row, 0..raw.len()).apply(&mut pen, 0);
    let mut order: Vec<Cand> =
        pen.iter().zip(raw).enumerate().map(|(id, (&pen, &raw))| Cand { pen, raw: clean(raw), id }).collect();
    order.sort_by(by_pen);
    let first = *order.first()?;
    let chosen = if p.is_greedy() {
        first
    } else {
        let t = p.temperature;
        let m = scaled(first.pen, t);
        let mut kept: Vec<(Cand, f64)> =
            order.iter().map(|c| (*c, weight(scaled(c.pen, t), m))).filter(|&(_, w)| min_p_keeps(w, p.min_p)).collect();
        if let Some(k) = p.top_k {
            kept.truncate(k);
        }
        if p.top_p < 1.0 {
            let total = kept.iter().fold(0u128, |a, &(_, w)| a.saturating_add(fixed(w)));
            if let Some(n) = nucleus_len(kept.iter().map(|&(_, w)| w), total, p.top_p) {
                kept.truncate(n);
            }
        }
        let kept: Vec<Cand> = kept.into_iter().map(|(c, _)| c).collect();
        // The first id always passes min_p (weight 1), so `kept` is never empty.
        draw(&kept, row).unwrap_or(first)
    };
    let logprobs = p.logprobs.map(|n| {
        let raws: Vec<f32> = raw.iter().map(|&l| clean(l)).collect();
        let norm = LogNorm::join(&[lse_part(&raws)]);
        let mut by_logit = order.clone();
        by_logit.sort_by(by_raw);
        let top = by_logit.iter().take(n).map(|c| (c.id as i64, norm.logprob(c.raw))).collect();
        TokenLogprobs { logprob: norm.logprob(chosen.raw), top }
    });
    Some(Sampled { token: chosen.id as i64, logprobs })
}
