//! The host AdamW step (`tp_core::adamw_step`, the GPU kernel's reference) against an f64
//! reference of torch's formulas and, bit for bit, against tp-train's f32 arithmetic (factors in
//! f64 rounded to f32, then f32 element operations in its order); its argument checks; and the
//! host `add_t_matmul`.

use tp_core::{AdamwParam, AdamwStep, DType, Device, Tensor, adamw_step};

const CPU: Device = Device::Cpu;

fn hyper(step: u64, lr: f64, weight_decay: f64, clip: f32) -> AdamwStep {
    AdamwStep { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay, step, clip }
}

/// tp-train's `AdamW::step` on slices (crates/tp-train/src/optim.rs), with the clip applied to
/// the gradient first as its Trainer does.
fn tp_train_step(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], h: &AdamwStep, decay: bool) {
    let g: Vec<f32> = g.iter().map(|&x| if h.clip != 1.0 { x * h.clip } else { x }).collect();
    if decay && h.weight_decay != 0.0 {
        let keep = (1.0 - h.lr * h.weight_decay) as f32;
        p.iter_mut().for_each(|p| *p *= keep);
    }
    let t = h.step as f64;
    let (bc1, bc2) = (1.0 - h.beta1.powf(t), 1.0 - h.beta2.powf(t));
    let (w1, b2, w2) = ((1.0 - h.beta1) as f32, h.beta2 as f32, (1.0 - h.beta2) as f32);
    let (step_size, bc2_sqrt, eps) = ((h.lr / bc1) as f32, bc2.sqrt() as f32, h.eps as f32);
    for (((p, &g), m), v) in p.iter_mut().zip(&g).zip(m.iter_mut()).zip(v.iter_mut()) {
        *m += (g - *m) * w1;
        *v = *v * b2 + w2 * g * g;
        let denom = v.sqrt() / bc2_sqrt + eps;
        *p -= step_size * *m / denom;
    }
}

fn vec_of(t: &Tensor) -> Vec<f32> {
    t.to_vec::<f32>().unwrap()
}

#[test]
fn host_adamw_is_tp_trains_arithmetic_bit_for_bit_and_near_f64() {
    let lens = [1usize, 37, 1001];
    let mk = |seed: u64, s: f32| -> Vec<Tensor> {
        lens.iter()
            .enumerate()
            .map(|(i, &n)| Tensor::randn(&[n], DType::F32, seed + i as u64, &CPU).unwrap().scale(s).unwrap())
            .collect()
    };
    let (mut p, mut m, mut v) = (mk(1, 1.0), mk(2, 0.0), mk(3, 0.0));
    let mut r: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> =
        p.iter().map(|t| (vec_of(t), vec![0.0; t.numel()], vec![0.0; t.numel()])).collect();
    let mut r64: Vec<(Vec<f64>, Vec<f64>, Vec<f64>)> =
        p.iter().map(|t| (t.to_f64_vec().unwrap(), vec![0.0; t.numel()], vec![0.0; t.numel()])).collect();
    for step in 1..=5u64 {
        let h = hyper(step, 1e-2 * step as f64, 0.1, if step == 3 { 0.25 } else { 1.0 });
        let g = mk(100 * step, 0.5);
        {
            let mut list: Vec<AdamwParam<'_>> = p
                .iter_mut()
                .zip(&g)
                .zip(m.iter_mut().zip(v.iter_mut()))
                .enumerate()
                .map(|(i, ((param, grad), (m, v)))| AdamwParam { param, grad, m, v, decay: i != 1 })
                .collect();
            adamw_step(&mut list, &h).unwrap();
        }
        for (i, (rp, rm, rv)) in r.iter_mut().enumerate() {
            tp_train_step(rp, &vec_of(&g[i]), rm, rv, &h, i != 1);
        }
        for (i, (rp, rm, rv)) in r64.iter_mut().enumerate() {
            let gv = g[i].to_f64_vec().unwrap();
            let t = step as f64;
            for j in 0..rp.len() {
                let gj = gv[j] * f64::from(h.clip);
                if i != 1 {
                    rp[j] *= 1.0 - h.lr * h.weight_decay;
                }
                rm[j] += (gj - rm[j]) * (1.0 - h.beta1);
                rv[j] = h.beta2 * rv[j] + (1.0 - h.beta2) * gj * gj;
                let (bc1, bc2) = (1.0 - h.beta1.powf(t), 1.0 - h.beta2.powf(t));
                rp[j] -= h.lr / bc1 * rm[j] / (rv[j].sqrt() / bc2.sqrt() + h.eps);
            }
        }
        for i in 0..lens.len() {
            let (rp, rm, rv) = &r[i];
            assert_eq!(
                vec_of(&p[i]).iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                rp.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "step {step} tensor {i} p"
            );
            assert_eq!(&vec_of(&m[i]), rm, "step {step} tensor {i} m");
            assert_eq!(&vec_of(&v[i]), rv, "step {step} tensor {i} v");
            for (got, want) in vec_of(&p[i]).iter().zip(&r64[i].0) {
                assert!((f64::from(*got) - want).abs() <= 1e-5 * want.abs().max(1.0), "step {step}: {got} vs {want}");
            }
        }
    }
}

#[test]
fn bad_adamw_arguments_are_typed_errors_that_change_nothing() {
    let p0 = Tensor::randn(&[5], DType::F32, 1, &CPU).unwrap();
    let g = Tensor::randn(&[5], DType::F32, 2, &CPU).unwrap();
    let (mut p, mut m, mut v) =
        (p0.clone(), Tensor::zeros(&[5], DType::F32, &CPU).unwrap(), Tensor::zeros(&[5], DType::F32, &CPU).unwrap());
    let ok = hyper(1, 1e-3, 0.0, 1.0);
    for bad in [
        AdamwStep { step: 0, ..ok },
        AdamwStep { beta1: 1.0, ..ok },
        AdamwStep { beta2: -0.1, ..ok },
        AdamwStep { lr: f64::NAN, ..ok },
        AdamwStep { eps: -1.0, ..ok },
        AdamwStep { weight_decay: f64::INFINITY, ..ok },
        AdamwStep { clip: f32::NAN, ..ok },
    ] {
        let r = p.adamw_step_(&g, &mut m, &mut v, true, &bad);
        assert!(matches!(r, Err(tp_core::Error::InvalidArgument { .. })), "{bad:?}: {r:?}");
    }
    let short = Tensor::zeros(&[4], DType::F32, &CPU).unwrap();
    assert!(p.adamw_step_(&short, &mut m, &mut v, true, &ok).is_err());
    let bf = g.to_dtype(DType::BF16).unwrap();
    assert!(p.adamw_step_(&bf, &mut m, &mut v, true, &ok).is_err());
    // A later parameter's error leaves the earlier ones unchanged too.
    let (mut p2, mut m2, mut v2) = (p0.clone(), m.clone(), short.clone());
    let mut list = [
        AdamwParam { param: &mut p, grad: &g, m: &mut m, v: &mut v, decay: true },
        AdamwParam { param: &mut p2, grad: &g, m: &mut m2, v: &mut v2, decay: true },
    ];
    assert!(adamw_step(&mut list, &ok).is_err());
    assert_eq!(p, p0);
    assert_eq!(vec_of(&m), vec![0.0; 5]);
    adamw_step(&mut [], &ok).unwrap();
}

#[test]
fn host_add_t_matmul_adds_the_product() {
    let a = Tensor::randn(&[37, 11], DType::BF16, 1, &CPU).unwrap();
    let b = Tensor::randn(&[37, 6], DType::F32, 2, &CPU).unwrap();
    let acc0 = Tensor::randn(&[11, 6], DType::F32, 3, &CPU).unwrap();
    let mut acc = acc0.clone();
    acc.add_t_matmul(&a, &b).unwrap();
    assert_eq!(acc, acc0.add(&a.t_matmul(&b).unwrap()).unwrap());
    let mut wrong = Tensor::zeros(&[6, 11], DType::F32, &CPU).unwrap();
    assert!(matches!(wrong.add_t_matmul(&a, &b), Err(tp_core::Error::InvalidArgument { .. })));
    let mut half = Tensor::zeros(&[11, 6], DType::BF16, &CPU).unwrap();
    assert!(half.add_t_matmul(&a, &b).is_err());
    assert!(acc.add_t_matmul(&a, &Tensor::zeros(&[36, 6], DType::F32, &CPU).unwrap()).is_err());
}
