//! The CUDA quant kernels' block dequantization, compiled for the host
//! (`tp_kernels::host_quant`, the very unit functions of `kernels/quant_blocks.cuh`), against
//! tp-cpu's `quant::dequantize` (bit-exact with ggml), bit for bit, for every format both
//! implement; and the two format tables against each other. No GPU needed.

mod common;
use common::quant::random_weight;
use tp_cpu::quant::{self, QuantType};
use tp_kernels::{QUANT_FORMATS, host_quant};

#[test]
fn kernel_dequantization_matches_tp_cpu_bit_for_bit() {
    for (i, f) in QUANT_FORMATS.into_iter().enumerate() {
        let t = QuantType::from_ggml_id(f.ggml_id()).expect("tp-cpu has every kernel format");
        assert_eq!((t.name(), t.block_elems(), t.block_bytes()), (f.name(), f.block_elems(), f.block_bytes()));
        let (rows, k) = (7, 3 * f.block_elems());
        // Sane scales, and random bytes in the scales too (NaN, infinities, subnormals).
        let mut raw = random_weight(f, rows, k, 0.25, 100 + i as u64);
        let mut rng = tp_core::rng::SplitMix64::new(200 + i as u64);
        let wild: Vec<u8> = (0..raw.len()).map(|_| rng.next_u64() as u8).collect();
        raw.extend(wild);
        let n = raw.len() / f.block_bytes() * f.block_elems();
        let (mut got, mut want) = (vec![f32::NAN; n], vec![f32::NAN; n]);
        host_quant::dequantize(f, &raw, &mut got).unwrap();
        quant::dequantize(t, &raw, &mut want).unwrap();
        for (e, (g, w)) in got.iter().zip(&want).enumerate() {
            let same = g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan());
            assert!(
                same,
                "{}: element {e}: kernel {g:e} ({:#x}), tp-cpu {w:e} ({:#x})",
                f.name(),
                g.to_bits(),
                w.to_bits()
            );
        }
        assert!(got[..rows * k].iter().filter(|v| **v != 0.0).count() * 2 > rows * k, "{}: mostly zeros", f.name());
    }
}
