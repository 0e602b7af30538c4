//! Sharded loading from safetensors checkpoints, as Hugging Face writes them: one
//! `model.safetensors`, or several files listed by `model.safetensors.index.json`; or from a
//! GGUF file whose tensors a model table maps to Hugging Face names
//! ([`Checkpoint::from_gguf`], [`crate::gguf_tensors`]), dequantized while loading or kept as
//! quantized blocks ([`Checkpoint::quant_range`]).
//!
//! Files are memory-mapped and each rank reads only its shard: the slice of the tensor's bytes
//! that `TensorShard` assigns it is copied out of the map, so only those pages are read from
//! disk. Every malformed input (missing file, truncated file, bad index, missing tensor,
//! unsupported dtype, wrong shape) is a typed [`LayerError`]. Files are opened through
//! [`crate::files`]: only regular files (symlinks followed) are read, and nothing blocks in
//! `open` (a named pipe or a device is an error).
//!
//! Each file's header is parsed once, when the checkpoint is opened: every tensor's dtype, shape
//! and byte range are kept in one hash map, so opening costs time linear in the number of tensors
//! and each lookup or load after it costs the same whatever their number. What is read is
//! bounded: an index is at most [`Checkpoint::MAX_INDEX_BYTES`], a safetensors header at most
//! [`Checkpoint::MAX_HEADER_BYTES`], an index names at most [`Checkpoint::MAX_FILES`] files, and a
//! checkpoint holds at most [`Checkpoint::MAX_TENSORS`] tensors (counted in its files and in its
//! index alike). Names and paths from the files reach error messages escaped and cut
//! ([`crate::text`]).

use crate::error::{LayerError, Result, dtype_name};
use crate::gguf_tensors::{GgufTensor, GgufTensors};
use crate::text::{cut, foreign, path_text, quote_text};
use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};
use std::collections::HashMap;
use std::path::Path;
use tp_core::{DType, Device, QuantWeight, Tensor, TensorShard};

/// One mapped safetensors file.
struct File {
    path: String,
    map: memmap2::Mmap,
}

/// Where one tensor lies, as its file's header says (read once, at open).
struct Entry {
    /// Index into `Checkpoint::files`.
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Byte range of its data within the file's map.
    start: usize,
    end: usize,
}

/// An open checkpoint: one or more safetensors files and where each tensor lies in them.
pub struct Checkpoint {
    /// The path opened, escaped for messages.
    origin: String,
    files: Vec<File>,
    /// Tensor name -> its file, dtype, shape and bytes.
    entries: HashMap<String, Entry>,
    /// A GGUF file's tensors instead (then `files` and `entries` are empty).
    gguf: Option<GgufTensors>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.gguf {
            Some(g) => write!(f, "Checkpoint({}, GGUF, {} tensors)", self.origin, g.len()),
            None => {
                write!(f, "Checkpoint({}, {} files, {} tensors)", self.origin, self.files.len(), self.entries.len())
            }
        }
    }
}

fn err(path: &Path, why: impl std::fmt::Display) -> LayerError {
    LayerError::Checkpoint { path: path_text(path), why: why.to_string() }
}

/// The same for a path already escaped.
fn err_at(path: &str, why: impl std::fmt::Display) -> LayerError {
    LayerError::Checkpoint { path: path.to_string(), why: why.to_string() }
}

/// Bytes of a safetensors file before its header: the header's length, little-endian u64.
const LEN_BYTES: usize = 8;

fn map_file(path: &Path) -> Result<File> {
    let f = crate::files::open_regular(path)?;
    // SAFETY: the file is opened read-only and mapped read-only. Like every mmap-based loader
    // (safetensors' own included) this relies on no other process truncating the file while it
    // is mapped; that would fault on access. The map outlives every slice taken from it.
    let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| err(path, format!("cannot map: {e}")))?;
    Ok(File { path: path_text(path), map })
}

/// Parses `f`'s header, the one time it is read, and returns its tensors (`file` is their
/// index into `Checkpoint::files`). `seen` counts the tensors of every file parsed so far; past
/// [`Checkpoint::MAX_TENSORS`] the checkpoint is refused. The header is validated whole, including
/// that the file holds every byte it promises (a truncated download fails here, not later).
fn read_header(f: &File, file: usize, seen: &mut usize) -> Result<Vec<(String, Entry)>> {
    let invalid = |why: String| err_at(&f.path, format!("not a valid safetensors file: {why}"));
    let len: [u8; LEN_BYTES] = f
        .map
        .get(..LEN_BYTES)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| invalid(format!("{} bytes, shorter than the header length", f.map.len())))?;
    let header = u64::from_le_bytes(len);
    if header > Checkpoint::MAX_HEADER_BYTES as u64 {
        return Err(invalid(format!(
            "its header of {header} bytes is larger than the {} accepted",
            Checkpoint::MAX_HEADER_BYTES
        )));
    }
    let (header, meta) = SafeTensors::read_metadata(&f.map).map_err(|e| invalid(foreign(e)))?;
    let tensors = meta.tensors();
    *seen = seen.saturating_add(tensors.len());
    if *seen > Checkpoint::MAX_TENSORS {
        return Err(err_at(&f.path, format!("the checkpoint holds more than {} tensors", Checkpoint::MAX_TENSORS)));
    }
    let data = LEN_BYTES + header;
    tensors
        .into_iter()
        .map(|(name, info)| {
            let (s, e) = info.data_offsets;
            let range = data.checked_add(s).zip(data.checked_add(e)).filter(|&(s, e)| s <= e && e <= f.map.len());
            let (start, end) =
                range.ok_or_else(|| invalid(format!("tensor {} lies past the end of the file", quote_text(&name))))?;
            Ok((name, Entry { file, dtype: info.dtype, shape: info.shape.clone(), start, end }))
        })
        .collect()
}

/// tp's dtype for a safetensors dtype, if it has one.
fn dtype_of(d: Dtype) -> Option<DType> {
    match d {
        Dtype::F32 => Some(DType::F32),
        Dtype::F16 => Some(DType::F16),
        Dtype::BF16 => Some(DType::BF16),
        Dtype::I32 => Some(DType::I32),
        Dtype::I64 => Some(DType::I64),
        _ => None,
    }
}

impl Checkpoint {
    /// Largest `*.index.json` read (real ones are well under 1 MiB).
    pub const MAX_INDEX_BYTES: u64 = 64 << 20;
    /// Largest safetensors header accepted, in bytes: the bound safetensors itself sets (and
    /// writes within); a header of 100k tensors takes about 10 MB.
    pub const MAX_HEADER_BYTES: usize = 100_000_000;
    /// Most distinct files an index may name (real ones name a few hundred at most).
    pub const MAX_FILES: usize = 65_536;
    /// Most tensors a checkpoint may hold, in its files or in its index (real ones hold a few
    /// thousand; a 671B mixture of experts about 100k).
    pub const MAX_TENSORS: usize = 1_000_000;

    /// Opens `path`: a `.safetensors` file, a `*.index.json` index, or a directory holding
    /// `model.safetensors.index.json` or `model.safetensors`.
    pub fn open(path: impl AsRef<Path>) -> Result<Checkpoint> {
        let path = path.as_ref();
        if path.is_dir() {
            let index = path.join("model.safetensors.index.json");
            if index.exists() {
                return Self::open_index(&index);
            }
            let single = path.join("model.safetensors");
            if single.exists() {
                return Self::open_file(path, &single);
            }
            return Err(err(path, "directory has neither model.safetensors.index.json nor model.safetensors"));
        }
        if path.extension().is_some_and(|e| e == "json") {
            return Self::open_index(path);
        }
        Self::open_file(path, path)
    }

    /// One safetensors file: every tensor in it.
    fn open_file(origin: &Path, path: &Path) -> Result<Checkpoint> {
        let file = map_file(path)?;
        let entries = read_header(&file, 0, &mut 0)?.into_iter().collect();
        Ok(Checkpoint { origin: path_text(origin), files: vec![file], entries, gguf: None })
    }

    /// A Hugging Face index: `{"weight_map": {"tensor name": "file name", ...}, ...}`, file
    /// names relative to the index's directory. Each file is mapped and its header parsed once;
    /// the checkpoint holds the tensors the index lists, each of which must be in its file.
    fn open_index(index: &Path) -> Result<Checkpoint> {
        let text = crate::files::read_text(index, Self::MAX_INDEX_BYTES)?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| err(index, format!("invalid JSON: {}", foreign(e))))?;
        let map =
            json.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| err(index, "no \"weight_map\" object"))?;
        if map.len() > Self::MAX_TENSORS {
            return Err(err(index, format!("weight_map lists {} tensors, more than {}", map.len(), Self::MAX_TENSORS)));
        }
        let dir = index.parent().unwrap_or(Path::new("."));
        // File name -> its index in `file_names`, in order of first appearance.
        let mut file_ids: HashMap<&str, usize> = HashMap::new();
        let mut file_names: Vec<&str> = Vec::new();
        // Tensor name -> the file the index puts it in.
        let mut wanted: HashMap<&str, usize> = HashMap::with_capacity(map.len());
        for (name, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| err(index, format!("weight_map[{}] is not a file name", quote_text(name))))?;
            if file.contains('/') || file.contains("..") {
                return Err(err(
                    index,
                    format!("weight_map[{}] = {} is not a plain file name", quote_text(name), quote_text(file)),
                ));
            }
            let id = match file_ids.get(file) {
                Some(&id) => id,
                None if file_names.len() == Self::MAX_FILES => {
                    return Err(err(index, format!("weight_map names more than {} files", Self::MAX_FILES)));
                }
                None => {
                    file_ids.insert(file, file_names.len());
                    file_names.push(file);
                    file_names.len() - 1
                }
            };
            wanted.insert(name, id);
        }
        let mut files = Vec::with_capacity(file_names.len());
        let mut entries = HashMap::with_capacity(map.len());
        let mut seen = 0;
        for (id, name) in file_names.iter().enumerate() {
            let file = map_file(&dir.join(name))?;
            for (tensor, entry) in read_header(&file, id, &mut seen)? {
                if wanted.get(tensor.as_str()) == Some(&id) {
                    entries.insert(tensor, entry);
                }
            }
            files.push(file);
        }
        // The index must not promise tensors its files lack (the first in the index's order).
        if let Some(name) = map.keys().find(|n| !entries.contains_key(n.as_str())) {
            let file = wanted.get(name.as_str()).map_or("", |&id| file_names[id]);
            return Err(err(
                index,
                format!("lists {} in {} but that file has no such tensor", quote_text(name), quote_text(file)),
            ));
        }
        Ok(Checkpoint { origin: path_text(index), files, entries, gguf: None })
    }

    /// The tensors of GGUF file `file` (opened from `path`) that `tensors` maps to Hugging Face
    /// names: each must exist in the file, with one or two dims, of a type tp runs.
    pub fn from_gguf(
        file: impl Into<std::sync::Arc<tp_gguf::GgufFile>>,
        path: &Path,
        tensors: Vec<GgufTensor>,
    ) -> Result<Checkpoint> {
        let origin = path_text(path);
        let gguf = GgufTensors::new(file.into(), origin.clone(), tensors)?;
        Ok(Checkpoint { origin, files: Vec::new(), entries: HashMap::new(), gguf: Some(gguf) })
    }

    /// The GGUF file, when the checkpoint is one.
    pub fn gguf(&self) -> Option<&tp_gguf::GgufFile> {
        self.gguf.as_ref().map(GgufTensors::file)
    }

    /// Entries `start..start + len` of dim `dim` (0: rows, 1: columns) of the 2-D tensor
    /// `name`, kept as the GGUF file's quantized blocks; `None` for a safetensors checkpoint.
    /// A column range that does not start or end on a block boundary holds the blocks covering
    /// it, padded as [`QuantWeight`] describes.
    pub fn quant_range(&self, name: &str, dim: usize, start: usize, len: usize) -> Result<Option<QuantWeight>> {
        self.gguf.as_ref().map(|g| g.quant_range(name, dim, start, len)).transpose()
    }

    /// The stored block type of tensor `name` in a GGUF checkpoint (`None` for safetensors).
    pub fn quant_type(&self, name: &str) -> Result<Option<tp_core::quant::QuantType>> {
        self.gguf.as_ref().map(|g| g.qtype(name)).transpose()
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = match &self.gguf {
            Some(g) => g.names().collect(),
            None => self.entries.keys().map(String::as_str).collect(),
        };
        v.sort_unstable();
        v
    }

    /// Whether the checkpoint has a tensor called `name`.
    pub fn contains(&self, name: &str) -> bool {
        match &self.gguf {
            Some(g) => g.contains(name),
            None => self.entries.contains_key(name),
        }
    }

    /// Tensor `name`'s entry and tp dtype: [`LayerError::MissingTensor`] if there is none,
    /// [`LayerError::WrongDtype`] if tp has no such dtype.
    fn entry(&self, name: &str) -> Result<(&Entry, DType)> {
        let e = self
            .entries
            .get(name)
            .ok_or_else(|| LayerError::MissingTensor { path: self.origin.clone(), name: cut(name) })?;
        let dtype = dtype_of(e.dtype).ok_or_else(|| LayerError::WrongDtype {
            name: cut(name),
            found: format!("{:?}", e.dtype),
            expected: "F32, F16, BF16, I32 or I64".into(),
        })?;
        Ok((e, dtype))
    }

    /// A view of tensor `name`'s bytes in its map, built from the entry kept at open (no header
    /// is parsed again).
    fn view(&self, name: &str) -> Result<(TensorView<'_>, DType)> {
        let (e, dtype) = self.entry(name)?;
        let f = &self.files[e.file];
        let invalid = |why: String| err_at(&f.path, format!("tensor {}: {why}", quote_text(name)));
        let data = f.map.get(e.start..e.end).ok_or_else(|| invalid("lies past the end of the file".into()))?;
        let view = TensorView::new(e.dtype, e.shape.clone(), data).map_err(|e| invalid(foreign(e)))?;
        Ok((view, dtype))
    }

    /// `(dtype, shape)` of tensor `name`.
    pub fn info(&self, name: &str) -> Result<(DType, Vec<usize>)> {
        if let Some(g) = &self.gguf {
            return g.info(name);
        }
        let (e, dtype) = self.entry(name)?;
        Ok((dtype, e.shape.clone()))
    }

    /// [`info`](Self::info) of a tensor that must be a parameter: a float dtype (f32, f16 or
    /// bf16), else [`LayerError::WrongDtype`].
    pub fn param_info(&self, name: &str) -> Result<(DType, Vec<usize>)> {
        let (d, dims) = self.info(name)?;
        if !d.is_float() {
            return Err(LayerError::WrongDtype {
                name: cut(name),
                found: dtype_name(d),
                expected: "f32, f16 or bf16".into(),
            });
        }
        Ok((d, dims))
    }

    /// The whole tensor `name`, converted to `dtype` (if given) and placed on `device`.
    pub fn load(&self, name: &str, dtype: Option<DType>, device: &Device) -> Result<Tensor> {
        if let Some(g) = &self.gguf {
            let rows = g.info(name)?.1.first().copied().unwrap_or(0);
            return Ok(g.load_range(name, 0, 0, rows, dtype, device)?.0);
        }
        let (v, d) = self.view(name)?;
        let t = Tensor::from_bytes(v.data(), v.shape(), d, &Device::Cpu)?;
        finish(t, dtype, device)
    }

    /// This rank's shard of tensor `name`: only the bytes of `shard`'s slice of dim
    /// `shard.dim()` are read. Checks that the tensor has that dim with `shard.global_len()`
    /// entries. Returns the tensor and the number of bytes read from the file.
    pub fn load_shard(
        &self,
        name: &str,
        shard: &TensorShard,
        dtype: Option<DType>,
        device: &Device,
    ) -> Result<(Tensor, usize)> {
        let (_, dims) = self.info(name)?;
        if dims.get(shard.dim()) != Some(&shard.global_len()) {
            let mut expected = dims.clone();
            if shard.dim() < expected.len() {
                expected[shard.dim()] = shard.global_len();
            }
            return Err(LayerError::WrongShape { name: cut(name), found: dims, expected });
        }
        self.load_range(name, shard.dim(), shard.start(), shard.len(), dtype, device)
    }

    /// Entries `start..start + len` of dim `dim` of tensor `name`, reading only those bytes.
    /// Returns the tensor and the number of bytes read from the file.
    pub fn load_range(
        &self,
        name: &str,
        dim: usize,
        start: usize,
        len: usize,
        dtype: Option<DType>,
        device: &Device,
    ) -> Result<(Tensor, usize)> {
        if let Some(g) = &self.gguf {
            return g.load_range(name, dim, start, len, dtype, device);
        }
        let (v, d) = self.view(name)?;
        let fail = |why: String| err_at(&self.origin, format!("tensor {}: {why}", quote_text(name)));
        let dims = v.shape().to_vec();
        let size = *dims.get(dim).ok_or_else(|| fail(format!("has no dim {dim}")))?;
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(fail(format!("range {start}+{len} exceeds dim {dim} of size {size}")));
        }
        let mut out_dims = dims.clone();
        out_dims[dim] = len;
        // Zeroed pages come from the OS lazily, so the copy below is the one pass over them.
        let mut t = Tensor::zeros(&out_dims, d, &Device::Cpu)?;
        let dst = t.as_bytes_mut()?;
        if !dst.is_empty() {
            // The range is `outer` contiguous runs of the mapped data, one per index of the dims
            // before `dim` (a single run for a row range), each `len * inner` bytes: copied
            // run by run, computed here rather than listed first (a list of every run would
            // cost 16 bytes per run, far more than the data for a column range of a tall
            // tensor). The sizes are bounded by the tensor's, which the header validated.
            let data = v.data();
            let inner: usize = dims[dim + 1..].iter().product::<usize>() * d.size_in_bytes();
            let outer: usize = dims[..dim].iter().product();
            let (run, stride) = (len * inner, size * inner);
            if outer.checked_mul(run) != Some(dst.len()) || outer.checked_mul(stride) != Some(data.len()) {
                return Err(fail(format!("the range holds {} bytes, not {}", outer.saturating_mul(run), dst.len())));
            }
            for (o, out) in dst.chunks_exact_mut(run).enumerate() {
                let from = o * stride + start * inner;
                out.copy_from_slice(&data[from..from + run]);
            }
        }
        let read = dst.len();
        Ok((finish(t, dtype, device)?, read))
    }

    /// The shape of a safetensors `U8` tensor (packed codes and scales, such as gpt-oss's MXFP4
    /// `*_blocks` and `*_scales`); [`LayerError::WrongDtype`] for any other dtype.
    pub fn u8_dims(&self, name: &str) -> Result<Vec<usize>> {
        let e = match &self.gguf {
            Some(_) => None,
            None => self.entries.get(name),
        };
        let e = e.ok_or_else(|| LayerError::MissingTensor { path: self.origin.clone(), name: cut(name) })?;
        if e.dtype != Dtype::U8 {
            return Err(LayerError::WrongDtype {
                name: cut(name),
                found: format!("{:?}", e.dtype),
                expected: "U8".into(),
            });
        }
        Ok(e.shape.clone())
    }

    /// Entry `i` of dim 0 of the `U8` tensor `name` (one expert of `[E, ..]`): its bytes, read
    /// from the map alone.
    pub fn u8_entry(&self, name: &str, i: usize) -> Result<Vec<u8>> {
        let dims = self.u8_dims(name)?;
        let fail = |why: String| err_at(&self.origin, format!("tensor {}: {why}", quote_text(name)));
        let e = &self.entries[name];
        let per: usize = dims.iter().skip(1).product();
        if dims.first().is_none_or(|&n| i >= n) {
            return Err(fail(format!("has no entry {i} along dim 0 of {dims:?}")));
        }
        let data = self.files[e.file].map.get(e.start..e.end).ok_or_else(|| fail("lies past the file's end".into()))?;
        if data.len() != per.saturating_mul(dims[0]) {
            return Err(fail(format!("holds {} bytes for shape {dims:?}", data.len())));
        }
        Ok(data[i * per..(i + 1) * per].to_vec())
    }

    /// Checks that tensor `name` has `dims` and one of tp's dtypes (`dtype`, when given).
    pub fn expect(&self, name: &str, dims: &[usize], dtype: Option<DType>) -> Result<()> {
        let (d, shape) = self.info(name)?;
        if shape != dims {
            return Err(LayerError::WrongShape { name: cut(name), found: shape, expected: dims.to_vec() });
        }
        if let Some(want) = dtype
            && want != d
        {
            return Err(LayerError::WrongDtype { name: cut(name), found: dtype_name(d), expected: dtype_name(want) });
        }
        Ok(())
    }
}

fn finish(t: Tensor, dtype: Option<DType>, device: &Device) -> Result<Tensor> {
    let t = match dtype {
        Some(d) => t.to_dtype(d)?,
        None => t,
    };
    Ok(t.to_device(device)?)
}

/// Writes `tensors` (name, host tensor) as one safetensors file, as Hugging Face would.
///
/// `path` must be a regular file (symlinks followed) or absent: a named pipe, a device such as
/// `/dev/null` or a directory is an error, never a blocked write or a replaced device node
/// (safetensors writes a temporary file beside `path` and renames it over `path`).
pub fn save(path: impl AsRef<Path>, tensors: &[(&str, &Tensor)]) -> Result<()> {
    let path = path.as_ref();
    crate::files::check_writable(path)?;
    let hosts = tensors.iter().map(|(n, t)| Ok((*n, t.to_device(&Device::Cpu)?))).collect::<Result<Vec<_>>>()?;
    let views = hosts
        .iter()
        .map(|(n, t)| {
            let dt = match t.dtype() {
                DType::F32 => Dtype::F32,
                DType::F16 => Dtype::F16,
                DType::BF16 => Dtype::BF16,
                DType::I32 => Dtype::I32,
                DType::I64 => Dtype::I64,
            };
            let view = TensorView::new(dt, t.dims().to_vec(), t.as_bytes()?).map_err(|e| err(path, e))?;
            Ok((n.to_string(), view))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize_to_file(views, None, path)
        .map_err(|e| LayerError::Write { path: path_text(path), why: foreign(e) })
}
