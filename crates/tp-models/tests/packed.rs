//! Packing the host weights once (`pack_host_weights`) changes nothing but the time: the
//! logits of a prefill (many rows: the packed GEMM) and of decode steps (few rows: the
//! streaming path) are bitwise those of the unpacked model, at TP 1 and 3, in f32 and bf16.

use tp_core::{DType, Device};
use tp_models::{ModelOptions, ParallelCausalLm};
use tp_testing::ranks::on_ranks;
use tp_testing::synthetic::SyntheticModel;

#[test]
fn packed_host_weights_give_bitwise_the_same_logits() {
    for dtype in [DType::F32, DType::BF16] {
        let spec = SyntheticModel { dtype, ..SyntheticModel::tiny() };
        let dir = std::env::temp_dir().join(format!("tp-packed-{dtype}-{}", std::process::id()));
        spec.write(&dir).expect("write");
        let prompt: Vec<i64> = (0..37).map(|i| (i * 97 + 5) % 1001).collect();
        for world in [1, 3] {
            let bits = |pack: bool| {
                on_ranks(world, Device::Cpu, |g| {
                    let mut m = ParallelCausalLm::load(&dir, &g, &ModelOptions::new()).expect("load");
                    if pack {
                        m.pack_host_weights().expect("pack");
                    }
                    let mut out = m.prefill(&prompt).expect("prefill").to_f64_vec().expect("host");
                    for id in [3, 17, 400] {
                        out.extend(m.decode_step(id).expect("decode").to_f64_vec().expect("host"));
                    }
                    out.into_iter().map(f64::to_bits).collect::<Vec<_>>()
                })
                .remove(0)
            };
            let (plain, packed) = (bits(false), bits(true));
            assert_eq!(plain.len(), packed.len());
            assert!(plain == packed, "{dtype} TP {world}: packed weights changed the logits");
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}
