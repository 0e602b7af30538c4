//! Reading the tensor infos (name, dimensions, type, data offset) and checking where their bytes
//! lie: names are UTF-8 and unique, at most [`GgufFile::MAX_DIMS`] dimensions, none 0, the type
//! known, the row length (`dims[0]`) a whole number of the type's blocks, the element count and
//! byte size representable, every offset a multiple of the alignment, and every tensor's bytes
//! inside the file and apart from every other tensor's.

use crate::GgufFile;
use crate::cursor::Cursor;
use crate::error::{GgufError, Result};
use crate::ggml_type::GgmlType;
use crate::text::{cut, quote};
use std::collections::HashMap;

/// The fewest bytes one tensor info takes: name length, number of dimensions, type, offset.
pub(crate) const MIN_TENSOR_INFO_BYTES: usize = 8 + 4 + 4 + 8;

/// One tensor as the file describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The tensor's name in the file (`blk.0.attn_q.weight`).
    pub name: String,
    /// The dimensions in ggml order: `dims[0]` is the fastest-varying (the row length), so a
    /// `[rows, cols]` matrix is `[cols, rows]`. At most [`GgufFile::MAX_DIMS`], none 0; empty for a
    /// scalar (one element).
    pub dims: Vec<u64>,
    /// How its elements are stored (a float type or a block quantization).
    pub ggml_type: GgmlType,
    /// Where the tensor's bytes start, from the start of the data section
    /// ([`GgufFile::data_offset`]); a multiple of the alignment.
    pub offset: u64,
    /// How many bytes the tensor takes: elements / block elements × block bytes.
    pub n_bytes: usize,
}

impl TensorInfo {
    /// How many elements the tensor holds (the product of its dimensions; checked at open).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// The tensor infos and where the data section starts.
pub(crate) struct Tensors {
    /// In file order.
    pub(crate) list: Vec<TensorInfo>,
    /// Each name's index in `list`.
    pub(crate) index: HashMap<String, usize>,
    /// The data section's offset in the file (the end of the tensor infos, rounded up to the
    /// alignment; the file's length if it has no tensors and ends before that).
    pub(crate) data_offset: usize,
}

/// Reads `n` tensor infos, then checks that their bytes lie in the file (of `file_len` bytes)
/// without overlapping.
pub(crate) fn read_tensors(c: &mut Cursor, n: usize, alignment: usize, file_len: usize) -> Result<Tensors> {
    let mut list = Vec::new();
    let mut index = HashMap::new();
    // The byte offset of each info, and of its offset field.
    let mut starts = Vec::new();
    let mut offset_fields = Vec::new();
    for i in 0..n {
        let start = c.offset();
        let (info, offset_at) = read_info(c, i, alignment)?;
        if let Some(&first) = index.get(&info.name) {
            let first = starts[first];
            let (path, name) = (c.path.to_string(), cut(&info.name));
            return Err(GgufError::DuplicateTensor { path, name, offset: start, first });
        }
        index.insert(info.name.clone(), list.len());
        list.push(info);
        starts.push(start);
        offset_fields.push(offset_at);
    }
    let data_start = c.position().div_ceil(alignment).saturating_mul(alignment);
    let data_offset = if list.is_empty() { data_start.min(file_len) } else { data_start };
    for (t, &offset_at) in list.iter().zip(&offset_fields) {
        let end = (data_start as u64).checked_add(t.offset).and_then(|s| s.checked_add(t.n_bytes as u64));
        if end.is_none_or(|end| end > file_len as u64) {
            return Err(GgufError::TensorPastEnd {
                path: c.path.to_string(),
                name: cut(&t.name),
                offset: offset_at,
                data_offset: t.offset,
                n_bytes: t.n_bytes as u64,
                data_start: data_start as u64,
                file_len: file_len as u64,
            });
        }
    }
    // In the file, every end is at most `file_len`, so these sums do not overflow.
    let mut by_offset: Vec<&TensorInfo> = list.iter().collect();
    by_offset.sort_by_key(|t| t.offset);
    for pair in by_offset.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        if a.offset + a.n_bytes as u64 > b.offset {
            return Err(GgufError::OverlappingTensors {
                path: c.path.to_string(),
                first: cut(&a.name),
                first_start: a.offset,
                first_end: a.offset + a.n_bytes as u64,
                second: cut(&b.name),
                second_start: b.offset,
            });
        }
    }
    Ok(Tensors { list, index, data_offset })
}

/// Reads tensor info `i` and checks it on its own; returns it and the offset of its offset field.
fn read_info(c: &mut Cursor, i: usize, alignment: usize) -> Result<(TensorInfo, u64)> {
    let path = c.path;
    let (name, _) = c.string(&|| format!("the name of tensor {i}"))?;
    let q = quote(&name);
    let n_dims_at = c.offset();
    let n_dims = c.u32(&|| format!("the number of dimensions of tensor {q}"))?;
    if n_dims as usize > GgufFile::MAX_DIMS {
        let (path, name, max) = (path.to_string(), cut(&name), GgufFile::MAX_DIMS);
        return Err(GgufError::TooManyDims { path, name, offset: n_dims_at, n_dims, max });
    }
    let dims_at = c.offset();
    let mut dims = Vec::with_capacity(n_dims as usize);
    for j in 0..n_dims as usize {
        let at = c.offset();
        let d = c.u64(&|| format!("dimension {j} of tensor {q}"))?;
        if d == 0 {
            return Err(GgufError::ZeroDim { path: path.to_string(), name: cut(&name), index: j, offset: at });
        }
        dims.push(d);
    }
    let overflow = |unit, bits| GgufError::SizeOverflow {
        path: path.to_string(),
        name: cut(&name),
        dims: dims.clone(),
        offset: dims_at,
        unit,
        bits,
    };
    let elements = dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d)).ok_or_else(|| overflow("elements", 64))?;
    let type_at = c.offset();
    let type_id = c.u32(&|| format!("the type of tensor {q}"))?;
    let ggml_type = GgmlType(type_id);
    let (Some(block), Some(block_bytes), Some(type_name)) =
        (ggml_type.block_elems(), ggml_type.block_bytes(), ggml_type.name())
    else {
        return Err(GgufError::UnknownTensorType {
            path: path.to_string(),
            name: cut(&name),
            offset: type_at,
            type_id,
        });
    };
    let row = dims.first().copied().unwrap_or(1);
    if row % block as u64 != 0 {
        let (path, name) = (path.to_string(), cut(&name));
        return Err(GgufError::RowNotBlocks { path, name, type_name, offset: dims_at, row, block });
    }
    let n_bytes = (elements / block as u64).checked_mul(block_bytes as u64).ok_or_else(|| overflow("bytes", 64))?;
    let n_bytes = usize::try_from(n_bytes).map_err(|_| overflow("bytes", usize::BITS))?;
    let offset_at = c.offset();
    let offset = c.u64(&|| format!("the data offset of tensor {q}"))?;
    if offset % alignment as u64 != 0 {
        let (path, name) = (path.to_string(), cut(&name));
        return Err(GgufError::MisalignedTensor { path, name, offset: offset_at, data_offset: offset, alignment });
    }
    Ok((TensorInfo { name, dims, ggml_type, offset, n_bytes }, offset_at))
}
