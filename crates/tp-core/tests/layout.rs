//! `narrow` and `cat` against index arithmetic done independently, element by element.

mod common;
use common::*;
use tp_core::{DType, Device, Tensor};

const CPU: Device = Device::Cpu;

/// Row-major flat index of `idx` in `dims`.
fn flat(dims: &[usize], idx: &[usize]) -> usize {
    dims.iter().zip(idx).fold(0, |acc, (d, i)| acc * d + i)
}

/// Every multi-index of `dims`, in row-major order.
fn indices(dims: &[usize]) -> Vec<Vec<usize>> {
    let mut out = vec![vec![]];
    for &d in dims {
        out = out.into_iter().flat_map(|p| (0..d).map(move |i| [p.clone(), vec![i]].concat())).collect();
    }
    out
}

#[test]
fn narrow_picks_the_right_elements_in_every_dim() {
    let dims = [3, 17, 5, 4];
    for dtype in DType::FLOATS {
        let t = Tensor::randn(&dims, dtype, 11, &CPU).unwrap();
        assert_nonzero(&t);
        let v = f64s(&t);
        for dim in 0..dims.len() {
            for (start, len) in [(0, 1), (1, dims[dim] - 1), (dims[dim] / 2, dims[dim] - dims[dim] / 2), (dims[dim], 0)]
            {
                let n = t.narrow(dim, start, len).unwrap();
                let mut nd = dims;
                nd[dim] = len;
                assert_eq!(n.dims(), &nd);
                assert_eq!(n.dtype(), dtype);
                let got = f64s(&n);
                for idx in indices(&nd) {
                    let mut src = idx.clone();
                    src[dim] += start;
                    assert_eq!(got[flat(&nd, &idx)], v[flat(&dims, &src)], "dim {dim} start {start} idx {idx:?}");
                }
            }
        }
    }
}

#[test]
fn cat_places_each_part_at_its_offset() {
    for dtype in DType::FLOATS {
        for dim in 0..3 {
            let lens = [2, 0, 5, 1];
            let parts: Vec<Tensor> = lens
                .iter()
                .enumerate()
                .map(|(i, &l)| {
                    let mut d = [3, 4, 6];
                    d[dim] = l;
                    Tensor::randn(&d, dtype, 20 + i as u64, &CPU).unwrap()
                })
                .collect();
            let c = Tensor::cat(&parts, dim).unwrap();
            let mut cd = [3, 4, 6];
            cd[dim] = lens.iter().sum();
            assert_eq!(c.dims(), &cd);
            let got = f64s(&c);
            let mut offset = 0;
            for p in &parts {
                let pv = f64s(p);
                for idx in indices(p.dims()) {
                    let mut dst = idx.clone();
                    dst[dim] += offset;
                    assert_eq!(got[flat(&cd, &dst)], pv[flat(p.dims(), &idx)]);
                }
                offset += p.dims()[dim];
            }
        }
    }
}

#[test]
fn narrow_then_cat_is_identity() {
    let t = Tensor::randn(&[7, 129, 3], DType::BF16, 3, &CPU).unwrap();
    let pieces = [t.narrow(1, 0, 64).unwrap(), t.narrow(1, 64, 1).unwrap(), t.narrow(1, 65, 64).unwrap()];
    let refs: Vec<&Tensor> = pieces.iter().collect();
    assert_eq!(Tensor::cat(&refs, 1).unwrap(), t);
}
