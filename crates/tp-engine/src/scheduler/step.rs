//! Planning one step: decodes, prefill chunks, admissions, and preemption when blocks run out.

use super::{ScheduledSeq, Scheduler, StepPlan};
use crate::api::RequestId;

impl Scheduler {
    /// The next step: running decodes first (one token each), then running prefills' next chunks,
    /// then waiting requests first come first served, within `max_num_batched_tokens` (longer
    /// prompts are prefilled in chunks) and `max_num_seqs`. Allocates blocks for what it plans;
    /// when they run out (after evicting unreferenced cached blocks, least recently used first),
    /// preempts the most recently admitted running sequence, which returns to the front of the
    /// queue. Nothing new is admitted in a step that preempted. Empty when nothing can run.
    pub fn schedule(&mut self) -> StepPlan {
        self.schedule_beside(&std::collections::HashSet::new(), usize::MAX)
    }

    /// [`schedule`](Self::schedule) beside steps still in flight (pipelined serving): the
    /// sequences in `busy` are neither scheduled nor preempted, and the step takes at most
    /// `max_seqs` sequences.
    pub fn schedule_beside(&mut self, busy: &std::collections::HashSet<RequestId>, max_seqs: usize) -> StepPlan {
        let mut plan = StepPlan::default();
        let mut budget = self.cfg.max_num_batched_tokens;
        let free = |s: &&super::Seq| !busy.contains(&s.id);
        let decodes = self.running.iter().filter(free).filter(|s| s.is_decode()).map(|s| s.id);
        let order: Vec<RequestId> =
            decodes.chain(self.running.iter().filter(free).filter(|s| !s.is_decode()).map(|s| s.id)).collect();
        for id in order {
            if budget == 0 || plan.seqs.len() >= max_seqs {
                break;
            }
            self.schedule_running(id, &mut plan, &mut budget, busy);
        }
        if plan.preempted.is_empty() {
            self.admit_waiting(&mut plan, &mut budget, max_seqs);
        }
        plan
    }

    /// Plans the next chunk of running sequence `id` (if it was not preempted earlier in this
    /// step), preempting the newest running sequences until its blocks fit.
    fn schedule_running(
        &mut self,
        id: RequestId,
        plan: &mut StepPlan,
        budget: &mut usize,
        busy: &std::collections::HashSet<RequestId>,
    ) {
        let bs = self.cfg.block_size;
        if let (Some(at), Some(seq)) = (self.rope_switch, self.running.iter_mut().find(|s| s.id == id))
            && seq.computed > 0
            && seq.computed_at_len <= at
            && seq.tokens.len() > at
        {
            // Its cache turned with the short frequencies: recompute it whole (its blocks stay).
            seq.computed = 0;
            seq.full = 0;
            seq.link = None;
        }
        loop {
            let Some(i) = self.running.iter().position(|s| s.id == id) else { return };
            let n = self.running[i].remaining().min(*budget);
            let need = self.running[i].blocks_needed(n, bs);
            if need <= self.pool.num_available() {
                let seq = &mut self.running[i];
                for _ in 0..need {
                    // Cannot fail: `need` blocks are available.
                    seq.blocks.extend(self.pool.allocate());
                }
                seq.computed_at_len = seq.tokens.len();
                plan.seqs.push(part(seq, n));
                *budget -= n;
                return;
            }
            // Preempt the newest (possibly this very sequence, then it is done for this step);
            // nothing to preempt beside the steps in flight: it waits.
            if !self.preempt_last(plan, budget, busy) {
                return;
            }
        }
    }

    /// Sends the most recently admitted running sequence back to the front of the queue, freeing
    /// its blocks and dropping its part of `plan` (returning its tokens to the budget).
    fn preempt_last(
        &mut self,
        plan: &mut StepPlan,
        budget: &mut usize,
        busy: &std::collections::HashSet<RequestId>,
    ) -> bool {
        // The newest not in a step in flight (its blocks are still being written).
        let Some(at) = self.running.iter().rposition(|s| !busy.contains(&s.id)) else { return false };
        let mut seq = self.running.remove(at);
        if let Some(p) = plan.seqs.iter().position(|s| s.id == seq.id) {
            *budget += plan.seqs.remove(p).tokens.len();
        }
        seq.reset(&mut self.pool);
        plan.preempted.push(seq.id);
        self.preemptions += 1;
        self.waiting.push_front(seq);
        true
    }

    /// Admits waiting requests in order while the sequence cap, the budget and the free blocks
    /// allow, each reusing its longest chain of cached full blocks (all but its last token at
    /// most: that one is always computed, for its logits).
    ///
    /// With `max_loras`, a request whose LoRA adapter would make one adapter too many among
    /// the running ones waits, and the first one after it that fits goes ahead.
    fn admit_waiting(&mut self, plan: &mut StepPlan, budget: &mut usize, max_seqs: usize) {
        let bs = self.cfg.block_size;
        while self.running.len() < self.cfg.max_num_seqs && *budget > 0 && plan.seqs.len() < max_seqs {
            let mut adapters: Vec<u32> = self.running.iter().map(|s| s.adapter).filter(|&a| a != 0).collect();
            adapters.sort_unstable();
            adapters.dedup();
            let fits = |a: u32| a == 0 || adapters.contains(&a) || adapters.len() < self.cfg.max_loras;
            let Some(at) = self.waiting.iter().position(|s| fits(s.adapter)) else { return };
            let seq = &self.waiting[at];
            let reusable = if seq.reuse_prefix { (seq.tokens.len() - 1) / bs } else { 0 };
            let chain = self.pool.lookup_from(crate::blocks::adapter_root(seq.adapter), &seq.tokens, reusable);
            let hit = chain.len() * bs;
            let n = (seq.tokens.len() - hit).min(*budget);
            let need = (hit + n).div_ceil(bs) - chain.len();
            if need > self.pool.num_available() - self.pool.unreferenced_among(&chain) {
                return;
            }
            let Some(mut seq) = self.waiting.remove(at) else { return };
            for link in &chain {
                self.pool.acquire(link.block.id);
            }
            seq.blocks = chain.iter().map(|l| l.block.id).collect();
            for _ in 0..need {
                // Cannot fail: `need` blocks beside the chain are available.
                seq.blocks.extend(self.pool.allocate());
            }
            seq.full = chain.len();
            seq.link = chain.last().copied();
            seq.computed = hit;
            seq.cached_pending = hit;
            seq.computed_at_len = seq.tokens.len();
            self.prefix_hit_tokens += hit.min(seq.prompt_len) as u64;
            plan.seqs.push(part(&seq, n));
            *budget -= n;
            self.running.push(seq);
        }
    }
}

/// The part of a step that feeds `seq`'s next `n` tokens.
fn part(seq: &super::Seq, n: usize) -> ScheduledSeq {
    let end = seq.computed + n;
    ScheduledSeq {
        id: seq.id,
        tokens: seq.tokens[seq.computed..end].to_vec(),
        context: seq.computed,
        blocks: seq.blocks.clone(),
        sample: end == seq.tokens.len(),
        cached_tokens: seq.cached_pending,
        draft: 0,
    }
}
