//! Checks of the GPU sampling kernels (`tp-kernels`' `Gpu::penalize`, `Gpu::top_k`,
//! `Gpu::row_max_sum_exp`, driven on a tensor's device buffer) against host references: the
//! penalties replayed in f32 in the documented order (bitwise), the top-k by sorting every
//! (value, column) pair (exact), and the row maximum and sum of exponentials in f64.

use super::f64s;
use std::sync::Arc;
use tp_core::rng::SplitMix64;
use tp_core::{DType, Device, Tensor};
use tp_kernels::{ElemType, Gpu, RowPenalties};

fn elem(d: DType) -> ElemType {
    match d {
        DType::F32 => ElemType::F32,
        DType::F16 => ElemType::F16,
        DType::BF16 => ElemType::BF16,
        DType::I32 => ElemType::I32,
        DType::I64 => ElemType::I64,
    }
}

/// `rows x n` logits of `dtype` with ties (multiples of 1/4), and in row 1 (when n >= 8) a NaN,
/// two -inf and a +inf; the tensor on `device` and its values as f64.
pub fn logits(rows: usize, n: usize, dtype: DType, seed: u64, device: Device) -> (Tensor, Vec<f64>) {
    let mut rng = SplitMix64::new(seed);
    let mut v: Vec<f64> = (0..rows * n).map(|_| (rng.normal() * 12.0).round() / 4.0).collect();
    if rows > 1 && n >= 8 {
        for (j, x) in [(1, f64::NAN), (3, f64::NEG_INFINITY), (4, f64::NEG_INFINITY), (n - 1, f64::INFINITY)] {
            v[n + j] = x;
        }
    }
    let t = Tensor::from_fn_f64(&[rows, n], dtype, &Device::Cpu, |i| v[i]).unwrap();
    let exact = f64s(&t);
    (t.to_device(&device).unwrap(), exact)
}

fn gpu_of(t: &Tensor) -> Arc<Gpu> {
    t.cuda_buffer().expect("a CUDA tensor").0.clone()
}

fn floats(gpu: &Gpu, buf: &tp_kernels::cudarc::driver::CudaSlice<u8>, n: usize) -> Vec<f32> {
    gpu.dtoh(buf, 4 * n).unwrap().chunks_exact(4).map(|c| f32::from_ne_bytes(c.try_into().unwrap())).collect()
}

/// Penalties of random columns (ids of a "prompt" and an "output") on every row, bitwise
/// against the f32 replay: `l > 0 ? l / r : l * r`, then `(l - c * f) - [c > 0] * p`.
pub fn check_penalize(device: Device, rows: usize, n: usize, dtype: DType) {
    let (x, exact) = logits(rows, n, dtype, 7 + n as u64, device);
    let gpu = gpu_of(&x);
    let mut rng = SplitMix64::new(n as u64);
    let lists: Vec<(Vec<usize>, Vec<u32>)> = (0..rows)
        .map(|r| {
            let mut cols: Vec<usize> = (0..n).filter(|_| rng.next_f64() < 0.3).collect();
            if r == 0 {
                cols.clear(); // a row without penalties is copied as is
            }
            let counts = cols.iter().map(|_| rng.int_in(0, 3) as u32).collect();
            (cols, counts)
        })
        .collect();
    let factors = [(1.3f32, 0.7f32, -0.4f32), (0.8, -1.5, 2.0), (1.0, 0.1, 0.3)];
    let pens: Vec<RowPenalties<'_>> = lists
        .iter()
        .enumerate()
        .map(|(r, (cols, counts))| {
            let (repetition, frequency, presence) = factors[r % factors.len()];
            RowPenalties { repetition, frequency, presence, cols, counts }
        })
        .collect();
    let mut out = gpu.alloc(4 * rows * n).unwrap();
    gpu.penalize(&mut out, x.cuda_buffer().unwrap().1, (rows, n), &pens, elem(dtype)).unwrap();
    let got = floats(&gpu, &out, rows * n);
    let mut want: Vec<f32> = exact.iter().map(|&v| v as f32).collect();
    for (r, p) in pens.iter().enumerate() {
        for (&c, &count) in p.cols.iter().zip(p.counts) {
            let l = &mut want[r * n + c];
            *l = if *l > 0.0 { *l / p.repetition } else { *l * p.repetition };
            *l -= count as f32 * p.frequency;
            *l -= if count > 0 { p.presence } else { 0.0 };
        }
    }
    // Bitwise, but any NaN equals any NaN (payloads differ between the device and the host).
    let bits = |v: &[f32]| v.iter().map(|x| if x.is_nan() { u32::MAX } else { x.to_bits() }).collect::<Vec<_>>();
    assert_eq!(bits(&got), bits(&want), "penalize {rows}x{n} {dtype}");
    let bad = [RowPenalties { cols: &[n], counts: &[1], ..pens[0] }];
    assert!(gpu.penalize(&mut out, x.cuda_buffer().unwrap().1, (1, n), &bad, elem(dtype)).is_err());
}

/// Top-k of every row against a full sort by (NaN first, larger value, lower column), the ids
/// shifted by `offset`; rows shorter than k end in (-inf, -1).
pub fn check_top_k(device: Device, rows: usize, n: usize, k: usize, dtype: DType) {
    let (x, exact) = logits(rows, n, dtype, 11 + n as u64 + k as u64, device);
    let gpu = gpu_of(&x);
    let offset = 1000;
    let (mut vals, mut ids) = (gpu.alloc(4 * rows * k).unwrap(), gpu.alloc(8 * rows * k).unwrap());
    gpu.top_k(&mut vals, &mut ids, x.cuda_buffer().unwrap().1, (rows, n), k, offset, elem(dtype)).unwrap();
    let got_v = floats(&gpu, &vals, rows * k);
    let got_i: Vec<i64> = gpu
        .dtoh(&ids, 8 * rows * k)
        .unwrap()
        .chunks_exact(8)
        .map(|c| i64::from_ne_bytes(c.try_into().unwrap()))
        .collect();
    for r in 0..rows {
        let row = &exact[r * n..][..n];
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| {
            let (va, vb) = (row[a], row[b]);
            match (va.is_nan(), vb.is_nan()) {
                (true, false) => std::cmp::Ordering::Less,
                (false, true) => std::cmp::Ordering::Greater,
                (true, true) => a.cmp(&b),
                (false, false) => vb.partial_cmp(&va).unwrap().then(a.cmp(&b)),
            }
        });
        for s in 0..k {
            let (gv, gi) = (got_v[r * k + s], got_i[r * k + s]);
            let what = format!("top_k {rows}x{n} k{k} {dtype} row {r} slot {s}");
            match order.get(s) {
                Some(&j) => {
                    assert_eq!(gi, (j + offset) as i64, "{what}: id");
                    let same = (row[j].is_nan() && gv.is_nan()) || f64::from(gv) == row[j];
                    assert!(same, "{what}: value {gv} != {}", row[j]);
                }
                None => assert_eq!((gv, gi), (f32::NEG_INFINITY, -1), "{what}: past the row"),
            }
        }
    }
    assert!(gpu.top_k(&mut vals, &mut ids, x.cuda_buffer().unwrap().1, (rows, n), 0, 0, elem(dtype)).is_err());
    let big = tp_kernels::TOP_K_MAX + 1;
    assert!(gpu.top_k(&mut vals, &mut ids, x.cuda_buffer().unwrap().1, (rows, n), big, 0, elem(dtype)).is_err());
}

/// Row maxima (exact) and sums of `exp((x - max) * scale)` against f64 within the f32
/// summation bound; a row of -inf gives (-inf, 0).
pub fn check_row_max_sum_exp(device: Device, rows: usize, n: usize, dtype: DType) {
    let mut v: Vec<f64> = {
        let mut rng = SplitMix64::new(3 + n as u64);
        (0..rows * n).map(|_| rng.normal() * 5.0).collect()
    };
    if rows > 2 {
        v[2 * n..3 * n].fill(f64::NEG_INFINITY);
    }
    if rows > 1 && n > 1 {
        v[n + 1] = f64::NEG_INFINITY; // masked ids carry no mass
    }
    let x = Tensor::from_fn_f64(&[rows, n], dtype, &Device::Cpu, |i| v[i]).unwrap();
    let exact = f64s(&x);
    let x = x.to_device(&device).unwrap();
    let gpu = gpu_of(&x);
    let scales: Vec<f32> = (0..rows).map(|r| [1.0, 1.0 / 0.7, 2.5][r % 3]).collect();
    let (mut maxs, mut sums) = (gpu.alloc(4 * rows).unwrap(), gpu.alloc(4 * rows).unwrap());
    gpu.row_max_sum_exp(&mut maxs, &mut sums, x.cuda_buffer().unwrap().1, (rows, n), &scales, elem(dtype)).unwrap();
    let (gm, gs) = (floats(&gpu, &maxs, rows), floats(&gpu, &sums, rows));
    for r in 0..rows {
        let row = &exact[r * n..][..n];
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = if m == f64::NEG_INFINITY {
            0.0
        } else {
            row.iter().map(|&x| ((x - m) * f64::from(scales[r])).exp()).sum()
        };
        let what = format!("row_max_sum_exp {rows}x{n} {dtype} row {r}");
        assert_eq!(f64::from(gm[r]), m, "{what}: max");
        // Each term e^-t (t >= 0) within 2 ulps of expf plus t e^-t u <= u/e from rounding x - m,
        // the sum within gamma_n; the largest term is 1, so s >= 1 bounds them all.
        let tol = s * (2.0 * n as f64 + 8.0) * 2f64.powi(-24);
        assert!((f64::from(gs[r]) - s).abs() <= tol, "{what}: sum {} vs {s} (tol {tol})", gs[r]);
    }
    let bad = vec![0.0f32; rows];
    assert!(
        gpu.row_max_sum_exp(&mut maxs, &mut sums, x.cuda_buffer().unwrap().1, (rows, n), &bad, elem(dtype)).is_err()
    );
}
