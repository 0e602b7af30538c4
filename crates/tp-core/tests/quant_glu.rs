//! A gate/up projection on quantized blocks with its activation fused into the product
//! (`linear_quant_glu`): bitwise the product followed by `glu`, for every type the integer GEMM
//! takes, both activations, every float dtype of the input, inputs padded into longer stored
//! rows, and row counts on and off the product's tiles; `None` wherever it does not apply.

use tp_core::quant::QuantType;
use tp_core::rng::SplitMix64;
use tp_core::{Activation, DType, Device, QuantWeight, Tensor};

/// `rows` rows of `k` elements of `t` from random bytes, with every block's scales set to
/// small finite f16 values (so that the products stay finite).
fn blocks(t: QuantType, rows: usize, k: usize, rng: &mut SplitMix64) -> Vec<u8> {
    let mut w: Vec<u8> = (0..rows * t.row_bytes(k).unwrap()).map(|_| rng.next_u64() as u8).collect();
    for b in w.chunks_exact_mut(t.block_bytes()) {
        let scale = (0x1c00 + (rng.next_u64() % 0x400) as u16).to_le_bytes();
        match t {
            QuantType::Q6K => b[208..210].copy_from_slice(&scale),
            QuantType::Q4K => {
                b[0..2].copy_from_slice(&scale);
                b[2..4].copy_from_slice(&scale);
            }
            _ => b[0..2].copy_from_slice(&scale),
        }
    }
    w
}

fn vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512vnni") && std::arch::is_x86_feature_detected!("avx512bw")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[test]
fn fused_gate_up_is_bitwise_the_product_then_glu() {
    let mut rng = SplitMix64::new(3);
    let mut fused = 0;
    for t in [QuantType::Q4_0, QuantType::Q4K, QuantType::Q6K] {
        let block = t.block_elems();
        // (rows I, stored k, lead, width): one block unpadded; two blocks with the input
        // placed inside them (an uneven row-parallel shard).
        for (inner, k, lead, width) in [(56, block, 0, block), (101, 2 * block, 3, 2 * block - 10)] {
            let gate = QuantWeight::new(t, inner, k, lead, width, blocks(t, inner, k, &mut rng)).unwrap();
            let up = QuantWeight::new(t, inner, k, lead, width, blocks(t, inner, k, &mut rng)).unwrap();
            let w = QuantWeight::stack(&[gate, up]).unwrap();
            for (m, dtype, act) in [
                (37, DType::F32, Activation::Silu),
                (64, DType::BF16, Activation::Silu),
                (50, DType::F16, Activation::GeluTanh),
                (100, DType::F32, Activation::GeluTanh),
                (5, DType::F32, Activation::Silu),
            ] {
                let x = Tensor::randn(&[m, width], dtype, rng.next_u64(), &Device::Cpu).unwrap();
                let want = x.linear_quant(&w, None).unwrap().glu(act).unwrap();
                match x.linear_quant_glu(&w, act).unwrap() {
                    Some(y) => {
                        assert!(vnni() && m >= 32, "{t} m {m}: fused where it should not be");
                        assert_eq!((y.dims(), y.dtype()), (want.dims(), dtype));
                        assert!(
                            y.as_bytes().unwrap() == want.as_bytes().unwrap(),
                            "{t} {dtype} {act:?} I {inner} k {k} m {m}: fused differs from the product then glu"
                        );
                        fused += 1;
                    }
                    None => assert!(!vnni() || m < 32, "{t} m {m}: not fused on AVX512-VNNI"),
                }
            }
        }
    }
    if vnni() {
        assert!(fused > 0);
    } else {
        eprintln!("no AVX512-VNNI here: the fused path does not run, only its refusals were checked");
    }
}

#[test]
fn the_fused_path_declines_what_it_does_not_take() {
    let mut rng = SplitMix64::new(4);
    let k = 256;
    let q4 = |rng: &mut SplitMix64, rows| {
        QuantWeight::new(QuantType::Q4K, rows, k, 0, k, blocks(QuantType::Q4K, rows, k, rng)).unwrap()
    };
    let q6 = QuantWeight::new(QuantType::Q6K, 8, k, 0, k, blocks(QuantType::Q6K, 8, k, &mut rng)).unwrap();
    let x = Tensor::randn(&[64, k], DType::F32, 9, &Device::Cpu).unwrap();
    // One part, three parts, parts of two types or two row counts.
    let one = q4(&mut rng, 8);
    let three = QuantWeight::stack(&[q4(&mut rng, 8), q4(&mut rng, 8), q4(&mut rng, 8)]).unwrap();
    let mixed = QuantWeight::stack(&[q4(&mut rng, 8), q6]).unwrap();
    let uneven = QuantWeight::stack(&[q4(&mut rng, 8), q4(&mut rng, 16)]).unwrap();
    for w in [&one, &three, &mixed, &uneven] {
        assert!(x.linear_quant_glu(w, Activation::Silu).unwrap().is_none());
    }
    // An input of the wrong width is declined too (the unfused path reports it).
    let wide = Tensor::randn(&[64, k + 1], DType::F32, 9, &Device::Cpu).unwrap();
    let pair = QuantWeight::stack(&[q4(&mut rng, 8), q4(&mut rng, 8)]).unwrap();
    assert!(wide.linear_quant_glu(&pair, Activation::Silu).unwrap().is_none());
    assert!(wide.linear_quant(&pair, None).is_err());
}
