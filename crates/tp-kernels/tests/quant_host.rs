//! The quant kernels' block dequantization (`kernels/quant_blocks.cuh`, run on the host through
//! `tp_kernels::host_quant`) against an independent Rust transcription of ggml's
//! `dequantize_row_*` loops (ggml-quants.c: element after element, in ggml's order and operand
//! order), bit for bit, on random blocks including every binary16 scale (NaN, infinity,
//! subnormals). No GPU needed: this is the code the GPU runs, compiled for the host.

use half::f16;
use tp_kernels::{QUANT_FORMATS, QuantFormat, host_quant};

/// SplitMix64 (test data only).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

fn h(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// ggml's get_scale_min_k4.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// One block of ggml type `id` dequantized the way ggml-quants.c's reference loops do.
fn reference(id: u32, b: &[u8]) -> Vec<f32> {
    let mut y = Vec::new();
    match id {
        2 | 3 | 6 | 7 => {
            let with_min = id == 3 || id == 7;
            let (d, m) = (h(b, 0), if with_min { h(b, 2) } else { 0.0 });
            let hdr = if with_min { 4 } else { 2 };
            let (qh, qs) = if id == 6 || id == 7 {
                (u32::from_le_bytes([b[hdr], b[hdr + 1], b[hdr + 2], b[hdr + 3]]), &b[hdr + 4..])
            } else {
                (0, &b[hdr..])
            };
            y.resize(32, 0.0);
            for j in 0..16 {
                let (xh0, xh1) = (((qh >> j) << 4) & 0x10, (qh >> (j + 12)) & 0x10);
                let (x0, x1) = ((qs[j] & 0xF) as u32 | xh0, (qs[j] >> 4) as u32 | xh1);
                let (y0, y1) = match id {
                    2 => ((x0 as i32 - 8) as f32 * d, (x1 as i32 - 8) as f32 * d),
                    6 => ((x0 as i32 - 16) as f32 * d, (x1 as i32 - 16) as f32 * d),
                    _ => (x0 as f32 * d + m, x1 as f32 * d + m),
                };
                y[j] = y0;
                y[j + 16] = y1;
            }
        }
        8 => y.extend(b[2..34].iter().map(|&q| (q as i8) as f32 * h(b, 0))),
        10 => {
            let (d, min) = (h(b, 80), h(b, 82));
            let mut is = 0;
            for n in 0..2 {
                let q = &b[16 + 32 * n..];
                for shift in [0, 2, 4, 6] {
                    for half in 0..2 {
                        let sc = b[is];
                        is += 1;
                        let (dl, ml) = (d * (sc & 0xF) as f32, min * (sc >> 4) as f32);
                        for l in 0..16 {
                            y.push(dl * ((q[l + 16 * half] >> shift) & 3) as f32 - ml);
                        }
                    }
                }
            }
        }
        11 => {
            let d_all = h(b, 108);
            let (hm, sc) = (&b[0..32], &b[96..108]);
            // ggml's kmask1/kmask2 unpacking of the 12 scale bytes into 16 6-bit scales.
            let aux: Vec<u32> = sc.chunks(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            let (k1, k2, tmp) = (0x0303_0303u32, 0x0f0f_0f0fu32, aux[2]);
            let words = [
                (aux[0] & k2) | ((tmp & k1) << 4),
                (aux[1] & k2) | (((tmp >> 2) & k1) << 4),
                ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4),
                ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4),
            ];
            let scales: Vec<i8> = words.iter().flat_map(|w| w.to_le_bytes()).map(|v| v as i8).collect();
            let (mut is, mut m) = (0, 1u8);
            for n in 0..2 {
                let q = &b[32 + 32 * n..];
                for shift in [0, 2, 4, 6] {
                    for half in 0..2 {
                        let dl = d_all * (scales[is] as i32 - 32) as f32;
                        is += 1;
                        for l in 16 * half..16 * half + 16 {
                            let v = ((q[l] >> shift) & 3) as i32 - if hm[l] & m != 0 { 0 } else { 4 };
                            y.push(dl * v as f32);
                        }
                    }
                    m <<= 1;
                }
            }
        }
        12 | 13 => {
            let (d, min) = (h(b, 0), h(b, 2));
            let sc = &b[4..16];
            let (qh, ql) = if id == 13 { (&b[16..48], &b[48..176]) } else { (&b[0..0], &b[16..144]) };
            let (mut u1, mut u2) = (1u8, 2u8);
            for j in 0..4 {
                let q = &ql[32 * j..];
                for (half, u) in [(0, u1), (1, u2)] {
                    let (s, mm) = scale_min_k4(2 * j + half, sc);
                    let (d1, m1) = (d * s as f32, min * mm as f32);
                    for l in 0..32 {
                        let nib = if half == 0 { q[l] & 0xF } else { q[l] >> 4 };
                        let high = if id == 13 && qh[l] & u != 0 { 16 } else { 0 };
                        y.push(d1 * (nib + high) as f32 - m1);
                    }
                }
                u1 <<= 2;
                u2 <<= 2;
            }
        }
        14 => {
            let d = h(b, 208);
            y.resize(256, 0.0);
            for n in 0..2 {
                let (ql, qh, sc) = (&b[64 * n..], &b[128 + 32 * n..], &b[192 + 8 * n..]);
                let yb = &mut y[128 * n..];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    yb[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                    yb[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                    yb[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                    yb[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                }
            }
        }
        _ => panic!("no reference for ggml type {id}"),
    }
    y
}

/// Bitwise equality, any NaN matching any NaN.
fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn check(f: QuantFormat, src: &[u8], what: &str) {
    let blocks = src.len() / f.block_bytes();
    let mut got = vec![f32::NAN; blocks * f.block_elems()];
    host_quant::dequantize(f, src, &mut got).unwrap();
    for (i, block) in src.chunks(f.block_bytes()).enumerate() {
        let want = reference(f.ggml_id(), block);
        assert_eq!(want.len(), f.block_elems(), "{} reference length", f.name());
        for (e, (&g, &w)) in got[i * f.block_elems()..][..f.block_elems()].iter().zip(&want).enumerate() {
            assert!(
                same(g, w),
                "{} {what}: block {i} element {e}: got {g:e} ({:#x}), want {w:e} ({:#x})",
                f.name(),
                g.to_bits(),
                w.to_bits()
            );
        }
    }
}

/// Byte offsets of a block's binary16 fields (d, then m / dmin).
fn scale_offsets(f: QuantFormat) -> Vec<usize> {
    match f.ggml_id() {
        2 | 6 | 8 => vec![0],
        3 | 7 | 12 | 13 => vec![0, 2],
        10 => vec![80, 82],
        11 => vec![108],
        14 => vec![208],
        id => panic!("unknown format {id}"),
    }
}

#[test]
fn host_dequantization_matches_ggml_reference_on_random_blocks() {
    let mut rng = Rng(0x5EED);
    for f in QUANT_FORMATS {
        // Wholly random bytes: every scale byte, quant and binary16 pattern (NaN, inf, subnormal).
        let src = rng.bytes(f.block_bytes() * 400);
        check(f, &src, "random bytes");
        // Finite, moderate binary16 scales (|d| < 0.125), the rest random.
        let mut sane = rng.bytes(f.block_bytes() * 50);
        for b in sane.chunks_mut(f.block_bytes()) {
            for at in scale_offsets(f) {
                let v = f16::from_f32(((rng.next() % 2000) as f32 - 1000.0) / 8192.0);
                b[at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        check(f, &sane, "sane scales");
        let mut values = vec![0f32; 50 * f.block_elems()];
        host_quant::dequantize(f, &sane, &mut values).unwrap();
        assert!(values.iter().filter(|v| **v != 0.0).count() * 2 > values.len(), "{}: mostly zeros", f.name());
    }
}

#[test]
fn every_binary16_scale_widens_exactly() {
    // Q8_0 blocks with d = every f16, q[0] = 1 and q[1] = 0: element 0 is d itself (exact; NaN
    // stays NaN), element 1 is 0 * d.
    let f = QuantFormat::from_ggml_id(8).unwrap();
    let mut src = Vec::with_capacity(65536 * 34);
    for bits in 0..=u16::MAX {
        src.extend(bits.to_le_bytes());
        src.push(1);
        src.extend([0u8; 31]);
    }
    let mut got = vec![0f32; 65536 * 32];
    host_quant::dequantize(f, &src, &mut got).unwrap();
    for bits in 0..=u16::MAX {
        let want = f16::from_bits(bits).to_f32();
        let (g0, g1) = (got[bits as usize * 32], got[bits as usize * 32 + 1]);
        assert!(same(g0, want), "f16 {bits:#06x}: got {g0}, want {want}");
        assert!(same(g1, 0.0 * want), "f16 {bits:#06x}: q = 0 gives {g1}");
    }
}

#[test]
fn structs_match_the_format_table_and_inputs_are_checked() {
    for f in QUANT_FORMATS {
        let want = (f.block_bytes(), f.block_elems(), f.block_elems() / 8);
        assert_eq!(host_quant::block_layout(f.ggml_id()), Some(want), "{}", f.name());
    }
    for id in [0, 1, 9, 30] {
        assert_eq!(host_quant::block_layout(id), None);
    }
    let f = QuantFormat::from_ggml_id(2).unwrap();
    assert!(host_quant::dequantize(f, &[0; 17], &mut [0.0; 32]).is_err(), "partial block");
    assert!(host_quant::dequantize(f, &[0; 18], &mut [0.0; 31]).is_err(), "short output");
    // An all-zero Q4_0 block: every quant is 0 - 8, times d = +0: -0.0 everywhere.
    let mut out = [f32::NAN; 32];
    host_quant::dequantize(f, &[0; 18], &mut out).unwrap();
    assert!(out.iter().all(|v| v.to_bits() == (-0.0f32).to_bits()), "{out:?}");
}

#[test]
fn hand_built_blocks_give_known_values() {
    // Q4_0, d = 2: qs[j] = j | (15 - j) << 4 -> element j = 2 (j - 8), element j + 16 = 2 (7 - j).
    let mut b = f16::from_f32(2.0).to_le_bytes().to_vec();
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let mut y = [0f32; 32];
    host_quant::dequantize(QuantFormat::from_ggml_id(2).unwrap(), &b, &mut y).unwrap();
    let want: Vec<f32> =
        (0..16).map(|j| 2.0 * (j as f32 - 8.0)).chain((0..16).map(|j| 2.0 * (7.0 - j as f32))).collect();
    assert_eq!(y.to_vec(), want);
    // Q6_K, d = 0.5, every scale 3, ql = 0x21, qh = 0b11_10_01_00: quarter g of each half has
    // q = (low nibble 1 for g < 2, high nibble 2 for g >= 2) | g << 4.
    let mut b = vec![0x21u8; 128];
    b.extend([0b1110_0100u8; 64]);
    b.extend([3u8; 16]);
    b.extend(f16::from_f32(0.5).to_le_bytes());
    let mut y = [0f32; 256];
    host_quant::dequantize(QuantFormat::from_ggml_id(14).unwrap(), &b, &mut y).unwrap();
    for (e, v) in y.iter().enumerate() {
        let g = (e % 128) / 32;
        let q = (if g < 2 { 1 } else { 2 }) | (g << 4);
        assert_eq!(*v, 1.5 * (q as f32 - 32.0), "Q6_K element {e}");
    }
}
