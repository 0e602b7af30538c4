//! [`sample_sharded`]: the sampler on each rank's columns of the logits, in rounds of one small
//! all-gather each, all rows of the batch together.
//!
//! Round 1 (always): each rank's split of the vocabulary, and per row its best id (greedy,
//! and the row maximum), its best Gumbel key (plain sampling), its first `k` ids (`top_k`) or
//! first 64 ids (`top_p`), and its log-normaliser part and top `n` raw logits (logprobs).
//! Round 2 (rows with `min_p` but no `top_k`/`top_p`, or `top_p` without `top_k`): the best key
//! among the ids `min_p` keeps, or the kept mass and count. Rounds 3.. (`top_p` rows whose
//! nucleus reaches past every rank's list): each rank's first `4c` ids, up to all it keeps
//! (which is the fallback of gathering the row: only where the nucleus is that wide).
//!
//! Collectives per step at world size > 1 (the batch takes as many as its neediest row; none at
//! world size 1): greedy, plain temperature sampling and any `top_k` mix (with `min_p`, `top_p`,
//! penalties, logprobs): 1. `min_p` without `top_k`: 2. `top_p` without `top_k`: 2 while the
//! nucleus lies within the ranks' first 64 ids, then one more per 4x growth of the lists (a flat
//! row of 4096 ids over 4 ranks: 4).
//!
//! The logits are read to the host as f32 (`[n, V_r]` per step); every message is `i64` words.

use super::local::LocalRow;
use super::math::{Cand, LogNorm, by_pen, by_raw, draw, scaled};
use super::merge::{cut_top_p, merge_keys, merge_top, min_p_filter, nucleus_from_lists, write_key};
use super::wire::{Reader, Writer, exchange};
use super::{SampleError, SampleRow, Sampled, check_rows};
use crate::api::TokenLogprobs;
use tp_comm::DeviceGroup;
use tp_core::{DType, Tensor};

/// Ids each rank lists first for a `top_p` row.
const FIRST_LIST: usize = 64;
/// How much a `top_p` row's lists grow per further round.
const GROWTH: usize = 4;
/// Rounds after which the sampler gives up (the lists grow 4x a round, so 40 reach any vocabulary).
const MAX_ROUNDS: usize = 40;

/// Samples one token per row from this rank's columns of the logits, `logits: [n, V_r]` (any
/// float dtype, any device) holding global ids `start..start + V_r` of `vocab`; every rank of
/// `group` calls it with the same rows and gets the same tokens, bitwise those of
/// [`sample_full`](super::sample_full) on the gathered f32 logits (logprobs within rounding).
///
/// Errors: [`SampleError::Invalid`] for logits that are not `[rows.len(), V_r]` floats, columns
/// beyond `vocab`, ranks whose columns do not tile `0..vocab`, or invalid parameters;
/// [`SampleError::Comm`] when a collective fails (a peer gone or past the group's deadline).
pub fn sample_sharded(
    logits: &Tensor,
    start: usize,
    vocab: usize,
    rows: &[SampleRow<'_>],
    group: &DeviceGroup,
) -> Result<Vec<Sampled>, SampleError> {
    sample_sharded_counted(logits, start, vocab, rows, group).map(|(s, _)| s)
}

/// [`sample_sharded`], also returning how many collectives it ran.
pub fn sample_sharded_counted(
    logits: &Tensor,
    start: usize,
    vocab: usize,
    rows: &[SampleRow<'_>],
    group: &DeviceGroup,
) -> Result<(Vec<Sampled>, usize), SampleError> {
    check_rows(vocab, rows)?;
    let dims = logits.dims();
    let width = match *dims {
        [n, w] if n == rows.len() => w,
        _ => {
            return Err(SampleError::Invalid(format!(
                "logits of shape {dims:?} for {} rows; expected [rows, V_r]",
                rows.len()
            )));
        }
    };
    if !logits.dtype().is_float() {
        return Err(SampleError::Invalid(format!("logits of dtype {}; expected a float dtype", logits.dtype())));
    }
    if start.checked_add(width).is_none_or(|end| end > vocab) {
        return Err(SampleError::Invalid(format!("columns {start}..{start}+{width} exceed the vocabulary of {vocab}")));
    }
    if rows.is_empty() {
        return Ok((Vec::new(), 0));
    }
    let host = logits.to_dtype(DType::F32)?.to_vec::<f32>()?;
    let mut states: Vec<RowState<'_>> = rows
        .iter()
        .enumerate()
        .map(|(i, row)| {
            let cols = host.get(i * width..(i + 1) * width).unwrap_or(&[]);
            RowState::new(LocalRow::new(cols, start, *row), *row, vocab)
        })
        .collect();
    let mut rounds = 0;
    loop {
        let mut w = Writer::new();
        if rounds == 0 {
            w.size(start);
            w.size(width);
        }
        for s in &states {
            s.write(&mut w);
        }
        if w.is_empty() {
            break;
        }
        if rounds == MAX_ROUNDS {
            return Err(SampleError::Disagree(format!("no decision after {MAX_ROUNDS} rounds")));
        }
        let mut readers = exchange(group, w)?;
        if rounds == 0 {
            check_split(&mut readers, vocab)?;
        }
        for s in &mut states {
            s.read(&mut readers, vocab)?;
        }
        for r in &readers {
            r.finish()?;
        }
        rounds += 1;
    }
    let collectives = if group.world_size() > 1 { rounds } else { 0 };
    let sampled = states.into_iter().map(RowState::result).collect::<Result<_, _>>()?;
    Ok((sampled, collectives))
}

/// Reads every rank's `(start, width)` and checks that they tile `0..vocab`.
fn check_split(readers: &mut [Reader], vocab: usize) -> Result<(), SampleError> {
    let mut split = readers.iter_mut().map(|r| Ok((r.size()?, r.size()?))).collect::<Result<Vec<_>, SampleError>>()?;
    split.sort_unstable();
    let mut next = 0;
    for &(s, w) in &split {
        if s != next {
            return Err(SampleError::Invalid(format!(
                "the ranks' columns {split:?} (start, width) do not tile the vocabulary 0..{vocab}"
            )));
        }
        next = s.saturating_add(w);
    }
    if next != vocab {
        return Err(SampleError::Invalid(format!(
            "the ranks' columns {split:?} (start, width) do not tile the vocabulary 0..{vocab}"
        )));
    }
    Ok(())
}

/// How a row's token is decided, from its parameters.
#[derive(Debug, Clone, Copy)]
enum Mode {
    /// The argmax.
    Greedy,
    /// A draw over every id.
    Plain,
    /// A draw over the ids `min_p` keeps.
    MinP,
    /// A draw over the first `k` ids (`k < vocab`), then `min_p` and `top_p` among them.
    TopK(usize),
    /// A draw over the `top_p` nucleus of the ids `min_p` keeps.
    TopP,
}

/// Where a row is in the rounds.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Stage {
    /// Round 1.
    First,
    /// Round 2.
    Second,
    /// A further round with lists of this many ids.
    More(usize),
    /// Decided.
    Done,
}

/// One row on this rank: its columns and what the rounds have told it so far (the same on
/// every rank, apart from `local`).
struct RowState<'a> {
    local: LocalRow<'a>,
    row: SampleRow<'a>,
    mode: Mode,
    /// Top logprobs asked for, at most `vocab`.
    logprobs: Option<usize>,
    stage: Stage,
    /// The scaled row maximum (sampled rows).
    m: f64,
    chosen: Option<Cand>,
    norm: Option<LogNorm>,
    top: Vec<Cand>,
    /// `top_p` rows: each rank's first `c` ids, their kept counts and the kept mass.
    lists: Vec<Vec<Cand>>,
    c: usize,
    kept: Vec<usize>,
    total: u128,
}

impl<'a> RowState<'a> {
    fn new(local: LocalRow<'a>, row: SampleRow<'a>, vocab: usize) -> RowState<'a> {
        let p = row.params;
        let mode = if p.is_greedy() {
            Mode::Greedy
        } else if let Some(k) = p.top_k.filter(|&k| k < vocab) {
            Mode::TopK(k)
        } else if p.top_p < 1.0 {
            Mode::TopP
        } else if p.min_p > 0.0 {
            Mode::MinP
        } else {
            Mode::Plain
        };
        RowState {
            local,
            row,
            mode,
            logprobs: p.logprobs.map(|n| n.min(vocab)),
            stage: Stage::First,
            m: 0.0,
            chosen: None,
            norm: None,
            top: Vec::new(),
            lists: Vec::new(),
            c: FIRST_LIST.min(vocab),
            kept: Vec::new(),
            total: 0,
        }
    }

    /// This rank's part of the current round's message (nothing once decided).
    fn write(&self, w: &mut Writer) {
        let l = &self.local;
        match (self.stage, self.mode) {
            (Stage::First, mode) => {
                w.cand(l.best().as_ref());
                match mode {
                    Mode::Plain => write_key(w, l.best_key(None)),
                    Mode::TopK(k) => w.cands(&l.top_by_pen(k), k),
                    Mode::TopP => w.cands(&l.top_by_pen(self.c), self.c),
                    Mode::Greedy | Mode::MinP => {}
                }
                if let Some(n) = self.logprobs {
                    let (m, s) = l.lse_part();
                    w.f32(m);
                    w.f64(s);
                    w.cands(&l.top_by_raw(n), n);
                }
            }
            (Stage::Second, Mode::MinP) => write_key(w, l.best_key(Some(self.m))),
            (Stage::Second, _) => {
                let (z, n) = l.kept_mass(self.m);
                w.u128(z);
                w.size(n);
            }
            (Stage::More(c), _) => w.cands(&l.top_by_pen(c), c),
            (Stage::Done, _) => {}
        }
    }

    /// Reads every rank's part of the round this row took part in, and moves on.
    fn read(&mut self, readers: &mut [Reader], vocab: usize) -> Result<(), SampleError> {
        match self.stage {
            Stage::First => self.read_first(readers, vocab),
            Stage::Second if matches!(self.mode, Mode::MinP) => {
                self.chosen = merge_keys(readers, vocab)?;
                self.stage = Stage::Done;
                Ok(())
            }
            Stage::Second => {
                self.kept.clear();
                self.total = 0;
                for r in readers {
                    self.total = self.total.saturating_add(r.u128()?);
                    self.kept.push(r.size()?);
                }
                self.decide_top_p();
                Ok(())
            }
            Stage::More(c) => {
                self.lists = readers.iter_mut().map(|r| r.cands(c, vocab)).collect::<Result<_, _>>()?;
                self.c = c;
                self.decide_top_p();
                Ok(())
            }
            Stage::Done => Ok(()),
        }
    }

    fn read_first(&mut self, readers: &mut [Reader], vocab: usize) -> Result<(), SampleError> {
        let mut best: Option<Cand> = None;
        for r in readers.iter_mut() {
            if let Some(c) = r.cand(vocab)?
                && best.is_none_or(|b| by_pen(&c, &b).is_lt())
            {
                best = Some(c);
            }
        }
        let best = best.ok_or_else(|| SampleError::Invalid("no rank holds a column of the vocabulary".into()))?;
        let p = self.row.params;
        self.m = if p.is_greedy() { 0.0 } else { scaled(best.pen, p.temperature) };
        self.stage = Stage::Done;
        match self.mode {
            Mode::Greedy => self.chosen = Some(best),
            Mode::Plain => self.chosen = merge_keys(readers, vocab)?,
            Mode::TopK(k) => {
                let lists = readers.iter_mut().map(|r| r.cands(k, vocab)).collect::<Result<_, _>>()?;
                let kept = min_p_filter(&merge_top(lists, k, by_pen), self.m, p);
                self.chosen = draw(&cut_top_p(kept, p.top_p), &self.row);
            }
            Mode::TopP => {
                self.lists = readers.iter_mut().map(|r| r.cands(self.c, vocab)).collect::<Result<_, _>>()?;
                self.stage = Stage::Second;
            }
            Mode::MinP => self.stage = Stage::Second,
        }
        if let Some(n) = self.logprobs {
            let mut parts = Vec::with_capacity(readers.len());
            let mut lists = Vec::with_capacity(readers.len());
            for r in readers.iter_mut() {
                parts.push((r.f32()?, r.f64()?));
                lists.push(r.cands(n, vocab)?);
            }
            self.norm = Some(LogNorm::join(&parts));
            self.top = merge_top(lists, n, by_raw);
        }
        Ok(())
    }

    /// Decides a `top_p` row from its lists if they reach far enough, else asks for longer ones.
    fn decide_top_p(&mut self) {
        match nucleus_from_lists(&self.lists, &self.kept, self.c, self.m, &self.row, self.total) {
            Some(nucleus) => {
                self.chosen = draw(&nucleus, &self.row);
                self.stage = Stage::Done;
            }
            None => {
                let most = self.kept.iter().copied().max().unwrap_or(0);
                self.stage = Stage::More(self.c.saturating_mul(GROWTH).min(most).max(self.c + 1));
            }
        }
    }

    /// The decided token and its logprobs.
    fn result(self) -> Result<Sampled, SampleError> {
        let chosen = self.chosen.ok_or_else(|| SampleError::Disagree("a row ended undecided".into()))?;
        let logprobs = match (self.logprobs, self.norm) {
            (Some(_), Some(norm)) => Some(TokenLogprobs {
                logprob: norm.logprob(chosen.raw),
                top: self.top.iter().map(|c| (c.id as i64, norm.logprob(c.raw))).collect(),
            }),
            _ => None,
        };
        Ok(Sampled { token: chosen.id as i64, logprobs })
    }
}
