//! Joining the ranks' candidates: the best Gumbel key, the global top `k`, and the `top_p`
//! nucleus from truncated per-rank lists (exact as far as every rank's list reaches).

use super::SampleError;
use super::math::{Cand, by_pen, fixed, key_beats, min_p_keeps, nucleus_len, scaled, weight};
use super::wire::{Reader, Writer};
use super::{SampleRow, SamplingParams};
use std::cmp::Ordering;

/// Writes a rank's best `(key, candidate)` (or an empty slot).
pub(crate) fn write_key(w: &mut Writer, best: Option<(f64, Cand)>) {
    w.f64(best.map_or(0.0, |b| b.0));
    w.cand(best.as_ref().map(|b| &b.1));
}

/// Reads every rank's best key and returns the winner (`None` if every slot is empty).
pub(crate) fn merge_keys(readers: &mut [Reader], vocab: usize) -> Result<Option<Cand>, SampleError> {
    let mut best: Option<(f64, Cand)> = None;
    for r in readers {
        let k = r.f64()?;
        if let Some(c) = r.cand(vocab)?
            && best.is_none_or(|(bk, b)| key_beats((k, c.id), (bk, b.id)))
        {
            best = Some((k, c));
        }
    }
    Ok(best.map(|b| b.1))
}

/// The global first `n` in `order` from every rank's own first `n` (each rank's list in order).
pub(crate) fn merge_top(lists: Vec<Vec<Cand>>, n: usize, order: fn(&Cand, &Cand) -> Ordering) -> Vec<Cand> {
    let mut all: Vec<Cand> = lists.into_iter().flatten().collect();
    all.sort_by(order);
    all.truncate(n);
    all
}

/// The ids `min_p` keeps among `cands` (in order), with their weights under the maximum `m`.
pub(crate) fn min_p_filter(cands: &[Cand], m: f64, p: &SamplingParams) -> Vec<(Cand, f64)> {
    cands
        .iter()
        .map(|c| (*c, weight(scaled(c.pen, p.temperature), m)))
        .filter(|&(_, w)| min_p_keeps(w, p.min_p))
        .collect()
}

/// `kept` (the whole kept set, in order) cut to its `top_p` nucleus.
pub(crate) fn cut_top_p(kept: Vec<(Cand, f64)>, top_p: f32) -> Vec<Cand> {
    let n = if top_p < 1.0 {
        let total = kept.iter().fold(0u128, |a, &(_, w)| a.saturating_add(fixed(w)));
        nucleus_len(kept.iter().map(|&(_, w)| w), total, top_p).unwrap_or(kept.len())
    } else {
        kept.len()
    };
    kept.into_iter().take(n).map(|(c, _)| c).collect()
}

/// The `top_p` nucleus of a row whose kept set (after `min_p`) has fixed-point mass `total`,
/// from each rank's first `c` ids in sampling order (`lists`, unfiltered) and the number of ids
/// each rank keeps (`kept`). `None` while the lists do not reach far enough to decide it.
///
/// A rank that keeps more than `c` ids may hold more below its last listed one; every id before
/// the earliest such last id (in sampling order) is present, so the prefix sums up to it are the
/// global ones.
pub(crate) fn nucleus_from_lists(
    lists: &[Vec<Cand>],
    kept: &[usize],
    c: usize,
    m: f64,
    row: &SampleRow<'_>,
    total: u128,
) -> Option<Vec<Cand>> {
    let p = row.params;
    let mut merged: Vec<Cand> = lists.iter().flatten().copied().collect();
    merged.sort_by(by_pen);
    let merged = min_p_filter(&merged, m, p);
    let bound =
        lists.iter().zip(kept).filter(|&(_, &n)| n > c).filter_map(|(l, _)| l.last()).min_by(|a, b| by_pen(a, b));
    let exact = bound.map_or(merged.len(), |b| merged.partition_point(|(x, _)| by_pen(x, b) != Ordering::Greater));
    let prefix = merged.get(..exact).unwrap_or(&merged);
    match nucleus_len(prefix.iter().map(|&(_, w)| w), total, p.top_p) {
        Some(n) => Some(merged.iter().take(n).map(|&(c, _)| c).collect()),
        // Never reached (rounding near top_p = 1): everything is kept, once everything is known.
        None if bound.is_none() => Some(merged.into_iter().map(|(c, _)| c).collect()),
        None => None,
    }
}
