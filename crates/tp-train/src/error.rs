//! The error type of `tp-train`: every variant prints as one line that names what was wrong
//! (for the data reader: the file and the 1-based line number).
//!
//! Text that came from a data file (a value, a role, a tokenizer's message) is cut to a bounded
//! length and printed with `{:?}`-style escaping before it is stored, so a hostile file makes a
//! one-line message of a few hundred bytes.

/// Result alias used throughout `tp-train`.
pub type Result<T> = std::result::Result<T, TrainError>;

/// Everything that can go wrong in `tp-train`. No public function panics on user input.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
#[allow(missing_docs)] // variant fields: each variant's documentation and message name them
pub enum TrainError {
    /// The data file could not be inspected, opened or read.
    #[error("{file}: cannot {action}: {message}")]
    Io { file: String, action: &'static str, message: String },

    /// The data path names a directory, a FIFO, a socket or a device (after following symlinks).
    #[error("{file}: is {kind}, not a regular file")]
    NotRegularFile { file: String, kind: &'static str },

    /// The data file is larger than [`crate::data::MAX_DATA_FILE_BYTES`].
    #[error("{file}: is {bytes} bytes, more than the {max} bytes a data file may have")]
    FileTooLarge { file: String, bytes: u64, max: u64 },

    /// A line of the data file is not a valid row (malformed JSON, not an object, no form or two
    /// forms, an id outside the vocabulary, labels of another length, zero tokens...).
    #[error("{file}:{line}: {message}")]
    BadRow { file: String, line: u64, message: String },

    /// The data file holds no rows (it is empty, or all its lines are blank).
    #[error("{file}: no rows: the file is empty or all its lines are blank")]
    NoRows { file: String },

    /// A learning-rate schedule name other than `constant`, `linear` or `cosine`.
    #[error("unknown learning-rate schedule {name:?}: expected constant, linear or cosine")]
    UnknownSchedule { name: String },

    /// An argument or hyperparameter out of its valid range (a negative learning rate, a beta
    /// not in [0, 1), step 0, a sequence length of 0...).
    #[error("{name} = {value}: {why}")]
    InvalidArgument { name: &'static str, value: String, why: &'static str },

    /// The model, its layers or the collectives failed (the message is theirs).
    #[error("{0}")]
    Model(String),

    /// A step's loss or gradient norm is NaN or infinite: training stops before the update.
    #[error("step {step}: the {what} is {value} (not finite); stopping before the update, nothing saved")]
    NotFinite { step: u64, what: &'static str, value: f64 },

    /// A step whose rows hold no target token (every label -100, or rows of one token).
    #[error("step {step}: its {rows} rows hold no target token (every label is -100 or rows are one token long)")]
    NoTargets { step: u64, rows: usize },

    /// A checkpoint cannot be written or read.
    #[error("{path}: {why}")]
    Checkpoint { path: String, why: String },

    /// An optimizer step was given a gradient or state of another length than the parameter.
    #[error("AdamW step: {what} has {got} elements but the parameter has {expected}")]
    LengthMismatch { what: &'static str, expected: usize, got: usize },
}

impl From<tp_models::ModelError> for TrainError {
    fn from(e: tp_models::ModelError) -> Self {
        TrainError::Model(e.to_string())
    }
}
impl From<tp_layers::LayerError> for TrainError {
    fn from(e: tp_layers::LayerError) -> Self {
        TrainError::Model(e.to_string())
    }
}
impl From<tp_core::Error> for TrainError {
    fn from(e: tp_core::Error) -> Self {
        TrainError::Model(e.to_string())
    }
}
impl From<tp_comm::CommError> for TrainError {
    fn from(e: tp_comm::CommError) -> Self {
        TrainError::Model(e.to_string())
    }
}

/// `text` as one line of at most `max_chars` characters: control characters (newlines
/// included) escaped, and a longer text cut with `...` appended.
pub(crate) fn one_line(text: &str, max_chars: usize) -> String {
    let mut out = String::new();
    for (i, c) in text.chars().enumerate() {
        if i == max_chars {
            out.push_str("...");
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::one_line;

    #[test]
    fn one_line_escapes_and_cuts() {
        assert_eq!(one_line("a\nb\tc", 10), "a\\nb\\tc");
        assert_eq!(one_line("abcdef", 3), "abc...");
        assert_eq!(one_line("abc", 3), "abc");
    }
}
