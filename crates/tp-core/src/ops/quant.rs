//! [`QuantWeight`]: a linear layer's weight held as llama.cpp's quantized blocks, and
//! [`Tensor::linear_quant`], `y = x W^T (+ b)` straight from those blocks.
//!
//! `W: [out, width]` is one or more *parts* stacked along the rows (a fused q/k/v or gate/up
//! weight whose parts a GGUF file stores as separate tensors, each of its own type: a Q4_K_M
//! file mixes Q4_K and Q6_K). Every part's rows have the same stored length `k`, a multiple of
//! each part's block (32 elements, or 256 for the K-quants). The logical input columns
//! `lead .. lead + width` of the stored rows are the layer's; the others (at most one block's
//! worth on each side) are there only because a rank's column range need not start or end on a
//! block boundary (a row-parallel shard at an uneven TP degree): `x` is placed at column `lead`
//! of a zero row of length `k`, so the columns outside the range meet zeros and add nothing,
//! exactly. The cost is the padding's bytes, read on every product.
//!
//! The host product quantizes `x` per block to 8 bits (tp-cpu's [`tp_cpu::quant`]) and takes
//! integer dot products with f32 accumulation; its error against the exact product of the
//! dequantized weight is bounded in [`tp_cpu::quant::quant_matmul`]'s documentation.

use crate::{DType, Device, Error, Result, Tensor};
use std::sync::Arc;
use tp_cpu::WeightBuf;
use tp_cpu::quant::{QuantPart, QuantType, RowLayout, quant_matmul_parts, to_layout};

const OP: &str = "linear_quant";

/// One block of rows of a [`QuantWeight`], of one type.
#[derive(Debug, Clone)]
struct Part {
    qtype: QuantType,
    rows: usize,
    /// `rows * qtype.row_bytes(k)` bytes on huge pages where the system allows ([`WeightBuf`]:
    /// decode streams them every token), in `layout`.
    data: Arc<WeightBuf>,
    /// How the rows are stored: the layout the host decode kernels read fastest
    /// ([`RowLayout::preferred`]: Q4_0, Q4_K and Q6_K rows eight at a time; ggml's for the others).
    layout: RowLayout,
}

impl Part {
    /// The part as tp-cpu's products take it.
    fn as_part(&self) -> QuantPart<'_> {
        QuantPart { t: self.qtype, w: &self.data[..], rows: self.rows, layout: self.layout }
    }
}

/// A weight `[out, width]` held as quantized blocks (host memory), for
/// [`Tensor::linear_quant`].
#[derive(Debug, Clone)]
pub struct QuantWeight {
    parts: Vec<Part>,
    /// Stored row length in elements.
    k: usize,
    /// Zero columns before the layer's input within a stored row.
    lead: usize,
    /// The layer's input features.
    width: usize,
}

impl QuantWeight {
    /// One part: `rows` rows of `k` elements of type `qtype` (`data`: exactly
    /// `rows * qtype.row_bytes(k)` bytes), of which columns `lead .. lead + width` are the
    /// layer's input.
    ///
    /// Errors: `k` not a multiple of the type's block, a byte count that does not match, or
    /// `lead + width > k`.
    pub fn new(qtype: QuantType, rows: usize, k: usize, lead: usize, width: usize, mut data: Vec<u8>) -> Result<Self> {
        let row_bytes = qtype.row_bytes(k).ok_or_else(|| Error::InvalidArgument {
            op: OP,
            why: format!("a row of {k} elements is not whole {} blocks of {}", qtype.name(), qtype.block_elems()),
        })?;
        if rows.checked_mul(row_bytes) != Some(data.len()) {
            return Err(Error::InvalidArgument {
                op: OP,
                why: format!(
                    "{rows} rows of {k} {} elements take {rows} x {row_bytes} bytes, got {}",
                    qtype.name(),
                    data.len()
                ),
            });
        }
        if lead.checked_add(width).is_none_or(|end| end > k) || width == 0 {
            return Err(Error::InvalidArgument {
                op: OP,
                why: format!("input columns {lead}..{lead}+{width} do not lie within a stored row of {k}"),
            });
        }
        let layout = RowLayout::preferred(qtype);
        to_layout(qtype, layout, &mut data, row_bytes)?;
        Ok(QuantWeight {
            parts: vec![Part { qtype, rows, data: Arc::new(WeightBuf::from_slice(&data)), layout }],
            k,
            lead,
            width,
        })
    }

    /// The weights stacked along the rows, in order (their outputs side by side).
    ///
    /// Errors: no weight, or weights whose stored rows or input columns differ.
    pub fn stack(weights: &[QuantWeight]) -> Result<QuantWeight> {
        let first = weights.first().ok_or_else(|| Error::InvalidArgument { op: OP, why: "nothing to stack".into() })?;
        let mut out = first.clone();
        for w in &weights[1..] {
            if (w.k, w.lead, w.width) != (first.k, first.lead, first.width) {
                return Err(Error::InvalidArgument {
                    op: OP,
                    why: format!(
                        "cannot stack rows of {} stored / {}+{} input columns on rows of {} / {}+{}",
                        w.k, w.lead, w.width, first.k, first.lead, first.width
                    ),
                });
            }
            out.parts.extend(w.parts.iter().cloned());
        }
        Ok(out)
    }

    /// Output features (rows of every part).
    pub fn out_features(&self) -> usize {
        self.parts.iter().map(|p| p.rows).sum()
    }
    /// Input features.
    pub fn in_features(&self) -> usize {
        self.width
    }
    /// Stored row length and the input's first column in it.
    pub fn stored(&self) -> (usize, usize) {
        (self.k, self.lead)
    }
    /// Each part's type and rows.
    pub fn parts(&self) -> impl Iterator<Item = (QuantType, usize)> + '_ {
        self.parts.iter().map(|p| (p.qtype, p.rows))
    }
    /// Bytes held (what one product reads).
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(|p| p.data.len()).sum()
    }
    /// Where the blocks live (host memory).
    pub fn device(&self) -> Device {
        Device::Cpu
    }

    /// The weight as f32 `[out, width]`, each element as ggml (and the gguf package)
    /// dequantizes it: what a frozen quantized layer's input gradient `dY W` multiplies by.
    pub fn dequantize(&self) -> Result<Tensor> {
        let (k, lead, width) = (self.k, self.lead, self.width);
        let mut out = Vec::with_capacity(self.out_features() * width);
        for p in &self.parts {
            let rows = tp_cpu::quant::dequantize_part(&p.as_part(), k)?;
            for row in rows.chunks_exact(k.max(1)) {
                out.extend_from_slice(&row[lead..lead + width]);
            }
        }
        Tensor::from_vec(out, &[self.out_features(), width], &Device::Cpu)
    }
}

impl Tensor {
    /// `x W^T + b` for `x: [.., width]` (self) and a quantized `W: [out, width]`, in f32:
    /// `x` is converted to f32, the result is `[.., out]` in `x`'s dtype, the bias (`[out]`,
    /// any float dtype) added in f32.
    ///
    /// Errors: a CUDA tensor, an integer dtype, a last dim other than `width`, a bias of another
    /// length.
    pub fn linear_quant(&self, w: &QuantWeight, bias: Option<&Tensor>) -> Result<Tensor> {
        crate::phase::timed(crate::phase::Phase::Gemm, || self.linear_quant_untimed(w, bias))
    }

    fn linear_quant_untimed(&self, w: &QuantWeight, bias: Option<&Tensor>) -> Result<Tensor> {
        self.require_float()?;
        if self.device() != Device::Cpu {
            return Err(Error::UnsupportedDevice { op: OP, device: self.device() });
        }
        let (&width, lead_dims) = self.dims().split_last().ok_or_else(|| Error::RankMismatch {
            op: OP,
            expected: "at least 1",
            dims: vec![],
        })?;
        if width != w.width {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.dims().to_vec(),
                rhs: vec![w.out_features(), w.width],
                why: "the input's last dim must be the weight's input features",
            });
        }
        let out = w.out_features();
        if let Some(b) = bias
            && b.dims() != [out]
        {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: b.dims().to_vec(),
                rhs: vec![out],
                why: "bias must be [out]",
            });
        }
        let m: usize = lead_dims.iter().product();
        let x = self.to_dtype(DType::F32)?;
        let padded = stored_input(x.as_slice::<f32>()?, m, w);
        let xs = &padded[..];
        let mut y = vec![0f32; m * out];
        // Each part's outputs are a block of columns of `y`; one pass over all of them.
        let parts: Vec<QuantPart<'_>> = w.parts.iter().map(Part::as_part).collect();
        quant_matmul_parts(&parts, w.k, xs, m, &mut y)?;
        if let Some(b) = bias {
            let b = b.to_dtype(DType::F32)?;
            let b = b.as_slice::<f32>()?;
            for row in y.chunks_exact_mut(out) {
                row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
            }
        }
        let mut dims = lead_dims.to_vec();
        dims.push(out);
        Tensor::from_vec(y, &dims, &Device::Cpu)?.to_dtype(self.dtype())
    }
}

/// The input `x: [m, width]` at column `lead` of zero rows of the weight's stored length
/// (borrowed where they are the same).
fn stored_input<'a>(x: &'a [f32], m: usize, w: &QuantWeight) -> std::borrow::Cow<'a, [f32]> {
    if w.k == w.width {
        return std::borrow::Cow::Borrowed(x);
    }
    let mut p = vec![0f32; m * w.k];
    for (dst, src) in p.chunks_exact_mut(w.k).zip(x.chunks_exact(w.width)) {
        dst[w.lead..w.lead + w.width].copy_from_slice(src);
    }
    std::borrow::Cow::Owned(p)
}

impl Tensor {
    /// `act(x G^T) ⊙ (x U^T)` for `x: [.., width]` (self) and a quantized gate/up weight of two
    /// parts `[G; U]` (one type, one row count `I`) without a bias, where the host's integer
    /// GEMM takes the product (many rows on AVX512-VNNI; see
    /// [`tp_cpu::quant::quant_matmul_paired`]): the activation is applied to each task's
    /// outputs as they are made, so the `[.., 2I]` product is never written. Bitwise
    /// `self.linear_quant(w, None)?.glu(act)` (the product rounded to `x`'s dtype first, as that
    /// would); `None` where the fused path does not apply (the caller runs those two).
    ///
    /// Errors: those of [`linear_quant`](Self::linear_quant).
    pub fn linear_quant_glu(&self, w: &QuantWeight, act: super::elementwise::Activation) -> Result<Option<Tensor>> {
        crate::phase::timed(crate::phase::Phase::Gemm, || self.linear_quant_glu_untimed(w, act))
    }

    fn linear_quant_glu_untimed(&self, w: &QuantWeight, act: super::elementwise::Activation) -> Result<Option<Tensor>> {
        let [gate, up] = &w.parts[..] else { return Ok(None) };
        if self.device() != Device::Cpu
            || !self.dtype().is_float()
            || self.dims().last() != Some(&w.width)
            || gate.qtype != up.qtype
            || gate.rows != up.rows
        {
            return Ok(None);
        }
        let lead_dims = &self.dims()[..self.ndim() - 1];
        let m: usize = lead_dims.iter().product();
        let x = self.to_dtype(DType::F32)?;
        let xs = stored_input(x.as_slice::<f32>()?, m, w);
        let mut y = vec![0f32; m * gate.rows];
        let done = crate::with_dtype!(self.dtype(), E => {
            let f = |g: &[f32], u: &[f32], o: &mut [f32]| super::elementwise::glu_pair::<E>(g, u, o, act);
            tp_cpu::quant::quant_matmul_paired(&gate.as_part(), &up.as_part(), w.k, &xs, m, &mut y, &f)?
        });
        if !done {
            return Ok(None);
        }
        let mut dims = lead_dims.to_vec();
        dims.push(gate.rows);
        // Every value is already one of the dtype's: the conversion is exact.
        Ok(Some(Tensor::from_vec(y, &dims, &Device::Cpu)?.to_dtype(self.dtype())?))
    }
}
