//! Random ggml-format weights for the quant kernel tests: random bytes (every quant, scale-byte
//! and bit pattern) whose binary16 fields (d, m / dmin) are set to finite, moderate scales.

use tp_core::f16;
use tp_core::rng::SplitMix64;
use tp_kernels::QuantFormat;

/// Byte offsets of a block's binary16 fields (d, then m or dmin), from ggml-common.h's structs.
pub fn scale_offsets(f: QuantFormat) -> &'static [usize] {
    match f.ggml_id() {
        2 | 6 | 8 => &[0],          // Q4_0, Q5_0, Q8_0: d first
        3 | 7 | 12 | 13 => &[0, 2], // Q4_1, Q5_1, Q4_K, Q5_K: d, m / dmin first
        10 => &[80, 82],            // Q2_K: scales[16], qs[64], d, dmin
        11 => &[108],               // Q3_K: hmask[32], qs[64], scales[12], d
        14 => &[208],               // Q6_K: ql[128], qh[64], scales[16], d
        id => panic!("no layout for ggml type {id}"),
    }
}

/// `rows` rows of `k` weights of format `f`, row after row: random bytes with every binary16
/// field a finite scale of magnitude below `max_scale` (zero and subnormals included).
pub fn random_weight(f: QuantFormat, rows: usize, k: usize, max_scale: f64, seed: u64) -> Vec<u8> {
    let mut rng = SplitMix64::new(seed);
    let bytes = rows * f.row_bytes(k).expect("k a multiple of the block");
    let mut w: Vec<u8> = (0..bytes).map(|_| rng.next_u64() as u8).collect();
    for block in w.chunks_mut(f.block_bytes()) {
        for &at in scale_offsets(f) {
            let v = f16::from_f64(rng.uniform(-max_scale, max_scale));
            block[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    w
}
