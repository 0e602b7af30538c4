//! A GGUF file's tensors under Hugging Face names, for [`crate::Checkpoint`].
//!
//! A model table (tp-models) maps each Hugging Face tensor name to the GGUF tensor that holds it
//! ([`GgufTensor`]): `model.layers.3.self_attn.q_proj.weight` is `blk.3.attn_q.weight`. GGUF
//! lists dims fastest first (`[in, out]` for a weight); here they read in Hugging Face's order
//! (`[out, in]`). llama.cpp stores the rows of Llama's Q and K projections in its rotary layout:
//! within each head of `d` rows, Hugging Face's row `w·d/2 + j` (half `w` of the head, pair `j`)
//! is stored at `2j + w` ([`RowOrder::Rotary`]); rows are read through that map, so every rank's
//! head-aligned row range comes out in Hugging Face's order.
//!
//! Two ways to read:
//! * [`GgufTensors::load_range`] dequantizes (bit-exact with ggml and the `gguf` package) only
//!   the rows asked for, or for a column range only the blocks that cover it, then converts.
//! * [`GgufTensors::quant_range`] keeps the blocks: a row range is those rows' bytes; a column
//!   range is, on every row, the whole blocks covering it, with the zero padding that keeps the
//!   product exact described in [`tp_core::QuantWeight`] (at most one block on each side).

use crate::error::{LayerError, Result};
use crate::text::{cut, quote_text};
use std::collections::HashMap;
use tp_core::quant::{QuantType, dequantize};
use tp_core::{DType, Device, QuantWeight, Tensor};
use tp_gguf::GgufFile;

/// How the rows of a GGUF tensor relate to the Hugging Face tensor's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowOrder {
    /// The same order.
    Stored,
    /// llama.cpp's rotary layout over `heads` heads (Llama's Q and K, weights and biases).
    Rotary {
        /// Heads the rows are grouped in.
        heads: usize,
    },
}

/// One tensor of a GGUF file under its Hugging Face name.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensor {
    /// The Hugging Face name (`model.layers.0.self_attn.q_proj.weight`).
    pub name: String,
    /// The GGUF name (`blk.0.attn_q.weight`).
    pub gguf_name: String,
    /// How its rows are stored.
    pub rows: RowOrder,
    /// Added to every value after dequantizing (Gemma's norms, which llama.cpp stores as `1 + w`,
    /// take `-1`); `0` leaves the values as they are.
    pub shift: f32,
    /// Which slice of the GGUF tensor this is: `Whole`, one expert of a 3-D expert tensor
    /// (`ffn_gate_exps: [E, I, H]` in Hugging Face's order), or a 1-D tensor read as one row
    /// (`ffn_gate_inp_shexp: [H]` as the `[1, H]` weight it was).
    pub part: GgufPart,
}

/// Which part of a GGUF tensor a Hugging Face tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GgufPart {
    /// The tensor as it is (1-D or 2-D).
    #[default]
    Whole,
    /// Entry `e` of the outermost dim of a 3-D tensor (llama.cpp stacks an MoE layer's experts
    /// so): the rows `e · rows .. (e + 1) · rows` of the tensor seen as 2-D; of a 2-D tensor
    /// (the experts' stacked biases, gpt-oss's `ffn_gate_exps.bias: [E, I]`), row `e` as a vector.
    Expert(usize),
    /// A 1-D tensor `[n]` as the weight `[1, n]`.
    Row,
}

impl GgufTensor {
    /// The whole GGUF tensor `gguf_name` as `name`, rows as stored, no shift.
    pub fn new(name: String, gguf_name: String) -> GgufTensor {
        GgufTensor { name, gguf_name, rows: RowOrder::Stored, shift: 0.0, part: GgufPart::Whole }
    }
}

/// Where one mapped tensor lies.
#[derive(Debug)]
struct Entry {
    /// Index into the file's tensors.
    tensor: usize,
    qtype: QuantType,
    /// Hugging Face order: `[out, in]` or `[n]`.
    dims: Vec<usize>,
    rows: RowOrder,
    shift: f32,
    /// The first stored row of this tensor's rows (an expert's slice of a 3-D tensor), and the
    /// bytes of one stored row.
    row_offset: usize,
    row_bytes: usize,
}

/// A GGUF file and its tensors under Hugging Face names.
pub(crate) struct GgufTensors {
    /// The open file, shared with whoever else reads it (the config, the other ranks).
    file: std::sync::Arc<GgufFile>,
    origin: String,
    entries: HashMap<String, Entry>,
}

impl GgufTensors {
    /// Maps `tensors` onto `file` (`origin` names it in errors). Each must exist, be of a type tp
    /// runs (others are refused by name), have one or two dims, and, for [`RowOrder::Rotary`],
    /// rows that split into heads of an even size.
    pub(crate) fn new(file: std::sync::Arc<GgufFile>, origin: String, tensors: Vec<GgufTensor>) -> Result<GgufTensors> {
        let fail = |why: String| LayerError::Checkpoint { path: origin.clone(), why };
        let index: HashMap<&str, usize> =
            file.tensors().iter().enumerate().map(|(i, t)| (t.name.as_str(), i)).collect();
        let mut entries = HashMap::with_capacity(tensors.len());
        for t in tensors {
            let &i = index
                .get(t.gguf_name.as_str())
                .ok_or_else(|| LayerError::MissingTensor { path: origin.clone(), name: cut(&t.gguf_name) })?;
            let info = &file.tensors()[i];
            let id = info.ggml_type.0;
            let qtype = QuantType::from_ggml_id(id).ok_or_else(|| LayerError::WrongDtype {
                name: cut(&t.gguf_name),
                found: info.ggml_type.name().map_or(format!("GGML type {id}"), |n| format!("{n} (GGML type {id})")),
                expected: "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K or MXFP4".into(),
            })?;
            let bad_dims =
                |d: &[u64], what: &str| fail(format!("tensor {} has dims {d:?}; {what}", quote_text(&t.gguf_name)));
            let (dims, row_offset) = match (&info.dims[..], t.part) {
                (&[n], GgufPart::Whole) => (vec![to_usize(n)], 0),
                (&[n], GgufPart::Row) => (vec![1, to_usize(n)], 0),
                (&[cols, rows], GgufPart::Whole) => (vec![to_usize(rows), to_usize(cols)], 0),
                (&[cols, rows, experts], GgufPart::Expert(e)) if (e as u64) < experts => {
                    (vec![to_usize(rows), to_usize(cols)], e * to_usize(rows))
                }
                (&[n, experts], GgufPart::Expert(e)) if (e as u64) < experts => (vec![to_usize(n)], e),
                (d, GgufPart::Expert(e)) => {
                    return Err(bad_dims(
                        d,
                        &format!(
                            "expert {e} of a 3-D [experts, rows, columns] (or 2-D [experts, n]) tensor was expected"
                        ),
                    ));
                }
                (d, GgufPart::Row) => return Err(bad_dims(d, "a vector was expected")),
                (d, GgufPart::Whole) => return Err(bad_dims(d, "a weight has 1 or 2")),
            };
            // One stored row: its blocks (a vector is one row).
            let cols = *dims.last().unwrap_or(&0);
            let row_bytes = cols.div_ceil(qtype.block_elems().max(1)) * qtype.block_bytes();
            if let RowOrder::Rotary { heads } = t.rows
                && (heads == 0 || dims[0] % heads != 0 || (dims[0] / heads) % 2 != 0)
            {
                return Err(fail(format!(
                    "tensor {}: {} rows do not split into {heads} heads of an even size",
                    quote_text(&t.gguf_name),
                    dims[0]
                )));
            }
            entries
                .insert(t.name, Entry { tensor: i, qtype, dims, rows: t.rows, shift: t.shift, row_offset, row_bytes });
        }
        Ok(GgufTensors { file, origin, entries })
    }

    /// The file.
    pub(crate) fn file(&self) -> &GgufFile {
        &self.file
    }
    /// Every mapped (Hugging Face) name.
    pub(crate) fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }
    /// Whether `name` is mapped.
    pub(crate) fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }
    /// The number of mapped tensors.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    fn entry(&self, name: &str) -> Result<&Entry> {
        self.entries.get(name).ok_or_else(|| LayerError::MissingTensor { path: self.origin.clone(), name: cut(name) })
    }

    /// `(dtype, dims)` of `name` in Hugging Face's order: F16 and BF16 tensors keep their
    /// dtype; F32 and the block types read as f32.
    pub(crate) fn info(&self, name: &str) -> Result<(DType, Vec<usize>)> {
        let e = self.entry(name)?;
        let dtype = match e.qtype {
            QuantType::F16 => DType::F16,
            QuantType::BF16 => DType::BF16,
            _ => DType::F32,
        };
        Ok((dtype, e.dims.clone()))
    }

    /// The stored type of `name`.
    pub(crate) fn qtype(&self, name: &str) -> Result<QuantType> {
        Ok(self.entry(name)?.qtype)
    }

    /// Checks a range of dim `dim` of `e`; returns `(rows, cols)` of the tensor seen as 2-D (a
    /// 1-D tensor is one row... of its entries: `[1, n]` with dim 0 its entries).
    fn check_range(&self, name: &str, e: &Entry, dim: usize, start: usize, len: usize) -> Result<()> {
        let size = e.dims.get(dim).copied().ok_or_else(|| self.fail(name, format!("has no dim {dim}")))?;
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(self.fail(name, format!("range {start}+{len} exceeds dim {dim} of size {size}")));
        }
        Ok(())
    }

    fn fail(&self, name: &str, why: String) -> LayerError {
        LayerError::Checkpoint { path: self.origin.clone(), why: format!("tensor {}: {why}", quote_text(name)) }
    }

    /// Entries `start..start + len` of dim `dim` of `name`, dequantized to f32 and converted to
    /// `dtype` (the tensor's own when `None`), placed on `device`. Only the rows asked for (or,
    /// for a column range, the blocks covering it on each row) are read; returns the tensor and
    /// the number of bytes read.
    pub(crate) fn load_range(
        &self,
        name: &str,
        dim: usize,
        start: usize,
        len: usize,
        dtype: Option<DType>,
        device: &Device,
    ) -> Result<(Tensor, usize)> {
        let e = self.entry(name)?;
        self.check_range(name, e, dim, start, len)?;
        let data = self.file.tensor_data(&self.file.tensors()[e.tensor]);
        let (q, block) = (e.qtype, e.qtype.block_elems());
        let mut out_dims = e.dims.clone();
        out_dims[dim] = len;
        let (values, read) = if e.dims.len() == 1 {
            // A vector: its entries, through the row order (a rotary bias); an expert's row of a
            // stacked 2-D tensor is its stored row `row_offset`.
            let data = &data[e.row_offset * e.row_bytes..(e.row_offset + 1) * e.row_bytes];
            let mut all = vec![0f32; e.dims[0]];
            dequantize(q, data, &mut all).map_err(|err| self.fail(name, err.to_string()))?;
            let v = (start..start + len).map(|i| all[stored_row(e.rows, e.dims[0], i)]).collect();
            (v, data.len())
        } else {
            let (rows, cols) = (e.dims[0], e.dims[1]);
            let row_bytes = e.row_bytes;
            let (r_range, c_range) =
                if dim == 0 { (start..start + len, 0..cols) } else { (0..rows, start..start + len) };
            // Whole blocks covering the columns.
            let (b0, b1) = (c_range.start / block, c_range.end.div_ceil(block));
            let bytes_per_block = q.block_bytes();
            let mut v = Vec::with_capacity(r_range.len() * c_range.len());
            let mut tmp = vec![0f32; (b1 - b0) * block];
            for r in r_range.clone() {
                let s = e.row_offset + stored_row(e.rows, rows, r);
                let row = &data[s * row_bytes..(s + 1) * row_bytes];
                dequantize(q, &row[b0 * bytes_per_block..b1 * bytes_per_block], &mut tmp)
                    .map_err(|err| self.fail(name, err.to_string()))?;
                let off = c_range.start - b0 * block;
                v.extend_from_slice(&tmp[off..off + c_range.len()]);
            }
            (v, r_range.len() * (b1 - b0) * bytes_per_block)
        };
        let values = if e.shift != 0.0 { values.into_iter().map(|x| x + e.shift).collect() } else { values };
        let own = self.info(name)?.0;
        let t = Tensor::from_vec(values, &out_dims, &Device::Cpu)?.to_dtype(dtype.unwrap_or(own))?;
        Ok((t.to_device(device)?, read))
    }

    /// Entries `start..start + len` of dim `dim` of the 2-D `name` as quantized blocks: rows
    /// (dim 0) are those rows' bytes; columns (dim 1) the blocks covering them on every row,
    /// padded as [`QuantWeight`] describes.
    pub(crate) fn quant_range(&self, name: &str, dim: usize, start: usize, len: usize) -> Result<QuantWeight> {
        let e = self.entry(name)?;
        if e.dims.len() != 2 || e.shift != 0.0 {
            return Err(self.fail(name, "only a 2-D weight is kept as quantized blocks".into()));
        }
        self.check_range(name, e, dim, start, len)?;
        let data = self.file.tensor_data(&self.file.tensors()[e.tensor]);
        let (q, block) = (e.qtype, e.qtype.block_elems());
        let (rows, cols) = (e.dims[0], e.dims[1]);
        let row_bytes = e.row_bytes;
        let (r_range, c_range) = if dim == 0 { (start..start + len, 0..cols) } else { (0..rows, start..start + len) };
        let (b0, b1) = (c_range.start / block, c_range.end.div_ceil(block));
        let (from, to) = (b0 * q.block_bytes(), b1 * q.block_bytes());
        let mut bytes = Vec::with_capacity(r_range.len() * (to - from));
        for r in r_range.clone() {
            let s = e.row_offset + stored_row(e.rows, rows, r);
            bytes.extend_from_slice(&data[s * row_bytes + from..s * row_bytes + to]);
        }
        let k = (b1 - b0) * block;
        Ok(QuantWeight::new(q, r_range.len(), k, c_range.start - b0 * block, c_range.len(), bytes)?)
    }
}

/// The stored row of Hugging Face row `r` of a tensor of `rows` rows.
fn stored_row(order: RowOrder, rows: usize, r: usize) -> usize {
    match order {
        RowOrder::Stored => r,
        RowOrder::Rotary { heads } => {
            let d = rows / heads;
            let (h, i) = (r / d, r % d);
            let (w, j) = (i / (d / 2), i % (d / 2));
            h * d + 2 * j + w
        }
    }
}

/// A dim the reader validated (it fits the file, so it fits a `usize`).
fn to_usize(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotary_rows_follow_llama_cpp_permute() {
        // llama.cpp: w.reshape(heads, 2, d/2, ..).swapaxes(1, 2): stored (h, j, w) = HF (h, w, j).
        let (heads, d) = (3, 8);
        let mut seen = vec![false; heads * d];
        for r in 0..heads * d {
            let s = stored_row(RowOrder::Rotary { heads }, heads * d, r);
            let (h, i) = (r / d, r % d);
            assert_eq!(s, h * d + 2 * (i % (d / 2)) + i / (d / 2), "row {r}");
            seen[s] = true;
        }
        assert!(seen.iter().all(|&s| s), "a permutation");
    }
}
