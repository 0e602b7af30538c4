//! `POST /v1/chat/completions`: messages rendered with the chat template (with the request's
//! `tools` and `chat_template_kwargs`), `n` choices, as one JSON response or as server-sent
//! events (a role chunk per choice, deltas, a final chunk with the finish reason); logprobs in
//! the chat form (`content: [{token, logprob, bytes, top_logprobs}]`). Each choice's output is
//! split into `reasoning_content` (`--reasoning-parser`), `content` and `tool_calls`.

use super::completions::start_choices;
use super::sse::{self, Format};
use super::{AppState, usage};
use crate::error::{ApiError, json_response};
use crate::request::{parse_chat, template_kwargs};
use crate::run::{Finish, TokenOut};
use crate::structured::Constraint;
use crate::tools::forced::{self, CallSyntax};
use crate::tools::stream::{ChoiceOutput, Delta, OutputRules, ToolMode};
use crate::tools::{self, ToolChoice, tool_calls_json};
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
    let (mut g, messages) = parse_chat(&body)?;
    st.check_model(g.model.as_deref())?;
    let obj = body.as_object().ok_or_else(|| ApiError::bad_request("the request body must be a JSON object"))?;
    let tools = tools::parse_request(obj)?;
    let kwargs = template_kwargs(obj)?;
    let template = st.text.template().ok_or_else(|| {
        ApiError::bad_request("the model has no chat template (tokenizer_config.json or chat_template.jinja)")
    })?;
    let text = template
        .render_full(&messages, true, tools.as_ref().map(|t| &t.raw), &kwargs)
        .map_err(|e| ApiError::invalid("messages", e))?;
    let prompt = st.text.encode(&text, false).map_err(ApiError::internal)?;
    if prompt.is_empty() {
        return Err(ApiError::invalid("messages", "the rendered conversation has no tokens"));
    }
    let mode = match &tools {
        None => ToolMode::Off,
        Some(t) => match &t.choice {
            ToolChoice::None => ToolMode::Off,
            ToolChoice::Auto => match st.tool_parser {
                Some(p) => ToolMode::Auto(p),
                None => {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        "`tool_choice` \"auto\" needs to know how the model writes tool calls: its chat template \
                         names no format; start tp serve with --tool-call-parser",
                    ));
                }
            },
            // In the model's own format where it is known, else vLLM's JSON form.
            forced => ToolMode::Forced(
                forced.clone(),
                st.tool_parser.map_or(CallSyntax::Vllm, crate::tools::ToolParser::forced_syntax),
            ),
        },
    };
    if let (ToolMode::Forced(_, syntax), Some(t)) = (&mode, &tools) {
        if g.constraint.is_some() {
            return Err(ApiError::invalid(
                "tool_choice",
                "a `tool_choice` that forces a call cannot be combined with `response_format` or `structured_outputs`",
            ));
        }
        let spec = forced::grammar(t, *syntax, st.tool_marker)
            .ok_or_else(|| ApiError::invalid("tool_choice", "no grammar for the choice"))?;
        g.constraint = Some(Constraint { spec, field: "tool_choice" });
    }
    let parallel_calls = tools.as_ref().is_none_or(|t| t.parallel);
    let rules = OutputRules { reasoning: st.reasoning, tools: mode, parallel_calls };
    let prompt_tokens = prompt.len();
    let choices = start_choices(&st, &g, std::slice::from_ref(&prompt), arrived, Some(&rules))?;
    let count = choices.len();
    let merged = sse::merge(choices);
    let fmt = Chat {
        id: st.response_id("chatcmpl"),
        created: super::now(),
        model: st.response_model(g.model.as_deref()),
        include_usage: g.include_usage,
        count,
        prompt_tokens,
        completion_tokens: 0,
        outputs: (0..count).map(|_| ChoiceOutput::new(rules.clone())).collect(),
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
            let finish = c.finish.unwrap_or(Finish { reason: "abort", completion_tokens: 0, token_ids: Vec::new() });
            completion_tokens += finish.completion_tokens;
            let logprobs = g.sampling.logprobs.map(|_| logprobs(&c.tokens));
            let split = rules.finish(&c.text);
            let mut message = json!({"role": "assistant", "content": split.content});
            if let Some(r) = split.reasoning {
                message["reasoning_content"] = r.into();
            }
            let mut reason = finish.reason;
            if !split.calls.is_empty() {
                message["tool_calls"] = tool_calls_json(&split.calls);
                if reason == "stop" {
                    reason = "tool_calls";
                }
            }
            json!({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason})
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
    /// Each choice's reasoning / content / tool-call split.
    outputs: Vec<ChoiceOutput>,
}

impl Chat {
    fn chunk(&self, choices: Value) -> Value {
        json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "choices": choices})
    }

    /// The chunk of one delta of choice `index`.
    fn delta(&self, index: usize, d: Delta, logprobs: Value) -> Value {
        let delta = match d {
            Delta::Reasoning(t) => json!({"reasoning_content": t}),
            Delta::Content(t) => json!({"content": t}),
            Delta::CallStart { index: k, id, name, arguments } => json!({"tool_calls": [{"index": k, "id": id,
                "type": "function", "function": {"name": name, "arguments": arguments}}]}),
            Delta::CallArgs { index: k, arguments } => json!({"tool_calls": [{"index": k,
                "function": {"arguments": arguments}}]}),
        };
        self.chunk(json!([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": null}]))
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
        let mut deltas = self.outputs.get_mut(index).map(|o| o.push(&text)).unwrap_or_default();
        let mut called = false;
        if finish.is_some()
            && let Some(o) = self.outputs.get_mut(index)
        {
            let (rest, c) = o.finish();
            deltas.extend(rest);
            called = c;
        }
        // The tokens' logprobs ride on the first chunk of the piece (alone when nothing is sent).
        let mut lp = if tokens.is_empty() { Value::Null } else { logprobs(&tokens) };
        if deltas.is_empty() && !lp.is_null() {
            deltas.push(Delta::Content(String::new()));
        }
        for d in deltas {
            out.push(self.delta(index, d, std::mem::take(&mut lp)));
        }
        if let Some(f) = finish {
            self.completion_tokens += f.completion_tokens;
            let reason = if called && f.reason == "stop" { "tool_calls" } else { f.reason };
            out.push(self.chunk(json!([{"index": index, "delta": {}, "logprobs": null, "finish_reason": reason}])));
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
