//! GPU test suite of a mixture of experts' kernels (`kernels/moe.cu`): the router against the
//! host's routing (the same experts wherever the host's choice is clear of a near-tie, weights
//! within a few f32 ulps: the softmax's sums run in another order) and the combine against the
//! host's `moe_combine` bit for bit (the same products and sums in the same order), on random
//! logits and rows, shapes off every warp and block multiple (1, 7, 33, 129 rows; 8, 60, 64,
//! 129 and 256 experts, and 300, past the kernel's 256, routed on the host; top 1, 2, 4, 8), f32, f16 and bf16 inputs, outputs poisoned (NaN) before the
//! kernels write them.
//!
//! Built only with `--features gpu-tests` (`cargo xtask bundle` ships it as `gpu-moe-tests`).
//! It FAILS, never skips, when no GPU, driver or compiled kernels are present.

mod common;
use common::gpu_setup;
use tp_core::moe::{moe_combine, route};
use tp_core::{DType, Device, RouterKind, Tensor};

const GPU: Device = Device::Cuda(0);
const CPU: Device = Device::Cpu;

fn setup() {
    gpu_setup();
}

/// Whether the host's `k`-th and `k+1`-th probabilities of a row (or any two chosen ones) are
/// too close for a sum in another order to be sure to keep the same choice.
fn near_tie(probs: &[f32], k: usize) -> bool {
    let mut p: Vec<f32> = probs.to_vec();
    p.sort_by(|a, b| b.total_cmp(a));
    (0..k.min(p.len() - 1)).any(|i| (p[i] - p[i + 1]).abs() <= 1e-5 * p[i].abs().max(1e-30))
}

#[test]
fn the_router_picks_the_hosts_experts_and_weights() {
    setup();
    for (rows, e, k) in [(1, 8, 2), (7, 60, 8), (33, 64, 8), (129, 129, 1), (40, 256, 4), (3, 300, 2)] {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for renormalize in [false, true] {
                let kind = RouterKind::SoftmaxTopK { renormalize };
                let logits = Tensor::randn(&[rows, e], DType::F32, (rows * e + k) as u64, &CPU).unwrap();
                let logits = logits.to_dtype(dtype).unwrap();
                let want = route(&logits, k, kind).unwrap();
                let got = route(&logits.to_device(&GPU).unwrap(), k, kind).unwrap();
                let values = logits.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
                let at = format!("{rows} x {e} top {k} {dtype:?} renormalize {renormalize}");
                let mut compared = 0;
                for r in 0..rows {
                    let probs = tp_core::moe::softmax(&values[r * e..(r + 1) * e]);
                    if near_tie(&probs, k) {
                        continue;
                    }
                    compared += 1;
                    assert_eq!(got.experts[r * k..(r + 1) * k], want.experts[r * k..(r + 1) * k], "{at} row {r}");
                    for j in 0..k {
                        let (g, w) = (got.weights[r * k + j], want.weights[r * k + j]);
                        assert!((g - w).abs() <= 8.0 * f32::EPSILON * w.abs(), "{at} row {r} slot {j}: {g} vs {w}");
                    }
                }
                assert!(compared * 2 >= rows, "{at}: only {compared} rows clear of near-ties");
            }
        }
    }
}

#[test]
fn the_combine_is_the_hosts_bit_for_bit() {
    setup();
    for (rows, k, h, n) in [(1, 1, 1, 1), (7, 2, 33, 9), (33, 8, 129, 200), (129, 4, 1000, 300)] {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let y = Tensor::randn(&[n, h], DType::F32, (n * h) as u64, &CPU).unwrap().to_dtype(dtype).unwrap();
            let mut rng = tp_core::rng::SplitMix64::new((rows * k) as u64);
            // Some slots skipped (-1: an expert this rank does not hold).
            let pos: Vec<i64> = (0..rows * k).map(|_| (rng.next_u64() % (n as u64 + 1)) as i64 - 1).collect();
            let weights: Vec<f32> = (0..rows * k).map(|_| (rng.next_u64() % 1000) as f32 / 997.0).collect();
            let want = moe_combine(&y, &pos, &weights, rows).unwrap().to_vec::<f32>().unwrap();
            let got = moe_combine(&y.to_device(&GPU).unwrap(), &pos, &weights, rows).unwrap();
            assert_eq!(got.device(), GPU);
            let got = got.to_device(&CPU).unwrap().to_vec::<f32>().unwrap();
            let at = format!("{rows} rows x {k} slots of {h} from {n} {dtype:?}");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "{at}: element {i}: {g} vs {w}");
            }
        }
    }
    // A position past y's rows is refused before any launch.
    let y = Tensor::zeros(&[3, 4], DType::F32, &GPU).unwrap();
    assert!(moe_combine(&y, &[3], &[1.0], 1).is_err());
}
