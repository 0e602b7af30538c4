//! A checked, memory-mapped reader of GGUF files, the model format of llama.cpp and ggml,
//! versions 2 and 3.
//!
//! ```no_run
//! let f = tp_gguf::GgufFile::open("model.gguf")?;
//! let arch = f.get_str("general.architecture")?.unwrap_or("?");
//! for t in f.tensors() {
//!     println!("{arch} {} {:?} {} {} bytes", t.name, t.dims, t.ggml_type, f.tensor_data(t).len());
//! }
//! # Ok::<(), tp_gguf::GgufError>(())
//! ```
//!
//! # The format
//!
//! Every number is little-endian; fields follow each other without padding unless said.
//!
//! | field | layout |
//! |---|---|
//! | magic | the bytes `GGUF` |
//! | version | u32: 2 or 3 |
//! | tensor count | u64 |
//! | metadata count | u64 |
//! | metadata | that many pairs: key (a string), value type (u32), value |
//! | tensor infos | that many: name (a string), n_dims (u32), n_dims dimensions (u64 each, `dims[0]` the fastest-varying), ggml type (u32), data offset (u64) |
//! | padding | zeros up to a multiple of the alignment |
//! | data | each tensor's bytes at its data offset from here, offsets multiples of the alignment |
//!
//! A string is a u64 byte length and that many bytes of UTF-8 (no terminator). A value is one of
//! 13 types, numbered in the file: u8 (0), i8 (1), u16 (2), i16 (3), u32 (4), i32 (5), f32 (6),
//! bool (7, one byte: 0 or 1), string (8), array (9), u64 (10), i64 (11), f64 (12). An array is
//! its element type (u32), its length (u64, in elements) and its elements; its elements may be
//! arrays, each with its own element type. The alignment is the metadata `general.alignment` (a
//! u32), 32 when absent. A tensor of a [`GgmlType`] holding blocks of `B` elements in `S` bytes
//! takes `elements / B × S` bytes.
//!
//! Version 1 used u32 counts and lengths and is refused; version 2 made them u64; version 3 is the
//! same layout and allows big-endian files, announced by nothing but their byte order, which this
//! reader recognises (the version reads as a byte-swapped small number) and refuses.
//!
//! # The checks
//!
//! [`GgufFile::open`] reads only a regular file, at most [`GgufFile::MAX_FILE_BYTES`], found so
//! before it is opened for reading (non-blocking, so a pipe cannot hang it). It then checks every
//! field of the header and returns a [`GgufError`] variant naming the field and its byte offset:
//!
//! - the magic ([`GgufError::BadMagic`]); the version: 2 or 3 ([`GgufError::UnsupportedVersion`]),
//!   not big-endian ([`GgufError::BigEndian`]);
//! - every fixed-size field lies in the file ([`GgufError::Truncated`]); every count and length
//!   (metadata pairs, tensors, array elements, string bytes) fits in the bytes left at the
//!   smallest size its items can take ([`GgufError::CountTooLarge`]), checked before anything is
//!   allocated for it, so a header cannot make the reader allocate much more than the file holds;
//! - keys, strings and tensor names are UTF-8 ([`GgufError::InvalidUtf8`]); bools are 0 or 1
//!   ([`GgufError::BadBool`]); value types are 0..=12 ([`GgufError::UnknownValueType`]); arrays
//!   nest at most [`GgufFile::MAX_ARRAY_DEPTH`] deep ([`GgufError::ArrayTooDeep`]); keys are
//!   non-empty and unique ([`GgufError::EmptyKey`], [`GgufError::DuplicateKey`]);
//! - `general.alignment` is a u32 ([`GgufError::AlignmentType`]) and a power of two
//!   ([`GgufError::BadAlignment`]);
//! - tensor names are unique ([`GgufError::DuplicateTensor`]); a tensor has at most
//!   [`GgufFile::MAX_DIMS`] dimensions ([`GgufError::TooManyDims`]), none 0
//!   ([`GgufError::ZeroDim`]), whose element count and byte size fit in 64 bits and in `usize`
//!   ([`GgufError::SizeOverflow`]); its type is a known ggml type ([`GgufError::UnknownTensorType`],
//!   naming the number); its row length `dims[0]` is a whole number of the type's blocks
//!   ([`GgufError::RowNotBlocks`]);
//! - every data offset is a multiple of the alignment ([`GgufError::MisalignedTensor`]), every
//!   tensor's bytes lie inside the file ([`GgufError::TensorPastEnd`]) and apart from every other
//!   tensor's ([`GgufError::OverlappingTensors`]).
//!
//! So once a file is open, [`GgufFile::tensor_data`] is a plain slice of the map. Text from the
//! file in an error (keys, names) is escaped and cut to a few hundred bytes.
//!
//! Not checked, as llama.cpp does not check them either: what the metadata means, the rules the
//! specification states for keys (ASCII, `lower_snake_case` segments), the 64-byte limit it states
//! for tensor names, that tensors are stored in the order of their infos without gaps, and the
//! padding bytes' values.

mod cursor;
mod error;
mod file;
mod files;
mod getters;
mod ggml_type;
mod metadata;
mod tensors;
mod text;
mod value;

pub use error::{GgufError, Result};
pub use file::GgufFile;
pub use files::{file_kind, non_blocking};
pub use ggml_type::GgmlType;
pub use tensors::TensorInfo;
pub use value::{Array, Value};
