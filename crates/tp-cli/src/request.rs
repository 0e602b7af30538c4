//! Reading OpenAI request bodies: every field's type and range is checked here, and a wrong one
//! is a 400 naming the field. Unknown fields are ignored, as vLLM does.

use crate::error::ApiError;
use crate::structured::Constraint;
use serde_json::{Map, Value};
use tp_engine::sampling::{MAX_TOP_LOGPROBS, SamplingParams};

/// Most choices per prompt (`n`).
pub const MAX_N: usize = 128;
/// Most prompts in one completions request.
pub const MAX_PROMPTS: usize = 256;
/// Most stop strings.
pub const MAX_STOPS: usize = 16;

/// What both endpoints share.
#[derive(Debug, Clone, PartialEq)]
pub struct GenParams {
    /// `model`, if given.
    pub model: Option<String>,
    /// `max_tokens` (chat: `max_completion_tokens` first), if given.
    pub max_tokens: Option<usize>,
    /// Choices per prompt.
    pub n: usize,
    /// Server-sent events.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Stop ids.
    pub stop_token_ids: Vec<i64>,
    /// Go on past end-of-sequence ids.
    pub ignore_eos: bool,
    /// Sampling (its `logprobs` is the number of top alternatives when logprobs are asked for).
    pub sampling: SamplingParams,
    /// A structured-output constraint (`response_format`, `structured_outputs`).
    pub constraint: Option<Constraint>,
    /// Completions' `echo`: the prompt comes back before the answer (with its logprobs when
    /// `logprobs` is set).
    pub echo: bool,
    /// vLLM's `prompt_logprobs`: the prompt tokens' logprobs with this many alternatives.
    pub prompt_logprobs: Option<usize>,
}

/// A completions prompt.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Text, tokenized with the model's special tokens.
    Text(String),
    /// Token ids as given.
    Ids(Vec<i64>),
}

/// The body's fields.
struct Fields<'a>(&'a Map<String, Value>);

fn wrong(name: &str, what: &str) -> ApiError {
    ApiError::invalid(name, format!("`{name}` must be {what}"))
}

impl<'a> Fields<'a> {
    fn of(body: &'a Value) -> Result<Fields<'a>, ApiError> {
        body.as_object().map(Fields).ok_or_else(|| ApiError::bad_request("the request body must be a JSON object"))
    }
    /// The field, `None` when absent or null.
    fn get(&self, name: &str) -> Option<&'a Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }
    fn f32(&self, name: &str) -> Result<Option<f32>, ApiError> {
        self.get(name).map(|v| v.as_f64().map(|x| x as f32).ok_or_else(|| wrong(name, "a number"))).transpose()
    }
    fn int(&self, name: &str) -> Result<Option<i64>, ApiError> {
        self.get(name).map(|v| v.as_i64().ok_or_else(|| wrong(name, "an integer"))).transpose()
    }
    fn count(&self, name: &str) -> Result<Option<usize>, ApiError> {
        match self.int(name)? {
            Some(v) => usize::try_from(v)
                .map(Some)
                .map_err(|_| ApiError::invalid(name, format!("`{name}` must be at least 0, got {v}"))),
            None => Ok(None),
        }
    }
    fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        self.get(name).map(|v| v.as_bool().ok_or_else(|| wrong(name, "true or false"))).transpose()
    }
    fn string(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        self.get(name).map(|v| v.as_str().ok_or_else(|| wrong(name, "a string"))).transpose()
    }
}

/// The fields both endpoints read (`top_logprobs` is the chat form; completions pass `None`).
fn common(f: &Fields<'_>, max_tokens: Option<usize>, logprobs: Option<usize>) -> Result<GenParams, ApiError> {
    let mut s = SamplingParams::default();
    if let Some(t) = f.f32("temperature")? {
        s.temperature = t;
    }
    if let Some(p) = f.f32("top_p")? {
        s.top_p = p;
    }
    s.top_k = match f.int("top_k")? {
        None | Some(-1) => None,
        Some(k) => Some(
            usize::try_from(k)
                .map_err(|_| ApiError::invalid("top_k", format!("`top_k` must be -1 (all) or at least 1, got {k}")))?,
        ),
    };
    if let Some(p) = f.f32("min_p")? {
        s.min_p = p;
    }
    if let Some(p) = f.f32("repetition_penalty")? {
        s.repetition_penalty = p;
    }
    if let Some(p) = f.f32("presence_penalty")? {
        s.presence_penalty = p;
    }
    if let Some(p) = f.f32("frequency_penalty")? {
        s.frequency_penalty = p;
    }
    s.seed = f.int("seed")?.map(|x| x as u64);
    s.logprobs = logprobs;
    s.min_tokens = f.count("min_tokens")?.unwrap_or(0);
    if let Some(m) = max_tokens
        && s.min_tokens > m
    {
        return Err(ApiError::invalid(
            "min_tokens",
            format!("`min_tokens` ({}) exceeds `max_tokens` ({m})", s.min_tokens),
        ));
    }
    s.logit_bias = logit_bias(f)?;
    if let Err((param, message)) = s.validate() {
        return Err(ApiError::invalid(param, message));
    }
    let n = f.count("n")?.unwrap_or(1);
    if !(1..=MAX_N).contains(&n) {
        return Err(ApiError::invalid("n", format!("`n` must be 1 to {MAX_N}, got {n}")));
    }
    let echo = f.bool("echo")?.unwrap_or(false);
    if max_tokens == Some(0) && !echo {
        return Err(ApiError::invalid("max_tokens", "`max_tokens` must be at least 1 (0 only with `echo`)"));
    }
    let prompt_logprobs = f.count("prompt_logprobs")?;
    if prompt_logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
        return Err(ApiError::invalid("prompt_logprobs", format!("`prompt_logprobs` must be 0 to {MAX_TOP_LOGPROBS}")));
    }
    // The engine scores the prompt for `prompt_logprobs`, and for `echo` (its logprobs come
    // back with the answer's; a `max_tokens: 0` request is a scoring request).
    s.prompt_logprobs = match (prompt_logprobs, echo) {
        (p, false) => p,
        (p, true) => Some(p.unwrap_or(0).max(logprobs.unwrap_or(0))),
    };
    let stop = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().map(str::to_string).ok_or_else(|| wrong("stop", "a string or a list of strings")))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(wrong("stop", "a string or a list of strings")),
    };
    if stop.len() > MAX_STOPS {
        return Err(ApiError::invalid("stop", format!("at most {MAX_STOPS} stop strings, got {}", stop.len())));
    }
    let stop_token_ids = match f.get("stop_token_ids") {
        None => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_i64().ok_or_else(|| wrong("stop_token_ids", "a list of integers")))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(wrong("stop_token_ids", "a list of integers")),
    };
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(o) => Fields::of(o)
            .map_err(|_| wrong("stream_options", "an object"))?
            .bool("include_usage")
            .map_err(|_| wrong("stream_options.include_usage", "true or false"))?
            .unwrap_or(false),
    };
    let stream = f.bool("stream")?.unwrap_or(false);
    if f.get("stream_options").is_some() && !stream {
        return Err(ApiError::invalid("stream_options", "`stream_options` needs `stream: true`"));
    }
    Ok(GenParams {
        model: f.string("model")?.map(str::to_string),
        max_tokens,
        n,
        stream,
        include_usage,
        stop,
        stop_token_ids,
        ignore_eos: f.bool("ignore_eos")?.unwrap_or(false),
        sampling: s,
        constraint: crate::structured::parse(f.0)?,
        echo,
        prompt_logprobs,
    })
}

/// OpenAI's `logit_bias`: an object from token ids (as strings) to biases in `[-100, 100]`,
/// sorted by id. Ids beyond the vocabulary are refused by the engine, naming the field.
fn logit_bias(f: &Fields<'_>) -> Result<Vec<(i64, f32)>, ApiError> {
    let Some(v) = f.get("logit_bias") else { return Ok(Vec::new()) };
    let o = v.as_object().ok_or_else(|| wrong("logit_bias", "an object mapping token ids to biases"))?;
    let mut out = Vec::with_capacity(o.len());
    for (k, b) in o {
        let id = k
            .trim()
            .parse::<i64>()
            .ok()
            .filter(|&id| id >= 0)
            .ok_or_else(|| ApiError::invalid("logit_bias", format!("`logit_bias` key {k:?} is not a token id")))?;
        let bias = b.as_f64().filter(|b| (-100.0..=100.0).contains(b)).ok_or_else(|| {
            ApiError::invalid("logit_bias", format!("`logit_bias` of token {id} must be a number in [-100, 100]"))
        })?;
        out.push((id, bias as f32));
    }
    out.sort_by_key(|&(id, _)| id);
    if out.windows(2).any(|w| w[0].0 == w[1].0) {
        return Err(ApiError::invalid("logit_bias", "`logit_bias` names a token id twice"));
    }
    Ok(out)
}

/// Refuses OpenAI options this server does not implement, when set to anything but their default.
fn unsupported(f: &Fields<'_>, names: &[(&str, Value)]) -> Result<(), ApiError> {
    for (name, default) in names {
        if let Some(v) = f.get(name)
            && v != default
        {
            return Err(ApiError::invalid(*name, format!("`{name}` is not supported by this server")));
        }
    }
    Ok(())
}

/// A `POST /v1/completions` body: its parameters and prompts (a text, a list of texts, a list of
/// ids, or a list of lists of ids).
pub fn parse_completion(body: &Value) -> Result<(GenParams, Vec<Prompt>), ApiError> {
    let f = Fields::of(body)?;
    unsupported(&f, &[("suffix", Value::String(String::new())), ("best_of", 1.into())])?;
    let logprobs = f.count("logprobs")?;
    if logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
        return Err(ApiError::invalid("logprobs", format!("`logprobs` must be 0 to {MAX_TOP_LOGPROBS}")));
    }
    let max_tokens = f.count("max_tokens")?.or(Some(16));
    let params = common(&f, max_tokens, logprobs)?;
    let bad = || wrong("prompt", "a string, a list of strings, a list of token ids or a list of lists of ids");
    let ids = |a: &Vec<Value>| a.iter().map(|v| v.as_i64().ok_or_else(bad)).collect::<Result<Vec<i64>, _>>();
    let prompts = match f.get("prompt") {
        None => return Err(ApiError::invalid("prompt", "`prompt` is required")),
        Some(Value::String(s)) => vec![Prompt::Text(s.clone())],
        Some(Value::Array(a)) if a.is_empty() => return Err(ApiError::invalid("prompt", "`prompt` is an empty list")),
        Some(Value::Array(a)) => match &a[0] {
            Value::String(_) => a
                .iter()
                .map(|v| v.as_str().map(|s| Prompt::Text(s.into())).ok_or_else(bad))
                .collect::<Result<_, _>>()?,
            Value::Number(_) => vec![Prompt::Ids(ids(a)?)],
            Value::Array(_) => a
                .iter()
                .map(|v| v.as_array().ok_or_else(bad).and_then(ids).map(Prompt::Ids))
                .collect::<Result<_, _>>()?,
            _ => return Err(bad()),
        },
        Some(_) => return Err(bad()),
    };
    if prompts.len() > MAX_PROMPTS {
        return Err(ApiError::invalid("prompt", format!("at most {MAX_PROMPTS} prompts, got {}", prompts.len())));
    }
    if prompts.len() * params.n > MAX_N * 8 {
        return Err(ApiError::invalid("n", "too many choices: prompts times `n` is over 1024"));
    }
    Ok((params, prompts))
}

/// Roles a chat message may have.
const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// A `POST /v1/chat/completions` body: its parameters and its messages as the template takes
/// them (see [`parse_messages`]).
pub fn parse_chat(body: &Value) -> Result<(GenParams, Value), ApiError> {
    let f = Fields::of(body)?;
    let want_logprobs = f.bool("logprobs")?.unwrap_or(false);
    let top = f.count("top_logprobs")?;
    if top.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
        return Err(ApiError::invalid("top_logprobs", format!("`top_logprobs` must be 0 to {MAX_TOP_LOGPROBS}")));
    }
    if top.is_some_and(|n| n > 0) && !want_logprobs {
        return Err(ApiError::invalid("top_logprobs", "`top_logprobs` needs `logprobs: true`"));
    }
    let logprobs = want_logprobs.then(|| top.unwrap_or(0));
    let max_tokens = match f.count("max_completion_tokens")? {
        Some(m) => Some(m),
        None => f.count("max_tokens")?,
    };
    // vLLM's chat `echo` repeats the last message, and its chat `prompt_logprobs` sit at the
    // response's top level; tp implements neither (prompt logprobs: /v1/completions).
    unsupported(&f, &[("echo", Value::Bool(false)), ("prompt_logprobs", Value::Null)])?;
    let params = common(&f, max_tokens, logprobs)?;
    let messages = match f.get("messages") {
        None => return Err(ApiError::invalid("messages", "`messages` is required")),
        Some(m) => parse_messages(m)?,
    };
    Ok((params, messages))
}

/// A chat's `messages` as the template takes them: `{role, content}` with content a string
/// (lists of text parts joined by newlines), an assistant's `tool_calls` (arguments parsed into
/// objects) and `reasoning_content`, a tool message's `tool_call_id` (which must answer an
/// earlier call).
pub fn parse_messages(messages: &Value) -> Result<Value, ApiError> {
    let list = match messages {
        Value::Array(a) if !a.is_empty() => a,
        Value::Array(_) => return Err(ApiError::invalid("messages", "`messages` is empty")),
        _ => return Err(wrong("messages", "a list of messages")),
    };
    let mut out = Vec::with_capacity(list.len());
    // Ids of the assistant tool calls so far: a tool message must answer one of them.
    let mut call_ids: Vec<String> = Vec::new();
    for (i, m) in list.iter().enumerate() {
        let at = |what: &str| ApiError::invalid(format!("messages[{i}]"), format!("messages[{i}]: {what}"));
        let m = m.as_object().ok_or_else(|| at("must be an object"))?;
        let role = m.get("role").and_then(Value::as_str).ok_or_else(|| at("`role` must be a string"))?;
        if !ROLES.contains(&role) {
            return Err(at(&format!("unknown role `{role}` (expected one of {})", ROLES.join(", "))));
        }
        let content = match m.get("content") {
            None | Some(Value::Null) if role == "assistant" => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut texts = Vec::with_capacity(parts.len());
                for p in parts {
                    match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(t)) => texts.push(t),
                        _ => return Err(at("content parts must be {\"type\": \"text\", \"text\": ...}")),
                    }
                }
                texts.join("\n")
            }
            _ => return Err(at("`content` must be a string or a list of text parts")),
        };
        let mut msg = Map::new();
        msg.insert("role".into(), role.into());
        msg.insert("content".into(), content.into());
        if let Some(name) = m.get("name").and_then(Value::as_str) {
            msg.insert("name".into(), name.into());
        }
        if role == "assistant" {
            if let Some(r) = m.get("reasoning_content").and_then(Value::as_str) {
                msg.insert("reasoning_content".into(), r.into());
            }
            match m.get("tool_calls") {
                None | Some(Value::Null) => {}
                Some(Value::Array(calls)) => {
                    let calls = calls
                        .iter()
                        .enumerate()
                        .map(|(j, c)| template_call(c).map_err(|what| at(&format!("tool_calls[{j}]: {what}"))))
                        .collect::<Result<Vec<_>, _>>()?;
                    for c in &calls {
                        if let Some(id) = c.get("id").and_then(Value::as_str) {
                            call_ids.push(id.to_string());
                        }
                    }
                    msg.insert("tool_calls".into(), Value::Array(calls));
                }
                Some(_) => return Err(at("`tool_calls` must be a list")),
            }
        }
        if role == "tool" {
            let id = m
                .get("tool_call_id")
                .and_then(Value::as_str)
                .ok_or_else(|| at("a tool message needs `tool_call_id`"))?;
            if !call_ids.iter().any(|c| c == id) {
                return Err(at(&format!("`tool_call_id` {id:?} matches no earlier assistant tool call")));
            }
            msg.insert("tool_call_id".into(), id.into());
        }
        out.push(Value::Object(msg));
    }
    Ok(Value::Array(out))
}

/// An assistant's tool call as templates read it (as vLLM passes it): `{id, type, function:
/// {name, arguments}}` with `arguments` parsed from its JSON string into an object.
fn template_call(c: &Value) -> Result<Value, String> {
    let id = c.get("id").and_then(Value::as_str).ok_or("`id` must be a string")?;
    let f = c.get("function").and_then(Value::as_object).ok_or("`function` must be an object")?;
    let name = f.get("name").and_then(Value::as_str).ok_or("`function.name` must be a string")?;
    let arguments = match f.get("arguments") {
        Some(Value::String(s)) => {
            serde_json::from_str::<Value>(s).map_err(|e| format!("`function.arguments` is not JSON: {e}"))?
        }
        Some(o @ Value::Object(_)) => o.clone(),
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(_) => return Err("`function.arguments` must be a JSON string".into()),
    };
    Ok(serde_json::json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}))
}

/// `chat_template_kwargs`: extra variables for the chat template (e.g. `enable_thinking`).
pub fn template_kwargs(body: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    match body.get("chat_template_kwargs") {
        None | Some(Value::Null) => Ok(Map::new()),
        Some(Value::Object(o)) => Ok(o.clone()),
        Some(_) => Err(wrong("chat_template_kwargs", "an object")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn err_param(r: Result<impl std::fmt::Debug, ApiError>) -> String {
        r.unwrap_err().param.unwrap_or_default()
    }

    #[test]
    fn completion_prompts_in_every_form() {
        let p = |v: Value| parse_completion(&json!({"prompt": v})).map(|(_, p)| p);
        assert_eq!(p(json!("hi")).unwrap(), vec![Prompt::Text("hi".into())]);
        assert_eq!(p(json!(["a", "b"])).unwrap().len(), 2);
        assert_eq!(p(json!([1, 2])).unwrap(), vec![Prompt::Ids(vec![1, 2])]);
        assert_eq!(p(json!([[1], [2, 3]])).unwrap(), vec![Prompt::Ids(vec![1]), Prompt::Ids(vec![2, 3])]);
        for bad in [json!([]), json!(3), json!([1, "a"]), json!([{}]), json!(["a", 1])] {
            assert_eq!(err_param(p(bad.clone())), "prompt", "{bad}");
        }
        assert_eq!(err_param(parse_completion(&json!({}))), "prompt");
    }

    #[test]
    fn sampling_fields_are_read_and_checked() {
        let (g, _) = parse_completion(&json!({"prompt": "x", "temperature": 0.5, "top_p": 0.9, "top_k": 5,
            "min_p": 0.1, "seed": 3, "n": 2, "stop": "\n", "stop_token_ids": [7], "logprobs": 2, "max_tokens": 9,
            "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}}))
        .unwrap();
        assert_eq!((g.sampling.temperature, g.sampling.top_p, g.sampling.top_k), (0.5, 0.9, Some(5)));
        assert_eq!((g.sampling.seed, g.sampling.logprobs, g.n, g.max_tokens), (Some(3), Some(2), 2, Some(9)));
        assert_eq!((g.stop, g.stop_token_ids), (vec!["\n".to_string()], vec![7]));
        assert!(g.ignore_eos && g.stream && g.include_usage);
        let (d, _) = parse_completion(&json!({"prompt": "x", "top_k": -1, "temperature": null})).unwrap();
        assert_eq!((d.sampling.top_k, d.sampling.temperature, d.max_tokens), (None, 1.0, Some(16)));
        for (field, v) in [
            ("temperature", json!(-0.1)),
            ("temperature", json!("hot")),
            ("top_p", json!(0)),
            ("top_p", json!(1.5)),
            ("top_k", json!(0)),
            ("n", json!(0)),
            ("max_tokens", json!(-1)),
            ("max_tokens", json!(0)),
            ("stop", json!(5)),
            ("logprobs", json!(50)),
            ("presence_penalty", json!(3)),
            ("stream", json!("yes")),
            ("suffix", json!("x")),
            ("prompt_logprobs", json!(21)),
        ] {
            let mut body = json!({"prompt": "x"});
            body[field] = v;
            assert_eq!(err_param(parse_completion(&body)), field, "{body}");
        }
        assert!(parse_completion(&json!([1])).unwrap_err().message.contains("JSON object"));
    }

    #[test]
    fn chat_messages_are_normalised() {
        let (g, m) = parse_chat(&json!({"messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null}],
            "max_completion_tokens": 5, "max_tokens": 9, "logprobs": true, "top_logprobs": 3}))
        .unwrap();
        assert_eq!(
            m,
            json!([{"role": "system", "content": "s"}, {"role": "user", "content": "a\nb"},
            {"role": "assistant", "content": ""}])
        );
        assert_eq!((g.max_tokens, g.sampling.logprobs), (Some(5), Some(3)));
        let (g, _) = parse_chat(&json!({"messages": [{"role": "user", "content": "x"}]})).unwrap();
        assert_eq!((g.max_tokens, g.sampling.logprobs), (None, None));
    }

    #[test]
    fn bad_chat_bodies_name_the_field() {
        for (body, param) in [
            (json!({}), "messages"),
            (json!({"messages": []}), "messages"),
            (json!({"messages": "hi"}), "messages"),
            (json!({"messages": [{"role": "wizard", "content": "x"}]}), "messages[0]"),
            (json!({"messages": [{"role": "user", "content": 5}]}), "messages[0]"),
            (json!({"messages": [{"content": "x"}]}), "messages[0]"),
            (json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}), "top_logprobs"),
            (json!({"messages": [{"role": "user", "content": "x"}], "model": 3}), "model"),
        ] {
            assert_eq!(err_param(parse_chat(&body)), param, "{body}");
        }
        let e = parse_chat(&json!({"messages": [{"role": "wizard", "content": "x"}]})).unwrap_err();
        assert!(e.message.contains("unknown role `wizard`"), "{}", e.message);
    }
}
