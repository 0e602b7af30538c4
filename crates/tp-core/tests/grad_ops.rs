//! The host backward ops against finite differences of their forwards: for a random output
//! weighting `dy` and random directions `u`, `(L(x + h·u) - L(x - h·u)) / 2h` with
//! `L(x) = Σ dy ⊙ f(x)` (summed in f64) must equal `<grad, u>` from the backward op. Shapes are
//! off every tile multiple, values random.

use tp_core::{Activation, AttentionSpec, DType, Device, KvGroups, NormStyle, RopeScaling, RotaryEmbedding, Tensor};

const CPU: Device = Device::Cpu;

fn rand(dims: &[usize], seed: u64) -> Tensor {
    // Uniform in [-1, 1).
    Tensor::rand(dims, DType::F32, seed, &CPU)
        .unwrap()
        .scale(2.0)
        .unwrap()
        .add(&Tensor::from_vec(vec![-1f32; dims.iter().product()], dims, &CPU).unwrap())
        .unwrap()
}

fn v(t: &Tensor) -> Vec<f64> {
    t.to_f64_vec().unwrap()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(a, b)| a * b).sum()
}

/// Checks `grad` (of `Σ dy ⊙ f(x)` w.r.t. `x`) along three random directions.
fn check_directional(name: &str, x: &Tensor, dy: &Tensor, grad: &Tensor, f: impl Fn(&Tensor) -> Tensor, tol: f64) {
    assert_eq!(grad.dims(), x.dims(), "{name}: gradient shape");
    let (g, dyv) = (v(grad), v(dy));
    for seed in 0..3 {
        let u = rand(x.dims(), 1000 + seed);
        let h = 1e-2f32;
        let shifted = |s: f32| x.add(&u.scale(s).unwrap()).unwrap();
        let (lp, lm) = (dot(&dyv, &v(&f(&shifted(h)))), dot(&dyv, &v(&f(&shifted(-h)))));
        let fd = (lp - lm) / (2.0 * f64::from(h));
        let an = dot(&g, &v(&u));
        let scale = an.abs().max(fd.abs()).max(1.0);
        assert!((fd - an).abs() <= tol * scale, "{name}: finite difference {fd} vs backward {an}");
    }
}

#[test]
fn attention_backward_matches_finite_differences() {
    // (T, kv_len, Hq, Hkv, D, window, groups): causal prefill, a cached prefix, a window,
    // grouped heads starting mid-group (a TP rank's straddling heads).
    type Case = (usize, usize, usize, usize, usize, Option<usize>, Option<KvGroups>);
    let cases: [Case; 4] = [
        (7, 7, 4, 2, 5, None, None),
        (5, 9, 3, 3, 4, Some(3), None),
        (11, 11, 2, 2, 3, Some(4), Some(KvGroups { size: 3, offset: 2 })),
        (1, 6, 6, 1, 8, None, None),
    ];
    for (i, &(t, l, hq, hkv, d, window, kv_groups)) in cases.iter().enumerate() {
        let seed = 10 * i as u64;
        let (q, k, vv, dy) = (
            rand(&[t, hq, d], seed),
            rand(&[l, hkv, d], seed + 1),
            rand(&[l, hkv, d], seed + 2),
            rand(&[t, hq, d], seed + 3),
        );
        let spec = AttentionSpec { kv_len: l, scale: 0.7, sliding_window: window, kv_groups, sinks: None };
        let (dq, dk, dv) = q.attention_backward(&k, &vv, &dy, &spec).unwrap();
        let name = format!("attention case {i}");
        check_directional(&format!("{name} dq"), &q, &dy, &dq, |q| q.attention(&k, &vv, &spec).unwrap(), 2e-3);
        check_directional(&format!("{name} dk"), &k, &dy, &dk, |k| q.attention(k, &vv, &spec).unwrap(), 2e-3);
        check_directional(&format!("{name} dv"), &vv, &dy, &dv, |vv| q.attention(&k, vv, &spec).unwrap(), 2e-3);

        // With a sink logit per head (gpt-oss): every input's gradient, and the sinks'.
        let sinks = Tensor::from_fn_f64(&[hq], DType::F32, &CPU, |h| [0.3, -0.5, 1.2, -1.0, 0.0, 2.0][h % 6]).unwrap();
        let with = |s: &Tensor| AttentionSpec { sinks: Some(v(s).iter().map(|&x| x as f32).collect()), ..spec.clone() };
        let spec = with(&sinks);
        let (dq, dk, dv, ds) = q.attention_backward_sinks(&k, &vv, &dy, &spec).unwrap();
        let ds = Tensor::from_vec(ds, &[hq], &CPU).unwrap();
        // (The step's O(h²) error reaches 3e-3 on case 2 along one direction, with or without
        // sinks; a third of the step leaves 1e-4.)
        let name = format!("attention with sinks case {i}");
        check_directional(&format!("{name} dq"), &q, &dy, &dq, |q| q.attention(&k, &vv, &spec).unwrap(), 5e-3);
        check_directional(&format!("{name} dk"), &k, &dy, &dk, |k| q.attention(k, &vv, &spec).unwrap(), 5e-3);
        check_directional(&format!("{name} dv"), &vv, &dy, &dv, |vv| q.attention(&k, vv, &spec).unwrap(), 5e-3);
        check_directional(
            &format!("{name} dsinks"),
            &sinks,
            &dy,
            &ds,
            |s| q.attention(&k, &vv, &with(s)).unwrap(),
            5e-3,
        );
        // Without sinks the sinks' gradient is zero and the rest unchanged.
        let (_, _, _, none) = q.attention_backward_sinks(&k, &vv, &dy, &AttentionSpec { sinks: None, ..spec }).unwrap();
        assert!(none.iter().all(|&x| x == 0.0));
    }
}

#[test]
fn rms_norm_backward_matches_finite_differences_in_every_style() {
    for (i, style) in [NormStyle::Weight, NormStyle::OnePlusWeight, NormStyle::WeightF32].into_iter().enumerate() {
        let (x, w, dy) = (rand(&[5, 13], i as u64), rand(&[13], 50 + i as u64), rand(&[5, 13], 60 + i as u64));
        let (dx, dw) = x.rms_norm_backward(&w, &dy, 1e-5, style, None).unwrap();
        check_directional("rms dx", &x, &dy, &dx, |x| x.rms_norm_with(&w, 1e-5, style, None).unwrap(), 2e-3);
        check_directional("rms dw", &w, &dy, &dw, |w| x.rms_norm_with(w, 1e-5, style, None).unwrap(), 2e-3);
    }
}

#[test]
fn split_rms_norm_backward_equals_the_whole_norms() {
    // A norm over 13 features held as 6 + 7 on two "ranks": the pieces' gradients, from the
    // summed statistics and dots, equal the whole norm's gradient's columns.
    let style = NormStyle::OnePlusWeight;
    let (x, w, dy) = (rand(&[4, 13], 1), rand(&[13], 2), rand(&[4, 13], 3));
    let (dx, dw) = x.rms_norm_backward(&w, &dy, 1e-6, style, None).unwrap();
    let parts = [(0, 6), (6, 7)];
    let piece = |t: &Tensor, (s, n): (usize, usize)| t.narrow(t.ndim() - 1, s, n).unwrap();
    let ss = parts.iter().map(|&p| piece(&x, p).sum_squares().unwrap()).reduce(|a, b| a.add(&b).unwrap()).unwrap();
    let dots = parts
        .iter()
        .map(|&p| piece(&x, p).rms_norm_grad_dot(&piece(&w, p), &piece(&dy, p), style).unwrap())
        .reduce(|a, b| a.add(&b).unwrap())
        .unwrap();
    for p in parts {
        let (pdx, pdw) =
            piece(&x, p).rms_norm_backward(&piece(&w, p), &piece(&dy, p), 1e-6, style, Some((&ss, 13, &dots))).unwrap();
        for (a, b) in v(&pdx).iter().zip(v(&piece(&dx, p))).chain(v(&pdw).iter().zip(v(&piece(&dw, p)))) {
            assert!((a - b).abs() < 1e-5 * b.abs().max(1.0), "{a} vs {b}");
        }
    }
}

#[test]
fn rope_backward_matches_finite_differences() {
    // Partial rotary (6 of 10 features) with YaRN's attention scaling on the cos and sin.
    let scaling = RopeScaling::Yarn {
        factor: 4.0,
        original_max_position_embeddings: 8.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
        attention_factor: 1.3,
    };
    for rope in [
        RotaryEmbedding::new(6, 10000.0, RopeScaling::Default).unwrap(),
        RotaryEmbedding::new(6, 500.0, scaling).unwrap(),
    ] {
        let (x, dy) = (rand(&[5, 3, 10], 7), rand(&[5, 3, 10], 8));
        let positions = [0, 3, 4, 9, 17];
        let dx = dy.rope_backward(&positions, &rope).unwrap();
        check_directional("rope", &x, &dy, &dx, |x| x.rope(&positions, &rope).unwrap(), 1e-3);
    }
}

#[test]
fn glu_softcap_embedding_and_t_matmul_backwards() {
    for act in [Activation::Silu, Activation::GeluTanh] {
        let (x, dy) = (rand(&[3, 2, 14], 21), rand(&[3, 2, 7], 22));
        let dx = x.glu_backward(act, &dy).unwrap();
        check_directional("glu", &x, &dy, &dx, |x| x.glu(act).unwrap(), 2e-3);
    }
    // gpt-oss's clamped SwiGLU with a low limit, so that gates above it and ups on both sides
    // are clamped; the values keep clear of the kinks by more than the finite step moves them.
    let act = Activation::ClampedSwiglu { alpha: 1.702, limit: 0.8 };
    let pattern = [-2.0, -1.1, -0.5, 0.1, 0.6, 1.0, 1.7, -0.2, 2.4, 0.3, -1.6, 0.45, 1.3, -0.9];
    let x = Tensor::from_fn_f64(&[3, 2, 14], DType::F32, &CPU, |i| pattern[(i * 5) % 14]).unwrap();
    let dy = rand(&[3, 2, 7], 23);
    let dx = x.glu_backward(act, &dy).unwrap();
    let clamped = v(&dx).iter().filter(|&&g| g == 0.0).count();
    assert!(clamped > 0, "some gate or up element must sit past the clamp");
    check_directional("clamped swiglu", &x, &dy, &dx, |x| x.glu(act).unwrap(), 2e-3);
    let (x, dy) = (rand(&[4, 9], 31).scale(20.0).unwrap(), rand(&[4, 9], 32));
    let dx = x.softcap(15.0).unwrap().softcap_backward(15.0, &dy).unwrap();
    check_directional("softcap", &x, &dy, &dx, |x| x.softcap(15.0).unwrap(), 2e-3);

    // Rows 3..8 of a 10-row table; ids outside add nothing, repeated ids add up.
    let table = rand(&[5, 4], 41);
    let ids = Tensor::from_vec(vec![3i64, 9, 4, 3, 0, 7], &[2, 3], &CPU).unwrap();
    let dy = rand(&[2, 3, 4], 42);
    let dt = dy.embedding_backward(&ids, 5, 3).unwrap();
    check_directional("embedding", &table, &dy, &dt, |t| t.embedding(&ids, 3).unwrap(), 1e-3);

    // dW = dY^T X against a float64 loop, at a shape off the tiles.
    let (a, b) = (rand(&[37, 19], 51), rand(&[37, 23], 52));
    let got = v(&a.t_matmul(&b).unwrap());
    let (av, bv) = (v(&a), v(&b));
    for m in 0..19 {
        for k in 0..23 {
            let want: f64 = (0..37).map(|t| av[t * 19 + m] * bv[t * 23 + k]).sum();
            assert!((got[m * 23 + k] - want).abs() < 1e-4, "t_matmul[{m}][{k}]");
        }
    }
    let sums = v(&a.sum_rows().unwrap());
    for (m, s) in sums.iter().enumerate() {
        assert!((s - (0..37).map(|t| av[t * 19 + m]).sum::<f64>()).abs() < 1e-5);
    }
}

#[test]
fn vocab_parallel_cross_entropy_pieces_equal_the_whole() {
    // Logits [5, 11] split 4 + 7; targets spread over both parts, one row ignored.
    let logits = rand(&[5, 11], 61).scale(3.0).unwrap();
    let targets: [Option<usize>; 5] = [Some(2), Some(9), None, Some(4), Some(10)];
    let weights = [0.25f32, 0.5, 0.0, 1.0, 0.75];
    let lv = v(&logits);
    // float64 reference: loss and gradient of Σ w_t loss_t.
    let mut want_loss = 0.0;
    let mut want_grad = vec![0f64; 55];
    for r in 0..5 {
        let row = &lv[r * 11..(r + 1) * 11];
        let m = row.iter().cloned().fold(f64::MIN, f64::max);
        let s: f64 = row.iter().map(|x| (x - m).exp()).sum();
        if let Some(y) = targets[r] {
            want_loss += f64::from(weights[r]) * (m + s.ln() - row[y]);
            for j in 0..11 {
                want_grad[r * 11 + j] =
                    f64::from(weights[r]) * ((row[j] - m).exp() / s - if j == y { 1.0 } else { 0.0 });
            }
        }
    }
    let parts = [(0usize, 4usize), (4, 7)];
    let local = |(s, n): (usize, usize)| logits.narrow(1, s, n).unwrap();
    let local_targets = |(s, n): (usize, usize)| -> Vec<Option<usize>> {
        targets.iter().map(|t| t.and_then(|y| (y >= s && y < s + n).then(|| y - s))).collect()
    };
    let max = parts
        .iter()
        .map(|&p| v(&local(p).row_max().unwrap()))
        .reduce(|a, b| a.iter().zip(&b).map(|(x, y)| x.max(*y)).collect())
        .unwrap();
    let max_t = Tensor::from_vec(max.iter().map(|&x| x as f32).collect::<Vec<f32>>(), &[5], &CPU).unwrap();
    let sums = parts
        .iter()
        .map(|&p| v(&local(p).cross_entropy_parts(&max_t, &local_targets(p)).unwrap()))
        .reduce(|a, b| a.iter().zip(&b).map(|(x, y)| x + y).collect())
        .unwrap();
    let got_loss: f64 = (0..5)
        .filter(|&r| targets[r].is_some())
        .map(|r| f64::from(weights[r]) * (max[r] + sums[r].ln() - sums[5 + r]))
        .sum();
    assert!((got_loss - want_loss).abs() < 1e-5 * want_loss.abs().max(1.0), "{got_loss} vs {want_loss}");
    let sum_exp = Tensor::from_vec(sums[..5].iter().map(|&x| x as f32).collect::<Vec<f32>>(), &[5], &CPU).unwrap();
    for p in parts {
        let g = v(&local(p).cross_entropy_backward(&max_t, &sum_exp, &local_targets(p), &weights).unwrap());
        for r in 0..5 {
            for j in 0..p.1 {
                let want = want_grad[r * 11 + p.0 + j];
                assert!((g[r * p.1 + j] - want).abs() < 1e-6, "grad[{r}][{}]", p.0 + j);
            }
        }
    }
}

#[test]
fn backward_ops_refuse_bad_shapes_with_typed_errors() {
    let x = rand(&[3, 4], 1);
    assert!(x.rms_norm_backward(&rand(&[5], 2), &x, 1e-5, NormStyle::Weight, None).is_err());
    assert!(x.glu_backward(Activation::Silu, &rand(&[3, 3], 3)).is_err());
    assert!(x.softcap_backward(0.0, &x).is_err());
    assert!(x.t_matmul(&rand(&[4, 4], 4)).is_err());
    assert!(x.cross_entropy_parts(&rand(&[3], 5), &[Some(4), None, None]).is_err());
    let q = rand(&[2, 2, 4], 6);
    let spec = AttentionSpec::causal(2, 4);
    assert!(q.attention_backward(&q, &q, &rand(&[2, 2, 3], 7), &spec).is_err());
}

#[test]
fn large_backward_ops_split_over_threads_match_float64() {
    // Big enough for the pool's row groups and column blocks.
    let (rows, h) = (97, 1003);
    let (x, w, dy) = (rand(&[rows, h], 71), rand(&[h], 72), rand(&[rows, h], 73));
    let (dx, dw) = x.rms_norm_backward(&w, &dy, 1e-5, NormStyle::Weight, None).unwrap();
    let (xv, wv, gv) = (v(&x), v(&w), v(&dy));
    let (dxv, dwv) = (v(&dx), v(&dw));
    let mut want_dw = vec![0f64; h];
    for r in 0..rows {
        let xr = &xv[r * h..(r + 1) * h];
        let gr = &gv[r * h..(r + 1) * h];
        let rstd = 1.0 / (xr.iter().map(|a| a * a).sum::<f64>() / h as f64 + 1e-5).sqrt();
        let dot: f64 = (0..h).map(|i| gr[i] * wv[i] * xr[i]).sum();
        for i in 0..h {
            let want = rstd * gr[i] * wv[i] - xr[i] * rstd.powi(3) * dot / h as f64;
            assert!((dxv[r * h + i] - want).abs() < 1e-4, "dx[{r}][{i}]");
            want_dw[i] += gr[i] * xr[i] * rstd;
        }
    }
    for i in 0..h {
        assert!((dwv[i] - want_dw[i]).abs() < 1e-3, "dw[{i}]");
    }
    let sums = v(&dy.sum_rows().unwrap());
    for c in 0..h {
        assert!((sums[c] - (0..rows).map(|r| gv[r * h + c]).sum::<f64>()).abs() < 1e-4);
    }
    let max = dy.row_max().unwrap();
    let mv = v(&max);
    for r in 0..rows {
        assert_eq!(mv[r], gv[r * h..(r + 1) * h].iter().cloned().fold(f64::MIN, f64::max));
    }
    let targets: Vec<Option<usize>> = (0..rows).map(|r| (r % 3 != 0).then_some(r * 7 % h)).collect();
    let parts = v(&dy.cross_entropy_parts(&max, &targets).unwrap());
    for r in 0..rows {
        let want: f64 = gv[r * h..(r + 1) * h].iter().map(|g| (g - mv[r]).exp()).sum();
        assert!((parts[r] - want).abs() < 1e-5 * want, "sum_exp[{r}]");
        assert_eq!(parts[rows + r], targets[r].map_or(0.0, |j| gv[r * h + j]));
    }
}

#[test]
fn cross_entropy_backward_in_place_equals_the_copy() {
    let logits = rand(&[37, 301], 81).scale(4.0).unwrap();
    let max = logits.row_max().unwrap();
    let targets: Vec<Option<usize>> = (0..37).map(|r| (r % 4 != 1).then_some(r * 13 % 301)).collect();
    let weights: Vec<f32> = (0..37).map(|r| if r % 5 == 0 { 0.0 } else { 0.1 * r as f32 }).collect();
    let parts = logits.cross_entropy_parts(&max, &targets).unwrap();
    let sum_exp = parts.narrow(0, 0, 1).unwrap().reshape(&[37]).unwrap();
    let want = logits.cross_entropy_backward(&max, &sum_exp, &targets, &weights).unwrap();
    let mut got =
        logits.to_dtype(DType::F32).unwrap().add(&Tensor::zeros(&[37, 301], DType::F32, &CPU).unwrap()).unwrap();
    got.cross_entropy_backward_in_place(&max, &sum_exp, &targets, &weights).unwrap();
    assert_eq!(v(&got), v(&want));
    assert!(got.cross_entropy_backward_in_place(&max, &sum_exp, &targets[..3], &weights).is_err());
}
