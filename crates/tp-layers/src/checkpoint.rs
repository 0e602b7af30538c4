//! Sharded loading from safetensors checkpoints, as Hugging Face writes them: one
//! `model.safetensors`, or several files listed by `model.safetensors.index.json`.
//!
//! Files are memory-mapped and each rank reads only its shard: the slice of the tensor's bytes
//! that `TensorShard` assigns it is copied out of the map, so only those pages are read from
//! disk. Every malformed input (missing file, truncated file, bad index, missing tensor,
//! unsupported dtype, wrong shape) is a typed [`LayerError`]. Files are opened through
//! [`crate::files`]: only regular files (symlinks followed) are read, and nothing blocks in
//! `open` (a named pipe or a device is an error); an index is at most 64 MiB.

use crate::error::{LayerError, Result, dtype_name};
use safetensors::SafeTensors;
use safetensors::slice::TensorIndexer;
use safetensors::tensor::{Dtype, TensorView};
use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::ops::Bound;
use std::path::{Path, PathBuf};
use tp_core::{DType, Device, Tensor, TensorShard};

/// One mapped safetensors file.
struct File {
    path: PathBuf,
    map: memmap2::Mmap,
}

/// An open checkpoint: one or more safetensors files and which file holds each tensor.
pub struct Checkpoint {
    origin: String,
    files: Vec<File>,
    /// Tensor name -> index into `files`.
    names: HashMap<String, usize>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Checkpoint({}, {} files, {} tensors)", self.origin, self.files.len(), self.names.len())
    }
}

fn err(path: &Path, why: impl std::fmt::Display) -> LayerError {
    LayerError::Checkpoint { path: path.display().to_string(), why: why.to_string() }
}

/// Largest `*.index.json` read (real ones are well under 1 MiB).
const MAX_INDEX_BYTES: u64 = 64 << 20;

fn map_file(path: &Path) -> Result<File> {
    let f = crate::files::open_regular(path)?;
    // SAFETY: the file is opened read-only and mapped read-only. Like every mmap-based loader
    // (safetensors' own included) this relies on no other process truncating the file while it
    // is mapped; that would fault on access. The map outlives every slice taken from it.
    let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| err(path, format!("cannot map: {e}")))?;
    // Validate the header and that the file holds every byte it promises (a truncated download
    // fails here, not later).
    SafeTensors::deserialize(&map).map_err(|e| err(path, format!("not a valid safetensors file: {e}")))?;
    Ok(File { path: path.to_path_buf(), map })
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
                return Self::open_files(path, vec![single]);
            }
            return Err(err(path, "directory has neither model.safetensors.index.json nor model.safetensors"));
        }
        if path.extension().is_some_and(|e| e == "json") {
            return Self::open_index(path);
        }
        Self::open_files(path, vec![path.to_path_buf()])
    }

    fn open_files(origin: &Path, paths: Vec<PathBuf>) -> Result<Checkpoint> {
        let files = paths.iter().map(|p| map_file(p)).collect::<Result<Vec<_>>>()?;
        let mut names = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            let st = SafeTensors::deserialize(&f.map).map_err(|e| err(&f.path, e))?;
            for name in st.names() {
                names.insert(name.to_string(), i);
            }
        }
        Ok(Checkpoint { origin: origin.display().to_string(), files, names })
    }

    /// A Hugging Face index: `{"weight_map": {"tensor name": "file name", ...}, ...}`, file
    /// names relative to the index's directory.
    fn open_index(index: &Path) -> Result<Checkpoint> {
        let text = crate::files::read_text(index, MAX_INDEX_BYTES)?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| err(index, format!("invalid JSON: {e}")))?;
        let map =
            json.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| err(index, "no \"weight_map\" object"))?;
        let dir = index.parent().unwrap_or(Path::new("."));
        let mut file_of: Vec<String> = Vec::new();
        let mut names = HashMap::new();
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| err(index, format!("weight_map[{name:?}] is not a file name")))?;
            if file.contains('/') || file.contains("..") {
                return Err(err(index, format!("weight_map[{name:?}] = {file:?} is not a plain file name")));
            }
            let i = match file_of.iter().position(|f| f == file) {
                Some(i) => i,
                None => {
                    file_of.push(file.to_string());
                    file_of.len() - 1
                }
            };
            names.insert(name.clone(), i);
        }
        let files = file_of.iter().map(|f| map_file(&dir.join(f))).collect::<Result<Vec<_>>>()?;
        // The index must not promise tensors its files lack.
        for (name, &i) in &names {
            let st = SafeTensors::deserialize(&files[i].map).map_err(|e| err(&files[i].path, e))?;
            if st.tensor(name).is_err() {
                return Err(err(index, format!("lists {name:?} in {} but that file has no such tensor", file_of[i])));
            }
        }
        Ok(Checkpoint { origin: index.display().to_string(), files, names })
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.names.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    /// Whether the checkpoint has a tensor called `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.names.contains_key(name)
    }

    fn view(&self, name: &str) -> Result<(TensorView<'_>, DType)> {
        let missing = || LayerError::MissingTensor { path: self.origin.clone(), name: name.into() };
        let &i = self.names.get(name).ok_or_else(missing)?;
        let f = &self.files[i];
        let st = SafeTensors::deserialize(&f.map).map_err(|e| err(&f.path, e))?;
        let view = st.tensor(name).map_err(|_| missing())?;
        let dtype = dtype_of(view.dtype()).ok_or_else(|| LayerError::WrongDtype {
            name: name.into(),
            found: format!("{:?}", view.dtype()),
            expected: "F32, F16, BF16, I32 or I64".into(),
        })?;
        // Rebuild the view over the map's lifetime (the parsed `st` is local).
        let view = TensorView::new(view.dtype(), view.shape().to_vec(), view.data()).map_err(|e| err(&f.path, e))?;
        Ok((view, dtype))
    }

    /// `(dtype, shape)` of tensor `name`.
    pub fn info(&self, name: &str) -> Result<(DType, Vec<usize>)> {
        let (v, d) = self.view(name)?;
        Ok((d, v.shape().to_vec()))
    }

    /// [`info`](Self::info) of a tensor that must be a parameter: a float dtype (f32, f16 or
    /// bf16), else [`LayerError::WrongDtype`].
    pub fn param_info(&self, name: &str) -> Result<(DType, Vec<usize>)> {
        let (d, dims) = self.info(name)?;
        if !d.is_float() {
            return Err(LayerError::WrongDtype {
                name: name.into(),
                found: dtype_name(d),
                expected: "f32, f16 or bf16".into(),
            });
        }
        Ok((d, dims))
    }

    /// The whole tensor `name`, converted to `dtype` (if given) and placed on `device`.
    pub fn load(&self, name: &str, dtype: Option<DType>, device: &Device) -> Result<Tensor> {
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
            return Err(LayerError::WrongShape { name: name.into(), found: dims, expected });
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
        let (v, d) = self.view(name)?;
        let dims = v.shape().to_vec();
        let size = *dims.get(dim).ok_or_else(|| err(Path::new(&self.origin), format!("{name} has no dim {dim}")))?;
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(err(
                Path::new(&self.origin),
                format!("{name}: range {start}+{len} exceeds dim {dim} of size {size}"),
            ));
        }
        let one = NonZeroUsize::MIN;
        let mut idx: Vec<TensorIndexer> =
            (0..dim).map(|_| TensorIndexer::Narrow(Bound::Unbounded, Bound::Unbounded, one)).collect();
        idx.push(TensorIndexer::Narrow(Bound::Included(start), Bound::Excluded(start + len), one));
        let mut out_dims = dims.clone();
        out_dims[dim] = len;
        // Zeroed pages come from the OS lazily, so the copy below is the one pass over them.
        let mut t = Tensor::zeros(&out_dims, d, &Device::Cpu)?;
        let dst = t.as_bytes_mut()?;
        if !dst.is_empty() {
            let it = v.sliced_data(&idx).map_err(|e| err(Path::new(&self.origin), format!("{name}: {e}")))?;
            if it.remaining_byte_len() != dst.len() {
                return Err(err(
                    Path::new(&self.origin),
                    format!("{name}: the slice holds {} bytes, not {}", it.remaining_byte_len(), dst.len()),
                ));
            }
            // The slice arrives as contiguous runs of the mapped file (whole rows of a row
            // range, one run per row of a column range): copy them run by run.
            let mut at = 0;
            for run in it {
                dst[at..at + run.len()].copy_from_slice(run);
                at += run.len();
            }
        }
        let read = dst.len();
        Ok((finish(t, dtype, device)?, read))
    }

    /// Checks that tensor `name` has `dims` and one of tp's dtypes (`dtype`, when given).
    pub fn expect(&self, name: &str, dims: &[usize], dtype: Option<DType>) -> Result<()> {
        let (d, shape) = self.info(name)?;
        if shape != dims {
            return Err(LayerError::WrongShape { name: name.into(), found: shape, expected: dims.to_vec() });
        }
        if let Some(want) = dtype
            && want != d
        {
            return Err(LayerError::WrongDtype { name: name.into(), found: dtype_name(d), expected: dtype_name(want) });
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
        .map_err(|e| LayerError::Write { path: path.display().to_string(), why: e.to_string() })
}
