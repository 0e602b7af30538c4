//! `POST /v1/completions`: one or more prompts (text or ids), `n` choices each, as one JSON
//! response or as server-sent events; logprobs in the legacy form (`tokens`, `token_logprobs`,
//! `top_logprobs`, `text_offset`).

use super::sse::{self, Format};
use super::{AppState, usage};
use crate::error::{ApiError, json_response};
use crate::request::{GenParams, Prompt, parse_completion};
use crate::run::{Choice, ChoiceSpec, Finish, TokenOut};
use crate::structured::GrammarConstraint;
use crate::tools::stream::OutputRules;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use std::sync::Arc;
use std::time::Instant;
use tp_engine::api::{PromptLogprob, TokenConstraint};

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
    let (g, prompts) = parse_completion(&body)?;
    // vLLM's `return_token_ids`: the prompt's and the answer's ids in each choice.
    let return_token_ids = match body.get("return_token_ids") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::invalid("return_token_ids", "`return_token_ids` must be true or false")),
    };
    if return_token_ids && g.stream {
        return Err(ApiError::invalid("return_token_ids", "`return_token_ids` is answered without `stream`"));
    }
    st.check_model(g.model.as_deref())?;
    // Each prompt's ids and its text (what `echo` returns: the string given, or the ids decoded).
    let (prompts, texts): (Vec<Vec<i64>>, Vec<String>) = prompts
        .into_iter()
        .enumerate()
        .map(|(i, p)| match p {
            Prompt::Ids(ids) => {
                let text = st.text.decode(&ids);
                Ok((ids, text))
            }
            Prompt::Text(t) => st.text.encode(&t, true).map_err(ApiError::internal).and_then(|ids| {
                if ids.is_empty() {
                    Err(ApiError::invalid("prompt", format!("prompt {i} has no tokens")))
                } else {
                    Ok((ids, t))
                }
            }),
        })
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .unzip();
    let prompt_tokens = prompts.iter().map(Vec::len).sum();
    let choices = start_choices(&st, &g, &prompts, arrived, None)?;
    let count = choices.len();
    let merged = sse::merge(choices);
    let id = st.response_id("cmpl");
    let per_choice = |i: usize| i / g.n;
    let mut fmt = Completions {
        id,
        created: super::now(),
        model: st.response_model(g.model.as_deref()),
        include_usage: g.include_usage,
        prompt_tokens,
        completion_tokens: 0,
        offsets: vec![0; count],
        echo: g.echo,
        logprobs: g.sampling.logprobs,
        prompt_logprobs: g.prompt_logprobs,
        prompts: (0..count).map(|i| (prompts[per_choice(i)].clone(), texts[per_choice(i)].clone())).collect(),
        state: st.clone(),
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
            let lps = c.prompt_logprobs.unwrap_or_default();
            let mut text = c.text;
            let mut logprobs = g.sampling.logprobs.map(|_| {
                json!({"tokens": [], "token_logprobs": [],
                "top_logprobs": [], "text_offset": []})
            });
            if g.echo {
                text = format!("{}{text}", fmt.prompts[i].1);
                if let Some(l) = &mut logprobs {
                    append_legacy(l, fmt.prompt_legacy(i, &lps));
                }
            }
            if let Some(l) = &mut logprobs {
                append_legacy(l, fmt.logprobs(i, &c.tokens));
            }
            let mut choice = json!({"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish.reason});
            if g.prompt_logprobs.is_some() {
                choice["prompt_logprobs"] = fmt.prompt_dicts(i, &lps);
            }
            if return_token_ids {
                choice["prompt_token_ids"] = json!(fmt.prompts[i].0);
                choice["token_ids"] = json!(finish.token_ids);
            }
            choice
        })
        .collect();
    let body = json!({"id": fmt.id, "object": "text_completion", "created": fmt.created, "model": fmt.model,
        "choices": choices, "usage": usage(prompt_tokens, completion_tokens)});
    Ok(json_response(StatusCode::OK, &body))
}

/// Starts `g.n` choices per prompt (choice `p * n + i`; with a seed, choice `i` uses `seed + i`).
/// Without `max_tokens`, a choice may run to the model's length limit. A constraint applies
/// after the reasoning, and the text keeps special tokens where a chat's output `rules` say so
/// (`None`: a completion's plain text).
pub fn start_choices(
    st: &Arc<AppState>,
    g: &GenParams,
    prompts: &[Vec<i64>],
    arrived: Instant,
    rules: Option<&OutputRules>,
) -> Result<Vec<Choice>, ApiError> {
    let reasoning = rules.and_then(|r| r.reasoning);
    let keep_special = rules.is_some_and(OutputRules::keeps_special);
    let max_len = st.engine.limits().max_model_len;
    // Compiled once (off the async workers: a large schema takes a while); each choice drives
    // its own copy.
    let matcher = match &g.constraint {
        Some(c) => Some(tokio::task::block_in_place(|| st.grammars.compile(c, reasoning))?),
        None => None,
    };
    let adapter = st.check_model(g.model.as_deref())?;
    let mut choices = Vec::with_capacity(prompts.len() * g.n);
    for (p, prompt) in prompts.iter().enumerate() {
        for i in 0..g.n {
            let mut sampling = g.sampling.clone();
            sampling.seed = sampling.seed.map(|s| s.wrapping_add(i as u64));
            let spec = ChoiceSpec {
                index: p * g.n + i,
                prompt: prompt.clone(),
                sampling,
                max_tokens: g.max_tokens.unwrap_or_else(|| max_len.saturating_sub(prompt.len()).max(1)),
                stop: g.stop.clone(),
                stop_token_ids: g.stop_token_ids.clone(),
                ignore_eos: g.ignore_eos,
                keep_special,
                adapter,
                constraint: matcher.as_ref().map(|m| {
                    Box::new(GrammarConstraint::new(m.deep_clone(), st.metrics.clone())) as Box<dyn TokenConstraint>
                }),
            };
            choices.push(Choice::start(st, spec, arrived)?);
        }
    }
    Ok(choices)
}

/// The completions response's shape.
struct Completions {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    prompt_tokens: usize,
    completion_tokens: usize,
    /// Characters of each choice's text so far (for `text_offset`).
    offsets: Vec<usize>,
    echo: bool,
    /// `logprobs` (top alternatives per token), if asked for.
    logprobs: Option<usize>,
    /// `prompt_logprobs`, if asked for.
    prompt_logprobs: Option<usize>,
    /// Each choice's prompt ids and text.
    prompts: Vec<(Vec<i64>, String)>,
    state: Arc<AppState>,
}

/// Appends the arrays of legacy logprobs `more` to `into`.
fn append_legacy(into: &mut Value, more: Value) {
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        if let (Some(a), Some(b)) = (into[key].as_array_mut(), more[key].as_array()) {
            a.extend(b.iter().cloned());
        }
    }
}

impl Completions {
    /// Legacy logprobs of choice `index`'s prompt tokens (`null` for the first), as `echo`
    /// returns them before the answer's.
    fn prompt_legacy(&mut self, index: usize, lps: &[Option<PromptLogprob>]) -> Value {
        let model = &self.state.text;
        let ids = self.prompts.get(index).map(|p| p.0.clone()).unwrap_or_default();
        let mut offset = self.offsets.get(index).copied().unwrap_or(0);
        let (mut tokens, mut lp, mut top, mut offsets) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (p, &id) in ids.iter().enumerate() {
            let text = model.token_text(id);
            offsets.push(offset);
            offset += text.chars().count();
            tokens.push(text);
            match lps.get(p).and_then(Option::as_ref) {
                Some(l) => {
                    lp.push(json!(l.logprob));
                    top.push(Value::Object(l.top.iter().map(|&(t, v)| (model.token_text(t), json!(v))).collect()));
                }
                None => {
                    lp.push(Value::Null);
                    top.push(Value::Null);
                }
            }
        }
        if let Some(o) = self.offsets.get_mut(index) {
            *o = offset;
        }
        json!({"tokens": tokens, "token_logprobs": lp, "top_logprobs": top, "text_offset": offsets})
    }

    /// vLLM's `prompt_logprobs` of choice `index`: `null`, then per prompt token a map from ids
    /// (the token's own and the top alternatives) to `{logprob, rank, decoded_token}`.
    fn prompt_dicts(&self, index: usize, lps: &[Option<PromptLogprob>]) -> Value {
        let model = &self.state.text;
        let ids = self.prompts.get(index).map(|p| p.0.as_slice()).unwrap_or(&[]);
        let list: Vec<Value> = ids
            .iter()
            .enumerate()
            .map(|(p, &id)| match lps.get(p).and_then(Option::as_ref) {
                None => Value::Null,
                Some(l) => {
                    let mut m = Map::new();
                    m.insert(
                        id.to_string(),
                        json!({"logprob": l.logprob, "rank": l.rank, "decoded_token": model.token_text(id)}),
                    );
                    for (r, &(t, v)) in l.top.iter().enumerate() {
                        m.entry(t.to_string()).or_insert_with(
                            || json!({"logprob": v, "rank": r + 1, "decoded_token": model.token_text(t)}),
                        );
                    }
                    Value::Object(m)
                }
            })
            .collect();
        Value::Array(list)
    }

    /// Legacy logprobs of `tokens`, the next of choice `index`'s.
    fn logprobs(&mut self, index: usize, tokens: &[TokenOut]) -> Value {
        let mut offset = self.offsets.get(index).copied().unwrap_or(0);
        let mut text_offset = Vec::with_capacity(tokens.len());
        for t in tokens {
            text_offset.push(offset);
            offset += t.text.chars().count();
        }
        if let Some(o) = self.offsets.get_mut(index) {
            *o = offset;
        }
        let top: Vec<Value> = tokens
            .iter()
            .map(|t| Value::Object(t.top.iter().map(|(s, l)| (s.clone(), json!(l))).collect::<Map<_, _>>()))
            .collect();
        json!({
            "tokens": tokens.iter().map(|t| t.text.clone()).collect::<Vec<_>>(),
            "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
            "top_logprobs": top,
            "text_offset": text_offset,
        })
    }
}

impl Format for Completions {
    fn start(&mut self) -> Vec<Value> {
        Vec::new()
    }

    fn prompt(&mut self, index: usize, lps: Vec<Option<PromptLogprob>>) -> Vec<Value> {
        let text =
            if self.echo { self.prompts.get(index).map(|p| p.1.clone()).unwrap_or_default() } else { String::new() };
        let logprobs = if self.echo && self.logprobs.is_some() { self.prompt_legacy(index, &lps) } else { Value::Null };
        let mut choice = json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": null});
        if self.prompt_logprobs.is_some() {
            choice["prompt_logprobs"] = self.prompt_dicts(index, &lps);
        }
        vec![json!({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
            "choices": [choice]})]
    }

    fn piece(&mut self, index: usize, text: String, tokens: Vec<TokenOut>, finish: Option<Finish>) -> Vec<Value> {
        let logprobs = if tokens.is_empty() { Value::Null } else { self.logprobs(index, &tokens) };
        let reason = finish.as_ref().map(|f| f.reason);
        if let Some(f) = &finish {
            self.completion_tokens += f.completion_tokens;
        }
        vec![json!({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}]})]
    }

    fn end(&mut self) -> Vec<Value> {
        if !self.include_usage {
            return Vec::new();
        }
        vec![json!({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
            "choices": [], "usage": usage(self.prompt_tokens, self.completion_tokens)})]
    }
}
