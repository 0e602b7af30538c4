//! The error type of `tp-models`.

/// Everything loading or running a model can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
#[allow(missing_docs)] // variant fields: each variant's documentation and message name them
pub enum ModelError {
    /// `config.json` (or `generation_config.json`) is missing, unreadable or not JSON.
    #[error("{path}: {why}")]
    ConfigFile { path: String, why: String },

    /// A config field is missing, of the wrong type, or out of range.
    #[error("config.json: field {field:?} {why}")]
    ConfigField { field: String, why: String },

    /// The config names an architecture tp does not implement (`name` escaped and cut).
    #[error("config.json: architecture \"{name}\" is not supported (tp runs {supported})")]
    UnknownArchitecture { name: String, supported: String },

    /// A config field has a value tp does not implement (an activation, a rope scaling kind...).
    #[error("config.json: {field} = {value} is not supported: {why}")]
    Unsupported { field: String, value: String, why: String },

    /// A generation request that cannot be served (empty prompt, N = 0, too long, bad id).
    #[error("{0}")]
    Request(String),

    /// The tokenizer metadata of a GGUF file is inconsistent or of a kind tp does not build.
    #[error("GGUF tokenizer: {0}")]
    Vocabulary(String),

    /// Loading or running a layer failed (checkpoint tensors, shapes, caches, collectives).
    #[error(transparent)]
    Layer(#[from] tp_layers::LayerError),

    /// A tensor operation failed.
    #[error(transparent)]
    Tensor(#[from] tp_core::Error),

    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] tp_comm::CommError),
}

/// Result alias of `tp-models`.
pub type Result<T> = std::result::Result<T, ModelError>;
