//! GPU suite of the layers: the same layers through LocalGroup ranks sharing GPU 0, against the
//! host backend; and the element-wise kernels (SwiGLU, row bias) against the host. Built with
//! `--features gpu-tests`; fails, never skips, without a GPU.

mod common;
use common::*;
use tp_core::{DType, Device, Tensor};
use tp_layers::{ColumnParallel, ParallelMlp, RowParallel};

const GPU: Device = Device::Cuda(0);

fn setup() {
    assert!(tp_kernels::device_count().expect("the GPU suite needs a CUDA device") > 0);
}

#[test]
fn elementwise_kernels_match_the_host() {
    setup();
    for dtype in DType::FLOATS {
        let x = Tensor::randn(&[37, 2 * 129], dtype, 1, &CPU).unwrap();
        let want = f64s(&x.swiglu().unwrap());
        let got = f64s(&x.to_device(&GPU).unwrap().swiglu().unwrap());
        let u = dtype.unit_roundoff();
        assert_close(&format!("swiglu {dtype}"), &got, &want, |i| 2.0 * u * want[i].abs() + 1e-6);
        let b = Tensor::randn(&[2 * 129], dtype, 2, &CPU).unwrap();
        let want = x.add_row(&b).unwrap();
        let got = x.to_device(&GPU).unwrap().add_row(&b.to_device(&GPU).unwrap()).unwrap().to_device(&CPU).unwrap();
        assert_eq!(got, want, "add_row {dtype}: one f32 add and one rounding on both");
    }
}

#[test]
fn layers_on_ranks_sharing_one_gpu_match_the_host() {
    setup();
    for dtype in DType::FLOATS {
        let (hidden, inter) = (64, 200);
        let gate = linear(inter, hidden, false, dtype, 1);
        let up = linear(inter, hidden, false, dtype, 3);
        let down = linear(hidden, inter, true, dtype, 5);
        let x = Tensor::rand(&[9, hidden], dtype, 7, &CPU).unwrap();
        let r = mlp_f64(&x, &gate, &up, &down);
        let u = dtype.unit_roundoff();
        for world in [1, 2, 3, 4, 8] {
            let got = on_ranks(world, GPU, |g| {
                let to_gpu = |l: &tp_layers::Linear| l.to(dtype, &GPU).unwrap();
                let (gg, ug, dg) = (to_gpu(&gate), to_gpu(&up), to_gpu(&down));
                let xg = x.to_device(&GPU).unwrap();
                let mlp = ParallelMlp::from_full(&gg, &ug, &dg, g.rank(), world).unwrap();
                let col = ColumnParallel::from_full(&gg, g.rank(), world).unwrap().forward_gathered(&xg, &g).unwrap();
                let row = RowParallel::from_full(dg.weight(), dg.bias(), g.rank(), world).unwrap();
                let act = Tensor::rand(&[9, inter], dtype, 11, &CPU).unwrap().to_device(&GPU).unwrap();
                let row_y = row.forward_split(&act, &g).unwrap();
                (
                    mlp.forward(&xg, &g).unwrap().to_device(&CPU).unwrap(),
                    col.to_device(&CPU).unwrap(),
                    row_y.to_device(&CPU).unwrap(),
                )
            });
            let c = if dtype == DType::F32 { 16.0 } else { 4.0 };
            for (y, col, _) in &got {
                assert_close(&format!("gpu mlp {dtype} world {world}"), &f64s(y), &r.y, |i| {
                    c * u * r.scale[i] + 2.0 * u * r.y[i].abs() + 1e-5
                });
                let (want, abs) = linear_f64(&x, &gate);
                assert_close(&format!("gpu column {dtype} world {world}"), &f64s(col), &want, |i| {
                    tol(dtype, hidden, want[i], abs[i])
                });
            }
            assert!(got.iter().all(|g| g.0 == got[0].0 && g.2 == got[0].2), "ranks disagree");
        }
    }
}
