//! LoRA's batched multi-adapter product on the host against float64: mixed slots (empty ones,
//! negative and out-of-table ids skipped), widths off every multiple, bf16 outputs rounded once;
//! bad shapes refused. (The GPU suite compares the kernels with this host product.)

use tp_core::lora::{LoraFactors, lora_product};
use tp_core::{DType, Device, Tensor};

const CPU: Device = Device::Cpu;

#[test]
fn each_row_gets_its_own_adapter_against_float64() {
    let (t, width, out, r) = (11, 37, 29, 5);
    let x = Tensor::randn(&[t, width], DType::F32, 1, &CPU).unwrap();
    let (a1, b1) = (
        Tensor::randn(&[r, width], DType::F32, 2, &CPU).unwrap(),
        Tensor::randn(&[out, r], DType::F32, 3, &CPU).unwrap(),
    );
    let (a2, b2) = (
        Tensor::randn(&[r, width], DType::F32, 4, &CPU).unwrap(),
        Tensor::randn(&[out, r], DType::F32, 5, &CPU).unwrap(),
    );
    let adapters =
        [Some(LoraFactors { a: &a1, b: &b1, scale: 0.5 }), None, Some(LoraFactors { a: &a2, b: &b2, scale: 2.0 })];
    let slots = [0, 2, -1, 1, 0, 7, 2, 2, 0, -3, 1];
    for dtype in [DType::F32, DType::BF16] {
        let y = Tensor::randn(&[t, out], DType::F32, 6, &CPU).unwrap().to_dtype(dtype).unwrap();
        let got = lora_product(&x, &y, &adapters, &slots).unwrap();
        assert_eq!(got.dtype(), dtype);
        let (xv, yv, gv) = (x.to_f64_vec().unwrap(), y.to_f64_vec().unwrap(), got.to_f64_vec().unwrap());
        let factors = [
            (a1.to_f64_vec().unwrap(), b1.to_f64_vec().unwrap(), 0.5),
            (a2.to_f64_vec().unwrap(), b2.to_f64_vec().unwrap(), 2.0),
        ];
        for row in 0..t {
            let pick = match slots[row] {
                0 => Some(&factors[0]),
                2 => Some(&factors[1]),
                _ => None,
            };
            for c in 0..out {
                let base = yv[row * out + c];
                let want = match pick {
                    None => base,
                    Some((a, b, s)) => {
                        let u: Vec<f64> =
                            (0..r).map(|i| (0..width).map(|j| xv[row * width + j] * a[i * width + j]).sum()).collect();
                        base + s * (0..r).map(|i| u[i] * b[c * r + i]).sum::<f64>()
                    }
                };
                let got = gv[row * out + c];
                let tol = if dtype == DType::F32 { 1e-5 } else { 8e-3 } * want.abs().max(1.0);
                assert!((got - want).abs() <= tol, "{dtype:?} row {row} col {c}: {got} vs {want}");
                if pick.is_none() {
                    assert_eq!(got, base, "a row without an adapter is left as it is");
                }
            }
        }
    }
}

#[test]
fn shapes_that_disagree_are_refused() {
    let x = Tensor::zeros(&[3, 8], DType::F32, &CPU).unwrap();
    let y = Tensor::zeros(&[3, 5], DType::F32, &CPU).unwrap();
    let (a, b) = (Tensor::zeros(&[2, 8], DType::F32, &CPU).unwrap(), Tensor::zeros(&[5, 2], DType::F32, &CPU).unwrap());
    let wrong_b = Tensor::zeros(&[5, 3], DType::F32, &CPU).unwrap();
    let ok = [Some(LoraFactors { a: &a, b: &b, scale: 1.0 })];
    assert!(lora_product(&x, &y, &ok, &[0, 0]).is_err(), "slots of another length");
    assert!(lora_product(&x, &y, &[Some(LoraFactors { a: &a, b: &wrong_b, scale: 1.0 })], &[0, 0, 0]).is_err());
    let half = a.to_dtype(DType::BF16).unwrap();
    assert!(lora_product(&x, &y, &[Some(LoraFactors { a: &half, b: &b, scale: 1.0 })], &[0, 0, 0]).is_err());
    assert_eq!(lora_product(&x, &y, &[None], &[0, 0, 0]).unwrap().to_f64_vec().unwrap(), vec![0.0; 15]);
}
