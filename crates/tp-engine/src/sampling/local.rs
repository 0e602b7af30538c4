//! One row's columns on one rank and what the rank computes from them alone: its best
//! candidates, its best Gumbel key, its share of the kept mass and of the log-normaliser.

use super::SampleRow;
use super::math::{
    Cand, Penalties, by_pen, by_raw, clean, fixed, key, key_beats, lse_part, min_p_keeps, scaled, weight,
};
use super::noise::{LN_EXP_BOUND, may_reach};
use std::cmp::Ordering;

/// A row's columns `start..start + len` on this rank, penalised and cleaned.
pub(crate) struct LocalRow<'a> {
    row: SampleRow<'a>,
    start: usize,
    pen: Vec<f32>,
    raw: Vec<f32>,
}

impl<'a> LocalRow<'a> {
    /// The columns `raw` (global ids from `start`) of `row`.
    pub(crate) fn new(raw: &[f32], start: usize, row: SampleRow<'a>) -> LocalRow<'a> {
        let mut pen = raw.to_vec();
        Penalties::new(&row, start..start + raw.len()).apply(&mut pen, start);
        LocalRow { row, start, pen, raw: raw.iter().map(|&l| clean(l)).collect() }
    }

    fn cand(&self, i: usize, pen: f32) -> Cand {
        Cand { pen, raw: self.raw.get(i).copied().unwrap_or(f32::NEG_INFINITY), id: self.start + i }
    }

    fn cands(&self) -> impl Iterator<Item = Cand> + '_ {
        self.pen.iter().enumerate().map(|(i, &p)| self.cand(i, p))
    }

    /// The first column in the sampling order (`None` without columns).
    pub(crate) fn best(&self) -> Option<Cand> {
        self.cands().min_by(by_pen)
    }

    /// The first `c` columns by `order`, in that order.
    fn top(&self, c: usize, order: fn(&Cand, &Cand) -> Ordering) -> Vec<Cand> {
        let mut all: Vec<Cand> = self.cands().collect();
        if c == 0 {
            return Vec::new();
        }
        if c < all.len() {
            all.select_nth_unstable_by(c - 1, order);
            all.truncate(c);
        }
        all.sort_by(order);
        all
    }

    /// The first `c` columns in the sampling order.
    pub(crate) fn top_by_pen(&self, c: usize) -> Vec<Cand> {
        self.top(c, by_pen)
    }

    /// The `n` largest raw logits (lower id first on ties).
    pub(crate) fn top_by_raw(&self, n: usize) -> Vec<Cand> {
        self.top(n, by_raw)
    }

    /// This rank's part of the log-normaliser.
    pub(crate) fn lse_part(&self) -> (f32, f64) {
        lse_part(&self.raw)
    }

    /// The column with the best Gumbel key, with that key, among all columns (`m == None`) or
    /// those `min_p` keeps under the row maximum `m` (`None` if no column qualifies).
    pub(crate) fn best_key(&self, m: Option<f64>) -> Option<(f64, Cand)> {
        let p = self.row.params;
        let mut best: Option<(f64, Cand)> = None;
        let mut visit = |c: Cand| {
            let x = scaled(c.pen, p.temperature);
            // No key exceeds x + LN_EXP_BOUND, so a column that far below the best cannot win.
            if best
                .is_some_and(|(bk, _)| x + LN_EXP_BOUND < bk || !may_reach(x, bk, self.row.seed, self.row.step, c.id))
            {
                return;
            }
            if m.is_some_and(|m| !min_p_keeps(weight(x, m), p.min_p)) {
                return;
            }
            let k = key(x, &self.row, c.id);
            if best.is_none_or(|(bk, b)| key_beats((k, c.id), (bk, b.id))) {
                best = Some((k, c));
            }
        };
        // The local maximum first, so the pruning bites from the start.
        if let Some(c) = self.best() {
            visit(c);
        }
        self.cands().for_each(visit);
        best
    }

    /// The fixed-point mass and the number of the columns `min_p` keeps under the row maximum `m`.
    pub(crate) fn kept_mass(&self, m: f64) -> (u128, usize) {
        let p = self.row.params;
        self.pen
            .iter()
            .map(|&l| weight(scaled(l, p.temperature), m))
            .filter(|&w| min_p_keeps(w, p.min_p))
            .fold((0u128, 0usize), |(z, n), w| (z.saturating_add(fixed(w)), n + 1))
    }
}
