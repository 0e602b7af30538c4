//! [`score_sharded`]: the logprobs of given ids under rows of vocab-parallel logits (a
//! prompt's own tokens, for `prompt_logprobs` and `echo`), from one small all-gather: each rank
//! sends per row its part of the log-normaliser, the target's raw logit if the target is in its
//! columns, and its own top `n`.

use super::SampleError;
use super::math::{Cand, LogNorm, by_raw, clean, lse_part};
use super::merge::merge_top;
use super::wire::{Writer, exchange};
use crate::api::PromptLogprob;
use tp_comm::DeviceGroup;

/// `log_softmax(l)[target]` of each row of this rank's columns `cols` (row-major `[targets.len(),
/// width]` f32 holding global ids `start..start + width` of `vocab`), the target's rank (how many
/// ids have a logit at least the target's, as vLLM counts), and the `top` most likely ids
/// (largest raw logit first, the lower id on ties). Two all-gathers (the second counts the
/// rank). Every rank of `group` calls it with the same targets and gets the same answer.
///
/// Errors: [`SampleError::Invalid`] for a target outside the vocabulary or columns of the wrong
/// size; [`SampleError::Comm`] when the all-gather fails.
pub fn score_sharded(
    cols: &[f32],
    width: usize,
    start: usize,
    vocab: usize,
    targets: &[i64],
    top: usize,
    group: &DeviceGroup,
) -> Result<Vec<PromptLogprob>, SampleError> {
    if cols.len() != targets.len() * width || start + width > vocab {
        return Err(SampleError::Invalid(format!(
            "{} logits for {} rows of {width} columns from {start} in a vocabulary of {vocab}",
            cols.len(),
            targets.len()
        )));
    }
    let top = top.min(vocab);
    let mut w = Writer::new();
    let mut rows = Vec::with_capacity(targets.len());
    for (i, &t) in targets.iter().enumerate() {
        let t = usize::try_from(t)
            .ok()
            .filter(|&t| t < vocab)
            .ok_or_else(|| SampleError::Invalid(format!("target {t} outside the vocabulary of {vocab}")))?;
        let raw: Vec<f32> = cols[i * width..(i + 1) * width].iter().map(|&l| clean(l)).collect();
        let (m, s) = lse_part(&raw);
        w.f32(m);
        w.f64(s);
        let mine = t.checked_sub(start).and_then(|j| raw.get(j)).copied();
        w.size(usize::from(mine.is_some()));
        w.f32(mine.unwrap_or(0.0));
        let mut best = Vec::new();
        if top > 0 {
            best = raw.iter().enumerate().map(|(j, &r)| Cand { pen: r, raw: r, id: start + j }).collect();
            if top < best.len() {
                best.select_nth_unstable_by(top - 1, by_raw);
                best.truncate(top);
            }
            best.sort_by(by_raw);
        }
        w.cands(&best, top);
        rows.push(t);
    }
    let mut readers = exchange(group, w)?;
    let mut out = Vec::with_capacity(rows.len());
    let mut target_logits = Vec::with_capacity(rows.len());
    for _ in &rows {
        let mut parts = Vec::with_capacity(readers.len());
        let mut target = None;
        let mut lists = Vec::with_capacity(readers.len());
        for r in readers.iter_mut() {
            let m = r.f32()?;
            let s = r.f64()?;
            parts.push((m, s));
            let has = r.size()? == 1;
            let l = r.f32()?;
            if has {
                target = Some(l);
            }
            lists.push(r.cands(top, vocab)?);
        }
        let l = target.ok_or_else(|| SampleError::Disagree("no rank holds a target's column".into()))?;
        let norm = LogNorm::join(&parts);
        let top = merge_top(lists, top, by_raw).iter().map(|c| (c.id as i64, norm.logprob(c.raw))).collect();
        out.push(PromptLogprob { logprob: norm.logprob(l), rank: 0, top });
        target_logits.push(l);
    }
    for r in &readers {
        r.finish()?;
    }
    // Round 2: each rank counts its columns at or above each target's logit.
    let mut w = Writer::new();
    for (i, &l) in target_logits.iter().enumerate() {
        w.size(cols[i * width..(i + 1) * width].iter().filter(|&&c| clean(c) >= l).count());
    }
    let mut readers = exchange(group, w)?;
    for o in &mut out {
        for r in readers.iter_mut() {
            o.rank += r.size()?;
        }
    }
    for r in &readers {
        r.finish()?;
    }
    Ok(out)
}
