//! Paged KV caches in 8 bits (`--kv-cache-dtype fp8 | q8_0`): a [`QuantKvBuffer`] holds the
//! keys (or values) of `[num_blocks, block_size, heads, head_dim]` as bytes, one *row* (one
//! slot's head, `head_dim` elements) after another, in one of two formats ([`KvQuant`]):
//!
//! * `Fp8E4M3`: each element one byte of OCP FP8 E4M3 (`e4m3fn`: bias 7, no infinities, largest
//!   finite 448, NaN `S.1111.111`), rounded to nearest (ties to even) and saturated to ±448, as
//!   vLLM's `fp8` cache stores keys and values with its default scales of 1.0. Relative error
//!   at most `2^-4` for magnitudes in `[2^-6, 448]`, absolute error at most `2^-10` below.
//! * `Q8_0`: llama.cpp's `block_q8_0` (`--cache-type-k q8_0`), bit for bit: each 32 elements an
//!   `f16` scale `d = amax / 127` and 32 signed codes `q = round(x / d)` (half away from zero),
//!   decoded as `d q`; `head_dim` must be a multiple of 32.
//!
//! Writes quantize a row once; paged attention widens each row back to `f32` once per KV head
//! and range of rows it serves (`paged.rs`), so scores, softmax and sums run as over an `f32`
//! cache holding the decoded values, bitwise. Host only.

use super::paged::{KvBuffer, check_slots};
use crate::{Element, Error, Result, Tensor, f16, with_dtype};

/// How an 8-bit KV cache stores its elements (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvQuant {
    /// One byte of FP8 E4M3 (`e4m3fn`) per element, saturating at ±448.
    Fp8E4M3,
    /// llama.cpp's `block_q8_0`: an `f16` scale and 32 signed bytes per 32 elements.
    Q8_0,
}

/// Elements of a `Q8_0` block, and its bytes (`f16` scale, 32 codes).
const Q8_BLOCK: usize = 32;
const Q8_BYTES: usize = 2 + Q8_BLOCK;

impl KvQuant {
    /// The format's name as the flag spells it: `fp8` or `q8_0`.
    pub fn name(self) -> &'static str {
        match self {
            KvQuant::Fp8E4M3 => "fp8",
            KvQuant::Q8_0 => "q8_0",
        }
    }

    /// Bytes of one row of `head_dim` elements, or `None` when this format cannot hold such a
    /// row (`Q8_0` needs whole blocks of 32; zero is no row).
    pub fn row_bytes(self, head_dim: usize) -> Option<usize> {
        match self {
            _ if head_dim == 0 => None,
            KvQuant::Fp8E4M3 => Some(head_dim),
            KvQuant::Q8_0 => head_dim.is_multiple_of(Q8_BLOCK).then(|| head_dim / Q8_BLOCK * Q8_BYTES),
        }
    }

    /// `src` (one row) quantized into `dst` (`row_bytes(src.len())` bytes).
    fn encode(self, src: &[f32], dst: &mut [u8]) {
        match self {
            KvQuant::Fp8E4M3 => dst.iter_mut().zip(src).for_each(|(b, &x)| *b = fp8_e4m3(x)),
            KvQuant::Q8_0 => {
                for (x, blk) in src.chunks_exact(Q8_BLOCK).zip(dst.chunks_exact_mut(Q8_BYTES)) {
                    // ggml's `quantize_row_q8_0_ref`: the scale from the f32 `amax / 127`, the
                    // codes from its f32 reciprocal, `roundf`; the scale stored as f16.
                    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let d = amax / 127.0;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    blk[..2].copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
                    for (q, &v) in blk[2..].iter_mut().zip(x) {
                        *q = (v * id).round() as i8 as u8;
                    }
                }
            }
        }
    }

    /// One row (`row_bytes(dst.len())` bytes of `src`) decoded into `dst`: loops without
    /// branches or table reads, so that they vectorise where attention inlines them (the
    /// Q8_0 scale widened as the FP8 bytes are, exactly as `f16::to_f32`).
    #[inline(always)]
    pub(super) fn decode(self, src: &[u8], dst: &mut [f32]) {
        match self {
            KvQuant::Fp8E4M3 => {
                let (d16, dt) = dst.split_at_mut(dst.len() / 16 * 16);
                let (s16, st) = src.split_at(d16.len());
                for (y, b) in d16.chunks_exact_mut(16).zip(s16.chunks_exact(16)) {
                    for i in 0..16 {
                        y[i] = fp8_e4m3_to_f32(b[i]);
                    }
                }
                dt.iter_mut().zip(st).for_each(|(y, &b)| *y = fp8_e4m3_to_f32(b));
            }
            KvQuant::Q8_0 => {
                for (blk, y) in src.chunks_exact(Q8_BYTES).zip(dst.chunks_exact_mut(Q8_BLOCK)) {
                    let (Ok(blk), Ok(y)) = (<&[u8; Q8_BYTES]>::try_from(blk), <&mut [f32; Q8_BLOCK]>::try_from(y))
                    else {
                        continue; // (chunks_exact: never)
                    };
                    let d = f16_to_f32(u16::from_le_bytes([blk[0], blk[1]]));
                    for i in 0..Q8_BLOCK {
                        y[i] = d * f32::from(blk[2 + i] as i8);
                    }
                }
            }
        }
    }
}

/// An `f16`'s value from its bits: normals by moving the exponent and mantissa into an f32's
/// fields and rebiasing the exponent (+112) in integers; subnormals as `m · 2^-24`; infinities
/// and NaNs (exponent 31) keeping their mantissa bits. Exact, with no subnormal f32 operand.
#[inline(always)]
fn f16_to_f32(h: u16) -> f32 {
    let (low, sign) = (u32::from(h & 0x7FFF), u32::from(h & 0x8000) << 16);
    // One test for both rare cases (exponent 0 or 31), so the usual scale takes no branch but it.
    let mag = if low.wrapping_sub(0x400) < 0x7800 {
        f32::from_bits((low << 13) + (112 << 23))
    } else if low < 0x400 {
        low as f32 * (1.0 / 16_777_216.0)
    } else {
        f32::from_bits(0x7F80_0000 | ((low & 0x3FF) << 13))
    };
    f32::from_bits(mag.to_bits() | sign)
}

impl std::fmt::Display for KvQuant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The value of an FP8 E4M3 byte (`e4m3fn`: `S.EEEE.MMM`, bias 7; exponent 0 subnormal,
/// `m · 2^-9`; `S.1111.111` NaN): normals by moving the exponent and mantissa into an f32's
/// fields and rebiasing the exponent (+120) in integers, subnormals as `m · 2^-9`. Exact, with
/// no subnormal f32 operand (which costs a microcode assist on some cores).
#[inline(always)]
fn fp8_e4m3_to_f32(b: u8) -> f32 {
    let low = u32::from(b & 0x7F);
    let mag = if low == 0x7F {
        f32::NAN
    } else if low < 8 {
        low as f32 * (1.0 / 512.0)
    } else {
        f32::from_bits((low << 20) + (120 << 23))
    };
    f32::from_bits(mag.to_bits() | (u32::from(b & 0x80) << 24))
}

/// The FP8 E4M3 byte nearest `x` (ties to the even code), saturated to ±448 (`0x7E`); NaN to
/// `0x7F` with `x`'s sign.
pub(super) fn fp8_e4m3(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a.is_nan() {
        return sign | 0x7F;
    }
    let code = if a >= 512.0 {
        0x7E
    } else if a < 1.0 / 64.0 {
        // Subnormals (and the smallest normal, code 8): `a · 2^9` rounded, exactly.
        (a * 512.0).round_ties_even() as u32
    } else {
        // `a = 2^e (1 + f)` with `-6 <= e <= 8`: the mantissa rounded to 3 bits; a carry into
        // the exponent (`m == 16`) lands on the next binade's first code by the addition.
        let e = ((a.to_bits() >> 23) as i32) - 127;
        let m = (a * f32::from_bits(((127 + 3 - e) as u32) << 23)).round_ties_even() as u32;
        (((e + 7) as u32) << 3) + (m - 8)
    };
    sign | code.min(0x7E) as u8
}

/// One layer's keys (or values) of a paged cache in 8 bits: `[num_blocks, block_size, heads,
/// head_dim]`, each (slot, head) row of `head_dim` elements stored as [`KvQuant::row_bytes`]
/// bytes, rows in slot-then-head order. Zeroed rows decode to zeros. Host memory only.
#[derive(Debug, Clone)]
pub struct QuantKvBuffer {
    quant: KvQuant,
    dims: [usize; 4],
    row_bytes: usize,
    data: Vec<u8>,
}

impl QuantKvBuffer {
    /// A zeroed buffer of `dims = [num_blocks, block_size, heads, head_dim]`.
    ///
    /// Errors: [`Error::InvalidArgument`] for a zero size or a `head_dim` the format cannot
    /// hold (`q8_0`: not a multiple of 32); [`Error::ShapeOverflow`] past `MAX_TENSOR_BYTES`;
    /// [`Error::OutOfMemory`] when the bytes cannot be had.
    pub fn zeros(quant: KvQuant, dims: [usize; 4]) -> Result<QuantKvBuffer> {
        const OP: &str = "QuantKvBuffer::zeros";
        if dims.contains(&0) {
            return Err(Error::InvalidArgument { op: OP, why: format!("every size must be > 0, got {dims:?}") });
        }
        let Some(row_bytes) = quant.row_bytes(dims[3]) else {
            return Err(Error::InvalidArgument {
                op: OP,
                why: format!("a {quant} KV cache needs head_dim a multiple of 32, got {}", dims[3]),
            });
        };
        let bytes = dims[..3]
            .iter()
            .try_fold(row_bytes, |acc, &d| acc.checked_mul(d))
            .filter(|&b| b <= crate::MAX_TENSOR_BYTES)
            .ok_or_else(|| Error::ShapeOverflow { dims: dims.to_vec() })?;
        let mut data = Vec::new();
        data.try_reserve_exact(bytes).map_err(|_| Error::OutOfMemory { op: OP, bytes })?;
        data.resize(bytes, 0);
        Ok(QuantKvBuffer { quant, dims, row_bytes, data })
    }

    /// `[num_blocks, block_size, heads, head_dim]`.
    pub fn dims(&self) -> [usize; 4] {
        self.dims
    }

    /// The storage format.
    pub fn quant(&self) -> KvQuant {
        self.quant
    }

    /// Bytes held.
    pub fn size_in_bytes(&self) -> usize {
        self.data.len()
    }

    /// Bytes of one (slot, head) row.
    pub(super) fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// The rows, slot after slot, head after head.
    pub(super) fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// Quantizes row `t` of `src: [T, heads, head_dim]` (any float dtype, on the host) into flat
    /// slot `slots[t]` (`block · block_size + offset`), as [`Tensor::write_slots`] does for a
    /// dense cache.
    ///
    /// Errors (nothing written): those of [`Tensor::write_slots`], and
    /// [`Error::UnsupportedDevice`] for a source off the host.
    pub fn write_slots(&mut self, src: &Tensor, slots: &[usize]) -> Result<()> {
        const OP: &str = "write_slots";
        src.require_float()?;
        check_slots(OP, &self.dims, src.dims(), slots)?;
        let row = self.dims[2] * self.dims[3];
        let from = src.cpu_storage(OP)?;
        let (quant, rb, heads) = (self.quant, self.row_bytes, self.dims[2]);
        crate::phase::timed(crate::phase::Phase::Attention, || -> Result<()> {
            with_dtype!(from.dtype(), E => {
                let s = from.as_slice::<E>().unwrap_or_default();
                let mut wide = vec![0f32; row];
                for (i, &slot) in slots.iter().enumerate() {
                    E::slice_to_f32(&s[i * row..(i + 1) * row], &mut wide);
                    let dst = &mut self.data[slot * heads * rb..(slot + 1) * heads * rb];
                    for (x, y) in wide.chunks_exact(self.dims[3]).zip(dst.chunks_exact_mut(rb)) {
                        quant.encode(x, y);
                    }
                }
            });
            Ok(())
        })
    }

    /// The decoded buffer as an `f32` tensor of the same dims (for checks and inspection).
    pub fn to_f32_tensor(&self) -> Result<Tensor> {
        let d = self.dims[3];
        let mut out = vec![0f32; self.data.len() / self.row_bytes * d];
        for (src, dst) in self.data.chunks_exact(self.row_bytes).zip(out.chunks_exact_mut(d)) {
            self.quant.decode(src, dst);
        }
        Tensor::from_vec(out, &self.dims, &crate::Device::Cpu)
    }

    /// This buffer as paged attention reads it.
    pub fn as_kv(&self) -> KvBuffer<'_> {
        KvBuffer::Quant(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every finite code decodes and encodes back to itself; NaN codes stay NaN; the extremes
    /// and the signs are where the format puts them.
    #[test]
    fn every_fp8_code_round_trips() {
        for c in 0..=255u8 {
            let v = fp8_e4m3_to_f32(c);
            if c & 0x7F == 0x7F {
                assert!(v.is_nan(), "{c:#x}");
                assert_eq!(fp8_e4m3(v) & 0x7F, 0x7F);
            } else {
                assert_eq!(fp8_e4m3(v), c, "{c:#x} = {v}");
                assert_eq!(v.is_sign_negative(), c >= 0x80, "{c:#x} = {v}");
            }
        }
        assert_eq!(fp8_e4m3_to_f32(0x7E), 448.0);
        assert_eq!(fp8_e4m3_to_f32(0xFE), -448.0);
        assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(fp8_e4m3_to_f32(0x07), 7.0 * 2f32.powi(-9));
        assert_eq!(fp8_e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(fp8_e4m3_to_f32(0x38), 1.0);
    }

    /// Every `f16` widens as the `half` crate widens it (NaNs as NaNs).
    #[test]
    fn every_f16_widens_exactly() {
        for h in 0..=u16::MAX {
            let (got, want) = (f16_to_f32(h), f16::from_bits(h).to_f32());
            assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{h:#x}: {got} vs {want}");
        }
    }
}
