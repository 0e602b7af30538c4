//! `POST /v1/chat/completions`: messages rendered with the model's chat template, `n` choices,
//! as one JSON response or as server-sent events (a role chunk per choice, content deltas, a
//! final chunk with the finish reason); logprobs in the chat form (`content: [{token, logprob,
//! bytes, top_logprobs}]`).

use super::completions::start_choices;
use super::sse::{self, Format};
use super::{AppState, usage};
use crate::error::{ApiError, json_response};
use crate::request::parse_chat;
use crate::run::{Finish, TokenOut};
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Instant;

/// The handler.
pub async fn handle(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    match run(st, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn run(st: Arc<AppState>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    st.authorize(&headers)?;
    let body = st.read_json(&headers, body).await?;
    let (g, messages) = parse_chat(&body)?;
    st.check_model(g.model.as_deref())?;
    let template = st.text.template().ok_or_else(|| {
        ApiError::bad_request("the model has no chat template (tokenizer_config.json or chat_template.jinja)")
    })?;
    let text = template.render(&messages).map_err(|e| ApiError::invalid("messages", e))?;
    let prompt = st.text.encode(&text, false).map_err(ApiError::internal)?;
    if prompt.is_empty() {
        return Err(ApiError::invalid("messages", "the rendered conversation has no tokens"));
    }
    let prompt_tokens = prompt.len();
    let choices = start_choices(&st, &g, std::slice::from_ref(&prompt), arrived)?;
    let count = choices.len();
    let merged = sse::merge(choices);
    let fmt = Chat {
        id: st.response_id("chatcmpl"),
        created: super::now(),
        model: st.model_name.clone(),
        include_usage: g.include_usage,
        count,
        prompt_tokens,
        completion_tokens: 0,
    };
    if g.stream {
        return Ok(sse::stream(merged, fmt));
    }
    let out = sse::collect(merged, count).await?;
    let mut completion_tokens = 0;
    let choices: Vec<Value> = out
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let finish = c.finish.unwrap_or(Finish { reason: "abort", completion_tokens: 0 });
            completion_tokens += finish.completion_tokens;
            let logprobs = g.sampling.logprobs.map(|_| logprobs(&c.tokens));
            json!({"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs,
                "finish_reason": finish.reason})
        })
        .collect();
    let body = json!({"id": fmt.id, "object": "chat.completion", "created": fmt.created, "model": fmt.model,
        "choices": choices, "usage": usage(prompt_tokens, completion_tokens)});
    Ok(json_response(StatusCode::OK, &body))
}

/// Chat logprobs of `tokens`.
fn logprobs(tokens: &[TokenOut]) -> Value {
    let entry = |text: &str, lp: f32| json!({"token": text, "logprob": lp, "bytes": text.as_bytes()});
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut e = entry(&t.text, t.logprob);
            e["top_logprobs"] = t.top.iter().map(|(s, l)| entry(s, *l)).collect();
            e
        })
        .collect();
    json!({ "content": content })
}

/// The chat response's shape.
struct Chat {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    count: usize,
    prompt_tokens: usize,
    completion_tokens: usize,
}

impl Chat {
    fn chunk(&self, choices: Value) -> Value {
        json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "choices": choices})
    }
}

impl Format for Chat {
    fn start(&mut self) -> Vec<Value> {
        (0..self.count)
            .map(|i| {
                self.chunk(json!([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null,
                    "finish_reason": null}]))
            })
            .collect()
    }

    fn piece(&mut self, index: usize, text: String, tokens: Vec<TokenOut>, finish: Option<Finish>) -> Vec<Value> {
        let mut out = Vec::new();
        if !text.is_empty() || !tokens.is_empty() {
            let lp = if tokens.is_empty() { Value::Null } else { logprobs(&tokens) };
            out.push(self.chunk(json!([{"index": index, "delta": {"content": text}, "logprobs": lp,
                "finish_reason": null}])));
        }
        if let Some(f) = finish {
            self.completion_tokens += f.completion_tokens;
            out.push(self.chunk(json!([{"index": index, "delta": {}, "logprobs": null, "finish_reason": f.reason}])));
        }
        out
    }

    fn end(&mut self) -> Vec<Value> {
        if !self.include_usage {
            return Vec::new();
        }
        let mut c = self.chunk(json!([]));
        c["usage"] = usage(self.prompt_tokens, self.completion_tokens);
        vec![c]
    }
}
