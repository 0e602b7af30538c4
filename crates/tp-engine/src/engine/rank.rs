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
use crate::api::PromptLogprob;
use crate::api::RequestId;
use crate::sampling::{SampleRow, Sampled, SamplingParams, sample_sharded, score_sharded};
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
    /// Its LoRA adapter's slot (0: the base model).
    pub adapter: u32,
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
    /// Where the first rank of a pipeline stage adds its busy time (`/metrics`, per stage), and
    /// its stage.
    pub stage_stats: Option<(std::sync::Arc<crate::api::SharedStats>, usize)>,
    /// Pipelined steps (with pipeline stages): step messages, masks and results travel as
    /// point-to-point messages instead of broadcasts over every rank, so that a stage can run
    /// one step while the next stage runs the one before (see `leader.rs`).
    pub pipelined: bool,
    /// Rank 0's point-to-point sends not yet known to be received (pipelined steps).
    pub outbox: Vec<tp_comm::Work>,
    /// This rank's step time by phase (its `scheduler` and `steps` left to the leader).
    pub phases: crate::api::StepPhases,
    /// Tokens this rank's forward passes routed to each expert, summed over the MoE layers
    /// (empty for a dense model).
    pub routed: Vec<u64>,
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

    /// Rank 0: sends `msg` to every rank (header `[kind, len]`, then the payload): a
    /// broadcast, or, pipelined, point-to-point messages that do not wait for the receivers.
    pub(crate) fn send(&mut self, msg: &StepMsg) -> Result<(), EngineError> {
        let words = msg.encode();
        let header = [msg.kind.code(), words.len() as i64];
        if self.pipelined {
            for r in 1..self.world.world_size() {
                self.post(&header, r)?;
                if !words.is_empty() {
                    self.post(&words, r)?;
                }
            }
            return Ok(());
        }
        self.broadcast(&header)?;
        if !words.is_empty() {
            self.broadcast(&words)?;
        }
        Ok(())
    }

    /// Posts `words` to world rank `to` without waiting (pipelined steps); finished sends are
    /// waited for (and their errors returned) as later ones are posted.
    fn post(&mut self, words: &[i64], to: usize) -> Result<(), EngineError> {
        let g = &self.world;
        let t = g.to_local(&Tensor::from_vec(words.to_vec(), &[words.len()], &Device::Cpu)?)?;
        let work = g.send_async(&t, to)?;
        self.outbox.push(work);
        let mut kept = Vec::with_capacity(self.outbox.len());
        for mut w in std::mem::take(&mut self.outbox) {
            if w.is_completed() {
                w.wait()?;
            } else {
                kept.push(w);
            }
        }
        self.outbox = kept;
        Ok(())
    }

    /// Waits for every send still in the outbox (pipelined steps), within the deadline.
    pub(crate) fn flush(&mut self) -> Result<(), EngineError> {
        for w in std::mem::take(&mut self.outbox) {
            w.wait()?;
        }
        Ok(())
    }

    /// `len` words from world rank `from` (pipelined steps).
    fn take(&self, len: usize, from: usize) -> Result<Vec<i64>, EngineError> {
        let g = &self.world;
        Ok(g.recv(&[len], DType::I64, from)?.to_i64_vec()?)
    }

    /// Other ranks: the next message from rank 0 (within the group's deadline).
    pub(crate) fn receive(&self) -> Result<StepMsg, EngineError> {
        let header = if self.pipelined { self.take(2, 0)? } else { self.broadcast(&[0, 0])? };
        let kind = StepKind::from_code(header[0])
            .ok_or_else(|| EngineError::Protocol(format!("unknown step kind {}", header[0])))?;
        let len = usize::try_from(header[1])
            .ok()
            .filter(|&n| n <= MAX_MESSAGE_WORDS)
            .ok_or_else(|| EngineError::Protocol(format!("step message of {} words", header[1])))?;
        let words = match len {
            0 => Vec::new(),
            _ if self.pipelined => self.take(len, 0)?,
            _ => self.broadcast(&vec![0; len])?,
        };
        StepMsg::decode(kind, &words).map_err(EngineError::Protocol)
    }

    /// Whether this rank is on the last pipeline stage (or there are no stages).
    fn last_stage(&self) -> bool {
        self.pipeline.as_ref().is_none_or(|(pp, _)| pp.rank() + 1 == pp.world_size())
    }

    /// Rank 0 of pipelined steps: the results of its oldest step in flight, from the last
    /// stage's first rank (world rank `root`).
    pub(crate) fn take_results(&mut self) -> Result<StepResult, EngineError> {
        let Some((_, root)) = self.pipeline.as_ref() else {
            return Err(EngineError::Protocol("results by message without pipeline stages".into()));
        };
        let root = *root;
        let len = self.take(1, root)?[0];
        let len = usize::try_from(len)
            .ok()
            .filter(|&n| n <= MAX_MESSAGE_WORDS)
            .ok_or_else(|| EngineError::Protocol(format!("step results of {len} words")))?;
        let words = if len == 0 { Vec::new() } else { self.take(len, root)? };
        let result =
            StepResult::decode(&words).ok_or_else(|| EngineError::Protocol("truncated step results".into()))?;
        for (id, s) in &result.sampled {
            if let Some(state) = self.seqs.get_mut(id) {
                state.output.push(s.token);
            }
        }
        Ok(result)
    }

    /// Rank 0's `words` on every rank.
    fn broadcast(&self, words: &[i64]) -> Result<Vec<i64>, EngineError> {
        let g = self.group();
        let t = g.to_local(&Tensor::from_vec(words.to_vec(), &[words.len()], &Device::Cpu)?)?;
        Ok(g.broadcast(&t, 0)?.to_i64_vec()?)
    }

    /// Fills or empties LoRA slots (`changes`, from [`StepMsg::adapters`]): every rank reads the
    /// adapter folder and attaches it to its layers, then the ranks agree (an all-reduce of a
    /// failure flag over every rank); where any rank failed, every rank empties the slot again,
    /// so a bad adapter leaves the model as it was. Returns each change's outcome.
    fn change_adapters(
        &mut self,
        changes: &[(u32, Option<String>)],
    ) -> Result<Vec<crate::api::AdapterOutcome>, EngineError> {
        let mut out = Vec::new();
        for (slot, path) in changes {
            let mine: Result<(), String> = match path {
                None => self.model.remove_adapter(*slot).map_err(|e| e.to_string()),
                Some(p) => {
                    let layers = self.model.config().num_hidden_layers;
                    tp_models::adapter::read_adapter(std::path::Path::new(p), layers)
                        .and_then(|a| self.model.add_adapter(*slot, a.spec()))
                        .map_err(|e| e.to_string())
                        .and_then(|n| {
                            if n == 0 && self.pipeline.is_none() {
                                Err("it adapts no module of this model".into())
                            } else {
                                Ok(())
                            }
                        })
                }
            };
            let g = &self.world;
            let flag = g.to_local(&Tensor::from_vec(vec![f32::from(u8::from(mine.is_err()))], &[1], &Device::Cpu)?)?;
            let failed = g.all_reduce(&flag, tp_comm::ReduceOp::Max)?.to_f64_vec()?[0] > 0.0;
            let outcome = if failed {
                let _ = self.model.remove_adapter(*slot);
                Err(mine.err().unwrap_or_else(|| "another rank could not load the adapter".into()))
            } else {
                Ok(())
            };
            out.push((*slot, outcome));
        }
        Ok(out)
    }

    /// Runs one step: applies the announcements, runs the batch, samples every sequence that
    /// asks for it, appends the tokens to the outputs. Every rank returns the same list.
    pub(crate) fn execute(&mut self, msg: &StepMsg, masks: MaskSource<'_>) -> Result<StepResult, EngineError> {
        for d in &msg.drop {
            self.seqs.remove(d);
        }
        let adapter_outcomes = self.change_adapters(&msg.adapters)?;
        for n in &msg.new {
            let state = SeqState {
                params: n.params.clone(),
                seed: n.seed,
                prompt: n.prompt.clone(),
                output: Vec::new(),
                min_stop: n.min_stop.clone(),
                adapter: n.adapter,
            };
            self.seqs.insert(n.id, state);
        }
        if msg.seqs.is_empty() {
            return Ok(StepResult { adapters: adapter_outcomes, ..StepResult::default() });
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
        let mut adapters: Vec<u32> = Vec::new();
        let mut batch_seqs = Vec::with_capacity(msg.seqs.len());
        let mut rows = Rows::default();
        for s in &msg.seqs {
            let Some(state) = self.seqs.get(&s.id) else {
                return Err(EngineError::Protocol(format!("step names request {} that no message announced", s.id)));
            };
            let base = ids.len();
            ids.extend_from_slice(&s.tokens);
            adapters.extend(std::iter::repeat_n(state.adapter, s.tokens.len()));
            batch_seqs.push(BatchSeq { tokens: s.tokens.len(), context: s.context, blocks: s.blocks.clone() });
            // Prompt logprobs: the row of position p scores prompt token p + 1.
            if state.params.prompt_logprobs.is_some() {
                let end = (s.context + s.tokens.len()).min(state.prompt.len().saturating_sub(1));
                if end > s.context {
                    rows.scored.push((s.id, s.context + 1, end - s.context));
                    for p in s.context..end {
                        rows.score_rows.push(base + p - s.context);
                        rows.targets.push(state.prompt[p + 1]);
                    }
                }
            }
            if s.sample {
                // The last known token's row, then one per draft token (speculative decoding).
                let first = ids.len() - 1 - s.draft;
                for j in 0..=s.draft {
                    rows.sample_rows.push(first + j);
                    rows.sampled_ids.push(s.id);
                    rows.draft_index.push(j);
                }
                if s.draft > 0 {
                    rows.drafts.insert(s.id, s.tokens[s.tokens.len() - s.draft..].to_vec());
                }
            }
        }
        // Length-dependent rotary frequencies follow each sequence's whole known length.
        let rope_lens: Vec<usize> = if msg.rope_lens.is_empty() {
            msg.seqs.iter().map(|s| self.seqs.get(&s.id).map_or(0, |st| st.prompt.len() + st.output.len())).collect()
        } else {
            msg.rope_lens.clone()
        };
        let batch = TokenBatch::new(batch_seqs, self.block_size)?.with_rope_lens(&rope_lens);
        let started = std::time::Instant::now();
        // Each token through its request's LoRA adapter, when any request has one.
        let out = if adapters.iter().any(|&a| a != 0) {
            tp_layers::lora::with_token_adapters(adapters.into(), || {
                self.forward_and_sample(&ids, &batch, &rows, msg, masks)
            })
        } else {
            self.forward_and_sample(&ids, &batch, &rows, msg, masks)
        };
        let busy = started.elapsed().as_secs_f64();
        self.busy_secs += busy;
        if let Some((stats, stage)) = &self.stage_stats {
            stats.add_stage_busy(*stage, busy);
        }
        let result = match &self.pipeline {
            None => out?,
            // Pipelined: the last stage keeps its own results (every rank of it samples alike)
            // and its first rank sends them to rank 0; the earlier stages go on to the next step.
            Some((_, root)) if self.pipelined => {
                let root = *root;
                let out = out?;
                if !self.last_stage() {
                    return Ok(StepResult { adapters: adapter_outcomes, ..StepResult::default() });
                }
                if self.world.rank() == root {
                    let words = out.encode();
                    self.post(&[words.len() as i64], 0)?;
                    if !words.is_empty() {
                        self.post(&words, 0)?;
                    }
                }
                out
            }
            Some((_, root)) => {
                let root = *root;
                let mine = if self.world.rank() == root { Some(out?) } else { out.map(|_| None)? };
                self.share_results(root, mine.as_ref())?
            }
        };
        for (id, s) in &result.sampled {
            if let Some(state) = self.seqs.get_mut(id) {
                state.output.push(s.token);
            }
        }
        Ok(StepResult { adapters: adapter_outcomes, ..result })
    }

    /// This rank's stage of the step and, on the last stage, the sampling and prompt scoring
    /// (empty elsewhere).
    fn forward_and_sample(
        &mut self,
        ids: &[i64],
        batch: &TokenBatch,
        rows: &Rows,
        msg: &StepMsg,
        masks: MaskSource<'_>,
    ) -> Result<StepResult, EngineError> {
        // The forward computes the logits of the scored rows and then the sampled ones.
        let all_rows: Vec<usize> = rows.score_rows.iter().chain(&rows.sample_rows).copied().collect();
        // A rank whose forward fails leaves before the masks' broadcast; it aborts the group,
        // which ends the others' wait at once.
        let _ = tp_core::phase::take();
        let _ = tp_core::moe::take_routed();
        let started = std::time::Instant::now();
        let logits = self.forward(ids, batch, &all_rows);
        let forward = started.elapsed().as_secs_f64();
        let spent = tp_core::phase::take();
        let routed = tp_core::moe::take_routed();
        if self.routed.len() < routed.len() {
            self.routed.resize(routed.len(), 0);
        }
        for (total, n) in self.routed.iter_mut().zip(routed) {
            *total += n;
        }
        let (gemm, attention) = (spent.gemm.as_secs_f64(), spent.attention.as_secs_f64());
        self.phases.gemm += gemm;
        self.phases.attention += attention;
        self.phases.elementwise += (forward - gemm - attention).max(0.0);
        let logits = logits?;
        let started = std::time::Instant::now();
        let out = self.sample(&all_rows, logits, rows, msg, masks);
        self.phases.sampling += started.elapsed().as_secs_f64();
        out
    }

    /// The sampling and prompt scoring of a step from this rank's `logits` of `all_rows` (none
    /// off the last stage).
    fn sample(
        &mut self,
        all_rows: &[usize],
        logits: Option<Tensor>,
        rows: &Rows,
        msg: &StepMsg,
        masks: MaskSource<'_>,
    ) -> Result<StepResult, EngineError> {
        let masks = self.exchange_masks(msg, masks)?;
        let Some(logits) = logits else { return Ok(StepResult::default()) };
        if all_rows.is_empty() {
            return Ok(StepResult::default());
        }
        let (start, width) = self.model.vocab_shard();
        let vocab = self.model.config().vocab_size;
        let words = vocab.div_ceil(64);
        let logits = if logits.dtype() == DType::F32 { logits } else { logits.to_dtype(DType::F32)? };
        let n_score = rows.score_rows.len();
        let (score_cols, logits) = if n_score == 0 {
            (Vec::new(), logits)
        } else {
            let host = logits.to_vec::<f32>()?;
            let (scored, sampled) = host.split_at(n_score * width);
            let sampled = Tensor::from_vec(sampled.to_vec(), &[rows.sample_rows.len(), width], &Device::Cpu)?;
            (scored.to_vec(), sampled)
        };
        let mut result = StepResult::default();
        if n_score > 0 {
            let top = rows
                .scored
                .iter()
                .filter_map(|(id, _, _)| self.seqs.get(id).and_then(|s| s.params.prompt_logprobs))
                .max()
                .unwrap_or(0);
            let mut scored = score_sharded(&score_cols, width, start, vocab, &rows.targets, top, self.model.group())
                .map_err(|e| EngineError::Step(e.to_string()))?
                .into_iter();
            for &(id, first, count) in &rows.scored {
                let want = self.seqs.get(&id).and_then(|s| s.params.prompt_logprobs).unwrap_or(0);
                let mut lps: Vec<PromptLogprob> = scored.by_ref().take(count).collect();
                for lp in &mut lps {
                    lp.top.truncate(want);
                }
                result.scored.push((id, first, lps));
            }
        }
        if rows.sample_rows.is_empty() {
            return Ok(result);
        }
        // A draft row j samples as if the draft's first j tokens were already the output.
        let outputs: Vec<Option<Vec<i64>>> = rows
            .sampled_ids
            .iter()
            .zip(&rows.draft_index)
            .map(|(id, &j)| {
                (j > 0).then(|| {
                    let mut o = self.seqs[id].output.clone();
                    o.extend_from_slice(&rows.drafts[id][..j]);
                    o
                })
            })
            .collect();
        let sample_rows: Vec<SampleRow<'_>> = rows
            .sampled_ids
            .iter()
            .zip(&outputs)
            .map(|(id, extended)| {
                let s = &self.seqs[id];
                let output = extended.as_deref().unwrap_or(&s.output);
                let mask = msg.masked.iter().position(|m| m == id).and_then(|k| masks.get(k * words..(k + 1) * words));
                SampleRow {
                    params: &s.params,
                    seed: s.seed,
                    step: output.len() as u64,
                    prompt: &s.prompt,
                    output,
                    banned: if output.len() < s.params.min_tokens { &s.min_stop } else { &[] },
                    mask,
                }
            })
            .collect();
        let sampled = sample_sharded(&logits, start, vocab, &sample_rows, self.model.group())
            .map_err(|e| EngineError::Step(e.to_string()))?;
        // Each sequence keeps its sampled tokens up to the first that differs from its draft.
        let mut i = 0;
        while i < sampled.len() {
            let id = rows.sampled_ids[i];
            let n = rows.drafts.get(&id).map_or(0, Vec::len);
            let tokens: Vec<i64> = sampled[i..i + n + 1].iter().map(|s| s.token).collect();
            let keep = crate::spec::accept(rows.drafts.get(&id).map_or(&[][..], Vec::as_slice), &tokens);
            result.sampled.extend(sampled[i..i + keep].iter().cloned().map(|s| (id, s)));
            i += n + 1;
        }
        Ok(result)
    }

    /// The step's structured-output masks on every rank (`ceil(vocab / 64)` words per entry of
    /// `msg.masked`, concatenated): rank 0's, broadcast over the world. Nothing when no sampled
    /// sequence is constrained.
    fn exchange_masks(&mut self, msg: &StepMsg, source: MaskSource<'_>) -> Result<Vec<u64>, EngineError> {
        if msg.masked.is_empty() {
            return Ok(Vec::new());
        }
        let len = msg.masked.len() * self.model.config().vocab_size.div_ceil(64);
        if let (true, Some((pp, root))) = (self.pipelined, self.pipeline.as_ref()) {
            // Pipelined: rank 0 sends the masks to the last stage's ranks (world ranks
            // `root ..`), which alone sample.
            let (first, count) = (*root, self.world.world_size() - *root);
            let _ = pp;
            return match source {
                MaskSource::Leader(compute) => {
                    let m = compute();
                    if m.len() != len {
                        return Err(EngineError::Step(format!("{} mask words for {len}", m.len())));
                    }
                    let words: Vec<i64> = m.into_iter().map(|w| w as i64).collect();
                    for r in first..first + count {
                        if r != 0 {
                            self.post(&words, r)?;
                        }
                    }
                    Ok(Vec::new())
                }
                MaskSource::Follower if self.last_stage() => {
                    Ok(self.take(len, 0)?.into_iter().map(|w| w as u64).collect())
                }
                MaskSource::Follower => Ok(Vec::new()),
            };
        }
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

    /// The last stage's results on every rank: world rank `root` (which holds them) broadcasts
    /// their length, then their words (see [`StepResult::encode`]).
    fn share_results(&self, root: usize, mine: Option<&StepResult>) -> Result<StepResult, EngineError> {
        let g = &self.world;
        let words = mine.map(StepResult::encode).unwrap_or_default();
        let bcast = |w: Vec<i64>| -> Result<Vec<i64>, EngineError> {
            let n = w.len();
            let t = g.to_local(&Tensor::from_vec(w, &[n], &Device::Cpu)?)?;
            Ok(g.broadcast(&t, root)?.to_i64_vec()?)
        };
        let len = bcast(vec![words.len() as i64])?[0];
        let len = usize::try_from(len)
            .ok()
            .filter(|&n| n <= MAX_MESSAGE_WORDS)
            .ok_or_else(|| EngineError::Protocol(format!("step results of {len} words")))?;
        let words = if len == 0 { Vec::new() } else { bcast(if mine.is_some() { words } else { vec![0; len] })? };
        StepResult::decode(&words).ok_or_else(|| EngineError::Protocol("truncated step results".into()))
    }
}

/// Which rows of a step's batch get logits, and why.
#[derive(Debug, Default)]
struct Rows {
    /// Rows whose next prompt token is scored, with those tokens.
    score_rows: Vec<usize>,
    targets: Vec<i64>,
    /// `(request, first scored prompt position, count)`, in row order.
    scored: Vec<(RequestId, usize, usize)>,
    /// Rows sampled, their requests, and each row's place in its request's draft (0: the
    /// last known token's row).
    sample_rows: Vec<usize>,
    sampled_ids: Vec<RequestId>,
    draft_index: Vec<usize>,
    /// The draft tokens of the requests that have them.
    drafts: HashMap<RequestId, Vec<i64>>,
}

/// What a step produced, the same on every rank: sampled tokens, and prompt logprobs as
/// `(request, position of the first scored prompt token, one per position from there)`.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct StepResult {
    pub sampled: Vec<(RequestId, Sampled)>,
    pub scored: Vec<(RequestId, usize, Vec<PromptLogprob>)>,
    /// The outcome of each of the message's LoRA slot changes (every rank agrees on it; not
    /// sent between ranks).
    pub adapters: Vec<crate::api::AdapterOutcome>,
}

impl StepResult {
    /// `[n, (id, token, has_lp, [logprob, k, (id, lp) x k]) x n, m, (id, first, count, (logprob,
    /// rank, k, (id, lp) x k) x count) x m]`, floats as their bits.
    fn encode(&self) -> Vec<i64> {
        let bits = |v: f32| i64::from(v.to_bits());
        let mut w = vec![self.sampled.len() as i64];
        for (id, s) in &self.sampled {
            w.extend([*id as i64, s.token]);
            match &s.logprobs {
                None => w.push(0),
                Some(lp) => {
                    w.extend([1, bits(lp.logprob), lp.top.len() as i64]);
                    w.extend(lp.top.iter().flat_map(|&(t, l)| [t, bits(l)]));
                }
            }
        }
        w.push(self.scored.len() as i64);
        for (id, first, lps) in &self.scored {
            w.extend([*id as i64, *first as i64, lps.len() as i64]);
            for lp in lps {
                w.extend([bits(lp.logprob), lp.rank as i64, lp.top.len() as i64]);
                w.extend(lp.top.iter().flat_map(|&(t, l)| [t, bits(l)]));
            }
        }
        w
    }

    /// Reads [`encode`](Self::encode)'s words back; `None` if they are cut short or malformed.
    fn decode(words: &[i64]) -> Option<StepResult> {
        let mut it = words.iter().copied();
        let f = |w: i64| u32::try_from(w).ok().map(f32::from_bits);
        // Counts of following items are bounded by the words left; positions and ranks are not.
        let count = |w: i64| usize::try_from(w).ok().filter(|&n| n <= words.len());
        let size = |w: i64| usize::try_from(w).ok();
        let mut r = StepResult::default();
        if words.is_empty() {
            return Some(r);
        }
        let top = |it: &mut dyn Iterator<Item = i64>| -> Option<Vec<(i64, f32)>> {
            let k = count(it.next()?)?;
            (0..k).map(|_| Some((it.next()?, f(it.next()?)?))).collect()
        };
        for _ in 0..count(it.next()?)? {
            let (id, token) = (it.next()? as RequestId, it.next()?);
            let logprobs = match it.next()? {
                0 => None,
                _ => {
                    let logprob = f(it.next()?)?;
                    Some(crate::api::TokenLogprobs { logprob, top: top(&mut it)? })
                }
            };
            r.sampled.push((id, Sampled { token, logprobs }));
        }
        for _ in 0..count(it.next()?)? {
            let (id, first, n) = (it.next()? as RequestId, size(it.next()?)?, count(it.next()?)?);
            let mut lps = Vec::with_capacity(n);
            for _ in 0..n {
                let logprob = f(it.next()?)?;
                let rank = size(it.next()?)?;
                lps.push(PromptLogprob { logprob, rank, top: top(&mut it)? });
            }
            r.scored.push((id, first, lps));
        }
        it.next().is_none().then_some(r)
    }
}

/// Longest step message accepted (words): far beyond any real step, short of a memory hazard.
const MAX_MESSAGE_WORDS: usize = 1 << 26;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::TokenLogprobs;

    #[test]
    fn step_results_survive_the_wire_and_cut_ones_are_refused() {
        let r = StepResult {
            sampled: vec![
                (3, Sampled { token: 7, logprobs: None }),
                (
                    9,
                    Sampled {
                        token: 1,
                        logprobs: Some(TokenLogprobs { logprob: -0.5, top: vec![(1, -0.5), (4, -2.0)] }),
                    },
                ),
            ],
            scored: vec![(9, 1, vec![PromptLogprob { logprob: -3.25, rank: 5000, top: vec![(2, -0.1)] }])],
            adapters: Vec::new(),
        };
        let w = r.encode();
        assert_eq!(StepResult::decode(&w), Some(r));
        for cut in 1..w.len() {
            assert_eq!(StepResult::decode(&w[..cut]), None, "cut at {cut}");
        }
        assert_eq!(StepResult::decode(&[]), Some(StepResult::default()));
    }
}
