//! What a server sees of the engine: [`Request`]s in, [`Event`]s out through an [`EventSink`],
//! and an [`EngineHandle`] to submit, abort, read [`Stats`] and stop.
//!
//! The engine runs on its own thread (rank 0's); the handle talks to it over a channel, so every
//! method returns at once. Events of one request arrive in order: zero or more
//! [`Event::Token`], then exactly one [`Event::Finished`] or [`Event::Failed`].

use crate::sampling::SamplingParams;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

/// An engine-wide request id.
pub type RequestId = u64;

/// One generation request, in token ids (the server tokenizes and detokenizes).
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The prompt, at least one id, each in the vocabulary.
    pub prompt: Vec<i64>,
    /// How tokens are picked.
    pub params: SamplingParams,
    /// Most tokens to generate: at least 1, or 0 to only score the prompt (with
    /// `params.prompt_logprobs`).
    pub max_tokens: usize,
    /// Ids that end the request (finish reason `stop`), besides the model's end-of-sequence ids
    /// unless `ignore_eos`. The stopping id is sent as the last token.
    pub stop_token_ids: Vec<i64>,
    /// Keep going past the model's end-of-sequence ids.
    pub ignore_eos: bool,
    /// The LoRA adapter's slot ([`EngineOptions::lora_adapters`](crate::EngineOptions::lora_adapters));
    /// 0: the base model.
    pub adapter: u32,
}

/// The chosen token's logprob and the most likely alternatives, from the raw logits.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// `log_softmax(logits)[token]`.
    pub logprob: f32,
    /// The `n` largest `(id, logprob)`, largest first (lower id first on ties).
    pub top: Vec<(i64, f32)>,
}

/// A prompt token's logprob under the model's raw logits at the position before it.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLogprob {
    /// `log_softmax(logits)[token]`.
    pub logprob: f32,
    /// How many ids have a logit at least the token's (1 for the most likely).
    pub rank: usize,
    /// The `n` largest `(id, logprob)`, largest first (lower id first on ties).
    pub top: Vec<(i64, f32)>,
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence or stop id was generated (or the server saw a stop string and
    /// aborted the request as stopped).
    Stop,
    /// `max_tokens`, or the model's length limit, was reached.
    Length,
    /// Aborted by the caller (a client that went away, or a stop string).
    Abort,
}

impl FinishReason {
    /// OpenAI's name: `stop`, `length`, `abort`.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt ids.
    pub prompt_tokens: usize,
    /// Generated ids (sent as [`Event::Token`]).
    pub completion_tokens: usize,
    /// Prompt ids whose keys and values came from the prefix cache.
    pub cached_prompt_tokens: usize,
}

/// What the engine reports about one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The logprobs of the prompt's tokens (the first `None`: nothing precedes it), sent once,
    /// before the first token, when the request asked for `prompt_logprobs`.
    PromptLogprobs(Vec<Option<PromptLogprob>>),
    /// The next generated id.
    Token {
        /// The id.
        id: i64,
        /// When the request asked for logprobs.
        logprobs: Option<TokenLogprobs>,
    },
    /// The request ended normally.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Its token counts.
        usage: Usage,
    },
    /// The request failed (a rank died, a step failed, the engine stopped); the message says why.
    Failed(String),
}

/// Where one request's events go. `send` returns `false` once nobody listens (a client that
/// disconnected): the engine then aborts the request and frees its blocks at the next step.
pub trait EventSink: Send {
    /// Delivers `event`; `false` if the receiver is gone.
    fn send(&mut self, event: Event) -> bool;
}

impl EventSink for mpsc::Sender<Event> {
    fn send(&mut self, event: Event) -> bool {
        mpsc::Sender::send(self, event).is_ok()
    }
}

/// A structured-output constraint on one request (a JSON schema, a regex, a grammar), driven
/// by rank 0: before each token it writes the ids it allows, which every rank applies to its own
/// columns of the logits (see [`SampleRow::mask`](crate::sampling::SampleRow::mask)), so
/// sampling stays exact and vocab-parallel. The engine computes the mask while the step's
/// forward pass runs, on a thread of its own.
pub trait TokenConstraint: Send {
    /// Sets the bit of every id allowed next in `mask` (id `i`: bit `i % 64` of word `i / 64`;
    /// `mask` is all zeros on entry and covers the model's vocabulary). Ids past the tokenizer's
    /// vocabulary must stay clear. An error fails this request only.
    fn fill_mask(&mut self, mask: &mut [u64]) -> Result<(), String>;
    /// Moves past the sampled `token`. An error (a token the constraint does not allow) fails
    /// this request only.
    fn advance(&mut self, token: i64) -> Result<(), String>;
    /// Whether the constraint is complete and allows nothing more: the request then ends with
    /// [`FinishReason::Stop`].
    fn is_finished(&self) -> bool;
}

/// Why a request was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// A field is out of range (`param` names it, as OpenAI's errors do).
    #[error("{message}")]
    Invalid {
        /// The request field at fault.
        param: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The prompt, or the prompt plus `max_tokens`, is longer than the model takes, or needs more
    /// KV-cache blocks than the whole cache holds.
    #[error("{0}")]
    TooLong(String),
    /// The waiting queue is full; try again later.
    #[error("the server is overloaded: {0} requests are waiting")]
    QueueFull(usize),
    /// The engine has stopped (shut down, or a rank failed).
    #[error("the engine is not running: {0}")]
    Stopped(String),
}

/// What the engine is doing, for metrics (read without waiting for the engine).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stats {
    /// Requests with blocks, being prefilled or decoded.
    pub running: usize,
    /// Requests queued (including preempted ones).
    pub waiting: usize,
    /// Fraction of the KV-cache blocks in use by requests, `0..=1`.
    pub kv_cache_usage: f64,
    /// Prompt tokens served from the prefix cache, in total.
    pub prefix_cache_hits: u64,
    /// Prompt tokens of finished or running requests, in total (prefix hits included).
    pub prompt_tokens: u64,
    /// Generated tokens, in total.
    pub generation_tokens: u64,
    /// Sequences preempted (to be recomputed), in total.
    pub preemptions: u64,
    /// Speculative draft tokens proposed, in total.
    pub spec_draft_tokens: u64,
    /// Speculative draft tokens accepted (each one a token gained over plain decoding), in total.
    pub spec_accepted_tokens: u64,
    /// Where the steps' time went, in total (rank 0's view).
    pub phases: StepPhases,
}

/// Seconds the engine's steps spent in each phase, summed over the steps run so far, as rank 0
/// sees them: its forward pass split into matrix products, attention (with the cache writes)
/// and the element-wise rest (norms, residuals, RoPE, activations, embedding, copies); then
/// sampling (with prompt scoring and the wait for structured-output masks); and the leader's
/// own work around each step (scheduling, drafting, delivering tokens).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepPhases {
    /// Steps run (those with sequences).
    pub steps: u64,
    /// Matrix products (dense and quantized).
    pub gemm: f64,
    /// Attention and the writes of keys and values into the cache.
    pub attention: f64,
    /// The forward pass outside products and attention.
    pub elementwise: f64,
    /// Sampling and prompt scoring.
    pub sampling: f64,
    /// The leader's scheduling and bookkeeping around each step.
    pub scheduler: f64,
}

impl StepPhases {
    /// The phases' seconds by name (`gemm`, `attention`, `elementwise`, `sampling`,
    /// `scheduler`), in that order: the labels `/metrics` uses.
    pub fn named(&self) -> [(&'static str, f64); 5] {
        [
            ("gemm", self.gemm),
            ("attention", self.attention),
            ("elementwise", self.elementwise),
            ("sampling", self.sampling),
            ("scheduler", self.scheduler),
        ]
    }
}

/// Fixed facts about the engine's model and limits, for validating requests up front.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Longest prompt plus output, in tokens.
    pub max_model_len: usize,
    /// Vocabulary size (ids are `0..vocab_size`).
    pub vocab_size: usize,
    /// The model's end-of-sequence ids.
    pub eos_token_ids: Vec<i64>,
    /// Most requests queued before [`SubmitError::QueueFull`].
    pub max_waiting: usize,
    /// Positions the whole KV cache holds (blocks × block size): a request needing more can
    /// never run and is refused at once.
    pub kv_cache_positions: usize,
}

/// A message from a handle to the engine thread.
pub enum Command {
    /// Start a request.
    Add {
        /// Its id.
        id: RequestId,
        /// What to generate (boxed: the other commands are small).
        request: Box<Request>,
        /// Where its events go.
        sink: Box<dyn EventSink>,
        /// Its structured-output constraint, if any.
        constraint: Option<Box<dyn TokenConstraint>>,
    },
    /// Abort a request (no effect if it already ended).
    Abort(RequestId),
    /// Attach the PEFT adapter at `path` in LoRA slot `slot` on every rank, or (`path: None`)
    /// empty the slot once no live request uses it; `reply` gets the outcome.
    Adapter {
        /// The slot (`> 0`, never reused by another adapter).
        slot: u32,
        /// The adapter folder, or `None` to unload.
        path: Option<std::path::PathBuf>,
        /// Where the outcome goes.
        reply: AdapterReply,
    },
}

/// Where the outcome of a LoRA slot change goes ([`Command::Adapter`]).
pub type AdapterReply = mpsc::Sender<Result<(), String>>;

/// Where the outcome of a LoRA slot change arrives ([`EngineHandle::load_adapter`]).
pub type AdapterReceiver = mpsc::Receiver<Result<(), String>>;

/// The outcome of a LoRA slot change: its slot, and `Err` with why it was refused.
pub type AdapterOutcome = (u32, Result<(), String>);

/// Live counters the engine publishes and handles read.
#[derive(Debug, Default)]
pub struct SharedStats {
    stats: Mutex<Stats>,
    /// Tokens routed to each expert, summed over the MoE layers (rank 0's forward passes).
    routed: Mutex<Vec<u64>>,
    stopped: Mutex<Option<String>>,
    stopping: AtomicBool,
    /// Seconds each pipeline stage's first rank spent computing steps (ranks in this process).
    stage_busy: Mutex<Vec<f64>>,
}

impl SharedStats {
    /// Adds `secs` of compute to pipeline stage `stage`'s busy time.
    pub fn add_stage_busy(&self, stage: usize, secs: f64) {
        if let Ok(mut g) = self.stage_busy.lock() {
            if g.len() <= stage {
                g.resize(stage + 1, 0.0);
            }
            g[stage] += secs;
        }
    }
    /// Publishes the engine's current figures.
    pub fn publish(&self, s: Stats) {
        if let Ok(mut g) = self.stats.lock() {
            *g = s;
        }
    }
    /// Publishes the routing histogram: tokens per expert, summed over the MoE layers.
    pub fn publish_routed(&self, counts: &[u64]) {
        if let Ok(mut g) = self.routed.lock() {
            g.clear();
            g.extend_from_slice(counts);
        }
    }
    /// Marks the engine stopped, with why; later submissions fail with that reason.
    pub fn set_stopped(&self, why: String) {
        if let Ok(mut g) = self.stopped.lock() {
            g.get_or_insert(why);
        }
    }
    /// Why the engine stopped, if it did.
    pub fn stopped(&self) -> Option<String> {
        self.stopped.lock().ok().and_then(|g| g.clone())
    }
    /// Whether a stop was asked for (the engine finishes what runs and accepts nothing new).
    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Relaxed)
    }
}

/// A server's handle on a running engine. Cheap to clone; every method returns at once.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    stats: Arc<SharedStats>,
    limits: Arc<Limits>,
    next_id: Arc<AtomicU64>,
    /// Requests submitted and not yet taken from the channel by the engine (counted against
    /// `max_waiting` together with the engine's own queue).
    in_channel: Arc<AtomicUsize>,
}

/// The engine's end of a handle's channel.
pub struct CommandReceiver {
    rx: mpsc::Receiver<Command>,
    in_channel: Arc<AtomicUsize>,
}

impl CommandReceiver {
    /// The next command, waiting at most `timeout`; `Err(Disconnected)` once every handle is gone.
    pub fn recv_timeout(&self, timeout: std::time::Duration) -> Result<Command, mpsc::RecvTimeoutError> {
        let c = self.rx.recv_timeout(timeout)?;
        if matches!(c, Command::Add { .. }) {
            self.in_channel.fetch_sub(1, Ordering::Relaxed);
        }
        Ok(c)
    }
    /// The next command if one is queued.
    pub fn try_recv(&self) -> Result<Command, mpsc::TryRecvError> {
        let c = self.rx.try_recv()?;
        if matches!(c, Command::Add { .. }) {
            self.in_channel.fetch_sub(1, Ordering::Relaxed);
        }
        Ok(c)
    }
}

impl EngineHandle {
    /// A handle and the engine's receiving end, sharing `stats`.
    pub fn channel(limits: Limits, stats: Arc<SharedStats>) -> (EngineHandle, CommandReceiver) {
        let (tx, rx) = mpsc::channel();
        let in_channel = Arc::new(AtomicUsize::new(0));
        let handle = EngineHandle {
            tx,
            stats,
            limits: Arc::new(limits),
            next_id: Arc::new(AtomicU64::new(1)),
            in_channel: in_channel.clone(),
        };
        (handle, CommandReceiver { rx, in_channel })
    }

    /// The model's limits.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// The engine's current figures.
    pub fn stats(&self) -> Stats {
        self.stats.stats.lock().map(|g| *g).unwrap_or_default()
    }

    /// Tokens routed to each expert so far (index = expert id), summed over the model's MoE
    /// layers; empty for a dense model.
    pub fn routed_tokens(&self) -> Vec<u64> {
        self.stats.routed.lock().map(|g| g.clone()).unwrap_or_default()
    }

    /// Seconds each pipeline stage spent computing steps (its first rank's forward passes and
    /// sampling), indexed by stage; the stages whose ranks run in this process (every stage
    /// when the ranks are threads, the first one when they are processes).
    pub fn stage_busy_secs(&self) -> Vec<f64> {
        self.stats.stage_busy.lock().map(|g| g.clone()).unwrap_or_default()
    }

    /// Why the engine stopped, if it has.
    pub fn stopped(&self) -> Option<String> {
        self.stats.stopped()
    }

    /// Checks `request` against the limits and queues it; its events go to `sink`.
    ///
    /// Errors: [`SubmitError::Invalid`] (an empty prompt, an id outside the vocabulary,
    /// `max_tokens == 0`, sampling parameters out of range), [`SubmitError::TooLong`] (prompt
    /// plus `max_tokens` beyond `max_model_len`, naming both), [`SubmitError::QueueFull`],
    /// [`SubmitError::Stopped`].
    pub fn submit(&self, request: Request, sink: Box<dyn EventSink>) -> Result<RequestId, SubmitError> {
        self.submit_constrained(request, None, sink)
    }

    /// [`submit`](Self::submit) with a structured-output `constraint` that decides which ids
    /// each token may be.
    pub fn submit_constrained(
        &self,
        request: Request,
        constraint: Option<Box<dyn TokenConstraint>>,
        sink: Box<dyn EventSink>,
    ) -> Result<RequestId, SubmitError> {
        self.check(&request)?;
        if let Some(why) = self.stats.stopped() {
            return Err(SubmitError::Stopped(why));
        }
        if self.stats.stopping() {
            return Err(SubmitError::Stopped("the server is shutting down".into()));
        }
        let queued = self.stats().waiting + self.in_channel.load(Ordering::Relaxed);
        if queued >= self.limits.max_waiting {
            return Err(SubmitError::QueueFull(queued));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.in_channel.fetch_add(1, Ordering::Relaxed);
        if self.tx.send(Command::Add { id, request: Box::new(request), sink, constraint }).is_err() {
            self.in_channel.fetch_sub(1, Ordering::Relaxed);
            return Err(SubmitError::Stopped(self.stats.stopped().unwrap_or_else(|| "the engine thread ended".into())));
        }
        Ok(id)
    }

    /// Attaches the PEFT adapter at `path` in LoRA slot `slot` (`> 0`, never used before) on
    /// every rank, between steps; the receiver gets the outcome (an adapter that does not fit
    /// the model is refused on every rank, the running ones untouched).
    pub fn load_adapter(&self, slot: u32, path: std::path::PathBuf) -> AdapterReceiver {
        self.adapter_command(slot, Some(path))
    }

    /// Empties LoRA slot `slot` on every rank once no live request uses it.
    pub fn unload_adapter(&self, slot: u32) -> AdapterReceiver {
        self.adapter_command(slot, None)
    }

    fn adapter_command(&self, slot: u32, path: Option<std::path::PathBuf>) -> AdapterReceiver {
        let (reply, rx) = mpsc::channel();
        if let Err(mpsc::SendError(Command::Adapter { reply, .. })) =
            self.tx.send(Command::Adapter { slot, path, reply })
        {
            let _ = reply.send(Err("the engine has stopped".into()));
        }
        rx
    }

    /// Aborts request `id`: it gets [`FinishReason::Abort`] and its blocks are freed at the next
    /// step. No effect on a request that already ended.
    pub fn abort(&self, id: RequestId) {
        let _ = self.tx.send(Command::Abort(id));
    }

    /// Asks the engine to stop: nothing new is accepted; running and waiting requests finish.
    pub fn begin_shutdown(&self) {
        self.stats.stopping.store(true, Ordering::Relaxed);
    }

    fn check(&self, r: &Request) -> Result<(), SubmitError> {
        let invalid = |param, message: String| Err(SubmitError::Invalid { param, message });
        if r.prompt.is_empty() {
            return invalid("prompt", "the prompt is empty".into());
        }
        let v = self.limits.vocab_size;
        if let Some((i, id)) =
            r.prompt.iter().enumerate().find(|(_, id)| usize::try_from(**id).map_or(true, |x| x >= v))
        {
            return invalid("prompt", format!("prompt token {id} at position {i} is outside the vocabulary (0..{v})"));
        }
        if r.max_tokens == 0 && r.params.prompt_logprobs.is_none() {
            return invalid("max_tokens", "max_tokens must be at least 1 (0 only to score the prompt)".into());
        }
        if let Some(id) = r.stop_token_ids.iter().find(|id| usize::try_from(**id).map_or(true, |x| x >= v)) {
            return invalid("stop_token_ids", format!("stop token {id} is outside the vocabulary (0..{v})"));
        }
        if let Err((param, message)) = r.params.validate() {
            return invalid(param, message);
        }
        if let Some((id, _)) = r.params.logit_bias.iter().find(|(id, _)| usize::try_from(*id).map_or(true, |x| x >= v))
        {
            return invalid("logit_bias", format!("logit_bias token {id} is outside the vocabulary (0..{v})"));
        }
        let max = self.limits.max_model_len;
        if r.prompt.len() > max {
            return Err(SubmitError::TooLong(format!(
                "this model's maximum context length is {max} tokens, but the prompt has {} tokens",
                r.prompt.len()
            )));
        }
        if r.prompt.len().saturating_add(r.max_tokens.max(1)) > max {
            return Err(SubmitError::TooLong(format!(
                "this model's maximum context length is {max} tokens, but {} prompt tokens plus max_tokens {} is {}",
                r.prompt.len(),
                r.max_tokens,
                r.prompt.len().saturating_add(r.max_tokens.max(1))
            )));
        }
        let cache = self.limits.kv_cache_positions;
        if r.prompt.len().saturating_add(r.max_tokens.max(1)) > cache {
            return Err(SubmitError::TooLong(format!(
                "{} prompt tokens plus max_tokens {} need more positions than the whole KV cache holds ({cache})",
                r.prompt.len(),
                r.max_tokens
            )));
        }
        Ok(())
    }
}
