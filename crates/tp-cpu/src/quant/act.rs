//! Activation quantization: the rows of `x` cut into blocks of 32 (Q8_0, for the legacy weight
//! types) or 256 (Q8_K, for the K-quants) and each block scaled to signed 8-bit integers once per
//! product, so that the dot products with the weights' integer codes run on integers.
//!
//! For a block with largest magnitude `amax`, the scale is `d = amax / 127` (in `f32`) and each
//! element becomes `q = round(x / d)` (ties to even; `|q| <= 127`), so `|x - d q| <= d / 2 (1 +
//! 2^-20)`. Blocks whose `d` would be below `f32::MIN_POSITIVE` (`amax < 127 * 2^-126`) are
//! flushed to zero (`d = 0`, `q = 0`); blocks holding a NaN or an infinity get `d = NaN` (so the
//! products they enter are NaN). Unlike ggml's `block_q8_0` the scale stays in `f32`.
//!
//! Next to the codes each block keeps what the dot products need besides them: Q8_0 blocks
//! `d * sum(q)` (the legacy types' offsets and mins multiply it), Q8_K blocks the sums of `q` over
//! each 16 elements (`bsums`, as ggml's `block_q8_K`), which the K-quants' mins and offsets use.

/// The quantized rows of `x`: `m` rows of `k` codes and their per-block data. The `d` and `sx`
/// arrays carry `PAD` zeros past the last row, so vector code may read 8 blocks at a time.
pub(crate) struct QuantX {
    pub qs: Vec<i8>,
    /// Scale of block `b` of row `i` at `i * nb + b`.
    pub d: Vec<f32>,
    /// Q8_0 only: `d * sum(q)` per block.
    pub sx: Vec<f32>,
    /// Q8_K only: 16 sums of 16 codes per block, `(i * nb + b) * 16 + g`.
    pub bsums: Vec<i16>,
    /// Blocks per row, and elements per row.
    pub nb: usize,
    pub k: usize,
}

/// Zeros after the per-block arrays.
const PAD: usize = 8;

/// One row of a [`QuantX`].
#[derive(Clone, Copy)]
pub(crate) struct XRow<'a> {
    /// `k` codes.
    pub qs: &'a [i8],
    /// `nb` scales, then at least [`PAD`] more readable values.
    pub d: &'a [f32],
    /// As `d` (Q8_0; empty for Q8_K).
    pub sx: &'a [f32],
    /// `16 nb` sums (Q8_K; empty for Q8_0).
    pub bsums: &'a [i16],
}

impl QuantX {
    /// Quantizes `m` rows of `k` elements (`x.len() == m * k`, `k` a multiple of `block`, 32 or
    /// 256).
    pub(crate) fn new(x: &[f32], m: usize, k: usize, block: usize) -> QuantX {
        assert!(x.len() == m * k && k.is_multiple_of(block) && (block == 32 || block == 256), "QuantX: shape");
        let nb = k / block;
        let mut qx = QuantX {
            qs: vec![0; m * k],
            d: vec![0.0; m * nb + PAD],
            sx: if block == 32 { vec![0.0; m * nb + PAD] } else { Vec::new() },
            bsums: if block == 256 { vec![0; m * nb * 16] } else { Vec::new() },
            nb,
            k,
        };
        for (b, (xb, qb)) in x.chunks_exact(block).zip(qx.qs.chunks_exact_mut(block)).enumerate() {
            let d = quantize_block(xb, qb);
            qx.d[b] = d;
            if block == 32 {
                let sum: i32 = qb.iter().map(|&q| i32::from(q)).sum();
                qx.sx[b] = d * sum as f32;
            } else {
                for (g, s) in qx.bsums[b * 16..][..16].iter_mut().enumerate() {
                    *s = qb[g * 16..][..16].iter().map(|&q| i16::from(q)).sum();
                }
            }
        }
        qx
    }

    /// Row `i`.
    pub(crate) fn row(&self, i: usize) -> XRow<'_> {
        let nb = self.nb;
        XRow {
            qs: &self.qs[i * self.k..][..self.k],
            d: &self.d[i * nb..],
            sx: if self.sx.is_empty() { &[] } else { &self.sx[i * nb..] },
            bsums: if self.bsums.is_empty() { &[] } else { &self.bsums[i * nb * 16..][..nb * 16] },
        }
    }
}

/// Quantizes one block: writes `q` and returns its scale `d` (see the module docs). Inlined, so
/// that vectorised callers vectorise it too (the same operations, so the same results).
#[inline(always)]
pub(crate) fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
    // Lane-wise (8 lanes, so it vectorises): the largest magnitude, and `Σ v * 0`, which is NaN
    // exactly when some `v` is a NaN or an infinity.
    let (mut max, mut probe) = ([0f32; 8], [0f32; 8]);
    for chunk in x.chunks_exact(8) {
        for l in 0..8 {
            max[l] = max[l].max(chunk[l].abs());
            probe[l] += chunk[l] * 0.0;
        }
    }
    if probe.iter().any(|p| p.is_nan()) {
        q.fill(0);
        return f32::NAN;
    }
    let d = max.iter().fold(0f32, |a, &m| a.max(m)) / 127.0;
    if d < f32::MIN_POSITIVE {
        q.fill(0);
        return 0.0;
    }
    for (q, &v) in q.iter_mut().zip(x) {
        // |v / d| <= 127 (1 + 2^-23) rounds to at most 127 anyway.
        *q = round_to_int((v / d).clamp(-127.0, 127.0)) as i8;
    }
    d
}

/// `1.5 * 2^23`: added to an `f32` of magnitude at most `2^22`, it leaves no fraction bits.
const MAGIC: f32 = 12_582_912.0;

/// [`round_ties_even`] of `v` (`|v| <= 2^22`) as an integer: the low bits of `v + MAGIC`.
/// Integer arithmetic only, so it vectorises where a float-to-int cast would not.
#[inline(always)]
fn round_to_int(v: f32) -> i32 {
    (v + MAGIC).to_bits() as i32 - MAGIC.to_bits() as i32
}

/// `v` rounded to the nearest integer, ties to even, for `|v| <= 2^22`: adding and subtracting
/// [`MAGIC`] leaves no fraction bits, and IEEE addition rounds ties to even. (The same value as
/// `f32::round_ties_even`, which the baseline x86-64 target turns into a library call per element.)
#[cfg(test)]
fn round_ties_even(v: f32) -> f32 {
    (v + MAGIC) - MAGIC
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element is within `d / 2` of `d * q`, the sums match the codes, and special blocks
    /// (zeros, tiny, non-finite) get the documented scales.
    #[test]
    fn blocks_round_to_nearest_and_keep_their_sums() {
        let mut s = 0x1234_5678_9abc_def1u64;
        let x: Vec<f32> = (0..2 * 512)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let v = ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0;
                if i / 256 == 1 { v * 1e-3 } else { v }
            })
            .collect();
        for block in [32, 256] {
            let qx = QuantX::new(&x, 2, 512, block);
            for i in 0..2 {
                let row = qx.row(i);
                for b in 0..qx.nb {
                    let d = row.d[b];
                    let mut sum = 0i32;
                    for l in 0..block {
                        let (v, q) = (x[i * 512 + b * block + l], row.qs[b * block + l]);
                        assert!((v - d * f32::from(q)).abs() <= d / 2.0 * (1.0 + 1e-6), "{block} {i} {b} {l}");
                        sum += i32::from(q);
                    }
                    if block == 32 {
                        assert_eq!(row.sx[b], d * sum as f32);
                    } else {
                        assert_eq!(row.bsums[b * 16..][..16].iter().map(|&v| i32::from(v)).sum::<i32>(), sum);
                    }
                }
            }
        }
        let mut q = [1i8; 32];
        assert_eq!(quantize_block(&[0.0; 32], &mut q), 0.0);
        assert_eq!(quantize_block(&[1e-40; 32], &mut q), 0.0);
        assert_eq!(q, [0; 32]);
        for v in [0.5f32, 1.5, 2.5, -0.5, -2.5, 126.5, -127.5, 3.49, 0.0, -0.0, 4e6, -4e6] {
            assert_eq!(round_ties_even(v), v.round_ties_even(), "{v}");
            assert_eq!(round_to_int(v), v.round_ties_even() as i32, "{v}");
        }
        let mut bad = [1.0f32; 32];
        bad[3] = f32::INFINITY;
        assert!(quantize_block(&bad, &mut q).is_nan());
    }
}
