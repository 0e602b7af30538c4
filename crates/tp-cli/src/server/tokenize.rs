//! `POST /tokenize` and `POST /detokenize`, as vLLM answers them: a prompt (or chat messages,
//! rendered with the model's template) to its ids, and ids back to text.

use super::AppState;
use crate::error::{ApiError, json_response};
use crate::request::{parse_messages, template_kwargs};
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use std::sync::Arc;

/// Most ids `/detokenize` takes.
const MAX_DETOKENIZE: usize = 1 << 20;

/// The body of an authorised request: a JSON object naming the served model or none.
async fn request_object(st: &AppState, headers: &HeaderMap, body: Body) -> Result<Map<String, Value>, ApiError> {
    st.authorize(headers)?;
    let Value::Object(o) = st.read_json(headers, body).await? else {
        return Err(ApiError::bad_request("the request body must be a JSON object"));
    };
    st.check_model(o.get("model").and_then(Value::as_str))?;
    Ok(o)
}

/// `POST /tokenize`: `{"prompt", "add_special_tokens" (default true)}` or `{"messages",
/// "tools", "chat_template_kwargs", "add_generation_prompt" (default true),
/// "add_special_tokens" (default false)}` to
/// `{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs`, the vocabulary entries as
/// transformers' `convert_ids_to_tokens` gives them, with `"return_token_strs": true`, else null).
pub async fn tokenize(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let run = async {
        let o = request_object(&st, &headers, body).await?;
        let flag = |name: &str, default: bool| match o.get(name) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(ApiError::invalid(name, format!("`{name}` must be true or false"))),
        };
        let tokens = match (o.get("prompt").filter(|v| !v.is_null()), o.get("messages").filter(|v| !v.is_null())) {
            (Some(_), Some(_)) => return Err(ApiError::invalid("messages", "give `prompt` or `messages`, not both")),
            (Some(p), None) => {
                let p = p.as_str().ok_or_else(|| ApiError::invalid("prompt", "`prompt` must be a string"))?;
                st.text.encode(p, flag("add_special_tokens", true)?).map_err(ApiError::internal)?
            }
            (None, Some(m)) => {
                let messages = parse_messages(m)?;
                let tools = crate::tools::parse_request(&o)?;
                let kwargs = template_kwargs(&o)?;
                let template =
                    st.text.template().ok_or_else(|| ApiError::bad_request("the model has no chat template"))?;
                let text = template
                    .render_full(
                        &messages,
                        flag("add_generation_prompt", true)?,
                        tools.as_ref().map(|t| &t.raw),
                        &kwargs,
                    )
                    .map_err(|e| ApiError::invalid("messages", e))?;
                st.text.encode(&text, flag("add_special_tokens", false)?).map_err(ApiError::internal)?
            }
            (None, None) => return Err(ApiError::invalid("prompt", "`prompt` or `messages` is required")),
        };
        let strs = flag("return_token_strs", false)?
            .then(|| tokens.iter().map(|&t| st.text.token_piece(t)).collect::<Vec<_>>());
        Ok(json!({"count": tokens.len(), "max_model_len": st.engine.limits().max_model_len, "tokens": tokens,
            "token_strs": strs}))
    };
    match run.await {
        Ok(v) => json_response(StatusCode::OK, &v),
        Err(e) => e.into_response(),
    }
}

/// `POST /detokenize`: `{"tokens": [ids]}` to `{"prompt": text}` (special tokens kept, as vLLM
/// decodes them). Ids outside the vocabulary are a 400.
pub async fn detokenize(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let run = async {
        let o = request_object(&st, &headers, body).await?;
        let bad = || ApiError::invalid("tokens", "`tokens` must be a list of token ids");
        let list = o.get("tokens").and_then(Value::as_array).ok_or_else(bad)?;
        if list.len() > MAX_DETOKENIZE {
            return Err(ApiError::invalid("tokens", format!("at most {MAX_DETOKENIZE} tokens")));
        }
        let vocab = st.engine.limits().vocab_size;
        let ids = list
            .iter()
            .map(|v| {
                let id = v.as_i64().ok_or_else(bad)?;
                if usize::try_from(id).is_ok_and(|i| i < vocab) {
                    Ok(id)
                } else {
                    Err(ApiError::invalid("tokens", format!("token {id} is outside the vocabulary (0..{vocab})")))
                }
            })
            .collect::<Result<Vec<i64>, _>>()?;
        Ok(json!({"prompt": st.text.decode_with_specials(&ids)}))
    };
    match run.await {
        Ok(v) => json_response(StatusCode::OK, &v),
        Err(e) => e.into_response(),
    }
}
