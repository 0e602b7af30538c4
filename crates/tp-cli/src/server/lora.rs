//! vLLM's runtime LoRA endpoints (served with `--allow-runtime-lora-updating` or
//! `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`): `POST /v1/load_lora_adapter` with
//! `{"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter` with `{"lora_name"}`,
//! answering in plain text as vLLM does. A loaded adapter takes a fresh engine slot; one that
//! does not fit the model is refused with the running ones untouched. An unloaded adapter's
//! name is gone at once; the engine frees its slot when its last request ends.

use super::AppState;
use crate::error::ApiError;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// How long a load may take on the ranks.
const LOAD_DEADLINE: Duration = Duration::from_secs(300);

fn text(status: StatusCode, body: String) -> Response {
    (status, body).into_response()
}

/// A string field of the body, or 400 naming it.
fn field(body: &Value, name: &str) -> Result<String, ApiError> {
    match body.get(name) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        _ => Err(ApiError::invalid(name, format!("`{name}` must be a non-empty string"))),
    }
}

/// `POST /v1/load_lora_adapter`.
pub async fn load(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    match load_inner(st, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn load_inner(st: Arc<AppState>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    st.authorize(&headers)?;
    let body = st.read_json(&headers, body).await?;
    let (name, path) = (field(&body, "lora_name")?, field(&body, "lora_path")?);
    let serving = st.lora.read().map_err(|_| ApiError::internal("the adapter table is poisoned"))?.clone();
    if name == st.model_name || serving.find(&name).is_some() {
        return Err(ApiError::bad_request(format!("The lora adapter '{name}' has already been loaded.")));
    }
    if serving.modules.len() >= serving.max_cpu_loras {
        return Err(ApiError::bad_request(format!(
            "{} adapters are loaded, the most --max-cpu-loras allows; unload one first",
            serving.modules.len()
        )));
    }
    // Read and checked here first (files, names, ranks), so that the ranks rarely refuse it.
    let path_buf = std::path::PathBuf::from(&path);
    let checked = tokio::task::block_in_place(|| serving.read(&name, &path_buf, serving.num_layers));
    checked.map_err(ApiError::bad_request)?;
    let slot = st.next_lora_slot.fetch_add(1, Ordering::Relaxed);
    let rx = st.engine.load_adapter(slot, path_buf.clone());
    let outcome = tokio::task::spawn_blocking(move || rx.recv_timeout(LOAD_DEADLINE))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(|_| ApiError::internal("the engine did not answer the load in time"))?;
    outcome.map_err(|e| ApiError::bad_request(format!("LoRA adapter '{name}': {e}")))?;
    let mut table = st.lora.write().map_err(|_| ApiError::internal("the adapter table is poisoned"))?;
    if table.find(&name).is_some() {
        // Loaded twice at once: the later one is dropped again.
        let _ = st.engine.unload_adapter(slot);
        return Err(ApiError::bad_request(format!("The lora adapter '{name}' has already been loaded.")));
    }
    table.modules.push(crate::lora_serve::LoraModule {
        name: name.clone(),
        path: path_buf,
        base_model_name: None,
        slot,
    });
    Ok(text(StatusCode::OK, format!("Success: LoRA adapter '{name}' added successfully.")))
}

/// `POST /v1/unload_lora_adapter`.
pub async fn unload(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    match unload_inner(st, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn unload_inner(st: Arc<AppState>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    st.authorize(&headers)?;
    let body = st.read_json(&headers, body).await?;
    let name = field(&body, "lora_name")?;
    let removed = {
        let mut table = st.lora.write().map_err(|_| ApiError::internal("the adapter table is poisoned"))?;
        let at = table.modules.iter().position(|m| m.name == name);
        at.map(|i| table.modules.remove(i))
    };
    let Some(module) = removed else {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The lora adapter '{name}' cannot be found."),
            kind: "NotFoundError",
            param: Some("lora_name".into()),
            code: None,
        });
    };
    // The engine empties the slot once no running request uses it.
    let _ = st.engine.unload_adapter(module.slot);
    Ok(text(StatusCode::OK, format!("Success: LoRA adapter '{name}' removed successfully.")))
}
