//! The per-element definitions both samplers share: penalties, the candidate order, weights,
//! the fixed-point mass, the nucleus cut, the Gumbel draw and the log-normaliser. Each is a
//! function of one element (or of a list every rank holds), so every rank computes bitwise the
//! same values as the full-row sampler.

use super::noise;
use super::{SampleRow, SamplingParams};
use std::cmp::Ordering;
use std::collections::HashMap;

/// A logit as the samplers order it: NaN becomes `-inf`, `-0` becomes `0`.
pub(crate) fn clean(v: f32) -> f32 {
    if v.is_nan() {
        f32::NEG_INFINITY
    } else if v == 0.0 {
        0.0
    } else {
        v
    }
}

/// One vocabulary id with its penalised and raw logits (both [`clean`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Cand {
    /// The penalised logit.
    pub pen: f32,
    /// The raw logit (for logprobs).
    pub raw: f32,
    /// The global id.
    pub id: usize,
}

/// The sampling order: larger penalised logit first, then the lower id.
pub(crate) fn by_pen(a: &Cand, b: &Cand) -> Ordering {
    b.pen.total_cmp(&a.pen).then(a.id.cmp(&b.id))
}

/// The logprob order: larger raw logit first, then the lower id.
pub(crate) fn by_raw(a: &Cand, b: &Cand) -> Ordering {
    b.raw.total_cmp(&a.raw).then(a.id.cmp(&b.id))
}

/// What one row does to its logits before the sampling order, for the ids in `range`: the
/// structured-output mask and the banned ids (`-inf`), `logit_bias`, then the penalties of each
/// id seen in the prompt or the output, with how often the output holds it.
pub(crate) struct Penalties<'a> {
    params: &'a SamplingParams,
    seen: HashMap<usize, u32>,
    row: SampleRow<'a>,
}

impl<'a> Penalties<'a> {
    /// Collects the seen ids of `row` within `range` (ids outside it, or negative, are ignored).
    pub(crate) fn new(row: &SampleRow<'a>, range: std::ops::Range<usize>) -> Penalties<'a> {
        let p = row.params;
        let mut seen = HashMap::new();
        let in_range = |id: i64| usize::try_from(id).ok().filter(|i| range.contains(i));
        if p.repetition_penalty != 1.0 {
            for id in row.prompt.iter().filter_map(|&id| in_range(id)) {
                seen.entry(id).or_insert(0);
            }
        }
        let counts = p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        if counts {
            for id in row.output.iter().filter_map(|&id| in_range(id)) {
                *seen.entry(id).or_insert(0) += 1;
            }
        }
        Penalties { params: p, seen, row: *row }
    }

    /// Masks, biases and penalises `logits` (the columns from global id `start` on) in place and
    /// cleans every value.
    pub(crate) fn apply(&self, logits: &mut [f32], start: usize) {
        for v in logits.iter_mut() {
            *v = clean(*v);
        }
        if self.row.mask.is_some() {
            for (i, v) in logits.iter_mut().enumerate() {
                if !self.row.allows(start + i) {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
        let local = |id: i64| usize::try_from(id).ok().and_then(|id| id.checked_sub(start));
        for &id in self.row.banned {
            if let Some(v) = local(id).and_then(|i| logits.get_mut(i)) {
                *v = f32::NEG_INFINITY;
            }
        }
        for &(id, bias) in &self.params.logit_bias {
            if let Some(v) = local(id).and_then(|i| logits.get_mut(i)) {
                *v = clean(*v + bias);
            }
        }
        for (&id, &count) in &self.seen {
            if let Some(v) = id.checked_sub(start).and_then(|i| logits.get_mut(i)) {
                *v = clean(penalize(*v, count, self.params));
            }
        }
    }
}

/// One seen id's penalised logit: the repetition penalty, then (for ids in the output, `count`
/// times) `frequency · count + presence` subtracted, all in f32.
fn penalize(l: f32, count: u32, p: &SamplingParams) -> f32 {
    let mut l = l;
    if p.repetition_penalty != 1.0 {
        l = if l > 0.0 { l / p.repetition_penalty } else { l * p.repetition_penalty };
    }
    if count > 0 {
        l -= p.frequency_penalty * count as f32 + p.presence_penalty;
    }
    l
}

/// The temperature-scaled logit `x = l' / T` in f64 (`T > 0`).
pub(crate) fn scaled(pen: f32, temperature: f32) -> f64 {
    f64::from(pen) / f64::from(temperature)
}

/// `exp(x - m)` for the row maximum `m`, 1 where `x == m` (so `+inf` and an all-`-inf` row
/// weigh 1, never NaN).
pub(crate) fn weight(x: f64, m: f64) -> f64 {
    if x == m { 1.0 } else { (x - m).exp() }
}

/// Whether `min_p` keeps an id of weight `w`.
pub(crate) fn min_p_keeps(w: f64, min_p: f32) -> bool {
    min_p <= 0.0 || w >= f64::from(min_p)
}

/// A weight in `[0, 1]` as a fixed-point integer of 96 fraction bits (truncated), so sums are
/// exact and independent of their order; up to 2^31 of them fit.
pub(crate) fn fixed(w: f64) -> u128 {
    (w * 2f64.powi(96)) as u128
}

/// The shortest prefix of `weights` (the kept ids in sampling order) whose fixed-point mass
/// reaches `top_p` of `total`, as its length; `None` if it never does (rounding near
/// `top_p = 1`: then everything stays).
pub(crate) fn nucleus_len(weights: impl IntoIterator<Item = f64>, total: u128, top_p: f32) -> Option<usize> {
    let threshold = (total as f64 * f64::from(top_p)) as u128;
    let mut cum = 0u128;
    for (j, w) in weights.into_iter().enumerate() {
        cum = cum.saturating_add(fixed(w));
        if cum >= threshold {
            return Some(j + 1);
        }
    }
    None
}

/// The Gumbel key of id `id` at scaled logit `x`.
pub(crate) fn key(x: f64, row: &SampleRow<'_>, id: usize) -> f64 {
    x - noise::ln_exp(row.seed, row.step, id)
}

/// Whether key `a` beats key `b` (`(key, id)`): the larger key, then the lower id.
pub(crate) fn key_beats(a: (f64, usize), b: (f64, usize)) -> bool {
    a.0 > b.0 || (a.0 == b.0 && a.1 < b.1)
}

/// The candidate of `cands` with the best Gumbel key (`None` if empty).
pub(crate) fn draw(cands: &[Cand], row: &SampleRow<'_>) -> Option<Cand> {
    let t = row.params.temperature;
    let mut best: Option<(f64, Cand)> = None;
    for c in cands {
        let k = key(scaled(c.pen, t), row, c.id);
        if best.is_none_or(|(bk, b)| key_beats((k, c.id), (bk, b.id))) {
            best = Some((k, *c));
        }
    }
    best.map(|(_, c)| c)
}

/// One part of a row's log-normaliser: the largest raw logit `m` of the part and
/// `Σ weight(l, m)` over it (`(-inf, 0)` for an empty part).
pub(crate) fn lse_part(raws: &[f32]) -> (f32, f64) {
    let m = raws.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let s = raws.iter().map(|&l| weight(f64::from(l), f64::from(m))).sum();
    (m, s)
}

/// A row's log-normaliser, `log Σ exp(l)` as `m + ln_z`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LogNorm {
    m: f64,
    ln_z: f64,
}

impl LogNorm {
    /// Joins the parts of [`lse_part`].
    pub(crate) fn join(parts: &[(f32, f64)]) -> LogNorm {
        let m = parts.iter().map(|p| f64::from(p.0)).fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = parts.iter().map(|&(pm, s)| if s == 0.0 { 0.0 } else { s * weight(f64::from(pm), m) }).sum();
        LogNorm { m, ln_z: z.ln() }
    }

    /// `log_softmax` at raw logit `l`.
    pub(crate) fn logprob(&self, l: f32) -> f32 {
        let l = f64::from(l);
        let d = if l == self.m { 0.0 } else { l - self.m };
        (d - self.ln_z) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_point_sums_are_order_free() {
        let ws = [1.0, 0.3, 1e-20, 0.7, 2f64.powi(-97), 0.123456789];
        let fwd = ws.iter().fold(0u128, |a, &w| a + fixed(w));
        let back = ws.iter().rev().fold(0u128, |a, &w| a + fixed(w));
        assert_eq!(fwd, back);
        assert_eq!(fixed(1.0), 1u128 << 96);
        assert_eq!(fixed(2f64.powi(-97)), 0);
    }

    #[test]
    fn nucleus_cuts_at_the_first_prefix_reaching_top_p() {
        let ws = [1.0, 0.5, 0.25, 0.25];
        let total: u128 = ws.iter().map(|&w| fixed(w)).sum();
        assert_eq!(nucleus_len(ws, total, 0.5), Some(1));
        assert_eq!(nucleus_len(ws, total, 0.51), Some(2));
        assert_eq!(nucleus_len(ws, total, 0.875), Some(3));
        assert_eq!(nucleus_len(ws, total, 0.9), Some(4));
    }

    #[test]
    fn log_norm_handles_infinities() {
        let n = LogNorm::join(&[lse_part(&[f32::NEG_INFINITY; 4])]);
        assert!((n.logprob(f32::NEG_INFINITY) - (-(4f32).ln())).abs() < 1e-6);
        let n = LogNorm::join(&[lse_part(&[f32::INFINITY, 1.0]), lse_part(&[f32::INFINITY])]);
        assert!((n.logprob(f32::INFINITY) - (-(2f32).ln())).abs() < 1e-6);
        assert_eq!(n.logprob(1.0), f32::NEG_INFINITY);
        let n = LogNorm::join(&[lse_part(&[0.0, 1.0]), lse_part(&[]), lse_part(&[2.0])]);
        let z = (0f64.exp() + 1f64.exp() + 2f64.exp()).ln();
        assert!((f64::from(n.logprob(1.0)) - (1.0 - z)).abs() < 1e-6);
    }
}
