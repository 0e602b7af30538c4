//! Constructors, accessors and the seeded generators.

use tp_core::{DType, Device, Tensor, bf16, f16};

const CPU: Device = Device::Cpu;

#[test]
fn from_vec_round_trips_every_dtype() {
    let v: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 3.0).collect();
    let t = Tensor::from_vec(v.clone(), &[3, 4], &CPU).unwrap();
    assert_eq!((t.dims(), t.dtype(), t.device(), t.numel()), (&[3usize, 4][..], DType::F32, CPU, 12));
    assert_eq!(t.to_vec::<f32>().unwrap(), v);
    let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
    assert_eq!(Tensor::from_slice(&h, &[12], &CPU).unwrap().to_vec::<f16>().unwrap(), h);
    let b: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
    let tb = Tensor::from_slice(&b, &[2, 6], &CPU).unwrap();
    assert_eq!(tb.dtype(), DType::BF16);
    assert_eq!(tb.size_in_bytes(), 24);
    assert_eq!(tb.to_f64_vec().unwrap(), v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>());
}

#[test]
fn seeded_generators_are_deterministic_and_not_degenerate() {
    for dtype in DType::FLOATS {
        let a = Tensor::rand(&[1000], dtype, 42, &CPU).unwrap();
        assert_eq!(a, Tensor::rand(&[1000], dtype, 42, &CPU).unwrap());
        assert_ne!(a, Tensor::rand(&[1000], dtype, 43, &CPU).unwrap());
        let v = a.to_f64_vec().unwrap();
        assert!(v.iter().all(|x| (-1.0..=1.0).contains(x)));
        let mean = v.iter().sum::<f64>() / 1000.0;
        assert!(mean.abs() < 0.1, "uniform mean {mean}");
        assert!(v.iter().filter(|x| **x > 0.5).count() > 150, "uniform spread");

        let n = Tensor::randn(&[4000], dtype, 7, &CPU).unwrap().to_f64_vec().unwrap();
        let mean = n.iter().sum::<f64>() / 4000.0;
        let var = n.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / 4000.0;
        assert!(mean.abs() < 0.08 && (var - 1.0).abs() < 0.1, "normal mean {mean} var {var}");

        let i = Tensor::rand_int(&[500], dtype, -4, 4, 3, &CPU).unwrap().to_f64_vec().unwrap();
        assert!(i.iter().all(|x| x.fract() == 0.0 && (-4.0..=4.0).contains(x)));
        for k in -4..=4 {
            assert!(i.contains(&(k as f64)), "value {k} never drawn");
        }
    }
}

#[test]
fn zeros_and_reshape() {
    let z = Tensor::zeros(&[2, 0, 3], DType::BF16, &CPU).unwrap();
    assert_eq!(z.numel(), 0);
    let z = Tensor::zeros(&[3, 2], DType::F16, &CPU).unwrap();
    assert!(z.to_f64_vec().unwrap().iter().all(|&x| x == 0.0));
    let t = Tensor::randn(&[2, 3, 4], DType::F32, 1, &CPU).unwrap();
    let r = t.reshape(&[6, 4]).unwrap();
    assert_eq!(r.dims(), &[6, 4]);
    assert_eq!(r.as_bytes().unwrap(), t.as_bytes().unwrap());
}

#[test]
fn in_place_writes_through_as_mut_slice() {
    let mut t = Tensor::zeros(&[4], DType::F32, &CPU).unwrap();
    t.as_mut_slice::<f32>().unwrap().copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
    assert_eq!(t.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0, 4.0]);
    assert!(t.as_mut_slice::<f16>().is_err());
}

/// Bytes written through `as_bytes_mut` are the elements, for every dtype, and a clone that
/// shared the storage keeps its own values (copy on write).
#[test]
fn in_place_writes_through_as_bytes_mut() {
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::I32, DType::I64] {
        let src = Tensor::rand_int(&[3, 5], dtype, -9, 9, 7, &Device::Cpu).unwrap();
        let mut t = Tensor::zeros(&[3, 5], dtype, &Device::Cpu).unwrap();
        let before = t.clone();
        t.as_bytes_mut().unwrap().copy_from_slice(src.as_bytes().unwrap());
        assert_eq!(t.to_f64_vec().unwrap(), src.to_f64_vec().unwrap(), "{dtype}");
        assert!(before.to_f64_vec().unwrap().iter().all(|&v| v == 0.0), "{dtype}: the clone changed");
    }
}

#[test]
fn names_parse() {
    assert_eq!("bf16".parse::<DType>().unwrap(), DType::BF16);
    assert_eq!("float16".parse::<DType>().unwrap(), DType::F16);
    assert!("f64".parse::<DType>().is_err());
    assert_eq!("cuda:3".parse::<Device>().unwrap(), Device::Cuda(3));
    assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
    assert!("tpu".parse::<Device>().is_err());
    assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
}
