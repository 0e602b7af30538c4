//! One rank's part of the engine: its shard of the model, its paged KV caches (its KV heads of
//! every block), and a copy of every running request's sampling state, so that every rank runs
//! the same step and samples the same tokens.
//!
//! With pipeline stages (`--pipeline-parallel-size`), a rank holds its stage's blocks: the
//! first stage embeds the step's tokens, each stage sends its hidden states to the next over
//! the pipeline group, the last stage computes the logits and samples (vocab-parallel over its
//! tensor-parallel group), and its first rank broadcasts the sampled tokens (with their
//! logprobs) to every rank, so every rank keeps the same request state.

use super::EngineError;
use super::plan::{StepKind, StepMsg};
use crate::api::RequestId;
use crate::sampling::{SampleRow, Sampled, SamplingParams, sample_sharded};
use std::collections::HashMap;
use tp_comm::DeviceGroup;
use tp_core::{DType, Device, Tensor};
use tp_layers::{BatchSeq, PagedKvCache, TokenBatch};
use tp_models::{ParallelCausalLm, StageOutput};

/// A request's sampling state, the same on every rank.
#[derive(Debug)]
pub(crate) struct SeqState {
    pub params: SamplingParams,
    pub seed: u64,
    pub prompt: Vec<i64>,
    pub output: Vec<i64>,
    /// Ids banned until `params.min_tokens` tokens are out.
    pub min_stop: Vec<i64>,
}

/// Where a step's structured-output masks come from: rank 0 computes them (the closure runs
/// after rank 0's forward pass, joining the thread that computed them meanwhile) and broadcasts
/// them; the other ranks receive them.
pub(crate) enum MaskSource<'a> {
    /// Rank 0: the masks of `StepMsg::masked`, concatenated.
    Leader(Box<dyn FnOnce() -> Vec<u64> + 'a>),
    /// Any other rank.
    Follower,
}

/// One rank of the engine.
pub(crate) struct RankWorker {
    pub model: ParallelCausalLm,
    /// Every rank of the engine (rank 0 the leader): step messages and sampled tokens travel
    /// over it. The model's own group when there is no pipeline.
    pub world: DeviceGroup,
    /// The pipeline group (rank `s` = stage `s`) and the world rank of the last stage's first
    /// rank (who shares the sampled tokens), when there are stages.
    pub pipeline: Option<(DeviceGroup, usize)>,
    /// Seconds this rank spent computing steps (forward and sampling), for `/metrics`.
    pub busy_secs: f64,
    pub caches: Vec<PagedKvCache>,
    pub block_size: usize,
    pub seqs: HashMap<RequestId, SeqState>,
    /// Steps run so far (those with sequences).
    pub steps: u64,
    /// A fault to inject (tests): fail or hang at this step.
    pub fault: Option<Fault>,
}

/// A fault a test injects into one rank: at its `step`-th step (counting from 1) it fails, or
/// hangs for `hang` before going on (past the group's deadline, as a hung process would).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// Which rank.
    pub rank: usize,
    /// At which of its steps.
    pub step: u64,
    /// `None`: fail; `Some(d)`: stop for `d` first.
    pub hang: Option<std::time::Duration>,
}

impl RankWorker {
    fn group(&self) -> &DeviceGroup {
        &self.world
    }

    /// Fails every group this rank belongs to (the world, its stage's, the pipeline), so every
    /// rank leaves its waits at once.
    pub(crate) fn abort(&self, why: &str) {
        self.world.abort(why);
        self.model.group().abort(why);
        if let Some((pp, _)) = &self.pipeline {
            pp.abort(why);
        }
    }

    /// Rank 0: sends `msg` to every rank (header `[kind, len]`, then the payload).
    pub(crate) fn send(&self, msg: &StepMsg) -> Result<(), EngineError> {
        let words = msg.encode();
        let header = [msg.kind.code(), words.len() as i64];
        self.broadcast(&header)?;
        if !words.is_empty() {
            self.broadcast(&words)?;
        }
        Ok(())
    }

    /// Other ranks: the next message from rank 0 (within the group's deadline).
    pub(crate) fn receive(&self) -> Result<StepMsg, EngineError> {
        let header = self.broadcast(&[0, 0])?;
        let kind = StepKind::from_code(header[0])
            .ok_or_else(|| EngineError::Protocol(format!("unknown step kind {}", header[0])))?;
        let len = usize::try_from(header[1])
            .ok()
            .filter(|&n| n <= MAX_MESSAGE_WORDS)
            .ok_or_else(|| EngineError::Protocol(format!("step message of {} words", header[1])))?;
        let words = if len == 0 { Vec::new() } else { self.broadcast(&vec![0; len])? };
        StepMsg::decode(kind, &words).map_err(EngineError::Protocol)
    }

    /// Rank 0's `words` on every rank.
    fn broadcast(&self, words: &[i64]) -> Result<Vec<i64>, EngineError> {
        let g = self.group();
        let t = g.to_local(&Tensor::from_vec(words.to_vec(), &[words.len()], &Device::Cpu)?)?;
        Ok(g.broadcast(&t, 0)?.to_i64_vec()?)
    }

    /// Runs one step: applies the announcements, runs the batch, samples every sequence that
    /// asks for it, appends the tokens to the outputs. Every rank returns the same list.
    pub(crate) fn execute(
        &mut self,
        msg: &StepMsg,
        masks: MaskSource<'_>,
    ) -> Result<Vec<(RequestId, Sampled)>, EngineError> {
        for d in &msg.drop {
            self.seqs.remove(d);
        }
        for n in &msg.new {
            let state = SeqState {
                params: n.params.clone(),
                seed: n.seed,
                prompt: n.prompt.clone(),
                output: Vec::new(),
                min_stop: n.min_stop.clone(),
            };
            self.seqs.insert(n.id, state);
        }
        if msg.seqs.is_empty() {
            return Ok(Vec::new());
        }
        self.steps += 1;
        if let Some(f) = self.fault
            && f.rank == self.group().rank()
            && f.step == self.steps
        {
            match f.hang {
                None => return Err(EngineError::Step(format!("rank {} failed at step {} (injected)", f.rank, f.step))),
                Some(d) => std::thread::sleep(d),
            }
        }
        let mut ids = Vec::new();
        let mut batch_seqs = Vec::with_capacity(msg.seqs.len());
        let mut rows = Vec::new();
        let mut sampled_ids = Vec::new();
        for s in &msg.seqs {
            if !self.seqs.contains_key(&s.id) {
                return Err(EngineError::Protocol(format!("step names request {} that no message announced", s.id)));
            }
            ids.extend_from_slice(&s.tokens);
            batch_seqs.push(BatchSeq { tokens: s.tokens.len(), context: s.context, blocks: s.blocks.clone() });
            if s.sample {
                rows.push(ids.len() - 1);
                sampled_ids.push(s.id);
            }
        }
        let batch = TokenBatch::new(batch_seqs, self.block_size)?;
        let started = std::time::Instant::now();
        let out = self.forward_and_sample(&ids, &batch, &rows, &sampled_ids, msg, masks);
        self.busy_secs += started.elapsed().as_secs_f64();
        let sampled = match &self.pipeline {
            None => out?,
            Some((_, root)) => {
                let root = *root;
                let mine = if self.world.rank() == root { Some(out?) } else { out.map(|_| None)? };
                self.share_sampled(root, mine.as_deref())?
            }
        };
        let mut out = Vec::with_capacity(sampled.len());
        for (id, s) in sampled {
            if let Some(state) = self.seqs.get_mut(&id) {
                state.output.push(s.token);
            }
            out.push((id, s));
        }
        Ok(out)
    }

    /// This rank's stage of the step and, on the last stage, the sampling: every sampled
    /// request's token (empty elsewhere).
    fn forward_and_sample(
        &mut self,
        ids: &[i64],
        batch: &TokenBatch,
        rows: &[usize],
        sampled_ids: &[RequestId],
        msg: &StepMsg,
        masks: MaskSource<'_>,
    ) -> Result<Vec<(RequestId, Sampled)>, EngineError> {
        // A rank whose forward fails leaves before the masks' broadcast; it aborts the group,
        // which ends the others' wait at once.
        let logits = self.forward(ids, batch, rows)?;
        let masks = self.exchange_masks(msg, masks)?;
        let Some(logits) = logits else { return Ok(Vec::new()) };
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let (start, _) = self.model.vocab_shard();
        let vocab = self.model.config().vocab_size;
        let words = vocab.div_ceil(64);
        let sample_rows: Vec<SampleRow<'_>> = sampled_ids
            .iter()
            .map(|id| {
                let s = &self.seqs[id];
                let mask = msg.masked.iter().position(|m| m == id).and_then(|k| masks.get(k * words..(k + 1) * words));
                SampleRow {
                    params: &s.params,
                    seed: s.seed,
                    step: s.output.len() as u64,
                    prompt: &s.prompt,
                    output: &s.output,
                    banned: if s.output.len() < s.params.min_tokens { &s.min_stop } else { &[] },
                    mask,
                }
            })
            .collect();
        let logits = if logits.dtype() == DType::F32 { logits } else { logits.to_dtype(DType::F32)? };
        let sampled = sample_sharded(&logits, start, vocab, &sample_rows, self.model.group())
            .map_err(|e| EngineError::Step(e.to_string()))?;
        Ok(sampled_ids.iter().copied().zip(sampled).collect())
    }

    /// The step's structured-output masks on every rank (`ceil(vocab / 64)` words per entry of
    /// `msg.masked`, concatenated): rank 0's, broadcast over the world. Nothing when no sampled
    /// sequence is constrained.
    fn exchange_masks(&self, msg: &StepMsg, source: MaskSource<'_>) -> Result<Vec<u64>, EngineError> {
        if msg.masked.is_empty() {
            return Ok(Vec::new());
        }
        let len = msg.masked.len() * self.model.config().vocab_size.div_ceil(64);
        let words: Vec<i64> = match source {
            MaskSource::Leader(compute) => {
                let m = compute();
                if m.len() != len {
                    return Err(EngineError::Step(format!("{} mask words for {len}", m.len())));
                }
                m.into_iter().map(|w| w as i64).collect()
            }
            MaskSource::Follower => vec![0; len],
        };
        let g = &self.world;
        let t = g.to_local(&Tensor::from_vec(words, &[len], &Device::Cpu)?)?;
        Ok(g.broadcast(&t, 0)?.to_i64_vec()?.into_iter().map(|w| w as u64).collect())
    }

    /// This rank's stage of the step: the logits of the sampled rows on the last stage (`None`
    /// on the others, which pass their hidden states on).
    fn forward(&mut self, ids: &[i64], batch: &TokenBatch, rows: &[usize]) -> Result<Option<Tensor>, EngineError> {
        let logits = match &self.pipeline {
            None => self.model.forward_batch(ids, batch, &mut self.caches, rows)?,
            Some((pp, _)) => {
                let (s, p) = (pp.rank(), pp.world_size());
                let input = if s > 0 {
                    Some(pp.recv(&[ids.len(), self.model.config().hidden_size], self.model.dtype(), s - 1)?)
                } else {
                    None
                };
                match self.model.forward_batch_stage(ids, input, batch, &mut self.caches, rows)? {
                    StageOutput::Hidden(h) if s + 1 < p => {
                        pp.send(&h, s + 1)?;
                        return Ok(None);
                    }
                    StageOutput::Hidden(_) => {
                        return Err(EngineError::Step("the last pipeline stage has no LM head".into()));
                    }
                    StageOutput::Logits(l) => l,
                }
            }
        };
        Ok(Some(logits))
    }

    /// The last stage's sampled tokens on every rank: world rank `root` (which passes them)
    /// broadcasts their length, then their words (`id, token, logprobs?, logprob, n, (id,
    /// logprob) x n` each, floats as their bits).
    fn share_sampled(
        &self,
        root: usize,
        mine: Option<&[(RequestId, Sampled)]>,
    ) -> Result<Vec<(RequestId, Sampled)>, EngineError> {
        let g = &self.world;
        let mut words = Vec::new();
        for (id, s) in mine.unwrap_or(&[]) {
            words.extend([*id as i64, s.token]);
            match &s.logprobs {
                None => words.push(0),
                Some(lp) => {
                    words.extend([1, i64::from(lp.logprob.to_bits()), lp.top.len() as i64]);
                    for (t, l) in &lp.top {
                        words.extend([*t, i64::from(l.to_bits())]);
                    }
                }
            }
        }
        let bcast = |w: Vec<i64>| -> Result<Vec<i64>, EngineError> {
            let n = w.len();
            let t = g.to_local(&Tensor::from_vec(w, &[n], &Device::Cpu)?)?;
            Ok(g.broadcast(&t, root)?.to_i64_vec()?)
        };
        let len = bcast(vec![words.len() as i64])?[0];
        let len = usize::try_from(len)
            .ok()
            .filter(|&n| n <= MAX_MESSAGE_WORDS)
            .ok_or_else(|| EngineError::Protocol(format!("sampled tokens of {len} words")))?;
        let words = if len == 0 { Vec::new() } else { bcast(if mine.is_some() { words } else { vec![0; len] })? };
        let bad = || EngineError::Protocol("a truncated list of sampled tokens".into());
        let mut it = words.into_iter();
        let mut next = || it.next().ok_or_else(bad);
        let mut out = Vec::new();
        let f32_of = |w: i64| f32::from_bits(w as u32);
        while let Ok(id) = next() {
            let token = next()?;
            let logprobs = if next()? == 0 {
                None
            } else {
                let logprob = f32_of(next()?);
                let n = usize::try_from(next()?).ok().filter(|&n| n <= len).ok_or_else(bad)?;
                let top = (0..n).map(|_| Ok((next()?, f32_of(next()?)))).collect::<Result<Vec<_>, EngineError>>()?;
                Some(crate::api::TokenLogprobs { logprob, top })
            };
            out.push((id as RequestId, Sampled { token, logprobs }));
        }
        Ok(out)
    }
}

/// Longest step message accepted (words): far beyond any real step, short of a memory hazard.
const MAX_MESSAGE_WORDS: usize = 1 << 26;
