//! The error type of `tp-gguf`: one variant per way a GGUF file can be wrong, each naming the file,
//! the field and (where the field has one place) its byte offset from the start of the file.
//!
//! Text that came from the file (keys, tensor names) is cut to a bounded length before it is
//! stored ([`crate::text`]) and printed with `{:?}`, which escapes control characters, so a
//! hostile file makes a one-line message of a few hundred bytes.

/// Everything opening or reading a GGUF file can fail with.
///
/// `path` is the file's path as escaped text; `offset` is a byte offset from the start of the file;
/// `what` names the field in words (`the length of the value of key "general.name"`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
#[allow(missing_docs)] // variant fields: each variant's documentation and message name them
pub enum GgufError {
    /// The file could not be opened, inspected or mapped.
    #[error("{path}: cannot {action}: {source}")]
    Io {
        path: String,
        action: &'static str,
        #[source]
        source: std::io::Error,
    },

    /// The path names a directory, a pipe, a device or a socket (after following symlinks).
    #[error("{path}: is {kind}, not a regular file")]
    NotRegularFile { path: String, kind: &'static str },

    /// The file is larger than [`crate::GgufFile::MAX_FILE_BYTES`] (or than this machine can map).
    #[error("{path}: is {bytes} bytes, more than the {max} bytes a GGUF file may have here")]
    FileTooLarge { path: String, bytes: u64, max: u64 },

    /// The first four bytes are not `GGUF`.
    #[error("{path}: not a GGUF file: the magic at byte 0 is {found} (expected \"GGUF\")")]
    BadMagic { path: String, found: String },

    /// The version field reads as a byte-swapped small number: a big-endian GGUF file.
    #[error(
        "{path}: the version field at byte 4 reads {raw:#010x}: a big-endian GGUF file (version {}), \
         which this reader does not support",
        raw.swap_bytes()
    )]
    BigEndian { path: String, raw: u32 },

    /// A version other than 2 or 3 (version 1 used 32-bit counts and lengths).
    #[error("{path}: GGUF version {version} (the version field at byte 4) is not supported: only versions 2 and 3 are")]
    UnsupportedVersion { path: String, version: u32 },

    /// The file ends inside a fixed-size field.
    #[error("{path}: the file ends inside {what} at byte {offset}: it needs {need} bytes, {have} remain")]
    Truncated { path: String, what: String, offset: u64, need: u64, have: u64 },

    /// A count or length (of metadata entries, tensors, array elements, string bytes) that the bytes
    /// left in the file cannot hold, checked before anything is allocated for it.
    #[error(
        "{path}: {what} at byte {offset} is {count}, but the {remaining} bytes left in the file hold at most {max}"
    )]
    CountTooLarge { path: String, what: String, offset: u64, count: u64, max: u64, remaining: u64 },

    /// A key, string value or tensor name that is not UTF-8.
    #[error("{path}: {what} at byte {offset} is not valid UTF-8 (from its byte {valid_up_to} on)")]
    InvalidUtf8 { path: String, what: String, offset: u64, valid_up_to: u64 },

    /// A bool stored as a byte other than 0 or 1.
    #[error("{path}: {what} at byte {offset} is a bool stored as {byte:#04x} (only 0 and 1 are valid)")]
    BadBool { path: String, what: String, offset: u64, byte: u8 },

    /// A value type number outside 0..=12.
    #[error("{path}: {what} at byte {offset} is value type {type_id}, which GGUF does not define (0..=12 are)")]
    UnknownValueType { path: String, what: String, offset: u64, type_id: u32 },

    /// Arrays nested deeper than [`crate::GgufFile::MAX_ARRAY_DEPTH`].
    #[error("{path}: {what} at byte {offset} nests arrays more than {max} deep")]
    ArrayTooDeep { path: String, what: String, offset: u64, max: usize },

    /// A metadata key of zero bytes.
    #[error("{path}: the key of metadata entry {index} at byte {offset} is empty")]
    EmptyKey { path: String, index: u64, offset: u64 },

    /// A metadata key that appears twice.
    #[error("{path}: metadata key {key:?} at byte {offset} appears twice (first at byte {first})")]
    DuplicateKey { path: String, key: String, offset: u64, first: u64 },

    /// `general.alignment` holds another type than u32.
    #[error("{path}: general.alignment at byte {offset} is {found}, but it must be a u32")]
    AlignmentType { path: String, found: String, offset: u64 },

    /// `general.alignment` is 0 or not a power of two.
    #[error("{path}: general.alignment at byte {offset} is {alignment}, not a power of two")]
    BadAlignment { path: String, alignment: u32, offset: u64 },

    /// Two tensors of one name.
    #[error("{path}: tensor name {name:?} at byte {offset} appears twice (first at byte {first})")]
    DuplicateTensor { path: String, name: String, offset: u64, first: u64 },

    /// More dimensions than [`crate::GgufFile::MAX_DIMS`].
    #[error("{path}: tensor {name:?}: its number of dimensions at byte {offset} is {n_dims}, more than {max}")]
    TooManyDims { path: String, name: String, offset: u64, n_dims: u32, max: usize },

    /// A dimension of 0.
    #[error("{path}: tensor {name:?}: dimension {index} at byte {offset} is 0")]
    ZeroDim { path: String, name: String, index: usize, offset: u64 },

    /// Dimensions whose element count, or byte size, does not fit in 64 bits (or in `usize`).
    #[error("{path}: tensor {name:?}: dimensions {dims:?} at byte {offset} make more {unit} than fit in {bits} bits")]
    SizeOverflow { path: String, name: String, dims: Vec<u64>, offset: u64, unit: &'static str, bits: u32 },

    /// A tensor type number that is not (or no longer) a ggml type.
    #[error("{path}: tensor {name:?}: type {type_id} at byte {offset} is not a ggml type this reader knows")]
    UnknownTensorType { path: String, name: String, offset: u64, type_id: u32 },

    /// A row length (`dims[0]`) that is not a whole number of the type's blocks.
    #[error(
        "{path}: tensor {name:?} of type {type_name}: its row length (dimension 0, at byte {offset}) is {row}, \
         not a multiple of the type's block of {block} elements"
    )]
    RowNotBlocks { path: String, name: String, type_name: &'static str, offset: u64, row: u64, block: usize },

    /// A data offset that is not a multiple of the file's alignment.
    #[error(
        "{path}: tensor {name:?}: its data offset {data_offset} (the field at byte {offset}) is not a multiple \
         of the alignment {alignment}"
    )]
    MisalignedTensor { path: String, name: String, offset: u64, data_offset: u64, alignment: usize },

    /// A tensor whose bytes would run past the end of the file.
    #[error(
        "{path}: tensor {name:?}: its {n_bytes} bytes from data offset {data_offset} (the field at byte {offset}) \
         run past the end of the file ({file_len} bytes; the data section starts at byte {data_start})"
    )]
    TensorPastEnd {
        path: String,
        name: String,
        offset: u64,
        data_offset: u64,
        n_bytes: u64,
        data_start: u64,
        file_len: u64,
    },

    /// Two tensors whose bytes overlap.
    #[error(
        "{path}: tensors {first:?} (data offsets {first_start}..{first_end}) and {second:?} (from data offset \
         {second_start}) overlap"
    )]
    OverlappingTensors {
        path: String,
        first: String,
        first_start: u64,
        first_end: u64,
        second: String,
        second_start: u64,
    },

    /// A typed getter found the key holding another type.
    #[error("{path}: metadata key {key:?} is {found}, expected {expected}")]
    WrongType { path: String, key: String, found: String, expected: &'static str },

    /// A typed getter found an integer that does not fit the type asked for.
    #[error("{path}: metadata key {key:?} is {value} ({found}), which does not fit in {expected}")]
    OutOfRange { path: String, key: String, value: String, found: String, expected: &'static str },
}

/// Result alias of `tp-gguf`.
pub type Result<T> = std::result::Result<T, GgufError>;
