//! Errors: [`CliError`] for starting the server, [`ApiError`] for one HTTP request (OpenAI's
//! error JSON `{"error": {"message", "type", "param", "code"}}` with its status).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tp_engine::api::SubmitError;

/// Why `tp` could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// A flag's value is out of range.
    #[error("{0}")]
    Args(String),
    /// The model folder's tokenizer or chat template could not be read.
    #[error("{0}")]
    Model(String),
    /// The engine did not start.
    #[error("the engine did not start: {0}")]
    Engine(String),
    /// Listening or serving failed.
    #[error("{0}")]
    Io(String),
    /// The running engine failed (a rank died or hung) or did not stop in time.
    #[error("{0}")]
    Stopped(String),
}

/// One request's failure, as OpenAI reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What went wrong, one line.
    pub message: String,
    /// OpenAI's `type`.
    pub kind: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// OpenAI's `code`, if any.
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400 for field `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.into()),
            code: None,
        }
    }

    /// 400 not tied to a field (malformed JSON, a body that is not an object).
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// 404 for a model that is not served.
    pub fn unknown_model(model: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist."),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    /// 401 for a missing or wrong bearer key.
    pub fn unauthorized() -> ApiError {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "Incorrect or missing API key: send `Authorization: Bearer KEY`.".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    /// 413 for a body over `limit` bytes.
    pub fn too_large(limit: usize) -> ApiError {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("the request body is larger than the limit of {limit} bytes"),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_too_large"),
        }
    }

    /// 404 for a path the server does not have.
    pub fn no_route(path: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("no endpoint {path}"),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// 500 for a request the engine failed.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// OpenAI's error object.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> ApiError {
        match e {
            SubmitError::Invalid { param, message } => ApiError::invalid(param, message),
            SubmitError::TooLong(m) => ApiError { code: Some("context_length_exceeded"), ..ApiError::bad_request(m) },
            SubmitError::QueueFull(_) => ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                message: e.to_string(),
                kind: "rate_limit_error",
                param: None,
                code: Some("queue_full"),
            },
            SubmitError::Stopped(_) => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message: e.to_string(),
                kind: "server_error",
                param: None,
                code: Some("engine_stopped"),
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = json_response(self.status, &self.body());
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert("www-authenticate", axum::http::HeaderValue::from_static("Bearer"));
        }
        r
    }
}

/// A JSON body with its status and content type.
pub fn json_response(status: StatusCode, body: &serde_json::Value) -> Response {
    (status, [(axum::http::header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}
