//! The mesh: Megatron's rank order (tp fastest, then pp, then dp), one group per axis, and real
//! collectives on every axis group with closed-form results.

use std::time::{Duration, Instant};
use tp_comm::{Axis, CommError, Coords, LaunchEnv, Launcher, Mesh, MeshShape, ReduceOp};
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
    for (dp, pp, tp) in [(0, 1, 1), (1, 0, 1), (1, 1, 0), (0, 0, 0)] {
        let e = MeshShape::new(dp, pp, tp).unwrap_err();
        assert!(matches!(e, CommError::Limit { .. }) && e.to_string().contains("at least 1"), "{e}");
    }
    for (dp, pp, tp) in [(64, 64, 2), (4097, 1, 1), (1, 1, 4097), (usize::MAX, 2, 2), (1 << 40, 1 << 40, 1 << 40)] {
        let e = MeshShape::new(dp, pp, tp).unwrap_err();
        assert!(matches!(e, CommError::Limit { .. }) && e.to_string().contains("exceed"), "{e}");
    }
    assert_eq!(MeshShape::new(16, 16, 16).unwrap().world_size(), tp_comm::MAX_WORLD_SIZE);
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

/// What one rank saw: its global rank, each axis group's sum of global ranks (tp, pp, dp,
/// world) and each axis group's all-gather of global ranks (tp, pp, dp).
type Seen = (usize, [f64; 4], [Vec<usize>; 3]);

#[test]
fn every_axis_group_sums_its_members() {
    for (dp, pp, tp) in SHAPES {
        let shape = MeshShape::new(dp, pp, tp).unwrap();
        let meshes = Mesh::local(shape, Duration::from_secs(30), |_| Device::Cpu).unwrap();
        assert_eq!(meshes.len(), dp * pp * tp);
        let results: Vec<Seen> = std::thread::scope(|s| {
            let hs: Vec<_> = meshes
                .into_iter()
                .enumerate()
                .map(|(i, m)| {
                    s.spawn(move || {
                        assert_eq!((m.rank(), m.shape()), (i, shape));
                        assert_eq!(m.device(), Device::Cpu);
                        let c = m.coords();
                        assert_eq!(c, shape.coords(i));
                        assert_eq!((m.tp().rank(), m.pp().rank(), m.dp().rank()), (c.tp, c.pp, c.dp));
                        assert_eq!((m.tp().world_size(), m.pp().world_size(), m.dp().world_size()), (tp, pp, dp));
                        assert_eq!((m.world().rank(), m.world().world_size()), (i, dp * pp * tp));
                        for axis in [Axis::Tp, Axis::Pp, Axis::Dp] {
                            assert_eq!(m.group(axis).world_size(), shape.size(axis));
                        }
                        let x = Tensor::from_vec(vec![m.rank() as f32], &[1], &Device::Cpu).unwrap();
                        let sum = |g: &tp_comm::DeviceGroup| {
                            g.all_reduce(&x, ReduceOp::Sum).unwrap().to_f64_vec().unwrap()[0]
                        };
                        let sums = [sum(m.tp()), sum(m.pp()), sum(m.dp()), sum(m.world())];
                        let gather = |axis| {
                            let v = m.group(axis).all_gather(&x, 0).unwrap().to_f64_vec().unwrap();
                            v.into_iter().map(|f| f as usize).collect::<Vec<usize>>()
                        };
                        (m.rank(), sums, [gather(Axis::Tp), gather(Axis::Pp), gather(Axis::Dp)])
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, sums, gathered) in results {
            let Coords { dp: d, pp: p, tp: t } = shape.coords(r);
            // Closed forms of the members' global ranks (T = tp, P = pp, D = dp sizes):
            // tp group: (d·P + p)·T + i for i < T;  pp group: (d·P + i)·T + t for i < P;
            // dp group: (i·P + p)·T + t for i < D;  world: 0..W.
            let tri = |n: usize| n * (n - 1) / 2;
            let tp_sum = tp * ((d * pp + p) * tp) + tri(tp);
            let pp_sum = pp * (d * pp * tp + t) + tp * tri(pp);
            let dp_sum = dp * (p * tp + t) + pp * tp * tri(dp);
            let world = tri(dp * pp * tp);
            let want = [tp_sum, pp_sum, dp_sum, world].map(|v| v as f64);
            assert_eq!(sums, want, "{dp}x{pp}x{tp} rank {r}");
            // The gathers are in the axis's order: member i is at coordinate i.
            let want = [Axis::Tp, Axis::Pp, Axis::Dp].map(|a| shape.group_ranks(r, a));
            assert_eq!(gathered, want, "{dp}x{pp}x{tp} rank {r}");
            assert_eq!(gathered[0], (0..tp).map(|i| (d * pp + p) * tp + i).collect::<Vec<_>>());
            assert_eq!(gathered[1], (0..pp).map(|i| (d * pp + i) * tp + t).collect::<Vec<_>>());
            assert_eq!(gathered[2], (0..dp).map(|i| (i * pp + p) * tp + t).collect::<Vec<_>>());
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

#[test]
fn an_abort_reaches_the_ranks_waiting_in_every_axis_group() {
    // 2 x 2 x 2 with a 30 s deadline: rank 7 aborts while the others run a tp, a pp, a dp and a
    // world all-reduce in turn; a rank whose collective fails aborts its own mesh, as a rank of
    // a real job does (tp train). Every wait involving rank 7 ends at once, and so, through
    // the ranks that failed first, do the waits of the ranks that share no group with it.
    let shape = MeshShape::new(2, 2, 2).unwrap();
    let meshes = Mesh::local(shape, Duration::from_secs(30), |_| Device::Cpu).unwrap();
    let started = Instant::now();
    let outcomes: Vec<(usize, Option<(String, String)>)> = std::thread::scope(|s| {
        let hs: Vec<_> = meshes
            .into_iter()
            .map(|m| {
                s.spawn(move || {
                    if m.rank() == 7 {
                        std::thread::sleep(Duration::from_millis(200));
                        m.abort("rank 7 failed on purpose");
                        return (7, None);
                    }
                    let x = Tensor::from_vec(vec![1.0f32; 4], &[4], &Device::Cpu).unwrap();
                    for (name, g) in [("tp", m.tp()), ("pp", m.pp()), ("dp", m.dp()), ("world", m.world())] {
                        if let Err(e) = g.all_reduce(&x, ReduceOp::Sum) {
                            m.abort(&format!("rank {} failed: {e}", m.rank()));
                            return (m.rank(), Some((name.to_string(), e.to_string())));
                        }
                    }
                    (m.rank(), None)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    for (r, out) in outcomes {
        if r == 7 {
            continue;
        }
        let (axis, e) = out.unwrap_or_else(|| panic!("rank {r} finished although rank 7 aborted"));
        assert!(e.contains("rank 7 failed on purpose"), "rank {r}: {e}");
        // 6 shares tp with 7, 5 pp; 4 then fails in pp (6 aborted); 3 shares dp with 7, and 0,
        // 1, 2 fail in dp (4, 5, 6 aborted). No rank reaches the world all-reduce.
        let want = match r {
            6 => "tp",
            4 | 5 => "pp",
            _ => "dp",
        };
        assert_eq!(axis, want, "rank {r}");
    }
}
