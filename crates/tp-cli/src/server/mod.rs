//! The HTTP server: routes, the shared state, bearer keys, body limits, and the small endpoints
//! (`/health`, `/metrics`, `/v1/models`). The generating endpoints are in [`completions`] and
//! [`chat`], their server-sent events in [`sse`].

pub mod chat;
pub mod completions;
pub mod lora;
pub mod sse;
pub mod tokenize;

use crate::args::ServerArgs;
use crate::error::{ApiError, json_response};
use crate::metrics::Metrics;
use crate::reasoning::ReasoningParser;
use crate::structured::Grammars;
use crate::text::TextModel;
use crate::tools::ToolParser;
use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::StreamExt;
use serde_json::{Value, json};
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};
use tp_engine::api::{EngineHandle, RequestId};

/// What every handler shares.
pub struct AppState {
    /// The engine.
    pub engine: EngineHandle,
    /// Tokenizer and chat template.
    pub text: Arc<TextModel>,
    /// The server's metrics.
    pub metrics: Arc<Metrics>,
    /// The structured-output compiler for the model's tokenizer.
    pub grammars: Grammars,
    /// How the model writes tool calls (`--tool-call-parser`, else read from the template).
    pub tool_parser: Option<ToolParser>,
    /// The id of the parser's opening marker where it is one special token of the tokenizer
    /// (Mistral's `[TOOL_CALLS]`): forced calls write that token, as the model does.
    pub tool_marker: Option<u32>,
    /// `--reasoning-parser`.
    pub reasoning: Option<ReasoningParser>,
    /// The model's name in the API.
    pub model_name: String,
    /// The LoRA adapters served beside it (`--lora-modules`, and those loaded since).
    pub lora: std::sync::RwLock<crate::lora_serve::LoraServing>,
    /// The next LoRA slot a loaded adapter takes (slots are never reused).
    pub next_lora_slot: std::sync::atomic::AtomicU32,
    api_key: Option<String>,
    max_body: usize,
    /// Engine requests not finished yet (aborted when the shutdown deadline passes).
    inflight: Mutex<HashSet<RequestId>>,
    next_id: AtomicU64,
    /// When the server started (seconds since the epoch).
    pub created: u64,
}

impl AppState {
    /// The state of a server for `args` over `engine`.
    pub fn new(engine: EngineHandle, text: TextModel, args: &ServerArgs) -> AppState {
        let limits = engine.limits();
        let grammars = Grammars::new(&text.tokenizer_json(), limits.vocab_size, &limits.eos_token_ids);
        let tool_parser =
            args.tool_call_parser.or_else(|| text.template().and_then(|t| ToolParser::from_template(t.source())));
        let tool_marker = match tool_parser {
            Some(p @ ToolParser::Mistral) => match text.encode(p.marker(), false).as_deref() {
                Ok(&[id]) => u32::try_from(id).ok(),
                _ => None,
            },
            _ => None,
        };
        // A harmony template (gpt-oss) is read as vLLM reads gpt-oss: reasoning on the analysis
        // channel, the answer on the final one.
        let harmony = tool_parser == Some(ToolParser::Harmony)
            || text.template().is_some_and(|t| crate::tools::is_harmony_template(t.source()));
        let reasoning = args.reasoning_parser.or(harmony.then_some(ReasoningParser::GptOss));
        AppState {
            engine,
            text: Arc::new(text),
            metrics: Arc::new(Metrics::default()),
            grammars,
            tool_parser,
            tool_marker,
            // A harmony template (gpt-oss) is read as vLLM reads gpt-oss: reasoning on the
            // analysis channel, the answer on the final one.
            reasoning,
            model_name: args.served_model_name.clone(),
            lora: std::sync::RwLock::new(args.lora.clone()),
            next_lora_slot: std::sync::atomic::AtomicU32::new(args.lora.modules.len() as u32 + 1),
            api_key: args.api_key.clone(),
            max_body: args.max_request_bytes,
            inflight: Mutex::new(HashSet::new()),
            next_id: AtomicU64::new(0),
            created: now(),
        }
    }

    /// Remembers an engine request as in flight.
    pub fn track(&self, id: RequestId) {
        if let Ok(mut s) = self.inflight.lock() {
            s.insert(id);
        }
    }

    /// Forgets an engine request.
    pub fn untrack(&self, id: RequestId) {
        if let Ok(mut s) = self.inflight.lock() {
            s.remove(&id);
        }
    }

    /// Engine requests in flight.
    pub fn inflight(&self) -> Vec<RequestId> {
        self.inflight.lock().map(|s| s.iter().copied().collect()).unwrap_or_default()
    }

    /// A fresh response id with `prefix` (`cmpl`, `chatcmpl`).
    pub fn response_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        format!("{prefix}-{:08x}{n:08x}", nanos)
    }

    /// 401 unless `--api-key` is unset or the request carries `Authorization: Bearer KEY`.
    pub fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(key) = &self.api_key else { return Ok(()) };
        let given = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        // Compares every byte whatever the first difference (no timing hint of the key).
        let same =
            given.len() == key.len() && given.bytes().zip(key.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
        if same { Ok(()) } else { Err(ApiError::unauthorized()) }
    }

    /// The engine's adapter slot for a request's `model`: 0 for the served name (or none
    /// given), a LoRA adapter's slot for its name; 404 (OpenAI's `model_not_found`) otherwise.
    pub fn check_model(&self, model: Option<&str>) -> Result<u32, ApiError> {
        match model {
            None => Ok(0),
            Some(m) if m == self.model_name => Ok(0),
            Some(m) => {
                let lora = self.lora.read().map_err(|_| ApiError::internal("the adapter table is poisoned"))?;
                lora.find(m).map(|a| a.slot).ok_or_else(|| ApiError::unknown_model(m))
            }
        }
    }

    /// The name a response gives as its `model`: the adapter's or the base's, as asked.
    pub fn response_model(&self, model: Option<&str>) -> String {
        match model {
            Some(m) if self.lora.read().is_ok_and(|l| l.find(m).is_some()) => m.to_string(),
            _ => self.model_name.clone(),
        }
    }

    /// Reads a JSON body of at most `--max-request-bytes`: a larger declared length is refused
    /// before reading anything, a longer body as soon as the limit is passed (413).
    pub async fn read_json(&self, headers: &HeaderMap, body: Body) -> Result<Value, ApiError> {
        let declared = headers
            .get(axum::http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > self.max_body as u64) {
            return Err(ApiError::too_large(self.max_body));
        }
        let mut data = Vec::new();
        let mut chunks = body.into_data_stream();
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk.map_err(|e| ApiError::bad_request(format!("could not read the request body: {e}")))?;
            if data.len() + chunk.len() > self.max_body {
                return Err(ApiError::too_large(self.max_body));
            }
            data.extend_from_slice(&chunk);
        }
        serde_json::from_slice(&data).map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))
    }
}

/// Seconds since the epoch.
pub fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The server's routes over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    let runtime_lora = state.lora.read().is_ok_and(|l| l.runtime_updates);
    let router = Router::new();
    // vLLM serves these only when runtime updates are allowed.
    let router = if runtime_lora {
        router.route("/v1/load_lora_adapter", post(lora::load)).route("/v1/unload_lora_adapter", post(lora::unload))
    } else {
        router
    };
    router
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions::handle))
        .route("/v1/chat/completions", post(chat::handle))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .fallback(|uri: Uri| async move { ApiError::no_route(uri.path()).into_response() })
        .with_state(state)
}

/// 200 while the engine runs, 503 once it stopped.
async fn health(State(st): State<Arc<AppState>>) -> Response {
    match st.engine.stopped() {
        None => StatusCode::OK.into_response(),
        Some(why) => (StatusCode::SERVICE_UNAVAILABLE, why).into_response(),
    }
}

/// Prometheus text.
async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let text =
        st.metrics.render(&st.engine.stats(), &st.engine.routed_tokens(), &st.engine.stage_busy_secs(), &st.model_name);
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// The served model and each LoRA adapter (with its `parent`, as vLLM lists them).
async fn models(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = st.authorize(&headers) {
        return e.into_response();
    }
    let max_model_len = st.engine.limits().max_model_len;
    let mut data = vec![json!({
        "id": st.model_name, "object": "model", "created": st.created, "owned_by": "tp", "root": st.model_name,
        "parent": null, "max_model_len": max_model_len,
    })];
    let lora = match st.lora.read() {
        Ok(l) => l.modules.clone(),
        Err(_) => Vec::new(),
    };
    for a in &lora {
        data.push(json!({
            "id": a.name, "object": "model", "created": st.created, "owned_by": "tp",
            "root": a.path.display().to_string(),
            "parent": a.base_model_name.clone().unwrap_or_else(|| st.model_name.clone()),
            "max_model_len": max_model_len,
        }));
    }
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}

/// Usage JSON.
pub fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}
