//! GPU test suite of a mixture of experts' kernels (`kernels/moe.cu`, and the grouped GEMM of
//! `kernels/gemm_mma.cu`): the grouped product bit for bit against a product per expert on the
//! GPU and near the host's; the router against the
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
use tp_core::moe::{grouped_linear, moe_combine, route};
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

/// One launch for every expert gives each expert's rows the bits of its own launch (the same
/// tiles; for experts of more rows than the decode kernel takes), and stays near the host's product: experts with no row, one row and rows past a
/// tile, in and out of the cp.async path (k 72 and 37), biases on some experts.
#[test]
fn the_grouped_product_is_each_experts_own_launch() {
    setup();
    for dtype in [DType::BF16, DType::F16] {
        for k in [72, 37] {
            let n = 100;
            let offsets = [0usize, 0, 1, 130, 130, 430];
            let rows = offsets[offsets.len() - 1];
            let x = Tensor::randn(&[rows, k], DType::F32, k as u64, &CPU).unwrap().to_dtype(dtype).unwrap();
            let ws: Vec<Tensor> = (0..5)
                .map(|e| Tensor::randn(&[n, k], DType::F32, 100 + e, &CPU).unwrap().to_dtype(dtype).unwrap())
                .collect();
            let b = Tensor::randn(&[n], DType::F32, 7, &CPU).unwrap().to_dtype(dtype).unwrap();
            let (xg, bg) = (x.to_device(&GPU).unwrap(), b.to_device(&GPU).unwrap());
            let wg: Vec<Tensor> = ws.iter().map(|w| w.to_device(&GPU).unwrap()).collect();
            let bias = |e: usize| (e % 2 == 1).then_some(e);
            let on_gpu: Vec<(&Tensor, Option<&Tensor>)> =
                wg.iter().enumerate().map(|(e, w)| (w, bias(e).map(|_| &bg))).collect();
            let on_host: Vec<(&Tensor, Option<&Tensor>)> =
                ws.iter().enumerate().map(|(e, w)| (w, bias(e).map(|_| &b))).collect();
            let got = grouped_linear(&xg, &on_gpu, &offsets).unwrap();
            assert_eq!(got.device(), GPU);
            let got = got.to_device(&CPU).unwrap().to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
            let host =
                grouped_linear(&x, &on_host, &offsets).unwrap().to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
            let at = format!("{dtype:?} k {k}");
            for (e, r) in offsets.windows(2).enumerate().filter(|(_, r)| r[1] > r[0]) {
                let own = xg.narrow(0, r[0], r[1] - r[0]).unwrap().linear(&wg[e], bias(e).map(|_| &bg)).unwrap();
                let own = own.to_device(&CPU).unwrap().to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
                let mine = &got[r[0] * n..r[1] * n];
                // An expert of at most SMALL_M_MAX rows launches the decode kernel on its own.
                if r[1] - r[0] > tp_kernels::SMALL_M_MAX {
                    for (i, (g, o)) in mine.iter().zip(&own).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            o.to_bits(),
                            "{at} expert {e} element {i}: {g} vs its own launch's {o}"
                        );
                    }
                }
            }
            let scale = host.iter().fold(0f32, |m, v| m.max(v.abs()));
            let worst = got.iter().zip(&host).map(|(g, h)| (g - h).abs()).fold(0f32, f32::max);
            assert!(worst <= 0.02 * scale, "{at}: {worst} from the host's product (max {scale})");
        }
    }
}
