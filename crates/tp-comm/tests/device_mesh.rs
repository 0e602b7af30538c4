//! The mesh: Megatron's rank order (tp fastest, then pp, then dp), one group per axis, and real
//! collectives on every axis group with closed-form results.

use std::time::{Duration, Instant};
use tp_comm::{Axis, Coords, Mesh, MeshShape, ReduceOp};
use tp_core::{Device, Tensor};

const SHAPES: [(usize, usize, usize); 5] = [(1, 1, 1), (2, 2, 2), (1, 4, 3), (2, 3, 1), (2, 1, 4)];

#[test]
fn coordinates_and_groups_follow_megatrons_order() {
    for (dp, pp, tp) in SHAPES {
        let s = MeshShape::new(dp, pp, tp).unwrap();
        assert_eq!(s.world_size(), dp * pp * tp);
        for r in 0..s.world_size() {
            let c = s.coords(r);
            assert_eq!(r, (c.dp * pp + c.pp) * tp + c.tp);
            assert_eq!(s.rank(c), r);
            assert_eq!(s.group_ranks(r, Axis::Tp), (0..tp).map(|i| s.rank(Coords { tp: i, ..c })).collect::<Vec<_>>());
            assert_eq!(s.group_ranks(r, Axis::Pp), (0..pp).map(|i| s.rank(Coords { pp: i, ..c })).collect::<Vec<_>>());
            assert_eq!(s.group_ranks(r, Axis::Dp), (0..dp).map(|i| s.rank(Coords { dp: i, ..c })).collect::<Vec<_>>());
        }
    }
    // dp 2 x pp 2 x tp 2: rank 3 is replica 0, stage 1, tensor rank 1.
    let s = MeshShape::new(2, 2, 2).unwrap();
    assert_eq!(s.coords(3), Coords { dp: 0, pp: 1, tp: 1 });
    assert_eq!(s.group_ranks(3, Axis::Pp), vec![1, 3]);
    assert_eq!(s.group_ranks(3, Axis::Dp), vec![3, 7]);
}

#[test]
fn bad_shapes_are_refused() {
    assert!(MeshShape::new(0, 1, 1).is_err());
    assert!(MeshShape::new(1, 0, 1).unwrap_err().to_string().contains("at least 1"));
    assert!(MeshShape::new(64, 64, 2).unwrap_err().to_string().contains("exceed"));
    assert!(MeshShape::new(usize::MAX, 2, 2).is_err());
}

#[test]
fn every_axis_group_sums_its_members() {
    for (dp, pp, tp) in SHAPES {
        let shape = MeshShape::new(dp, pp, tp).unwrap();
        let meshes = Mesh::local(shape, Duration::from_secs(30), |_| Device::Cpu).unwrap();
        let results: Vec<(usize, [f64; 4])> = std::thread::scope(|s| {
            let hs: Vec<_> = meshes
                .into_iter()
                .map(|m| {
                    s.spawn(move || {
                        let c = m.coords();
                        assert_eq!((m.tp().rank(), m.pp().rank(), m.dp().rank()), (c.tp, c.pp, c.dp));
                        assert_eq!((m.tp().world_size(), m.pp().world_size(), m.dp().world_size()), (tp, pp, dp));
                        let x = Tensor::from_vec(vec![m.rank() as f32], &[1], &Device::Cpu).unwrap();
                        let sum = |g: &tp_comm::DeviceGroup| {
                            g.all_reduce(&x, ReduceOp::Sum).unwrap().to_f64_vec().unwrap()[0]
                        };
                        (m.rank(), [sum(m.tp()), sum(m.pp()), sum(m.dp()), sum(m.world())])
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, got) in results {
            let total = |axis| shape.group_ranks(r, axis).iter().sum::<usize>() as f64;
            let world = (0..shape.world_size()).sum::<usize>() as f64;
            assert_eq!(got, [total(Axis::Tp), total(Axis::Pp), total(Axis::Dp), world], "{dp}x{pp}x{tp} rank {r}");
        }
    }
}

#[test]
fn an_abort_on_one_rank_ends_the_others_waits() {
    let meshes = Mesh::local(MeshShape::new(2, 2, 1).unwrap(), Duration::from_secs(30), |_| Device::Cpu).unwrap();
    let started = Instant::now();
    let errors: Vec<Option<String>> = std::thread::scope(|s| {
        let hs: Vec<_> = meshes
            .into_iter()
            .map(|m| {
                s.spawn(move || {
                    if m.rank() == 3 {
                        std::thread::sleep(Duration::from_millis(100));
                        m.abort("rank 3 failed on purpose");
                        return None;
                    }
                    Some(m.world().barrier().unwrap_err().to_string())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(started.elapsed() < Duration::from_secs(5));
    for e in errors.into_iter().flatten() {
        assert!(e.contains("rank 3 failed on purpose"), "{e}");
    }
}
