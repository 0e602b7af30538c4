//! GPU test suite of training's kernels: every CUDA backward op, cross-entropy piece, gradient
//! GEMM layout and the multi-tensor AdamW against the host op (the reference semantics) and,
//! for the reductions, an f64 reference with an error bound. Random data, shapes off every tile
//! multiple (37 x 1001, 3 x 7, ...), f32, f16 and bf16 inputs and mixed ones, outputs poisoned
//! (NaN) before the kernels write them, every element checked. Element-wise results whose
//! formulas round the same way on both sides (transpose, scatter-add, row maxima, soft-capping,
//! AdamW) must be bit-exact; and so must repeated runs of the deterministic reductions.
//!
//! Built only with `--features gpu-tests` (`cargo xtask bundle` ships it as `gpu-grad-tests`).
//! It FAILS, never skips, when no GPU, driver or compiled kernels are present.

mod common;
use common::*;
use tp_core::{Activation, AdamwParam, AdamwStep, DType, Device, NormStyle, RopeScaling, RotaryEmbedding, Tensor};
use tp_core::{WeightLayout, adamw_step};

const GPU: Device = Device::Cuda(0);
const CPU: Device = Device::Cpu;
/// f32's unit roundoff.
const U: f64 = 1.0 / (1u64 << 24) as f64;

fn setup() {
    gpu_setup();
}

fn gpu(t: &Tensor) -> Tensor {
    t.to_device(&GPU).expect("host -> device")
}

fn host(t: &Tensor) -> Tensor {
    t.to_device(&CPU).expect("device -> host")
}

fn randn(dims: &[usize], dtype: DType, seed: u64) -> Tensor {
    Tensor::randn(dims, dtype, seed, &CPU).unwrap()
}

/// A GPU result: on the GPU, f32, shaped as the host's, and back on the host.
fn fetched(what: &str, g: &Tensor, h: &Tensor) -> Tensor {
    assert_eq!(g.device(), GPU, "{what}: result device");
    assert_eq!(g.dtype(), DType::F32, "{what}: result dtype");
    assert_eq!(g.dims(), h.dims(), "{what}: result shape");
    host(g)
}

/// Bit-exact equality of a GPU result with the host's.
fn assert_same(what: &str, g: &Tensor, h: &Tensor) {
    let g = fetched(what, g, h);
    let (a, b) = (g.to_vec::<f32>().unwrap(), h.to_vec::<f32>().unwrap());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()), "{what}: element {i}: gpu {x}, host {y}");
    }
}

/// GPU and host results both within `tol(i)` of `want` (an f64 reference).
fn assert_both_near(what: &str, g: &Tensor, h: &Tensor, want: &[f64], tol: impl Fn(usize) -> f64) {
    let g = fetched(what, g, h);
    assert_close(&format!("{what} (gpu)"), &f64s(&g), want, &tol);
    assert_close(&format!("{what} (host)"), &f64s(h), want, &tol);
}

/// The (input dtype, dy dtype) pairs each backward op is run with: one dtype throughout, and
/// f32 gradients of a bf16 forward (the operands then meet in f32 on the GPU).
const PAIRS: [(DType, DType); 4] =
    [(DType::F32, DType::F32), (DType::F16, DType::F16), (DType::BF16, DType::BF16), (DType::BF16, DType::F32)];

/// `(rows, h)` of the row ops: a single element, short rows, rows off the 256-thread block, more
/// rows than a column-sum chunk (64) and one long row.
const ROWS: [(usize, usize); 5] = [(1, 1), (3, 7), (37, 1001), (300, 129), (2, 4099)];

#[test]
fn rms_norm_backward_matches_host_and_f64_in_every_style() {
    setup();
    for (xt, gt) in PAIRS {
        for (rows, h) in ROWS {
            for style in [NormStyle::Weight, NormStyle::OnePlusWeight, NormStyle::WeightF32] {
                let seed = (rows * 7 + h) as u64;
                let (x, w, dy) =
                    (randn(&[rows, h], xt, seed), randn(&[h], xt, seed + 1), randn(&[rows, h], gt, seed + 2));
                let what = format!("rms_norm_backward {xt}/{gt} {rows}x{h} {style:?}");
                check_norm_backward(&what, &x, &w, &dy, style, None);
                // Split over "ranks": statistics of a wider row (n = 3h) given from outside.
                let n = 3 * h;
                let ss = Tensor::rand(&[rows], DType::F32, seed + 3, &CPU).unwrap().scale(n as f32).unwrap();
                let dot = randn(&[rows], DType::F32, seed + 4);
                check_norm_backward(&format!("{what} split"), &x, &w, &dy, style, Some((&ss, n, &dot)));
            }
        }
    }
}

fn check_norm_backward(
    what: &str,
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    style: NormStyle,
    split: Option<(&Tensor, usize, &Tensor)>,
) {
    let eps = 1e-5;
    let (rows, h) = (x.dims()[0], x.dims()[1]);
    let (gs, gd) = (split.map(|s| gpu(s.0)), split.map(|s| gpu(s.2)));
    let gsplit = split.map(|(_, n, _)| (gs.as_ref().unwrap(), n, gd.as_ref().unwrap()));
    let (gdx, gdw) = gpu(x).rms_norm_backward(&gpu(w), &gpu(dy), eps, style, gsplit).unwrap();
    let (hdx, hdw) = x.rms_norm_backward(w, dy, eps, style, split).unwrap();
    // The f64 reference, with each element's bound: (terms + 16) roundings of the magnitudes.
    let (xv, wv, gv) = (f64s(x), f64s(w), f64s(dy));
    let wp: Vec<f64> = wv.iter().map(|&w| if style == NormStyle::OnePlusWeight { 1.0 + w } else { w }).collect();
    let (mut dx, mut dx_tol) = (vec![0.0; rows * h], vec![0.0; rows * h]);
    let (mut dw, mut dw_abs) = (vec![0.0; h], vec![0.0; h]);
    for r in 0..rows {
        let (xr, gr) = (&xv[r * h..(r + 1) * h], &gv[r * h..(r + 1) * h]);
        let gx: Vec<f64> = (0..h).map(|i| gr[i] * wp[i] * xr[i]).collect();
        let (mean, n, dot, terms) = match split {
            Some((ss, n, d)) => (f64s(ss)[r] / n as f64, n, f64s(d)[r], 0),
            None => (xr.iter().map(|v| v * v).sum::<f64>() / h as f64, h, gx.iter().sum(), h),
        };
        let dot_abs = match split {
            Some(_) => dot.abs(),
            None => gx.iter().map(|v| v.abs()).sum(),
        };
        // The mean and rstd as the f32 code has them (f32 statistic given from outside).
        let rstd = 1.0 / (mean + eps).sqrt();
        let c = rstd.powi(3) * dot / n as f64;
        let c_abs = rstd.powi(3) * dot_abs / n as f64;
        for i in 0..h {
            dx[r * h + i] = rstd * gr[i] * wp[i] - xr[i] * c;
            let k = (terms + 16) as f64 * U;
            dx_tol[r * h + i] = k * ((rstd * gr[i] * wp[i]).abs() + (xr[i] * c_abs).abs()) + 1e-30;
            dw[i] += gr[i] * xr[i] * rstd;
            dw_abs[i] += (gr[i] * xr[i] * rstd).abs();
        }
    }
    assert_both_near(&format!("{what}: dx"), &gdx, &hdx, &dx, |i| dx_tol[i]);
    let k = (rows + h + 32) as f64 * U;
    assert_both_near(&format!("{what}: dw"), &gdw, &hdw, &dw, |i| k * dw_abs[i] + 1e-30);
    // The grad_dot part (a split norm's exchanged sum), and the determinism of the reductions.
    let g_dot = gpu(x).rms_norm_grad_dot(&gpu(w), &gpu(dy), style).unwrap();
    let h_dot = x.rms_norm_grad_dot(w, dy, style).unwrap();
    let want: Vec<f64> = (0..rows).map(|r| (0..h).map(|i| gv[r * h + i] * wp[i] * xv[r * h + i]).sum()).collect();
    let abs: Vec<f64> =
        (0..rows).map(|r| (0..h).map(|i| (gv[r * h + i] * wp[i] * xv[r * h + i]).abs()).sum()).collect();
    assert_both_near(&format!("{what}: grad_dot"), &g_dot, &h_dot, &want, |r| (h + 4) as f64 * U * abs[r] + 1e-30);
    let (again, _) = gpu(x).rms_norm_backward(&gpu(w), &gpu(dy), eps, style, gsplit).unwrap();
    assert_same(&format!("{what}: dx twice"), &again, &host(&gdx));
}

#[test]
fn rope_backward_matches_host() {
    setup();
    let llama3 = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192.0,
    };
    let yarn = tp_testing::reference::ops::yarn_defaults(16.0, 64.0);
    let dynamic = RopeScaling::Dynamic { factor: 4.0, max_position_embeddings: 64.0 };
    for dtype in DType::FLOATS {
        for scaling in [RopeScaling::Default, llama3.clone(), yarn.clone(), dynamic.clone()] {
            // (tokens, heads, D, rotated R): full and partial rotary, odd head counts.
            for (t, heads, d, r) in [(6, 3, 64, 64), (37, 5, 128, 128), (3, 7, 10, 6), (5, 2, 256, 256)] {
                let rope = RotaryEmbedding::new(r, 500_000.0, scaling.clone()).unwrap();
                let pos: Vec<usize> = (0..t).map(|i| [0, 1, 2, 7, 100, 4097][i % 6] + i).collect();
                let dy = randn(&[t, heads, d], dtype, (t * d) as u64);
                let g = gpu(&dy).rope_backward(&pos, &rope).unwrap();
                let h = dy.rope_backward(&pos, &rope).unwrap();
                // cos/sin from sincospi on the GPU and f64 cos/sin on the host agree to an ulp of
                // f32; the rest rounds the same way.
                let dv = f64s(&dy);
                let m = f64::from(rope.attention_scaling());
                let tol = |i: usize| {
                    let (row, j) = (i / d, i % d);
                    let half = r / 2;
                    let pair = if j < half {
                        j + half
                    } else if j < r {
                        j - half
                    } else {
                        j
                    };
                    8.0 * U * m * (dv[row * d + j].abs() + dv[row * d + pair].abs()) + 1e-30
                };
                assert_close(
                    &format!("rope_backward {dtype} {scaling:?} {t}x{heads}x{d}/{r}"),
                    &f64s(&fetched("rope", &g, &h)),
                    &f64s(&h),
                    tol,
                );
            }
        }
    }
}

#[test]
fn glu_and_softcap_backward_match_host() {
    setup();
    for (xt, gt) in PAIRS {
        for (rows, inner) in [(1, 1), (3, 7), (37, 1001), (2, 4099)] {
            for act in [Activation::Silu, Activation::GeluTanh, Activation::ClampedSwiglu { alpha: 1.702, limit: 1.0 }]
            {
                let seed = (rows * 31 + inner) as u64;
                let (x, dy) =
                    (randn(&[rows, 2 * inner], xt, seed).scale(2.0).unwrap(), randn(&[rows, inner], gt, seed + 1));
                let g = gpu(&x).glu_backward(act, &gpu(&dy)).unwrap();
                let h = x.glu_backward(act, &dy).unwrap();
                // expf/tanhf (CUDA, <= 2 ulp) against Rust's: a few ulps of each term's size.
                let (xv, dv) = (f64s(&x), f64s(&dy));
                let tol = |i: usize| {
                    let (r, j) = (i / (2 * inner), i % (2 * inner));
                    let (g, u, d) = (
                        xv[r * 2 * inner + j % inner],
                        xv[r * 2 * inner + inner + j % inner],
                        dv[r * inner + j % inner],
                    );
                    2f64.powi(-18) * d.abs() * (1.0 + g.abs()).powi(3) * (1.0 + u.abs()) + 1e-30
                };
                let what = format!("glu_backward {xt}/{gt} {rows}x{inner} {act:?}");
                assert_close(&what, &f64s(&fetched(&what, &g, &h)), &f64s(&h), tol);
            }
            let y = randn(&[rows, inner], xt, 5).scale(10.0).unwrap().softcap(30.0).unwrap();
            let dy = randn(&[rows, inner], gt, 6);
            let what = format!("softcap_backward {xt}/{gt} {rows}x{inner}");
            assert_same(
                &what,
                &gpu(&y).softcap_backward(30.0, &gpu(&dy)).unwrap(),
                &y.softcap_backward(30.0, &dy).unwrap(),
            );
        }
    }
}

#[test]
fn embedding_backward_is_the_hosts_scatter_add_bit_for_bit() {
    setup();
    for dtype in DType::FLOATS {
        // 777 ids over a vocabulary of 1001 (repeats), some past it, a rank holding [400, 900).
        let n = 777;
        let ids: Vec<i64> = (0..n as i64).map(|i| if i % 50 == 3 { 5000 + i } else { (i * 13) % 1001 }).collect();
        for (rows, offset, h) in [(500, 400, 31), (1001, 0, 1), (7, 995, 300), (3, 2000, 5)] {
            let dy = randn(&[n, h], dtype, (rows + h) as u64);
            for id_ty in [DType::I64, DType::I32] {
                let ids_t = Tensor::from_vec(ids.clone(), &[7, 111], &CPU).unwrap();
                let ids_t = if id_ty == DType::I32 {
                    Tensor::from_vec(ids.iter().map(|&i| i as i32).collect::<Vec<_>>(), &[7, 111], &CPU).unwrap()
                } else {
                    ids_t
                };
                let dy3 = dy.reshape(&[7, 111, h]).unwrap();
                let g = gpu(&dy3).embedding_backward(&gpu(&ids_t), rows, offset).unwrap();
                let want = dy3.embedding_backward(&ids_t, rows, offset).unwrap();
                assert_same(
                    &format!("embedding_backward {dtype} {id_ty} rows {rows} offset {offset} h {h}"),
                    &g,
                    &want,
                );
            }
        }
        // A single id repeated n times: one block sums them all.
        let ids = Tensor::from_vec(vec![3i64; 600], &[600], &CPU).unwrap();
        let dy = randn(&[600, 77], dtype, 9);
        assert_same(
            &format!("embedding_backward {dtype} one id"),
            &gpu(&dy).embedding_backward(&gpu(&ids), 10, 0).unwrap(),
            &dy.embedding_backward(&ids, 10, 0).unwrap(),
        );
    }
}

#[test]
fn cross_entropy_pieces_match_host() {
    setup();
    for dtype in DType::FLOATS {
        for (rows, n) in [(1, 1), (3, 7), (37, 1001), (5, 32_003)] {
            let x = randn(&[rows, n], dtype, (rows * n) as u64).scale(4.0).unwrap();
            let gx = gpu(&x);
            let (gmax, hmax) = (gx.row_max().unwrap(), x.row_max().unwrap());
            assert_same(&format!("row_max {dtype} {rows}x{n}"), &gmax, &hmax);
            // A "global" maximum a little above the local one, as from other ranks.
            let global =
                Tensor::from_vec(f64s(&hmax).iter().map(|m| (m + 0.5) as f32).collect::<Vec<_>>(), &[rows], &CPU)
                    .unwrap();
            let targets: Vec<Option<usize>> = (0..rows).map(|r| (r % 3 != 1).then_some((r * 7919) % n)).collect();
            let gp = gx.cross_entropy_parts(&gpu(&global), &targets).unwrap();
            let hp = x.cross_entropy_parts(&global, &targets).unwrap();
            // Sum of positive terms: (n + 4) roundings of the sum; the target's logit exactly.
            let hv = f64s(&hp);
            let what = format!("cross_entropy_parts {dtype} {rows}x{n}");
            assert_close(&what, &f64s(&fetched(&what, &gp, &hp)), &hv, |i| {
                if i < rows { (n + 4) as f64 * U * hv[i] + 1e-30 } else { 0.0 }
            });
            let sum_exp = hp.narrow(0, 0, 1).unwrap().reshape(&[rows]).unwrap();
            let weights: Vec<f32> = (0..rows).map(|r| if r % 4 == 2 { 0.0 } else { 1.0 / (r + 1) as f32 }).collect();
            let gb = gx.cross_entropy_backward(&gpu(&global), &gpu(&sum_exp), &targets, &weights).unwrap();
            let hb = x.cross_entropy_backward(&global, &sum_exp, &targets, &weights).unwrap();
            let hv = f64s(&hb);
            let what = format!("cross_entropy_backward {dtype} {rows}x{n}");
            assert_close(&what, &f64s(&fetched(&what, &gb, &hb)), &hv, |i| {
                8.0 * U * (hv[i].abs() + f64::from(weights[i / n])) + 1e-30
            });
        }
    }
}

#[test]
fn sum_rows_and_transpose_match_host() {
    setup();
    for dtype in DType::FLOATS {
        // One chunk, several (64 rows each), and the 128-chunk cap (then longer chunks).
        for (rows, n) in [(1, 1), (3, 7), (37, 1001), (1001, 33), (20_000, 3)] {
            let x = randn(&[rows, n], dtype, (rows + n) as u64);
            let g = gpu(&x).sum_rows().unwrap();
            let h = x.sum_rows().unwrap();
            let xv = f64s(&x);
            let want: Vec<f64> = (0..n).map(|c| (0..rows).map(|r| xv[r * n + c]).sum()).collect();
            let abs: Vec<f64> = (0..n).map(|c| (0..rows).map(|r| xv[r * n + c].abs()).sum()).collect();
            let what = format!("sum_rows {dtype} {rows}x{n}");
            assert_both_near(&what, &g, &h, &want, |c| (rows + 4) as f64 * U * abs[c] + 1e-30);
            assert_same(&format!("{what} twice"), &gpu(&x).sum_rows().unwrap(), &host(&g));
            // Leading dims flatten into rows.
            if rows % 37 == 0 {
                let x3 = x.reshape(&[37, rows / 37, n]).unwrap();
                assert_same(&format!("{what} 3-D"), &gpu(&x3).sum_rows().unwrap(), &host(&g));
            }
            if rows * n <= 1 << 20 {
                assert_same(
                    &format!("transpose2d {dtype} {rows}x{n}"),
                    &gpu(&x).transpose2d().unwrap(),
                    &x.transpose2d().unwrap(),
                );
            }
        }
    }
}

/// `a^T b` in f64 with its magnitudes, `a: [t, m]`, `b: [t, k]`.
fn t_matmul_f64(a: &Tensor, b: &Tensor) -> (Vec<f64>, Vec<f64>, usize) {
    let (t, m, k) = (a.dims()[0], a.dims()[1], b.dims()[1]);
    let (av, bv) = (f64s(a), f64s(b));
    let (mut want, mut abs) = (vec![0.0; m * k], vec![0.0; m * k]);
    for r in 0..t {
        for i in 0..m {
            let x = av[r * m + i];
            for j in 0..k {
                want[i * k + j] += x * bv[r * k + j];
                abs[i * k + j] += (x * bv[r * k + j]).abs();
            }
        }
    }
    (want, abs, t)
}

#[test]
fn weight_gradient_gemm_matches_host_and_f64() {
    setup();
    // (T, M, K): ragged everywhere; M and K multiples of 8 (the tensor cores' cp.async path) and
    // not; T below one K step, T = 1; a product over many K steps.
    let shapes = [(37, 1001, 3), (3, 7, 5), (300, 136, 264), (1, 129, 17), (513, 64, 200), (1000, 77, 130)];
    for (at, bt) in
        [(DType::F32, DType::F32), (DType::BF16, DType::BF16), (DType::F16, DType::F16), (DType::F32, DType::BF16)]
    {
        for (t, m, k) in shapes {
            let seed = (t * 3 + m * 5 + k) as u64;
            let (a, b) = (randn(&[t, m], at, seed), randn(&[t, k], bt, seed + 1));
            let (want, abs, t) = t_matmul_f64(&a, &b);
            let tol = |i: usize| (t + 4) as f64 * U * abs[i] + 1e-30;
            let what = format!("t_matmul {at}x{bt} {t}x{m}x{k}");
            let g = gpu(&a).t_matmul(&gpu(&b)).unwrap();
            assert_both_near(&what, &g, &a.t_matmul(&b).unwrap(), &want, tol);
            // Accumulated into an f32 gradient in place (beta = 1), host and GPU.
            let acc0 = randn(&[m, k], DType::F32, seed + 2);
            let mut gacc = gpu(&acc0);
            gacc.add_t_matmul(&gpu(&a), &gpu(&b)).unwrap();
            let mut hacc = acc0.clone();
            hacc.add_t_matmul(&a, &b).unwrap();
            let base = f64s(&acc0);
            let want_acc: Vec<f64> = want.iter().zip(&base).map(|(p, c)| p + c).collect();
            assert_both_near(&format!("{what} accumulated"), &gacc, &hacc, &want_acc, |i| {
                tol(i) + 2.0 * U * want_acc[i].abs()
            });
        }
    }
    // Leading dims flatten into T; a shared accumulator is copied, not written through.
    let (a, b) = (randn(&[4, 9, 33], DType::BF16, 1), randn(&[4, 9, 20], DType::BF16, 2));
    let g = gpu(&a).t_matmul(&gpu(&b)).unwrap();
    assert_eq!(g.dims(), &[33, 20]);
    let zero = gpu(&Tensor::zeros(&[33, 20], DType::F32, &CPU).unwrap());
    let mut acc = zero.clone();
    acc.add_t_matmul(&gpu(&a), &gpu(&b)).unwrap();
    assert_same("t_matmul 3-D accumulated", &acc, &host(&g));
    assert_same("the shared zeros stay zero", &zero, &Tensor::zeros(&[33, 20], DType::F32, &CPU).unwrap());
}

#[test]
fn data_gradient_gemm_runs_the_kn_layouts() {
    setup();
    // x W with W read as [K, N] (dX = dY W): f32 on SIMT, f16/bf16 on mma.sync's kn layout
    // (cp.async when K and N are multiples of 8, element loads otherwise), against f64.
    for (m, k, n) in
        [(257, 1000, 383), (300, 1027, 129), (128, 512, 256), (9, 64, 72), (513, 8, 77), (5, 0, 9), (3, 7, 5)]
    {
        for dtype in DType::FLOATS {
            check_matmul(GPU, m, k, n, dtype, WeightLayout::Kn, true, 70 + m as u64);
            check_matmul(GPU, m, k, n, dtype, WeightLayout::Kn, false, 71 + m as u64);
        }
    }
}

#[test]
fn adamw_is_the_hosts_bit_for_bit_over_many_tensors() {
    setup();
    // 35 tensors (two launches of at most 32), lengths across the 16384-element chunks.
    let lens: Vec<usize> = (0..35).map(|i| [1, 7, 16_384, 16_385, 40_000, 3][i % 6] + i).collect();
    let mk = |seed: u64, scale: f32| -> Vec<Tensor> {
        lens.iter().enumerate().map(|(i, &n)| randn(&[n], DType::F32, seed + i as u64).scale(scale).unwrap()).collect()
    };
    let (mut hp, mut hm, mut hv) = (mk(100, 1.0), mk(200, 0.0), mk(300, 0.0));
    let (mut gp, mut gm, mut gv): (Vec<Tensor>, Vec<Tensor>, Vec<Tensor>) =
        (hp.iter().map(gpu).collect(), hm.iter().map(gpu).collect(), hv.iter().map(gpu).collect());
    for step in 1..=3u64 {
        let grads = mk(1000 * step, 0.3);
        let ggrads: Vec<Tensor> = grads.iter().map(gpu).collect();
        let hyper = AdamwStep {
            lr: 1e-3 * step as f64,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            step,
            clip: if step == 2 { 0.5 } else { 1.0 },
        };
        let params = |p: &mut [Tensor],
                      g: &[Tensor],
                      m: &mut [Tensor],
                      v: &mut [Tensor],
                      run: &dyn Fn(&mut [AdamwParam<'_>])| {
            let mut list: Vec<AdamwParam<'_>> = p
                .iter_mut()
                .zip(g)
                .zip(m.iter_mut().zip(v.iter_mut()))
                .enumerate()
                .map(|(i, ((param, grad), (m, v)))| AdamwParam { param, grad, m, v, decay: i % 3 != 0 })
                .collect();
            run(&mut list);
        };
        params(&mut hp, &grads, &mut hm, &mut hv, &|l| adamw_step(l, &hyper).unwrap());
        params(&mut gp, &ggrads, &mut gm, &mut gv, &|l| adamw_step(l, &hyper).unwrap());
        for i in 0..lens.len() {
            for (what, g, h) in [("p", &gp[i], &hp[i]), ("m", &gm[i], &hm[i]), ("v", &gv[i], &hv[i])] {
                assert_same(&format!("adamw step {step} tensor {i} {what}"), g, h);
            }
        }
    }
    // The single-tensor form is the same step.
    let (mut p, g) = (gpu(&hp[0]), gpu(&hp[1].narrow(0, 0, hp[0].numel()).unwrap()));
    let (mut m, mut v) = (gpu(&hm[0]), gpu(&hv[0]));
    let (mut p2, mut m2, mut v2) = (hp[0].clone(), hm[0].clone(), hv[0].clone());
    let hyper = AdamwStep { lr: 1e-2, beta1: 0.8, beta2: 0.99, eps: 1e-6, weight_decay: 0.0, step: 7, clip: 1.0 };
    p.adamw_step_(&g, &mut m, &mut v, true, &hyper).unwrap();
    p2.adamw_step_(&host(&g), &mut m2, &mut v2, true, &hyper).unwrap();
    assert_same("adamw_step_ p", &p, &p2);
}

#[test]
fn training_ops_refuse_mixed_devices_with_typed_errors() {
    setup();
    let x = randn(&[3, 8], DType::F32, 1);
    let (gx, w) = (gpu(&x), randn(&[8], DType::F32, 2));
    let mismatch =
        |r: tp_core::Result<Tensor>| assert!(matches!(r, Err(tp_core::Error::DeviceMismatch { .. })), "{r:?}");
    mismatch(gx.rms_norm_grad_dot(&w, &gx, NormStyle::Weight));
    mismatch(gx.rms_norm_backward(&gpu(&w), &x, 1e-5, NormStyle::Weight, None).map(|r| r.0));
    mismatch(gx.glu_backward(Activation::Silu, &randn(&[3, 4], DType::F32, 3)));
    mismatch(gx.softcap_backward(5.0, &x));
    mismatch(gx.t_matmul(&x));
    let ids = Tensor::from_vec(vec![1i64, 2, 3], &[3], &CPU).unwrap();
    mismatch(gx.embedding_backward(&ids, 10, 0));
    mismatch(gx.cross_entropy_parts(&Tensor::zeros(&[3], DType::F32, &CPU).unwrap(), &[None, None, None]));
    let mut acc = Tensor::zeros(&[8, 8], DType::F32, &CPU).unwrap();
    assert!(matches!(acc.add_t_matmul(&gx, &gx), Err(tp_core::Error::DeviceMismatch { .. })));
    let hyper = AdamwStep { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, step: 1, clip: 1.0 };
    let (mut p, mut m, mut v) = (gx.clone(), gx.clone(), x.clone());
    assert!(matches!(p.adamw_step_(&gx, &mut m, &mut v, false, &hyper), Err(tp_core::Error::DeviceMismatch { .. })));
    assert_eq!(host(&p), x, "a refused step changes nothing");
}
