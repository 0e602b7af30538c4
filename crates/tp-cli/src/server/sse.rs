//! Server-sent events and the gathering of choices: choices run side by side, their pieces are
//! formatted by a [`Format`] as `data: {json}` events, the stream ends in `data: [DONE]`.
//! Dropping the stream (the client went away) drops every choice, which aborts its request.

use crate::error::ApiError;
use crate::run::{Choice, Finish, Piece, TokenOut};
use axum::body::Body;
use axum::response::Response;
use futures_util::StreamExt;
use futures_util::stream::{BoxStream, SelectAll};
use serde_json::Value;
use std::convert::Infallible;
use tp_engine::api::PromptLogprob;

/// How an endpoint formats its events.
pub trait Format: Send + 'static {
    /// Events sent before any piece (chat: each choice's role).
    fn start(&mut self) -> Vec<Value>;
    /// The events of a choice's prompt logprobs (completions' `echo`; nothing by default).
    fn prompt(&mut self, _index: usize, _logprobs: Vec<Option<PromptLogprob>>) -> Vec<Value> {
        Vec::new()
    }
    /// The events of one piece.
    fn piece(&mut self, index: usize, text: String, tokens: Vec<TokenOut>, finish: Option<Finish>) -> Vec<Value>;
    /// Events after the last piece (the usage chunk, when asked for).
    fn end(&mut self) -> Vec<Value>;
}

/// All choices' pieces, as they come.
pub type Merged = SelectAll<BoxStream<'static, Piece>>;

/// The choices' pieces merged.
pub fn merge(choices: Vec<Choice>) -> Merged {
    futures_util::stream::select_all(choices.into_iter().map(|c| c.into_stream().boxed()))
}

fn event(v: &Value) -> String {
    format!("data: {v}\n\n")
}

/// A `text/event-stream` response of `merged` formatted by `fmt`.
pub fn stream(merged: Merged, mut fmt: impl Format) -> Response {
    let start: String = fmt.start().iter().map(event).collect();
    let state = (Some(merged), fmt, Some(start));
    let body = futures_util::stream::unfold(state, |(mut merged, mut fmt, mut pending)| async move {
        if let Some(p) = pending.take() {
            return Some((Ok::<_, Infallible>(p), (merged, fmt, None)));
        }
        let m = merged.as_mut()?;
        let out = match m.next().await {
            Some(Piece::Data { index, text, tokens, finish }) => {
                fmt.piece(index, text, tokens, finish).iter().map(event).collect()
            }
            Some(Piece::Prompt { index, logprobs }) => fmt.prompt(index, logprobs).iter().map(event).collect(),
            Some(Piece::Failed(why)) => {
                merged = None;
                format!("{}data: [DONE]\n\n", event(&ApiError::internal(why).body()))
            }
            None => {
                merged = None;
                let mut s: String = fmt.end().iter().map(event).collect();
                s.push_str("data: [DONE]\n\n");
                s
            }
        };
        Some((Ok(out), (merged, fmt, None)))
    });
    Response::builder()
        .header(axum::http::header::CONTENT_TYPE, "text/event-stream")
        .header(axum::http::header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| Response::new(Body::empty()))
}

/// One choice's whole output.
#[derive(Debug, Default)]
pub struct Collected {
    /// Its text.
    pub text: String,
    /// Its tokens (with logprobs asked for).
    pub tokens: Vec<TokenOut>,
    /// How it ended.
    pub finish: Option<Finish>,
    /// Its prompt's logprobs, when asked for.
    pub prompt_logprobs: Option<Vec<Option<PromptLogprob>>>,
}

/// Runs every choice to its end; the first failure is a 500.
pub async fn collect(mut merged: Merged, count: usize) -> Result<Vec<Collected>, ApiError> {
    let mut out: Vec<Collected> = (0..count).map(|_| Collected::default()).collect();
    while let Some(p) = merged.next().await {
        match p {
            Piece::Data { index, text, tokens, finish } => {
                let c = out.get_mut(index).ok_or_else(|| ApiError::internal("a choice index out of range"))?;
                c.text.push_str(&text);
                c.tokens.extend(tokens);
                if finish.is_some() {
                    c.finish = finish;
                }
            }
            Piece::Prompt { index, logprobs } => {
                let c = out.get_mut(index).ok_or_else(|| ApiError::internal("a choice index out of range"))?;
                c.prompt_logprobs = Some(logprobs);
            }
            Piece::Failed(why) => return Err(ApiError::internal(why)),
        }
    }
    Ok(out)
}
