//! One choice of one request: submitted to the engine, its events turned into text pieces
//! ([`Piece`]) by a [`TextStream`]. Dropping a [`Choice`] before it finished (a client that went
//! away, a stop string) aborts its engine request.

use crate::detok::{TextStream, WithSpecials};
use crate::error::ApiError;
use crate::server::AppState;
use futures_util::Stream;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;
use tp_engine::api::{Event, EventSink, FinishReason, PromptLogprob, Request, RequestId, TokenConstraint};
use tp_engine::sampling::SamplingParams;

/// An engine sink feeding a tokio channel.
struct ChannelSink(mpsc::UnboundedSender<Event>);

impl EventSink for ChannelSink {
    fn send(&mut self, event: Event) -> bool {
        self.0.send(event).is_ok()
    }
}

/// One generated token, for logprobs.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenOut {
    /// Its text.
    pub text: String,
    /// Its logprob.
    pub logprob: f32,
    /// The top alternatives' texts and logprobs.
    pub top: Vec<(String, f32)>,
}

/// How a choice ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Finish {
    /// `stop`, `length` or `abort`.
    pub reason: &'static str,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Their ids, in order (vLLM's `return_token_ids`).
    pub token_ids: Vec<i64>,
}

/// A step of one choice's output.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// New text (maybe empty), its tokens' logprobs when asked for, and the end if this is it.
    Data {
        /// The choice's index in the response.
        index: usize,
        /// Text to append.
        text: String,
        /// Tokens since the last piece (only when logprobs were asked for).
        tokens: Vec<TokenOut>,
        /// Set on the choice's last piece.
        finish: Option<Finish>,
    },
    /// The logprobs of the choice's prompt tokens (the first `None`), before its first text.
    Prompt {
        /// The choice's index in the response.
        index: usize,
        /// One per prompt token.
        logprobs: Vec<Option<PromptLogprob>>,
    },
    /// The engine failed the request.
    Failed(String),
}

/// One engine request and its text.
pub struct Choice {
    index: usize,
    id: RequestId,
    rx: mpsc::UnboundedReceiver<Event>,
    text: TextStream,
    stop_ids: HashSet<i64>,
    logprobs: bool,
    keep_special: bool,
    /// The ids generated so far.
    ids: Vec<i64>,
    generated: usize,
    done: bool,
    state: Arc<AppState>,
    arrived: Option<Instant>,
}

/// What a choice is started with.
pub struct ChoiceSpec {
    /// Index in the response.
    pub index: usize,
    /// Prompt ids.
    pub prompt: Vec<i64>,
    /// Sampling.
    pub sampling: SamplingParams,
    /// Most tokens.
    pub max_tokens: usize,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Stop ids.
    pub stop_token_ids: Vec<i64>,
    /// Go past end-of-sequence.
    pub ignore_eos: bool,
    /// Its structured-output constraint, if any.
    pub constraint: Option<Box<dyn TokenConstraint>>,
    /// Keep special tokens in the text (an output parser reads them).
    pub keep_special: bool,
    /// The LoRA adapter's slot the request's `model` named (0: the base).
    pub adapter: u32,
}

impl Choice {
    /// Submits `spec` to the engine; `arrived` is when the HTTP request came in (for TTFT).
    pub fn start(state: &Arc<AppState>, spec: ChoiceSpec, arrived: Instant) -> Result<Choice, ApiError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut stop_ids: HashSet<i64> = spec.stop_token_ids.iter().copied().collect();
        if !spec.ignore_eos {
            stop_ids.extend(state.engine.limits().eos_token_ids.iter().copied());
        }
        let text = TextStream::new(&spec.prompt, spec.stop);
        let logprobs = spec.sampling.logprobs.is_some();
        let request = Request {
            prompt: spec.prompt,
            params: spec.sampling,
            max_tokens: spec.max_tokens,
            stop_token_ids: spec.stop_token_ids,
            ignore_eos: spec.ignore_eos,
            adapter: spec.adapter,
        };
        let id = state.engine.submit_constrained(request, spec.constraint, Box::new(ChannelSink(tx)))?;
        state.track(id);
        Ok(Choice {
            index: spec.index,
            id,
            rx,
            text,
            stop_ids,
            logprobs,
            keep_special: spec.keep_special,
            ids: Vec::new(),
            generated: 0,
            done: false,
            state: state.clone(),
            arrived: Some(arrived),
        })
    }

    /// The next piece; `None` after the last one. Pieces with no text and no tokens are skipped.
    pub async fn next_piece(&mut self) -> Option<Piece> {
        let mut tokens = Vec::new();
        while !self.done {
            let Some(event) = self.rx.recv().await else {
                self.end();
                return Some(Piece::Failed("the engine dropped the request".into()));
            };
            match event {
                Event::PromptLogprobs(logprobs) => return Some(Piece::Prompt { index: self.index, logprobs }),
                Event::Token { id, logprobs } => {
                    if let Some(t) = self.arrived.take() {
                        self.state.metrics.observe_ttft(t.elapsed().as_secs_f64());
                    }
                    self.generated += 1;
                    self.ids.push(id);
                    if self.logprobs
                        && let Some(lp) = logprobs
                    {
                        let model = &self.state.text;
                        let top = lp.top.iter().map(|&(t, l)| (model.token_text(t), l)).collect();
                        tokens.push(TokenOut { text: model.token_text(id), logprob: lp.logprob, top });
                    }
                    let model = self.state.text.as_ref();
                    let stopped = !self.stop_ids.contains(&id)
                        && if self.keep_special {
                            self.text.push(&WithSpecials(model), id)
                        } else {
                            self.text.push(model, id)
                        };
                    let text = self.text.take_ready();
                    if stopped {
                        self.state.engine.abort(self.id);
                        return Some(self.finish("stop", text, tokens));
                    }
                    if !text.is_empty() || !tokens.is_empty() {
                        return Some(Piece::Data { index: self.index, text, tokens, finish: None });
                    }
                }
                Event::Finished { reason, usage } => {
                    self.generated = usage.completion_tokens.max(self.generated);
                    let model = self.state.text.as_ref();
                    let text = if self.keep_special {
                        self.text.finish(&WithSpecials(model))
                    } else {
                        self.text.finish(model)
                    };
                    // A stop string completed by the last, forced decode ends as a stop too.
                    let reason = match reason {
                        _ if self.text.stopped() => "stop",
                        FinishReason::Stop => "stop",
                        FinishReason::Length => "length",
                        FinishReason::Abort => "abort",
                    };
                    return Some(self.finish(reason, text, tokens));
                }
                Event::Failed(why) => {
                    self.end();
                    self.state.metrics.failed();
                    return Some(Piece::Failed(why));
                }
            }
        }
        None
    }

    fn finish(&mut self, reason: &'static str, text: String, tokens: Vec<TokenOut>) -> Piece {
        self.end();
        self.state.metrics.finished(reason);
        let finish =
            Some(Finish { reason, completion_tokens: self.generated, token_ids: std::mem::take(&mut self.ids) });
        Piece::Data { index: self.index, text, tokens, finish }
    }

    fn end(&mut self) {
        self.done = true;
        self.state.untrack(self.id);
    }

    /// The choice as a stream of pieces.
    pub fn into_stream(self) -> impl Stream<Item = Piece> + Send {
        futures_util::stream::unfold(self, |mut c| async move { c.next_piece().await.map(|p| (p, c)) })
    }
}

impl Drop for Choice {
    fn drop(&mut self) {
        if !self.done {
            self.state.engine.abort(self.id);
            self.state.untrack(self.id);
            self.state.metrics.finished("abort");
        }
    }
}
