//! Continuous batching: which tokens of which requests run in each step.
//!
//! Every step the [`Scheduler`] plans one flat batch ([`StepPlan`]): first one token for each
//! running sequence that is decoding, then the next chunks of running sequences still being
//! prefilled, then waiting requests first come first served, all within a token budget
//! (`max_num_batched_tokens`, so a long prompt is prefilled in chunks beside running decodes) and
//! a cap on running sequences (`max_num_seqs`). It allocates the KV-cache blocks for what it
//! plans; when blocks run out (after evicting unreferenced prefix-cache blocks), it preempts the
//! most recently admitted running sequence: its blocks are freed and it goes back to the front of
//! the queue, to be recomputed from its prompt and generated tokens later (nothing is lost).
//! A request that could never fit in the whole cache is refused when added.

mod seq;
mod step;

use crate::api::{RequestId, SubmitError};
use crate::blocks::BlockPool;
use seq::Seq;
use std::collections::VecDeque;

/// The scheduler's limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most sequences running (holding blocks) at once.
    pub max_num_seqs: usize,
    /// Most tokens in one step, over all sequences.
    pub max_num_batched_tokens: usize,
    /// Longest prompt plus output of one request, in tokens.
    pub max_model_len: usize,
    /// Positions per KV-cache block.
    pub block_size: usize,
    /// Blocks in the KV cache.
    pub num_blocks: usize,
    /// Reuse cached full blocks of equal prefixes.
    pub enable_prefix_caching: bool,
    /// Most requests waiting before [`SubmitError::QueueFull`].
    pub max_waiting: usize,
    /// Most distinct LoRA adapters among the running sequences (vLLM's `--max-loras`).
    pub max_loras: usize,
}

/// One step's work.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// The sequences of the flat batch, in batch order (their tokens one after another).
    pub seqs: Vec<ScheduledSeq>,
    /// Sequences preempted while planning this step (their earlier outputs stay valid; they are
    /// recomputed later and the engine just keeps waiting for their next token).
    pub preempted: Vec<RequestId>,
}

impl StepPlan {
    /// Tokens in the flat batch.
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }
}

/// One sequence's part of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledSeq {
    /// The request.
    pub id: RequestId,
    /// Ids fed this step, at positions `context .. context + tokens.len()`.
    pub tokens: Vec<i64>,
    /// Positions already in the cache (prefix hits included).
    pub context: usize,
    /// The block table covering `context + tokens.len()` positions.
    pub blocks: Vec<u32>,
    /// This chunk ends at the sequence's last known token: sample the next one.
    pub sample: bool,
    /// Positions served from the prefix cache at this admission (0 after its first step).
    pub cached_tokens: usize,
    /// Draft tokens at the end of `tokens` (speculative decoding): every position from the
    /// last known token on is sampled, and the draft is accepted up to its first miss.
    pub draft: usize,
}

/// Continuous batching over a block pool; see the module documentation.
#[derive(Debug, Clone)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    pool: BlockPool,
    /// Sequences holding blocks, in admission order (the last is preempted first).
    running: Vec<Seq>,
    /// Sequences without blocks, served from the front.
    waiting: VecDeque<Seq>,
    prefix_hit_tokens: u64,
    preemptions: u64,
    /// LongRoPE's switch length (`original_max_position_embeddings`): a sequence computed while
    /// no longer than it is recomputed whole once it grows past it (transformers' Phi-3 rule).
    rope_switch: Option<usize>,
}

impl Scheduler {
    /// A scheduler with an empty cache. Errors when a limit is zero or the block count does not
    /// fit in a block id.
    pub fn new(cfg: SchedulerConfig) -> Result<Scheduler, String> {
        for (name, v) in [
            ("max_num_seqs", cfg.max_num_seqs),
            ("max_num_batched_tokens", cfg.max_num_batched_tokens),
            ("max_model_len", cfg.max_model_len),
            ("block_size", cfg.block_size),
            ("num_blocks", cfg.num_blocks),
            ("max_waiting", cfg.max_waiting),
        ] {
            if v == 0 {
                return Err(format!("the scheduler's {name} must be at least 1"));
            }
        }
        let pool = BlockPool::new(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching)?;
        Ok(Scheduler {
            cfg,
            pool,
            running: Vec::new(),
            waiting: VecDeque::new(),
            prefix_hit_tokens: 0,
            preemptions: 0,
            rope_switch: None,
        })
    }

    /// Sets LongRoPE's switch length: the rotary frequencies change once a sequence is longer
    /// than `at` tokens, so a sequence whose cache was computed before is recomputed whole when
    /// it first grows past it (as transformers' Phi-3 drops its cache then).
    pub fn set_rope_switch(&mut self, at: Option<usize>) {
        self.rope_switch = at;
    }

    /// LongRoPE's switch length, if set.
    pub fn rope_switch(&self) -> Option<usize> {
        self.rope_switch
    }

    /// Its limits.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Queues request `id` with prompt `prompt`, to generate at most `max_tokens` tokens.
    ///
    /// Errors: [`SubmitError::TooLong`] when `prompt.len() + max_tokens` exceeds `max_model_len`
    /// or needs more blocks than the whole cache holds; [`SubmitError::QueueFull`] with
    /// `max_waiting` requests queued; [`SubmitError::Invalid`] for an empty prompt, a zero
    /// `max_tokens` or an id already queued or running.
    pub fn add(&mut self, id: RequestId, prompt: Vec<i64>, max_tokens: usize) -> Result<(), SubmitError> {
        self.add_with(id, prompt, max_tokens, true)
    }

    /// [`add_with`](Self::add_with) of a request through LoRA adapter `adapter` (0: the base):
    /// its cached blocks are shared only with requests of the same adapter.
    pub fn add_adapted(
        &mut self,
        id: RequestId,
        prompt: Vec<i64>,
        max_tokens: usize,
        reuse_prefix: bool,
        adapter: u32,
    ) -> Result<(), SubmitError> {
        self.add_with(id, prompt, max_tokens, reuse_prefix)?;
        if let Some(seq) = self.waiting.back_mut() {
            seq.adapter = adapter;
        }
        Ok(())
    }

    /// [`add`](Self::add); `reuse_prefix: false` computes every prompt position even where the
    /// prefix cache holds it (a request that needs the logits of its prompt).
    pub fn add_with(
        &mut self,
        id: RequestId,
        prompt: Vec<i64>,
        max_tokens: usize,
        reuse_prefix: bool,
    ) -> Result<(), SubmitError> {
        if prompt.is_empty() {
            return Err(SubmitError::Invalid { param: "prompt", message: "the prompt is empty".into() });
        }
        if max_tokens == 0 {
            return Err(SubmitError::Invalid { param: "max_tokens", message: "max_tokens must be at least 1".into() });
        }
        if self.contains(id) {
            return Err(SubmitError::Invalid { param: "id", message: format!("request {id} is already scheduled") });
        }
        let positions = prompt.len().saturating_add(max_tokens);
        let max = self.cfg.max_model_len;
        if positions > max {
            return Err(SubmitError::TooLong(format!(
                "this model's maximum context length is {max} tokens, but {} prompt tokens plus max_tokens {max_tokens} is {positions}",
                prompt.len()
            )));
        }
        let (bs, nb) = (self.cfg.block_size, self.cfg.num_blocks);
        let blocks = positions.div_ceil(bs);
        if blocks > nb {
            return Err(SubmitError::TooLong(format!(
                "{} prompt tokens plus max_tokens {max_tokens} is {positions} positions, {blocks} KV-cache blocks of {bs}, but the whole cache holds {nb} blocks ({} positions)",
                prompt.len(),
                nb * bs
            )));
        }
        if self.waiting.len() >= self.cfg.max_waiting {
            return Err(SubmitError::QueueFull(self.waiting.len()));
        }
        let mut seq = Seq::new(id, prompt);
        seq.reuse_prefix = reuse_prefix;
        self.waiting.push_back(seq);
        Ok(())
    }

    fn contains(&self, id: RequestId) -> bool {
        self.running.iter().chain(&self.waiting).any(|s| s.id == id)
    }

    /// Takes request `id` out, waiting or running, freeing its blocks (full ones stay in the
    /// prefix cache). `None` if unknown.
    fn remove(&mut self, id: RequestId) -> Option<Seq> {
        let mut seq = if let Some(i) = self.running.iter().position(|s| s.id == id) {
            self.running.remove(i)
        } else {
            let i = self.waiting.iter().position(|s| s.id == id)?;
            self.waiting.remove(i)?
        };
        seq.reset(&mut self.pool);
        Some(seq)
    }

    /// Drops request `id` (waiting or running) and frees its blocks now (full ones stay in the
    /// prefix cache). `false` if it is unknown.
    pub fn abort(&mut self, id: RequestId) -> bool {
        self.remove(id).is_some()
    }

    /// Request `id` ended (end of sequence, stop, length): frees its blocks (full ones stay
    /// cached). No effect on an unknown id.
    pub fn finish(&mut self, id: RequestId) {
        self.remove(id);
    }

    /// Records that `plan` ran: each scheduled sequence still running has its tokens in the
    /// cache, each `(id, token)` of `sampled` is appended to a sequence whose part had `sample`
    /// set, and blocks filled by the step go to the prefix cache. Sequences aborted or finished
    /// since the plan are skipped. A sampling part without its token in `sampled` has its last
    /// token fed again next step.
    ///
    /// A part with a draft may have several tokens in `sampled` (in order): the accepted draft
    /// tokens and the one after them. Only the positions of the tokens they confirm count as
    /// computed; the rest of the draft's cache entries are overwritten later.
    pub fn complete_step(&mut self, plan: &StepPlan, sampled: &[(RequestId, i64)]) {
        for part in &plan.seqs {
            let Some(seq) = self.running.iter_mut().find(|s| s.id == part.id) else { continue };
            let fed = part.tokens.len() - part.draft;
            if seq.computed != part.context || part.context + fed > seq.tokens.len() {
                continue; // not this plan's state of the sequence
            }
            seq.computed = part.context + fed;
            seq.cached_pending = 0;
            if part.sample {
                let tokens: Vec<i64> =
                    sampled.iter().filter(|(id, _)| *id == part.id).map(|&(_, t)| t).take(part.draft + 1).collect();
                if tokens.is_empty() {
                    seq.computed = seq.tokens.len() - 1;
                } else {
                    // The fed last token and the accepted draft tokens are in the cache.
                    seq.computed += tokens.len() - 1;
                    seq.tokens.extend(tokens);
                }
            }
            seq.register_full_blocks(&mut self.pool);
        }
    }

    /// Appends `draft` to sequence `id`'s decode part of `plan` (speculative decoding), with the
    /// blocks its positions need. `false` (nothing changed) if the part is not a decode or the
    /// blocks are not free.
    pub fn add_draft(&mut self, plan: &mut StepPlan, id: RequestId, draft: &[i64]) -> bool {
        let bs = self.cfg.block_size;
        let Some(part) = plan.seqs.iter_mut().find(|p| p.id == id && p.sample && p.tokens.len() == 1 && p.draft == 0)
        else {
            return false;
        };
        let Some(seq) = self.running.iter_mut().find(|s| s.id == id) else { return false };
        let need = seq.blocks_needed(1 + draft.len(), bs);
        if draft.is_empty() || need > self.pool.num_available() {
            return false;
        }
        for _ in 0..need {
            // Cannot fail: `need` blocks are available.
            seq.blocks.extend(self.pool.allocate());
        }
        part.tokens.extend_from_slice(draft);
        part.blocks = seq.blocks.clone();
        part.draft = draft.len();
        true
    }

    /// The tokens (prompt and output) of running sequence `id`.
    pub fn tokens(&self, id: RequestId) -> Option<&[i64]> {
        self.running.iter().find(|s| s.id == id).map(|s| s.tokens.as_slice())
    }

    /// Sequences holding blocks.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests queued, preempted ones included.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Blocks referenced by sequences over all blocks, `0..=1`.
    pub fn kv_cache_usage(&self) -> f64 {
        self.pool.usage()
    }

    /// Prompt tokens served from the prefix cache, in total (counted at every admission).
    pub fn prefix_hit_tokens(&self) -> u64 {
        self.prefix_hit_tokens
    }

    /// Sequences preempted, in total.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// Blocks free or evictable; `num_blocks` once every request has ended.
    pub fn free_blocks(&self) -> usize {
        self.pool.num_available()
    }

    /// Checks the accounting (for tests and debug assertions): the pool's states, every reference
    /// held by exactly the running sequences' tables, blocks shared between tables only when cached
    /// and full, no table longer than its positions need, waiting sequences holding nothing.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.pool.check()?;
        let bs = self.cfg.block_size;
        let mut refs = vec![0u32; self.cfg.num_blocks];
        for s in &self.running {
            if s.computed >= s.tokens.len() {
                return Err(format!("running request {} has no token left to feed", s.id));
            }
            // Blocks cover at most the sequence's known tokens, so at most one is partly filled.
            if s.blocks.len() > s.tokens.len().div_ceil(bs) || s.blocks.len() < s.computed.div_ceil(bs) {
                return Err(format!("request {} holds {} blocks for {} tokens", s.id, s.blocks.len(), s.tokens.len()));
            }
            for (i, &b) in s.blocks.iter().enumerate() {
                refs[b as usize] += 1;
                if i >= s.full && self.pool.refs(b) != 1 {
                    return Err(format!("request {}'s unfilled block {b} is shared", s.id));
                }
            }
        }
        for (b, &r) in refs.iter().enumerate() {
            if r != self.pool.refs(b as u32) {
                return Err(format!("block {b}: {r} tables hold it, {} references counted", self.pool.refs(b as u32)));
            }
            if r > 1 && !self.pool.is_cached(b as u32) {
                return Err(format!("block {b} is shared by {r} tables but not cached"));
            }
        }
        if let Some(s) = self.waiting.iter().find(|s| !s.blocks.is_empty() || s.computed != 0) {
            return Err(format!("waiting request {} holds blocks", s.id));
        }
        if self.running.len() > self.cfg.max_num_seqs {
            return Err(format!("{} running, over the cap {}", self.running.len(), self.cfg.max_num_seqs));
        }
        Ok(())
    }
}

#[cfg(test)]
mod sim_tests;
#[cfg(test)]
mod tests;
