//! A parsed tool call, what every output parser produces (a leaf: the parsers and harmony's
//! reader share it without depending on each other).

/// One parsed call: a name and its arguments as a JSON string (Python's `json.dumps`).
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    /// The function.
    pub name: String,
    /// Its arguments, a JSON object as text.
    pub arguments: String,
}
