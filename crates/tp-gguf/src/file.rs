//! [`GgufFile`]: a GGUF file mapped read-only, its header parsed and checked whole at open.

use crate::cursor::Cursor;
use crate::error::{GgufError, Result};
use crate::files::open_regular;
use crate::metadata::read_metadata;
use crate::tensors::{MIN_TENSOR_INFO_BYTES, TensorInfo, read_tensors};
use crate::text::{bytes_text, path_text};
use crate::value::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The magic every GGUF file starts with.
const MAGIC: &[u8; 4] = b"GGUF";

/// The fewest bytes one metadata pair takes: key length, value type, a one-byte value.
const MIN_KV_BYTES: usize = 8 + 4 + 1;

/// An open GGUF file: the file mapped read-only, and its header (version, metadata, tensor infos)
/// parsed and checked. Tensor bytes are slices of the map, read only when used.
pub struct GgufFile {
    path: PathBuf,
    /// `path` as escaped text, for errors.
    shown: String,
    /// `None` for an empty file (which never opens: it has no magic).
    map: Option<memmap2::Mmap>,
    version: u32,
    alignment: usize,
    metadata: Vec<(String, Value)>,
    keys: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    names: HashMap<String, usize>,
    data_offset: usize,
}

impl GgufFile {
    /// The largest file opened: 4 TiB, well above the files models are published in (large models
    /// come split into several files). A larger file is [`GgufError::FileTooLarge`] before it is
    /// mapped.
    pub const MAX_FILE_BYTES: u64 = 1 << 42;

    /// The most dimensions a tensor may have (`GGML_MAX_DIMS`).
    pub const MAX_DIMS: usize = 4;

    /// The deepest metadata arrays may nest: a key's array is depth 1, an array inside it 2, …
    /// (llama.cpp reads no nested arrays at all; the `gguf` Python package writes them.)
    pub const MAX_ARRAY_DEPTH: usize = 8;

    /// Opens the GGUF file at `path` (version 2 or 3, little-endian), maps it read-only and checks
    /// its whole header. Only a regular file is opened (symlinks are followed); a directory, a
    /// pipe or a device is [`GgufError::NotRegularFile`] without blocking.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let shown = path_text(path);
        let (file, len) = open_regular(path, &shown)?;
        let max = Self::MAX_FILE_BYTES.min(isize::MAX as u64);
        if len > max {
            return Err(GgufError::FileTooLarge { path: shown, bytes: len, max });
        }
        let map = if len == 0 {
            None
        } else {
            // SAFETY: the file is opened read-only and mapped read-only. Like every mmap-based
            // loader (llama.cpp's and safetensors' included) this relies on no other process
            // truncating the file while it is mapped; that would fault on access. The map lives
            // in the returned `GgufFile` and outlives every slice taken from it.
            let map = unsafe { memmap2::Mmap::map(&file) };
            Some(map.map_err(|source| GgufError::Io { path: shown.clone(), action: "map", source })?)
        };
        let bytes: &[u8] = map.as_deref().unwrap_or(&[]);
        let mut c = Cursor::new(bytes, &shown);
        let magic = c.array::<4>(&|| "the magic".to_string())?;
        if &magic != MAGIC {
            return Err(GgufError::BadMagic { path: shown.clone(), found: bytes_text(&magic) });
        }
        let version = c.u32(&|| "the version".to_string())?;
        if version & 0xffff == 0 && version != 0 {
            return Err(GgufError::BigEndian { path: shown.clone(), raw: version });
        }
        if version != 2 && version != 3 {
            return Err(GgufError::UnsupportedVersion { path: shown.clone(), version });
        }
        let n_tensors = c.count(MIN_TENSOR_INFO_BYTES, &|| "the tensor count".to_string())?;
        let n_kv = c.count(MIN_KV_BYTES, &|| "the metadata key-value count".to_string())?;
        let meta = read_metadata(&mut c, n_kv)?;
        let tensors = read_tensors(&mut c, n_tensors, meta.alignment, bytes.len())?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            map,
            version,
            alignment: meta.alignment,
            metadata: meta.entries,
            keys: meta.index,
            tensors: tensors.list,
            names: tensors.index,
            data_offset: tensors.data_offset,
            shown,
        })
    }

    /// The path the file was opened by.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The path as escaped text, as errors name it.
    pub(crate) fn shown(&self) -> &str {
        &self.shown
    }

    /// The format version: 2 or 3 (they differ only in that 3 may be big-endian, which this
    /// reader refuses).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The data section's alignment in bytes: `general.alignment` (a u32 power of two) or 32.
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Every metadata pair, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The value of `key`, if the file has it.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.keys.get(key).map(|&i| &self.metadata[i].1)
    }

    /// Every tensor, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor named `name`, if the file has it.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.names.get(name).map(|&i| &self.tensors[i])
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }

    /// Tensor `t`'s bytes: exactly [`TensorInfo::n_bytes`] of them, checked at open to lie in the
    /// file. `t` should be one of this file's [`GgufFile::tensors`]; for any other (from another
    /// file, or edited) the answer is this file's tensor of that name if it has the same place and
    /// size, else an empty slice.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        match self.tensor(&t.name) {
            Some(own) if own.offset == t.offset && own.n_bytes == t.n_bytes => {
                let start = self.data_offset + own.offset as usize;
                self.bytes().get(start..start + own.n_bytes).unwrap_or(&[])
            }
            _ => &[],
        }
    }

    /// The data section's offset in the file: the end of the tensor infos rounded up to the
    /// alignment (for a file without tensors, at most the file's length).
    pub fn data_offset(&self) -> usize {
        self.data_offset
    }
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.shown)
            .field("version", &self.version)
            .field("alignment", &self.alignment)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("data_offset", &self.data_offset)
            .finish()
    }
}
