//! The byte layouts of ggml's quantized blocks (`ggml-common.h`), and a scalar decoder that turns
//! one block into signed integer codes with integer group scales ([`Decoded`]), which the portable
//! dot products and the dequantization share.
//!
//! Layouts (offsets in bytes; `f16` little-endian; "element `e`" counts from the block's start):
//!
//! | type | bytes | fields |
//! |------|-------|--------|
//! | Q4_0 | 18  | `d` f16 @0, `qs[16]` @2: element `e < 16` is the low nibble of `qs[e]`, `e >= 16` the high nibble of `qs[e - 16]` |
//! | Q4_1 | 20  | `d` @0, `m` @2, `qs[16]` @4 (as Q4_0) |
//! | Q5_0 | 22  | `d` @0, `qh` u32 @2 (bit `e` is element `e`'s 5th bit), `qs[16]` @6 |
//! | Q5_1 | 24  | `d` @0, `m` @2, `qh` @4, `qs[16]` @8 |
//! | Q8_0 | 34  | `d` @0, `qs[32]` i8 @2 |
//! | Q2_K | 84  | `scales[16]` @0 (low nibble scale, high nibble min, per 16 elements), `qs[64]` @16, `d` @80, `dmin` @82 |
//! | Q3_K | 110 | `hmask[32]` @0, `qs[64]` @32, `scales[12]` @96 (16 packed 6-bit values), `d` @108 |
//! | Q4_K | 144 | `d` @0, `dmin` @2, `scales[12]` @4 (8 scales and 8 mins, 6 bits each), `qs[128]` @16 |
//! | Q5_K | 176 | `d` @0, `dmin` @2, `scales[12]` @4, `qh[32]` @16, `qs[128]` @48 |
//! | Q6_K | 210 | `ql[128]` @0, `qh[64]` @128, `scales[16]` i8 @192, `d` @208 |
//! | MXFP4 | 17 | `e` u8 @0 (E8M0: `d = 2^(e-128)`, ggml's half scale), `qs[16]` @1 (as Q4_0), each code `kvalues[q]` |
//!
//! In the K-quants, 2-bit codes of element `e = 128 j + 32 s + l` (`l < 32`) sit at bits `2s..2s+2`
//! of byte `32 j + l` (Q2_K, Q3_K `qs`, Q6_K `qh`); the 1-bit planes (Q3_K `hmask`, Q5_K `qh`) put
//! element `e = 32 b + l` at bit `b` of byte `l`; 4-bit codes of element `e = 64 c + 32 h + l` sit
//! in nibble `h` of byte `32 c + l` (Q4_K, Q5_K), and Q6_K's low nibbles of `e = 128 j + 64 h + l`
//! (`l < 64`) in nibble `h` of `ql[64 j + l]`. Q3_K's 3-bit code is `low2 - 4` when its `hmask`
//! bit is clear and `low2` when set; Q6_K's code is `ql | qh << 4` minus 32.

use super::types::QuantType;

/// Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0: offsets of the nibbles / codes, and of `qh`.
pub(crate) const Q4_0_QS: usize = 2;
pub(crate) const Q4_1_QS: usize = 4;
pub(crate) const Q5_0_QH: usize = 2;
pub(crate) const Q5_0_QS: usize = 6;
pub(crate) const Q5_1_QH: usize = 4;
pub(crate) const Q5_1_QS: usize = 8;
pub(crate) const Q8_0_QS: usize = 2;
/// MXFP4's codes, after its scale byte.
pub(crate) const MXFP4_QS: usize = 1;
/// MXFP4's code values, doubled (`kvalues_mxfp4`: FP4 E2M1 `±{0, .5, 1, 1.5, 2, 3, 4, 6}` times
/// 2, so that they are integers; the scale is halved to match).
pub(crate) const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// ggml's `GGML_E8M0_TO_FP32_HALF`: `2^(e - 128)` for an E8M0 byte `e` (subnormal below `e = 2`).
#[inline(always)]
pub(crate) fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 { 0x0020_0000u32 << e } else { (u32::from(e) - 1) << 23 };
    f32::from_bits(bits)
}
/// Q2_K fields.
pub(crate) const Q2K_QS: usize = 16;
pub(crate) const Q2K_D: usize = 80;
pub(crate) const Q2K_DMIN: usize = 82;
/// Q3_K fields.
pub(crate) const Q3K_QS: usize = 32;
pub(crate) const Q3K_SCALES: usize = 96;
pub(crate) const Q3K_D: usize = 108;
/// Q4_K / Q5_K fields (`d` @0, `dmin` @2).
pub(crate) const K4_SCALES: usize = 4;
pub(crate) const Q4K_QS: usize = 16;
pub(crate) const Q5K_QH: usize = 16;
pub(crate) const Q5K_QS: usize = 48;
/// Q6_K fields.
pub(crate) const Q6K_QH: usize = 128;
pub(crate) const Q6K_SCALES: usize = 192;
pub(crate) const Q6K_D: usize = 208;

/// The little-endian `f16` at `b[at..at + 2]`, widened (exactly) to `f32`. (`half`'s integer
/// conversion, which inlines; its `to_f32` checks for F16C on every call.)
#[inline(always)]
pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32_const()
}

/// The little-endian `u32` at `b[at..at + 4]`.
#[inline(always)]
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Q4_K / Q5_K's 12 scale bytes: 8 six-bit scales and 8 six-bit mins (`get_scale_min_k4`).
/// Groups 0..4 keep their 6 bits in the low bits of bytes 0..4 (scales) and 4..8 (mins); groups
/// 4..8 take their low 4 bits from the nibbles of bytes 8..12 and their top 2 bits from the top
/// bits of bytes 0..4 (scales) and 4..8 (mins).
#[inline(always)]
pub(crate) fn k4_scales_mins(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    (sc, mn)
}

/// Q3_K's 12 scale bytes: 16 six-bit scales, minus 32. Scale `i`'s low 4 bits are the low
/// (`i < 8`) or high (`i >= 8`) nibble of byte `i % 8`; its top 2 bits are bits `2 (i / 4)` of
/// byte `8 + i % 4`.
#[inline(always)]
pub(crate) fn q3k_scales(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        let low = if i < 8 { s[i] & 0x0F } else { s[i - 8] >> 4 };
        let high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        *o = ((low | (high << 4)) as i8) - 32;
    }
    out
}

/// One block as signed integer codes and integer group scales. Element `e` of the block is
/// `(d * sc[g]) * q[e] - (dmin * mn[g])`, `g = e / group`, in `f32` with that order of
/// operations, which is the order ggml's reference (and the gguf Python package) uses for every
/// type: legacy blocks are one group with `sc = 1`, and `dmin = -m`, `mn = 1` for Q4_1 / Q5_1.
pub(crate) struct Decoded {
    /// Signed codes, `block_elems` of them.
    pub q: [i8; 256],
    /// Integer scale of each group.
    pub sc: [i16; 16],
    /// Integer min of each group (zero for types without mins).
    pub mn: [i16; 16],
    /// Elements per group: 32 (legacy, Q4_K, Q5_K) or 16 (Q2_K, Q3_K, Q6_K).
    pub group: usize,
    pub d: f32,
    pub dmin: f32,
}

impl Decoded {
    pub(crate) fn new() -> Decoded {
        Decoded { q: [0; 256], sc: [1; 16], mn: [0; 16], group: 32, d: 0.0, dmin: 0.0 }
    }

    /// Decodes block `b` (exactly `t.block_bytes()` bytes) of quantized type `t`. Inlined, so
    /// that the vectorised builds of the dequantization vectorise it too.
    #[inline(always)]
    pub(crate) fn decode(&mut self, t: QuantType, b: &[u8]) {
        assert_eq!(b.len(), t.block_bytes(), "decode: one block");
        match t {
            QuantType::Q4_0 => self.legacy(b, Q4_0_QS, None, 8, None),
            QuantType::Q4_1 => self.legacy(b, Q4_1_QS, None, 0, Some(f16_at(b, 2))),
            QuantType::Q5_0 => self.legacy(b, Q5_0_QS, Some(u32_at(b, Q5_0_QH)), 16, None),
            QuantType::Q5_1 => self.legacy(b, Q5_1_QS, Some(u32_at(b, Q5_1_QH)), 0, Some(f16_at(b, 2))),
            QuantType::Q8_0 => {
                for (q, &v) in self.q[..32].iter_mut().zip(&b[Q8_0_QS..]) {
                    *q = v as i8;
                }
                self.set_legacy(f16_at(b, 0), None);
            }
            QuantType::Q2K => self.q2k(b),
            QuantType::Q3K => self.q3k(b),
            QuantType::Q4K | QuantType::Q5K => self.q45k(t, b),
            QuantType::Q6K => self.q6k(b),
            QuantType::Mxfp4 => {
                let nibbles = &b[MXFP4_QS..MXFP4_QS + 16];
                for (l, &v) in nibbles.iter().enumerate() {
                    self.q[l] = MXFP4_VALUES[usize::from(v & 0x0F)];
                    self.q[l + 16] = MXFP4_VALUES[usize::from(v >> 4)];
                }
                self.set_legacy(e8m0_half(b[0]), None);
            }
            QuantType::F32 | QuantType::F16 | QuantType::BF16 => unreachable!("decode: float types have no blocks"),
        }
    }

    /// One group of 32 with `sc = 1`; `m` (Q4_1 / Q5_1) becomes `dmin = -m`, `mn = 1`.
    #[inline(always)]
    fn set_legacy(&mut self, d: f32, m: Option<f32>) {
        self.group = 32;
        self.d = d;
        self.sc[0] = 1;
        (self.dmin, self.mn[0]) = match m {
            Some(m) => (-m, 1),
            None => (0.0, 0),
        };
    }

    /// Q4_0 / Q4_1 / Q5_0 / Q5_1: nibbles at `qs`, 5th bits in `qh`, minus `offset`.
    #[inline(always)]
    fn legacy(&mut self, b: &[u8], qs: usize, qh: Option<u32>, offset: u8, m: Option<f32>) {
        let qh = qh.unwrap_or(0);
        let nibbles = &b[qs..qs + 16];
        // Low nibbles are elements 0..16, high nibbles 16..32 (two simple loops vectorise).
        for (l, (q, &v)) in self.q[..16].iter_mut().zip(nibbles).enumerate() {
            *q = ((v & 0x0F) | ((((qh >> l) & 1) as u8) << 4)) as i8 - offset as i8;
        }
        for (l, (q, &v)) in self.q[16..32].iter_mut().zip(nibbles).enumerate() {
            *q = ((v >> 4) | ((((qh >> (l + 16)) & 1) as u8) << 4)) as i8 - offset as i8;
        }
        self.set_legacy(f16_at(b, 0), m);
    }

    #[inline(always)]
    fn q2k(&mut self, b: &[u8]) {
        for j in 0..2 {
            for s in 0..4 {
                for l in 0..32 {
                    self.q[128 * j + 32 * s + l] = ((b[Q2K_QS + 32 * j + l] >> (2 * s)) & 3) as i8;
                }
            }
        }
        for ((sc, mn), &v) in self.sc.iter_mut().zip(&mut self.mn).zip(&b[..16]) {
            (*sc, *mn) = (i16::from(v & 0x0F), i16::from(v >> 4));
        }
        (self.group, self.d, self.dmin) = (16, f16_at(b, Q2K_D), f16_at(b, Q2K_DMIN));
    }

    #[inline(always)]
    fn q3k(&mut self, b: &[u8]) {
        for j in 0..2 {
            for s in 0..4 {
                for l in 0..32 {
                    let low = ((b[Q3K_QS + 32 * j + l] >> (2 * s)) & 3) as i8;
                    let high = (b[l] >> (4 * j + s)) & 1;
                    self.q[128 * j + 32 * s + l] = if high == 1 { low } else { low - 4 };
                }
            }
        }
        for (sc, v) in self.sc.iter_mut().zip(q3k_scales(&b[Q3K_SCALES..Q3K_SCALES + 12])) {
            *sc = i16::from(v);
        }
        self.mn = [0; 16];
        (self.group, self.d, self.dmin) = (16, f16_at(b, Q3K_D), 0.0);
    }

    /// Q4_K (`qh` absent) and Q5_K.
    #[inline(always)]
    fn q45k(&mut self, t: QuantType, b: &[u8]) {
        let (qs, qh) = if t == QuantType::Q5K { (Q5K_QS, Some(Q5K_QH)) } else { (Q4K_QS, None) };
        for c in 0..4 {
            for h in 0..2 {
                for l in 0..32 {
                    let e = 64 * c + 32 * h + l;
                    let low = (b[qs + 32 * c + l] >> (4 * h)) & 0x0F;
                    let high = qh.map_or(0, |qh| (b[qh + l] >> (e / 32)) & 1);
                    self.q[e] = (low | (high << 4)) as i8;
                }
            }
        }
        let (sc, mn) = k4_scales_mins(&b[K4_SCALES..K4_SCALES + 12]);
        for g in 0..8 {
            (self.sc[g], self.mn[g]) = (i16::from(sc[g]), i16::from(mn[g]));
        }
        (self.group, self.d, self.dmin) = (32, f16_at(b, 0), f16_at(b, 2));
    }

    #[inline(always)]
    fn q6k(&mut self, b: &[u8]) {
        for j in 0..2 {
            for l in 0..32 {
                let qh = b[Q6K_QH + 32 * j + l];
                for s in 0..4 {
                    // Quarter `s` of half `j`: low nibbles from `ql[64 j + l]` (s = 0, 2) or
                    // `ql[64 j + 32 + l]` (s = 1, 3), nibble `s / 2`.
                    let ql = b[64 * j + 32 * (s % 2) + l] >> (4 * (s / 2));
                    let q = (ql & 0x0F) | (((qh >> (2 * s)) & 3) << 4);
                    self.q[128 * j + 32 * s + l] = (q as i8) - 32;
                }
            }
        }
        for g in 0..16 {
            self.sc[g] = i16::from(b[Q6K_SCALES + g] as i8);
        }
        self.mn = [0; 16];
        (self.group, self.d, self.dmin) = (16, f16_at(b, Q6K_D), 0.0);
    }

    /// The block's elements, in `f32`, bit-exact with ggml's dequantization.
    #[inline(always)]
    pub(crate) fn dequantize(&self, out: &mut [f32]) {
        for (g, chunk) in out.chunks_mut(self.group).enumerate() {
            let dl = self.d * f32::from(self.sc[g]);
            let ml = self.dmin * f32::from(self.mn[g]);
            let q = &self.q[g * self.group..][..chunk.len()];
            for (o, &q) in chunk.iter_mut().zip(q) {
                *o = dl * f32::from(q) - ml;
            }
        }
    }
}
