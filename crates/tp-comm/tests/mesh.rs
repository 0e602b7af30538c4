//! The device mesh on real `LocalGroup`s: Megatron's rank order (rank = (dp · pp_size + pp) ·
//! tp_size + tp), every rank's groups along each axis (and the module docs' table), all-reduces
//! on every axis group and on the world with closed-form sums, an abort reaching the other
//! ranks, and bad shapes and launches of the wrong size refused. (The mesh over processes is in
//! `mpi.rs`.)

use std::collections::BTreeSet;
use std::time::{Duration, Instant};
use tp_comm::{Axis, CommError, Coords, DeviceGroup, LaunchEnv, Launcher, MAX_WORLD_SIZE, Mesh, MeshShape, ReduceOp};
use tp_core::{Device, Tensor};

const CPU: Device = Device::Cpu;
const SHAPES: [(usize, usize, usize); 5] = [(1, 1, 1), (2, 2, 2), (1, 4, 3), (2, 3, 1), (2, 1, 4)];
const AXES: [Axis; 3] = [Axis::Tp, Axis::Pp, Axis::Dp];

/// The formula of the layout, written out independently of the crate.
fn rank_of(dp: usize, pp: usize, tp: usize, (pp_size, tp_size): (usize, usize)) -> usize {
    (dp * pp_size + pp) * tp_size + tp
}

/// Runs `f` on every rank's mesh, one thread each; the results in rank order.
fn on_meshes<R: Send>(meshes: Vec<Mesh>, f: impl Fn(&Mesh) -> R + Sync) -> Vec<R> {
    let f = &f;
    std::thread::scope(|s| {
        let hs: Vec<_> = meshes.into_iter().map(|m| s.spawn(move || f(&m))).collect();
        hs.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
    })
}

#[test]
fn coords_and_ranks_round_trip_for_every_rank() {
    for (dp, pp, tp) in SHAPES {
        let s = MeshShape::new(dp, pp, tp).unwrap();
        assert_eq!((s.dp, s.pp, s.tp), (dp, pp, tp));
        assert_eq!(s.world_size(), dp * pp * tp);
        assert_eq!((s.size(Axis::Dp), s.size(Axis::Pp), s.size(Axis::Tp)), (dp, pp, tp));
        let mut seen = BTreeSet::new();
        for r in 0..s.world_size() {
            let c = s.coords(r);
            assert!(c.dp < dp && c.pp < pp && c.tp < tp, "{dp}x{pp}x{tp} rank {r}: {c:?}");
            assert_eq!(rank_of(c.dp, c.pp, c.tp, (pp, tp)), r, "{dp}x{pp}x{tp} rank {r}");
            assert_eq!(s.rank(c), r);
            assert!(seen.insert((c.dp, c.pp, c.tp)), "{dp}x{pp}x{tp}: coords {c:?} twice");
        }
        // And every coordinate names a rank that maps back to it.
        for cdp in 0..dp {
            for cpp in 0..pp {
                for ctp in 0..tp {
                    let c = Coords { dp: cdp, pp: cpp, tp: ctp };
                    assert_eq!(s.coords(s.rank(c)), c);
                    assert_eq!(s.rank(c), rank_of(cdp, cpp, ctp, (pp, tp)));
                }
            }
        }
    }
}

#[test]
fn group_ranks_follow_the_formula_on_every_axis() {
    for (dp, pp, tp) in SHAPES {
        let s = MeshShape::new(dp, pp, tp).unwrap();
        for r in 0..s.world_size() {
            let c = s.coords(r);
            let tp_group: Vec<usize> = (0..tp).map(|i| rank_of(c.dp, c.pp, i, (pp, tp))).collect();
            let pp_group: Vec<usize> = (0..pp).map(|i| rank_of(c.dp, i, c.tp, (pp, tp))).collect();
            let dp_group: Vec<usize> = (0..dp).map(|i| rank_of(i, c.pp, c.tp, (pp, tp))).collect();
            assert_eq!(s.group_ranks(r, Axis::Tp), tp_group, "{dp}x{pp}x{tp} rank {r}");
            assert_eq!(s.group_ranks(r, Axis::Pp), pp_group, "{dp}x{pp}x{tp} rank {r}");
            assert_eq!(s.group_ranks(r, Axis::Dp), dp_group, "{dp}x{pp}x{tp} rank {r}");
            // A tensor-parallel group is consecutive ranks.
            assert_eq!(tp_group, (tp_group[0]..tp_group[0] + tp).collect::<Vec<_>>());
            // Every member of a group lists the same group.
            for axis in AXES {
                let g = s.group_ranks(r, axis);
                assert!(g.contains(&r));
                for &m in &g {
                    assert_eq!(s.group_ranks(m, axis), g, "{dp}x{pp}x{tp} {axis:?} rank {r} member {m}");
                }
            }
        }
        // The groups of an axis partition the world into world / size groups.
        for axis in AXES {
            let groups: BTreeSet<Vec<usize>> = (0..s.world_size()).map(|r| s.group_ranks(r, axis)).collect();
            assert_eq!(groups.len(), s.world_size() / s.size(axis), "{dp}x{pp}x{tp} {axis:?}");
            let all: BTreeSet<usize> = groups.iter().flatten().copied().collect();
            assert_eq!(all.len(), s.world_size());
        }
    }
    // The table of the module's docs, dp 2 x pp 2 x tp 2.
    let s = MeshShape::new(2, 2, 2).unwrap();
    assert_eq!(s.coords(3), Coords { dp: 0, pp: 1, tp: 1 });
    assert_eq!(s.coords(4), Coords { dp: 1, pp: 0, tp: 0 });
    assert_eq!(s.group_ranks(1, Axis::Tp), vec![0, 1]);
    assert_eq!(s.group_ranks(1, Axis::Pp), vec![1, 3]);
    assert_eq!(s.group_ranks(1, Axis::Dp), vec![1, 5]);
    assert_eq!(s.group_ranks(4, Axis::Pp), vec![4, 6]);
    assert_eq!(s.group_ranks(4, Axis::Dp), vec![0, 4]);
}

#[test]
fn each_mesh_knows_its_place_and_its_groups() {
    for (dp, pp, tp) in SHAPES {
        let shape = MeshShape::new(dp, pp, tp).unwrap();
        let meshes = Mesh::local(shape, Duration::from_secs(30), |_| CPU).unwrap();
        assert_eq!(meshes.len(), dp * pp * tp);
        for (r, m) in meshes.iter().enumerate() {
            let c = m.coords();
            assert_eq!(m.rank(), r);
            assert_eq!(m.shape(), shape);
            assert_eq!(c, shape.coords(r));
            assert_eq!(m.device(), CPU);
            assert_eq!(m.pp().rank(), c.pp, "{dp}x{pp}x{tp} rank {r}");
            assert_eq!(m.tp().rank(), c.tp, "{dp}x{pp}x{tp} rank {r}");
            assert_eq!(m.dp().rank(), c.dp, "{dp}x{pp}x{tp} rank {r}");
            assert_eq!(m.world().rank(), r);
            assert_eq!((m.tp().world_size(), m.pp().world_size(), m.dp().world_size()), (tp, pp, dp));
            assert_eq!(m.world().world_size(), dp * pp * tp);
            for axis in AXES {
                let g = m.group(axis);
                assert_eq!(g.world_size(), shape.size(axis));
                // Rank i of the group is member i of group_ranks.
                assert_eq!(shape.group_ranks(r, axis)[g.rank()], r, "{dp}x{pp}x{tp} {axis:?} rank {r}");
                assert_eq!(g.device(), CPU);
            }
        }
    }
}

#[test]
fn all_reduce_on_every_axis_and_the_world_sums_the_group_s_global_ranks() {
    for (dp, pp, tp) in SHAPES {
        let shape = MeshShape::new(dp, pp, tp).unwrap();
        let meshes = Mesh::local(shape, Duration::from_secs(30), |_| CPU).unwrap();
        let got = on_meshes(meshes, |m| {
            let x = Tensor::from_vec(vec![m.rank() as f32, 1.0], &[2], &CPU).unwrap();
            let sum = |g: &DeviceGroup| g.all_reduce(&x, ReduceOp::Sum).unwrap().to_f64_vec().unwrap();
            // The world last, then the axes again in another order: the groups are independent.
            let first = [sum(m.tp()), sum(m.pp()), sum(m.dp()), sum(m.world())];
            let again = [sum(m.dp()), sum(m.tp()), sum(m.pp())];
            (m.rank(), first, again)
        });
        let world = shape.world_size();
        for (r, (rank, first, again)) in got.into_iter().enumerate() {
            assert_eq!(rank, r);
            let want = |axis: Axis| {
                let members = shape.group_ranks(r, axis);
                vec![members.iter().sum::<usize>() as f64, members.len() as f64]
            };
            let ctx = format!("{dp}x{pp}x{tp} rank {r}");
            assert_eq!(first[0], want(Axis::Tp), "{ctx} tp");
            assert_eq!(first[1], want(Axis::Pp), "{ctx} pp");
            assert_eq!(first[2], want(Axis::Dp), "{ctx} dp");
            assert_eq!(first[3], vec![(world * (world - 1) / 2) as f64, world as f64], "{ctx} world");
            assert_eq!(again, [want(Axis::Dp), want(Axis::Tp), want(Axis::Pp)], "{ctx} again");
            // Closed form of the tensor-parallel sum: tp consecutive ranks from c.
            let c = shape.coords(r);
            let base = rank_of(c.dp, c.pp, 0, (pp, tp));
            assert_eq!(first[0][0], (tp * base + tp * (tp - 1) / 2) as f64, "{ctx} tp closed form");
            // Of the pipeline sum: stride tp from (dp, 0, tp).
            let base = rank_of(c.dp, 0, c.tp, (pp, tp));
            assert_eq!(first[1][0], (pp * base + tp * pp * (pp - 1) / 2) as f64, "{ctx} pp closed form");
            // Of the data-parallel sum: stride pp * tp from (0, pp, tp).
            let base = rank_of(0, c.pp, c.tp, (pp, tp));
            assert_eq!(first[2][0], (dp * base + pp * tp * dp * (dp - 1) / 2) as f64, "{ctx} dp closed form");
        }
    }
}

#[test]
fn an_abort_on_one_rank_ends_the_others_pending_world_collective() {
    for (dp, pp, tp) in [(2, 2, 2), (1, 4, 3)] {
        let shape = MeshShape::new(dp, pp, tp).unwrap();
        let meshes = Mesh::local(shape, Duration::from_secs(10), |_| CPU).unwrap();
        let victim = shape.world_size() - 1;
        let started = Instant::now();
        let got = on_meshes(meshes, |m| {
            if m.rank() == victim {
                std::thread::sleep(Duration::from_millis(100));
                m.abort("x");
                return None;
            }
            let x = Tensor::from_vec(vec![1.0f32], &[1], &CPU).unwrap();
            let t = Instant::now();
            let e = m.world().all_reduce(&x, ReduceOp::Sum).unwrap_err();
            Some((e, t.elapsed()))
        });
        assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
        assert!(got[victim].is_none());
        for (r, out) in got.into_iter().enumerate().filter(|(r, _)| *r != victim) {
            let (e, took) = out.unwrap();
            assert!(matches!(e, CommError::Poisoned { .. }), "rank {r}: {e:?}");
            assert!(e.to_string().contains(&format!("rank {victim} aborted: x")), "rank {r}: {e}");
            assert!(took < Duration::from_secs(2), "rank {r}: {took:?}");
        }
    }
}

#[test]
fn an_abort_reaches_every_axis_group_of_the_aborting_rank() {
    let shape = MeshShape::new(2, 2, 2).unwrap();
    let meshes = Mesh::local(shape, Duration::from_secs(10), |_| CPU).unwrap();
    let got = on_meshes(meshes, |m| {
        if m.rank() == 0 {
            std::thread::sleep(Duration::from_millis(100));
            m.abort("x");
            return Vec::new();
        }
        // The ranks that share a group with rank 0 see the abort there; the others' groups
        // along that axis are unaffected (and every group of a rank sharing none stays usable).
        let x = Tensor::from_vec(vec![m.rank() as f32], &[1], &CPU).unwrap();
        AXES.iter()
            .map(|&axis| {
                let shares = shape.group_ranks(m.rank(), axis).contains(&0);
                let out = m.group(axis).all_reduce(&x, ReduceOp::Sum);
                (axis, shares, out.map(|t| t.to_f64_vec().unwrap()[0]))
            })
            .collect()
    });
    for (r, outs) in got.iter().enumerate().skip(1) {
        for (axis, shares, out) in outs {
            if *shares {
                assert!(matches!(out, Err(CommError::Poisoned { .. })), "rank {r} {axis:?}: {out:?}");
            } else {
                let want = shape.group_ranks(r, *axis).iter().sum::<usize>() as f64;
                assert_eq!(out, &Ok(want), "rank {r} {axis:?}");
            }
        }
    }
}

#[test]
fn shapes_with_a_zero_axis_or_too_many_ranks_are_refused() {
    for (dp, pp, tp) in [(0, 1, 1), (1, 0, 1), (1, 1, 0), (0, 0, 0), (0, usize::MAX, 2)] {
        let e = MeshShape::new(dp, pp, tp).unwrap_err();
        assert!(matches!(e, CommError::Limit { .. }), "{dp}x{pp}x{tp}: {e:?}");
        assert!(e.to_string().contains("at least 1"), "{e}");
    }
    let over = [
        (MAX_WORLD_SIZE + 1, 1, 1),
        (1, MAX_WORLD_SIZE + 1, 1),
        (1, 1, MAX_WORLD_SIZE + 1),
        (MAX_WORLD_SIZE / 2 + 1, 2, 1),
        (64, 64, 2),
        (usize::MAX, 2, 2),
        (usize::MAX, usize::MAX, usize::MAX),
        (1 << 32, 1 << 32, 1),
    ];
    for (dp, pp, tp) in over {
        let e = MeshShape::new(dp, pp, tp).unwrap_err();
        assert!(matches!(e, CommError::Limit { .. }), "{dp}x{pp}x{tp}: {e:?}");
        assert!(e.to_string().contains("exceed"), "{e}");
    }
    // The limit itself is allowed.
    assert_eq!(MeshShape::new(MAX_WORLD_SIZE, 1, 1).unwrap().world_size(), MAX_WORLD_SIZE);
    assert_eq!(MeshShape::new(1, 2, MAX_WORLD_SIZE / 2).unwrap().world_size(), MAX_WORLD_SIZE);
}

/// Expert parallelism splits the data-parallel axis: `ep` consecutive replicas share out the
/// experts, and the replicas `ep` apart hold the same ones. Each group's all-reduce sums the
/// global ranks written out from the formula; an `ep` that does not divide `dp` is refused.
#[test]
fn expert_parallel_groups_split_the_data_parallel_axis() {
    for (dp, pp, tp, ep) in [(4, 1, 1, 2), (4, 2, 2, 2), (6, 1, 2, 3), (2, 2, 1, 2), (3, 1, 2, 1)] {
        let s = MeshShape::new(dp, pp, tp).unwrap().with_expert_parallel(ep).unwrap();
        assert_eq!((s.size(Axis::Ep), s.size(Axis::Edp)), (ep, dp / ep));
        for r in 0..s.world_size() {
            let c = s.coords(r);
            let (outer, inner) = (c.dp / ep, c.dp % ep);
            let ep_group: Vec<usize> = (0..ep).map(|i| rank_of(outer * ep + i, c.pp, c.tp, (pp, tp))).collect();
            let edp_group: Vec<usize> = (0..dp / ep).map(|i| rank_of(i * ep + inner, c.pp, c.tp, (pp, tp))).collect();
            assert_eq!(s.group_ranks(r, Axis::Ep), ep_group, "{dp}x{pp}x{tp} ep {ep} rank {r}");
            assert_eq!(s.group_ranks(r, Axis::Edp), edp_group, "{dp}x{pp}x{tp} ep {ep} rank {r}");
        }
        let meshes = Mesh::local(s, Duration::from_secs(30), |_| CPU).unwrap();
        let sums = on_meshes(meshes, |m| {
            [m.ep(), m.edp()].map(|g| {
                let t = Tensor::from_vec(vec![m.rank() as f32], &[1], &CPU).unwrap();
                g.all_reduce(&t, ReduceOp::Sum).unwrap().to_vec::<f32>().unwrap()[0] as usize
            })
        });
        for (r, [ep_sum, edp_sum]) in sums.into_iter().enumerate() {
            assert_eq!(ep_sum, s.group_ranks(r, Axis::Ep).iter().sum::<usize>(), "rank {r} ep");
            assert_eq!(edp_sum, s.group_ranks(r, Axis::Edp).iter().sum::<usize>(), "rank {r} edp");
        }
    }
    let err = MeshShape::new(4, 1, 1).unwrap().with_expert_parallel(3).unwrap_err().to_string();
    assert!(err.contains("expert parallelism of 3") && err.contains("4 data-parallel"), "{err}");
    assert!(MeshShape::new(4, 1, 1).unwrap().with_expert_parallel(0).is_err());
}

#[test]
fn the_layout_of_the_doc_table() {
    // dp 2 x pp 2 x tp 2, the table of the module docs.
    let s = MeshShape::new(2, 2, 2).unwrap();
    let rows: Vec<(usize, [usize; 3], [Vec<usize>; 3])> = (0..8)
        .map(|r| {
            let c = s.coords(r);
            (
                r,
                [c.dp, c.pp, c.tp],
                [s.group_ranks(r, Axis::Tp), s.group_ranks(r, Axis::Pp), s.group_ranks(r, Axis::Dp)],
            )
        })
        .collect();
    assert_eq!(rows[0], (0, [0, 0, 0], [vec![0, 1], vec![0, 2], vec![0, 4]]));
    assert_eq!(rows[1], (1, [0, 0, 1], [vec![0, 1], vec![1, 3], vec![1, 5]]));
    assert_eq!(rows[2], (2, [0, 1, 0], [vec![2, 3], vec![0, 2], vec![2, 6]]));
    assert_eq!(rows[3], (3, [0, 1, 1], [vec![2, 3], vec![1, 3], vec![3, 7]]));
    assert_eq!(rows[4], (4, [1, 0, 0], [vec![4, 5], vec![4, 6], vec![0, 4]]));
    assert_eq!(rows[7], (7, [1, 1, 1], [vec![6, 7], vec![5, 7], vec![3, 7]]));
    assert_eq!((s.size(Axis::Dp), s.size(Axis::Pp), s.size(Axis::Tp)), (2, 2, 2));
    let s = MeshShape::new(3, 4, 5).unwrap();
    assert_eq!((s.size(Axis::Dp), s.size(Axis::Pp), s.size(Axis::Tp)), (3, 4, 5));
    assert_eq!(s.coords(59), Coords { dp: 2, pp: 3, tp: 4 });
    assert_eq!(s.group_ranks(27, Axis::Pp), vec![22, 27, 32, 37]);
}

#[test]
fn a_launch_of_the_wrong_size_is_refused_before_any_rendezvous() {
    for (vars, launcher, size_var) in [
        (vec![("RANK", "0"), ("WORLD_SIZE", "6")], Launcher::Torchrun, "WORLD_SIZE=6"),
        (vec![("SLURM_PROCID", "0"), ("SLURM_NTASKS", "6")], Launcher::Slurm, "SLURM_NTASKS=6"),
        (
            vec![("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "6")],
            Launcher::OpenMpi,
            "OMPI_COMM_WORLD_SIZE=6",
        ),
    ] {
        let env = LaunchEnv::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())).unwrap();
        assert_eq!(env.launcher, launcher);
        let started = Instant::now();
        let e = Mesh::from_launch_env(&env, MeshShape::new(2, 2, 2).unwrap()).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(1));
        assert!(matches!(e, CommError::Env(_)), "{e:?}");
        let e = e.to_string();
        assert!(e.contains(size_var) && e.contains("2 x 2 x 2 = 8"), "{e}");
    }
}
