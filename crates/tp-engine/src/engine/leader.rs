//! Rank 0's loop: takes commands from the handles, schedules each step, sends the plan to the
//! other ranks, runs its own part, turns sampled tokens into events, and decides when requests
//! end (end-of-sequence or stop ids, `max_tokens`, the model's length).

use super::EngineError;
use super::plan::{NewSeq, StepKind, StepMsg};
use super::rank::{MaskSource, RankWorker};
use crate::api::{
    Command, CommandReceiver, Event, EventSink, FinishReason, PromptLogprob, Request, RequestId, SharedStats, Stats,
    StepPhases, TokenConstraint, TokenLogprobs, Usage,
};
use crate::scheduler::Scheduler;
use crate::spec::NgramConfig;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tp_core::rng::SplitMix64;

/// What rank 0 keeps of a request besides the shared sampling state.
struct Live {
    sink: Box<dyn EventSink>,
    request: Request,
    cached_prompt_tokens: usize,
    /// Its structured-output constraint, advanced with every token it is sent.
    constraint: Option<Box<dyn TokenConstraint>>,
    /// Its prompt's logprobs as the steps score them (position 0 stays `None`), until sent.
    prompt_logprobs: Option<Vec<Option<PromptLogprob>>>,
    /// Tokens sent so far.
    delivered: usize,
}

/// How rank 0 ends requests and paces itself.
pub(crate) struct LeaderRules {
    /// The model's end-of-sequence ids.
    pub eos: Vec<i64>,
    /// Longest prompt plus output.
    pub max_model_len: usize,
    /// The engine's seed (requests without their own draw from it).
    pub seed: u64,
    /// The longest rank 0 stays silent.
    pub heartbeat: Duration,
    /// A pause after each step that ran sequences.
    pub step_delay: Duration,
    /// N-gram speculative decoding, if on.
    pub speculative: Option<NgramConfig>,
}

/// Rank 0's engine state.
pub(crate) struct Leader {
    pub worker: RankWorker,
    pub scheduler: Scheduler,
    pub commands: CommandReceiver,
    pub stats: Arc<SharedStats>,
    pub eos: Vec<i64>,
    pub max_model_len: usize,
    /// Draws seeds for requests without their own (SplitMix64 over the engine's seed).
    pub seeds: SplitMix64,
    /// The longest rank 0 stays silent: other ranks wait in a broadcast with a deadline.
    pub heartbeat: Duration,
    step_delay: Duration,
    speculative: Option<NgramConfig>,
    live: HashMap<RequestId, Live>,
    pending_new: Vec<NewSeq>,
    pending_drop: Vec<RequestId>,
    /// LoRA slot changes waiting for a step (an unload waits until no live request uses it).
    pending_adapters: Vec<(u32, Option<std::path::PathBuf>, crate::api::AdapterReply)>,
    totals: Stats,
    /// Requests in a step still in flight (pipelined steps): not scheduled again, not ended
    /// until their step is back.
    busy: std::collections::HashSet<RequestId>,
    /// Aborts of requests that were busy when they came.
    deferred_aborts: Vec<RequestId>,
}

/// A step sent and begun but whose results have not come back (pipelined steps).
struct InFlight {
    plan: crate::scheduler::StepPlan,
    drafts: Vec<(RequestId, usize)>,
    adapter_replies: Vec<crate::api::AdapterReply>,
    adapter_outcomes: Vec<crate::api::AdapterOutcome>,
    mask_errors: Vec<(RequestId, String)>,
    /// Rank 0's own time around the step (planning, sending).
    own: Duration,
}

impl Leader {
    pub(crate) fn new(
        worker: RankWorker,
        scheduler: Scheduler,
        commands: CommandReceiver,
        stats: Arc<SharedStats>,
        rules: LeaderRules,
    ) -> Leader {
        let LeaderRules { eos, max_model_len, seed, heartbeat, step_delay, speculative } = rules;
        Leader {
            worker,
            scheduler,
            commands,
            stats,
            eos,
            max_model_len,
            seeds: SplitMix64::new(seed),
            heartbeat,
            step_delay,
            speculative,
            live: HashMap::new(),
            pending_new: Vec::new(),
            pending_drop: Vec::new(),
            pending_adapters: Vec::new(),
            totals: Stats::default(),
            busy: std::collections::HashSet::new(),
            deferred_aborts: Vec::new(),
        }
    }

    /// Runs until every handle is gone or a shutdown finished its work; then tells the other
    /// ranks to stop. On a failed step every request gets [`Event::Failed`] and the error is
    /// returned (the group is aborted so the other ranks leave their waits at once).
    pub(crate) fn run(mut self) -> Result<(), EngineError> {
        let result = if self.worker.pipelined { self.serve_pipelined() } else { self.serve() };
        match &result {
            Ok(()) => {
                let _ = self.worker.send(&StepMsg::empty(StepKind::Stop));
                let _ = self.worker.flush();
                self.stats.set_stopped("the engine has stopped".into());
            }
            Err(e) => {
                let why = format!("the engine failed: {e}");
                self.stats.set_stopped(why.clone());
                self.worker.abort(&why);
                for (_, mut l) in self.live.drain() {
                    l.sink.send(Event::Failed(why.clone()));
                }
                // Requests still in the channel fail too.
                while let Ok(c) = self.commands.try_recv() {
                    if let Command::Add { mut sink, .. } = c {
                        sink.send(Event::Failed(why.clone()));
                    }
                }
            }
        }
        self.publish();
        result
    }

    fn serve(&mut self) -> Result<(), EngineError> {
        let mut last_sent = Instant::now();
        let mut stalled = false;
        loop {
            // Idle: wait for work up to the next heartbeat. Requests that could not be scheduled
            // last time (none should stay so: what can never fit is refused): a short wait, not
            // a spin.
            let wait = if self.live.is_empty() {
                self.heartbeat.saturating_sub(last_sent.elapsed())
            } else if stalled {
                Duration::from_millis(1)
            } else {
                Duration::ZERO
            };
            match self.take_commands(wait) {
                Ok(()) => {}
                Err(()) if self.live.is_empty() => return Ok(()), // every handle is gone
                Err(()) => {}
            }
            if self.stats.stopping() && self.live.is_empty() {
                return Ok(());
            }
            let planning = Instant::now();
            let mut plan = self.scheduler.schedule();
            let (mut msg, drafts, adapter_replies) = self.step_message(&mut plan, false);
            stalled = msg.seqs.is_empty() && self.pending_adapters.is_empty();
            if msg.is_empty() {
                if last_sent.elapsed() < self.heartbeat {
                    continue;
                }
                msg.kind = StepKind::Idle;
            }
            let own = planning.elapsed();
            self.worker.send(&msg)?;
            last_sent = Instant::now();
            let (sampled, mask_errors) = self.execute(&msg)?;
            let after = Instant::now();
            let outcomes = sampled.adapters.clone();
            let done = InFlight { plan, drafts, adapter_replies, adapter_outcomes: outcomes, mask_errors, own };
            self.finish_step(done, sampled, after);
        }
    }

    /// Pipelined steps (pipeline stages): up to one step per stage in flight, each over
    /// sequences no other step in flight holds (at most `ceil(active / stages)` of them), so that
    /// stage `s` runs one step while stage `s + 1` runs the one before. Rank 0 plans and sends a
    /// step, runs its own (first) stage of it, and plans the next while the later stages work;
    /// once as many steps are in flight as there are stages (or nothing more can run), it waits
    /// for the oldest one's results from the last stage and finishes it as [`serve`] does.
    fn serve_pipelined(&mut self) -> Result<(), EngineError> {
        let depth = self.worker.pipeline.as_ref().map_or(1, |(pp, _)| pp.world_size()).max(1);
        let mut flight: std::collections::VecDeque<InFlight> = std::collections::VecDeque::new();
        let mut last_sent = Instant::now();
        loop {
            let wait = if !flight.is_empty() {
                Duration::ZERO
            } else if self.live.is_empty() {
                self.heartbeat.saturating_sub(last_sent.elapsed())
            } else {
                Duration::from_millis(1)
            };
            if self.take_commands(wait).is_err() && self.live.is_empty() && flight.is_empty() {
                return Ok(()); // every handle is gone
            }
            if self.stats.stopping() && self.live.is_empty() && flight.is_empty() {
                return Ok(());
            }
            if flight.len() < depth
                && let Some(step) = self.launch(depth)?
            {
                last_sent = Instant::now();
                if step.plan.seqs.is_empty() {
                    // Announcements alone: no results come back for it.
                    self.finish_step(step, super::rank::StepResult::default(), Instant::now());
                } else {
                    flight.push_back(step);
                }
                continue;
            }
            if let Some(done) = flight.pop_front() {
                let sampled = self.worker.take_results()?;
                let after = Instant::now();
                for s in &done.plan.seqs {
                    self.busy.remove(&s.id);
                }
                self.finish_step(done, super::rank::StepResult { adapters: Vec::new(), ..sampled }, after);
                for id in std::mem::take(&mut self.deferred_aborts) {
                    self.end(id, FinishReason::Abort);
                }
                continue;
            }
            if last_sent.elapsed() >= self.heartbeat {
                self.worker.send(&StepMsg::empty(StepKind::Idle))?;
                last_sent = Instant::now();
            }
        }
    }

    /// Plans, sends and begins one pipelined step beside those in flight (`None` when there is
    /// nothing to run or announce).
    fn launch(&mut self, depth: usize) -> Result<Option<InFlight>, EngineError> {
        let planning = Instant::now();
        let active = self.scheduler.num_running() + self.scheduler.num_waiting();
        let mut plan = self.scheduler.schedule_beside(&self.busy, active.div_ceil(depth).max(1));
        let (msg, drafts, adapter_replies) = self.step_message(&mut plan, true);
        if msg.is_empty() {
            return Ok(None);
        }
        let own = planning.elapsed();
        self.worker.send(&msg)?;
        let (begun, mask_errors) = self.execute(&msg)?;
        self.busy.extend(plan.seqs.iter().map(|s| s.id));
        Ok(Some(InFlight { plan, drafts, adapter_replies, adapter_outcomes: begun.adapters, mask_errors, own }))
    }

    /// The message of a step running `plan`: its drafts added (speculation), the sampled
    /// sequences with a constraint marked for masks, the pending announcements and ready
    /// adapter changes taken, and, pipelined, every sequence's known length. Also the drafts
    /// made and where the adapter changes' outcomes go.
    fn step_message(
        &mut self,
        plan: &mut crate::scheduler::StepPlan,
        pipelined: bool,
    ) -> (StepMsg, Vec<(RequestId, usize)>, Vec<crate::api::AdapterReply>) {
        let drafts = self.draft(plan);
        let masked = plan
            .seqs
            .iter()
            .filter(|s| s.sample && self.live.get(&s.id).is_some_and(|l| l.constraint.is_some()))
            .map(|s| s.id)
            .collect();
        let (adapters, adapter_replies) = self.ready_adapters();
        let rope_lens = if pipelined {
            plan.seqs.iter().map(|s| self.scheduler.tokens(s.id).map_or(0, <[i64]>::len)).collect()
        } else {
            Vec::new()
        };
        let msg = StepMsg {
            kind: StepKind::Run,
            new: std::mem::take(&mut self.pending_new),
            drop: std::mem::take(&mut self.pending_drop),
            seqs: plan.seqs.clone(),
            masked,
            adapters,
            rope_lens,
        };
        (msg, drafts, adapter_replies)
    }

    /// Rank 0's part of step `msg`: its structured-output masks computed on a thread beside
    /// its forward pass (and broadcast or sent on once done), then `RankWorker::execute`; the
    /// step's results (without stages, or empty but for the adapter outcomes when pipelined)
    /// and the requests whose constraint failed.
    fn execute(&mut self, msg: &StepMsg) -> Result<(super::rank::StepResult, Vec<(RequestId, String)>), EngineError> {
        let vocab = self.worker.model.config().vocab_size;
        let mut mask_errors = Vec::new();
        let (worker, live) = (&mut self.worker, &mut self.live);
        let result = std::thread::scope(|scope| {
            let source = if msg.masked.is_empty() {
                MaskSource::Follower
            } else {
                let job = scope.spawn(|| compute_masks(live, &msg.masked, vocab));
                let errors = &mut mask_errors;
                let masked = &msg.masked;
                MaskSource::Leader(Box::new(move || {
                    let (words, errs) = job.join().unwrap_or_else(|_| {
                        let why = "the structured-output constraint panicked".to_string();
                        (
                            vec![u64::MAX; masked.len() * vocab.div_ceil(64)],
                            masked.iter().map(|&id| (id, why.clone())).collect(),
                        )
                    });
                    *errors = errs;
                    words
                }))
            };
            worker.execute(msg, source)
        })?;
        Ok((result, mask_errors))
    }

    /// A step's results applied: adapter replies, the scheduler's bookkeeping, prompt
    /// logprobs, structured-output failures, speculation counts, the sampled tokens delivered,
    /// the phases and the published figures.
    fn finish_step(&mut self, done: InFlight, sampled: super::rank::StepResult, after: Instant) {
        let InFlight { plan, drafts, adapter_replies, adapter_outcomes, mask_errors, mut own } = done;
        for (reply, outcome) in adapter_replies.into_iter().zip(&adapter_outcomes) {
            let _ = reply.send(outcome.1.clone());
        }
        for s in &plan.seqs {
            if s.cached_tokens > 0
                && let Some(l) = self.live.get_mut(&s.id)
            {
                l.cached_prompt_tokens = s.cached_tokens;
            }
        }
        let pairs: Vec<(RequestId, i64)> = sampled.sampled.iter().map(|(id, s)| (*id, s.token)).collect();
        self.scheduler.complete_step(&plan, &pairs);
        for (id, first, lps) in sampled.scored {
            if let Some(slots) = self.live.get_mut(&id).and_then(|l| l.prompt_logprobs.as_mut()) {
                for (p, lp) in (first..).zip(lps) {
                    if let Some(slot) = slots.get_mut(p) {
                        *slot = Some(lp);
                    }
                }
            }
        }
        for (id, why) in mask_errors {
            self.fail(id, format!("structured output: {why}"));
        }
        for (id, n) in drafts {
            let kept = sampled.sampled.iter().filter(|(i, _)| *i == id).count();
            self.totals.spec_draft_tokens += n as u64;
            self.totals.spec_accepted_tokens += kept.saturating_sub(1) as u64;
        }
        for (id, s) in sampled.sampled {
            self.totals.generation_tokens += 1;
            self.deliver(id, s.token, s.logprobs);
        }
        if !plan.seqs.is_empty() {
            own += after.elapsed();
            self.totals.phases.steps += 1;
            self.totals.phases.scheduler += own.as_secs_f64();
        }
        self.publish();
        if !plan.seqs.is_empty() && !self.step_delay.is_zero() {
            std::thread::sleep(self.step_delay);
        }
    }

    /// Takes every queued command, waiting up to `wait` for the first. `Err` once every handle
    /// is gone.
    fn take_commands(&mut self, wait: Duration) -> Result<(), ()> {
        let first = if wait.is_zero() {
            match self.commands.try_recv() {
                Ok(c) => Some(c),
                Err(std::sync::mpsc::TryRecvError::Empty) => None,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => return Err(()),
            }
        } else {
            match self.commands.recv_timeout(wait) {
                Ok(c) => Some(c),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => None,
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return Err(()),
            }
        };
        let Some(first) = first else { return Ok(()) };
        self.command(first);
        loop {
            match self.commands.try_recv() {
                Ok(c) => self.command(c),
                Err(std::sync::mpsc::TryRecvError::Empty) => return Ok(()),
                Err(std::sync::mpsc::TryRecvError::Disconnected) => return Err(()),
            }
        }
    }

    fn command(&mut self, c: Command) {
        match c {
            Command::Add { id, request, mut sink, constraint } => {
                // A prompt scored (`prompt_logprobs`) is computed whole; `max_tokens: 0` still
                // samples once (then the request ends without sending the token).
                let reuse = request.params.prompt_logprobs.is_none();
                let (prompt, max_tokens) = (request.prompt.clone(), request.max_tokens.max(1));
                if let Err(e) = self.scheduler.add_adapted(id, prompt, max_tokens, reuse, request.adapter) {
                    sink.send(Event::Failed(e.to_string()));
                    return;
                }
                let seed = request.params.seed.unwrap_or_else(|| self.seeds.next_u64());
                self.totals.prompt_tokens += request.prompt.len() as u64;
                let mut min_stop = Vec::new();
                if request.params.min_tokens > 0 {
                    min_stop.extend_from_slice(&request.stop_token_ids);
                    if !request.ignore_eos {
                        min_stop.extend_from_slice(&self.eos);
                    }
                }
                self.pending_new.push(NewSeq {
                    id,
                    seed,
                    params: request.params.clone(),
                    prompt: request.prompt.clone(),
                    min_stop,
                    adapter: request.adapter,
                });
                let prompt_logprobs = request.params.prompt_logprobs.map(|_| vec![None; request.prompt.len()]);
                let live = Live {
                    sink,
                    request: *request,
                    cached_prompt_tokens: 0,
                    constraint,
                    prompt_logprobs,
                    delivered: 0,
                };
                self.live.insert(id, live);
            }
            // A request in a step still in flight ends when that step is back (its blocks are
            // being written).
            Command::Abort(id) if self.busy.contains(&id) => self.deferred_aborts.push(id),
            Command::Abort(id) => self.end(id, FinishReason::Abort),
            Command::Adapter { slot, path, reply } => self.pending_adapters.push((slot, path, reply)),
        }
    }

    /// The adapter changes the next step makes (loads at once, unloads of slots no live request
    /// uses), with where each outcome goes.
    fn ready_adapters(&mut self) -> (Vec<(u32, Option<String>)>, Vec<crate::api::AdapterReply>) {
        let (mut changes, mut replies) = (Vec::new(), Vec::new());
        let mut waiting = Vec::new();
        for (slot, path, reply) in std::mem::take(&mut self.pending_adapters) {
            let in_use = path.is_none() && self.live.values().any(|l| l.request.adapter == slot);
            if in_use {
                waiting.push((slot, path, reply));
            } else {
                changes.push((slot, path.map(|p| p.to_string_lossy().into_owned())));
                replies.push(reply);
            }
        }
        self.pending_adapters = waiting;
        (changes, replies)
    }

    /// Sends a sampled token and ends the request if it should.
    fn deliver(&mut self, id: RequestId, token: i64, logprobs: Option<TokenLogprobs>) {
        let Some(l) = self.live.get_mut(&id) else { return };
        // The prompt's logprobs are complete once its last chunk ran, which is the step that
        // samples the first token.
        if let Some(lps) = l.prompt_logprobs.take()
            && !l.sink.send(Event::PromptLogprobs(lps))
        {
            self.end(id, FinishReason::Abort);
            return;
        }
        if l.request.max_tokens == 0 {
            self.end(id, FinishReason::Length);
            return;
        }
        let alive = l.sink.send(Event::Token { id: token, logprobs });
        l.delivered += 1;
        let generated = l.delivered;
        let r = &l.request;
        let reason = if !alive {
            Some(FinishReason::Abort)
        } else if (!r.ignore_eos && self.eos.contains(&token)) || r.stop_token_ids.contains(&token) {
            Some(FinishReason::Stop)
        } else if generated >= r.max_tokens || r.prompt.len() + generated >= self.max_model_len {
            Some(FinishReason::Length)
        } else {
            None
        };
        if let Some(reason) = reason {
            self.end(id, reason);
            return;
        }
        if let Some(c) = &mut l.constraint {
            if let Err(why) = c.advance(token) {
                self.fail(id, format!("structured output: {why}"));
            } else if c.is_finished() {
                self.end(id, FinishReason::Stop);
            }
        }
    }

    /// Drafts the next tokens of the plan's decodes (n-gram speculation, when on), within the
    /// step's token budget and each request's `max_tokens` and the model's length; the drafts
    /// made, `(request, draft length)`. Constrained requests and those scoring their prompt are
    /// not drafted.
    fn draft(&mut self, plan: &mut crate::scheduler::StepPlan) -> Vec<(RequestId, usize)> {
        let Some(cfg) = self.speculative else { return Vec::new() };
        let mut budget = self
            .scheduler
            .config()
            .max_num_batched_tokens
            .saturating_sub(plan.seqs.iter().map(|s| s.tokens.len()).sum());
        let mut made = Vec::new();
        let decodes: Vec<RequestId> =
            plan.seqs.iter().filter(|s| s.sample && s.tokens.len() == 1).map(|s| s.id).collect();
        for id in decodes {
            let Some(l) = self.live.get(&id) else { continue };
            if l.constraint.is_some() || l.request.params.prompt_logprobs.is_some() || budget == 0 {
                continue;
            }
            let Some(tokens) = self.scheduler.tokens(id) else { continue };
            // The step samples one token at least; the draft may add as many as fit.
            let room = l
                .request
                .max_tokens
                .saturating_sub(l.delivered + 1)
                .min(self.max_model_len.saturating_sub(tokens.len() + 1))
                .min(budget);
            // A draft does not cross LongRoPE's switch (the step would turn with the long
            // frequencies over a cache computed with the short ones).
            let room = match self.scheduler.rope_switch() {
                Some(at) if tokens.len() <= at => room.min(at - tokens.len()),
                _ => room,
            };
            let draft = cfg.propose(tokens, room);
            if !draft.is_empty() && self.scheduler.add_draft(plan, id, &draft) {
                budget -= draft.len();
                made.push((id, draft.len()));
            }
        }
        made
    }

    /// Fails request `id` alone (if live): frees its blocks, tells the other ranks to forget it,
    /// sends [`Event::Failed`].
    fn fail(&mut self, id: RequestId, why: String) {
        if let Some(mut sink) = self.forget(id, FinishReason::Abort).map(|(l, _)| l.sink) {
            sink.send(Event::Failed(why));
        }
    }

    /// Ends request `id` (if live): frees its blocks, tells the other ranks to forget it, sends
    /// its last event.
    fn end(&mut self, id: RequestId, reason: FinishReason) {
        if let Some((mut l, usage)) = self.forget(id, reason) {
            l.sink.send(Event::Finished { reason, usage });
        }
    }

    /// Removes request `id` from the engine (as `reason` ends it): its live state and usage.
    fn forget(&mut self, id: RequestId, reason: FinishReason) -> Option<(Live, Usage)> {
        let l = self.live.remove(&id)?;
        if reason == FinishReason::Abort {
            self.scheduler.abort(id);
        } else {
            self.scheduler.finish(id);
        }
        let completion_tokens = l.delivered;
        // A request announced but never run is dropped from the announcements instead.
        if let Some(i) = self.pending_new.iter().position(|n| n.id == id) {
            self.pending_new.remove(i);
        } else {
            self.pending_drop.push(id);
        }
        let usage = Usage {
            prompt_tokens: l.request.prompt.len(),
            completion_tokens,
            cached_prompt_tokens: l.cached_prompt_tokens,
        };
        Some((l, usage))
    }

    fn publish(&self) {
        let s = Stats {
            running: self.scheduler.num_running(),
            waiting: self.scheduler.num_waiting(),
            kv_cache_usage: self.scheduler.kv_cache_usage(),
            preemptions: self.scheduler.preemptions(),
            prefix_cache_hits: self.scheduler.prefix_hit_tokens(),
            phases: StepPhases {
                steps: self.totals.phases.steps,
                scheduler: self.totals.phases.scheduler,
                ..self.worker.phases
            },
            ..self.totals
        };
        self.stats.publish(s);
        if !self.worker.routed.is_empty() {
            self.stats.publish_routed(&self.worker.routed);
        }
    }
}

/// The masks of the `masked` requests' next tokens (`ceil(vocab / 64)` words each, in order), and
/// the requests whose constraint failed (their mask allows every id; they are failed after the
/// step). Runs on its own thread while rank 0's forward pass runs.
fn compute_masks(
    live: &mut HashMap<RequestId, Live>,
    masked: &[RequestId],
    vocab: usize,
) -> (Vec<u64>, Vec<(RequestId, String)>) {
    let words = vocab.div_ceil(64);
    let mut out = vec![0u64; masked.len() * words];
    let mut errors = Vec::new();
    for (k, id) in masked.iter().enumerate() {
        let mask = &mut out[k * words..(k + 1) * words];
        let Some(c) = live.get_mut(id).and_then(|l| l.constraint.as_mut()) else { continue };
        if let Err(why) = c.fill_mask(mask) {
            mask.fill(u64::MAX);
            errors.push((*id, why));
        }
    }
    (out, errors)
}
