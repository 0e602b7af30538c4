//! The MPI backend across real processes: every case runs this binary's `rank_main` under
//! `mpirun -np N` and under `srun -n N` (a one-node SLURM, PMIx), each process one rank.
//!
//! Results are checked against the thread backend run in each process on the same inputs (bit
//! for bit: both fold every element in rank order in f32) and against float64. Failure cases
//! (a stalled rank, an abort, a mismatch, a killed rank) check the error each rank returns and
//! that the job ends well before its deadline. Needs Open MPI and SLURM (`.ci/slurm.sh`
//! installs both and starts the daemons; `cargo xtask test` runs it).

use std::time::{Duration, Instant};
use tp_comm::mpi::MpiComm;
use tp_comm::{CommError, Communicator, LocalGroup, Mesh, MeshShape, P2p, ReduceOp};
use tp_core::{DType, Device, Tensor};
use tp_testing::launch::{Finished, Launcher, run_bounded};

/// Runs `rank_main` with case `case` as `n` processes, killed if still running after `limit`.
fn launch(launcher: Launcher, n: usize, case: &str, limit: Duration) -> Finished {
    let mut cmd = launcher.command(n, std::env::current_exe().unwrap());
    cmd.args(["rank_main", "--exact", "--ignored", "--nocapture", "--test-threads=1"]).env("TP_MPI_CASE", case);
    let f = run_bounded(cmd, limit);
    assert!(!f.killed, "{launcher:?} -n {n} {case} ran past {limit:?}:\n{}", f.output);
    f
}

/// Launches `case` and checks that every rank printed its `ok` line.
fn all_ok(launcher: Launcher, n: usize, case: &str) {
    let f = launch(launcher, n, case, Duration::from_secs(120));
    let (ok, text) = (f.success, f.output);
    for r in 0..n {
        assert!(
            text.contains(&format!("rank {r}/{n} ok {case}")),
            "{launcher:?} -n {n} {case}: rank {r} missing:\n{text}"
        );
    }
    assert!(ok, "{launcher:?} -n {n} {case} failed:\n{text}");
}

#[test]
fn collectives_match_the_thread_backend_bit_for_bit_mpirun() {
    for n in [1, 2, 3, 4] {
        all_ok(Launcher::Mpirun, n, "collectives");
    }
}

#[test]
fn collectives_match_the_thread_backend_bit_for_bit_srun() {
    for n in [2, 4] {
        all_ok(Launcher::Srun, n, "collectives");
    }
}

#[test]
fn mesh_groups_follow_megatron_order() {
    all_ok(Launcher::Mpirun, 8, "mesh");
    all_ok(Launcher::Srun, 4, "mesh");
}

#[test]
fn neighbours_that_both_send_first_do_not_deadlock() {
    all_ok(Launcher::Mpirun, 3, "p2p");
    all_ok(Launcher::Srun, 2, "p2p");
}

#[test]
fn disagreeing_calls_are_a_mismatch_on_every_rank() {
    all_ok(Launcher::Mpirun, 3, "mismatch");
}

#[test]
fn a_stalled_rank_is_named_within_the_deadline() {
    all_ok(Launcher::Mpirun, 3, "stall");
}

#[test]
fn an_abort_reaches_every_waiting_rank_at_once() {
    all_ok(Launcher::Mpirun, 4, "abort");
    all_ok(Launcher::Srun, 3, "abort");
}

#[test]
fn a_killed_rank_ends_the_job_long_before_the_deadline() {
    for launcher in Launcher::ALL {
        // The survivors wait in an all-reduce with a 60 s deadline; the launcher ends them.
        let f = launch(launcher, 3, "killed", Duration::from_secs(90));
        let (ok, text, took) = (f.success, f.output, f.elapsed);
        assert!(!ok, "{launcher:?}: a killed rank must fail the job:\n{text}");
        assert!(took < Duration::from_secs(30), "{launcher:?}: took {took:?}:\n{text}");
        assert!(
            text.contains("rank 1") || text.contains("task 1"),
            "{launcher:?}: the dead rank is not named:\n{text}"
        );
        assert!(!text.contains("rank 0/3 ok"), "{text}");
    }
}

/// Rank `r`'s deterministic input: values with fraction bits, so rounding order shows.
fn input(seed: u64, r: usize, dims: &[usize], dtype: DType) -> Tensor {
    Tensor::from_fn_f64(dims, dtype, &Device::Cpu, |i| {
        let mut h =
            seed ^ (r as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        h ^= h >> 31;
        h = h.wrapping_mul(0x94D0_49BB_1331_11EB);
        h ^= h >> 29;
        (h % 4001) as f64 / 1000.0 - 2.0 + 1.0 / 3.0
    })
    .unwrap()
}

/// `f` run by `n` thread ranks of a [`LocalGroup`]: every rank's result.
fn local(n: usize, f: impl Fn(&LocalGroup) -> Tensor + Sync) -> Vec<Tensor> {
    let groups = LocalGroup::with_timeout(n, Duration::from_secs(30)).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = groups.iter().map(|g| s.spawn(|| f(g))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn same_bits(a: &Tensor, b: &Tensor, what: &str) {
    assert_eq!((a.dims(), a.dtype()), (b.dims(), b.dtype()), "{what}");
    assert!(a.as_bytes().unwrap() == b.as_bytes().unwrap(), "{what}: bits differ from the thread backend");
}

fn close_to(a: &Tensor, want: &[f64], tol: f64, what: &str) {
    let got = a.to_f64_vec().unwrap();
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{what}: element {i} is {g}, float64 says {w}");
    }
}

/// One process's rank: the case named by `TP_MPI_CASE`, then `rank R/N ok CASE` on stdout.
#[test]
#[ignore = "a rank of an MPI job: started by the tests above under mpirun and srun"]
fn rank_main() {
    let case = std::env::var("TP_MPI_CASE").expect("TP_MPI_CASE: run by the launching tests");
    assert!(tp_comm::mpi::launched(), "rank_main runs under mpirun or srun");
    let timeout = if case == "stall" { Duration::from_secs(3) } else { Duration::from_secs(60) };
    let world = MpiComm::world(timeout).unwrap();
    let (me, n) = (world.rank(), world.world_size());
    match case.as_str() {
        "collectives" => collectives(&world),
        "mesh" => mesh(n),
        "p2p" => p2p(&world),
        "mismatch" => {
            let dims: &[usize] = if me == 0 { &[2, 3] } else { &[3, 2] };
            let e = world.all_reduce(&input(1, me, dims, DType::F32), ReduceOp::Sum).unwrap_err();
            assert!(matches!(e, CommError::Mismatch { .. }), "{e}");
            assert!(e.to_string().contains("[2, 3]") && e.to_string().contains("[3, 2]"), "{e}");
        }
        "stall" => {
            let t = Instant::now();
            if me == 1 {
                std::thread::sleep(Duration::from_secs(5));
                // By now the others have given up and told this rank why.
                let e = world.barrier().unwrap_err();
                assert!(matches!(e, CommError::Poisoned { .. }) && e.to_string().contains("[1]"), "{e}");
            } else {
                let e = world.barrier().unwrap_err();
                let waited = t.elapsed();
                match &e {
                    CommError::Timeout { missing, .. } => assert_eq!(missing, &vec![1], "{e}"),
                    // The other survivor may hear of rank 1 from this one first.
                    CommError::Poisoned { reason, .. } => assert!(reason.contains("[1]"), "{e}"),
                    other => panic!("{other}"),
                }
                assert!(waited >= Duration::from_millis(2900) && waited < Duration::from_secs(5), "{waited:?}");
            }
        }
        "abort" => {
            let t = Instant::now();
            if me == n - 1 {
                world.abort("the disk is full");
            } else {
                let e = world.all_reduce(&input(1, me, &[5], DType::F32), ReduceOp::Sum).unwrap_err();
                assert!(matches!(e, CommError::Poisoned { .. }), "{e}");
                let text = e.to_string();
                assert!(text.contains("the disk is full") && text.contains(&format!("rank {}", n - 1)), "{text}");
                assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
            }
        }
        "killed" => {
            if me == 1 {
                std::thread::sleep(Duration::from_millis(300));
                std::process::abort();
            }
            let _ = world.all_reduce(&input(1, me, &[5], DType::F32), ReduceOp::Sum);
            // Only reached if the launcher failed to end this rank; the test then fails on time.
            std::thread::sleep(Duration::from_secs(120));
        }
        other => panic!("unknown case {other}"),
    }
    println!("rank {me}/{n} ok {case}");
    drop(world);
    tp_comm::mpi::finalize().unwrap();
}

fn collectives(world: &MpiComm) {
    let (me, n) = (world.rank(), world.world_size());
    // Reductions: small (whole to every rank) and large (reduce-scatter + all-gather) paths, at
    // lengths off every multiple, every dtype and op.
    for (k, dims) in [vec![7, 13], vec![3, 40_001], vec![1]].into_iter().enumerate() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                let seed = 10 + k as u64;
                let x = input(seed, me, &dims, dtype);
                let got = world.all_reduce(&x, op).unwrap();
                let want = local(n, |g| g.all_reduce(&input(seed, g.rank(), &dims, dtype), op).unwrap());
                same_bits(&got, &want[me], &format!("all_reduce {op:?} {dtype} {dims:?}"));
                // In place, the even ranks mixing it with the other form: the same bits.
                let mut y = x.clone();
                if me % 2 == 0 {
                    world.all_reduce_into(&mut y, op).unwrap();
                } else {
                    y = world.all_reduce(&y, op).unwrap();
                }
                same_bits(&y, &want[me], &format!("all_reduce_into {op:?} {dtype} {dims:?}"));
                assert!(x.as_bytes().unwrap() == input(seed, me, &dims, dtype).as_bytes().unwrap(), "x untouched");
                if dtype == DType::F32 && op == ReduceOp::Sum {
                    let all: Vec<Vec<f64>> =
                        (0..n).map(|r| input(seed, r, &dims, dtype).to_f64_vec().unwrap()).collect();
                    let sum: Vec<f64> = (0..all[0].len()).map(|i| all.iter().map(|v| v[i]).sum()).collect();
                    close_to(&got, &sum, 1e-6, "all_reduce against float64");
                }
            }
        }
    }
    // All-gather, uneven along dim 1; integers too.
    let x = input(3, me, &[2, me + 1, 3], DType::BF16);
    let got = world.all_gather(&x, 1).unwrap();
    let want = local(n, |g| g.all_gather(&input(3, g.rank(), &[2, g.rank() + 1, 3], DType::BF16), 1).unwrap());
    same_bits(&got, &want[me], "all_gather dim 1");
    let ids = Tensor::from_vec(vec![me as i64 * 1_000_000_007; me + 2], &[me + 2], &Device::Cpu).unwrap();
    let got = world.all_gather(&ids, 0).unwrap().to_i64_vec().unwrap();
    let want: Vec<i64> = (0..n).flat_map(|r| vec![r as i64 * 1_000_000_007; r + 2]).collect();
    assert_eq!(got, want, "all_gather of i64");
    // Reduce-scatter along an uneven dim, and broadcast from the last rank.
    for dim in [0, 1] {
        let dims = [2 * n + 1, 5];
        let got = world.reduce_scatter(&input(4, me, &dims, DType::F32), dim, ReduceOp::Sum).unwrap();
        let want = local(n, |g| g.reduce_scatter(&input(4, g.rank(), &dims, DType::F32), dim, ReduceOp::Sum).unwrap());
        same_bits(&got, &want[me], &format!("reduce_scatter dim {dim}"));
    }
    let got = world.broadcast(&input(5, me, &[4, 9], DType::F16), n - 1).unwrap();
    same_bits(&got, &input(5, n - 1, &[4, 9], DType::F16), "broadcast");
    world.barrier().unwrap();
    // All-to-all with uneven counts (some zero), i64 and bf16 rows: as the thread backend.
    let counts = |r: usize| -> Vec<usize> { (0..n).map(|j| (r * 3 + j * 5) % 4).collect() };
    let rows = |r: usize| counts(r).iter().sum::<usize>();
    let rows_of = |r: usize, dtype: DType| match dtype {
        DType::I64 => {
            let v: Vec<i64> = (0..rows(r) * 3).map(|i| (r * 1_000_003 + i) as i64 - 7).collect();
            Tensor::from_vec(v, &[rows(r), 3], &Device::Cpu).unwrap()
        }
        d => input(9, r, &[rows(r), 3], d),
    };
    for dtype in [DType::BF16, DType::I64] {
        let (got, from) = world.all_to_all(&rows_of(me, dtype), &counts(me)).unwrap();
        let want = local(n, |g| g.all_to_all(&rows_of(g.rank(), dtype), &counts(g.rank())).unwrap().0);
        same_bits(&got, &want[me], &format!("all_to_all {dtype}"));
        assert_eq!(from, (0..n).map(|r| counts(r)[me]).collect::<Vec<_>>());
    }
    // Integers are not reduced.
    assert!(world.all_reduce(&ids, ReduceOp::Sum).is_err() || n == 0);
    // A split: even and odd ranks, each reduced on its own.
    let half = world.split(me % 2, me).unwrap();
    let got = half.all_reduce(&Tensor::from_vec(vec![me as f32], &[1], &Device::Cpu).unwrap(), ReduceOp::Sum).unwrap();
    let want: f32 = (0..n).filter(|r| r % 2 == me % 2).map(|r| r as f32).sum();
    assert_eq!(got.to_vec::<f32>().unwrap(), vec![want]);
}

fn mesh(n: usize) {
    let shapes = match n {
        8 => vec![MeshShape::new(2, 2, 2).unwrap(), MeshShape::new(1, 4, 2).unwrap(), MeshShape::new(2, 1, 4).unwrap()],
        _ => vec![MeshShape::new(1, 2, 2).unwrap(), MeshShape::new(2, 1, 2).unwrap(), MeshShape::new(2, 2, 1).unwrap()],
    };
    for shape in shapes {
        let m = Mesh::from_mpi(shape, Duration::from_secs(60)).unwrap();
        let me = Tensor::from_vec(vec![m.rank() as i64], &[1], &Device::Cpu).unwrap();
        for axis in [tp_comm::Axis::Tp, tp_comm::Axis::Pp, tp_comm::Axis::Dp] {
            let got = m.group(axis).all_gather(&me, 0).unwrap().to_i64_vec().unwrap();
            let want: Vec<i64> = shape.group_ranks(m.rank(), axis).into_iter().map(|r| r as i64).collect();
            assert_eq!(got, want, "{shape:?} {axis:?}");
        }
    }
    // A job whose size is not the mesh's is refused, naming both.
    let e = Mesh::from_mpi(MeshShape::new(1, 1, n + 1).unwrap(), Duration::from_secs(5)).unwrap_err();
    assert!(
        e.to_string().contains(&format!("{n} processes")) && e.to_string().contains(&format!("-np {}", n + 1)),
        "{e}"
    );
}

fn p2p(world: &MpiComm) {
    let (me, n) = (world.rank(), world.world_size());
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    // Every rank sends 8 MiB to its next before receiving from its previous (1F1B neighbours
    // both sending first), twice, the waits in the opposite order of the posts.
    let big = [1024, 2048];
    let a = world.send_async(&input(6, me, &big, DType::F32), next).unwrap();
    let b = world.send_async(&input(7, me, &big, DType::BF16), next).unwrap();
    let rb = world.recv_async(&big, DType::F32, prev).unwrap();
    let rc = world.recv_async(&big, DType::BF16, prev).unwrap();
    same_bits(&rc.wait().unwrap(), &input(7, prev, &big, DType::BF16), "second message");
    same_bits(&rb.wait().unwrap(), &input(6, prev, &big, DType::F32), "first message");
    b.wait().unwrap();
    a.wait().unwrap();
    // The same exchange as one batch (`send_recv_async`): a work per operation, in order.
    let (x, y) = (input(9, me, &big, DType::F32), input(10, me, &[5, 3], DType::I64));
    let ops = [
        P2p::Send { x: &x, peer: next },
        P2p::Recv { dims: &big, dtype: DType::F32, peer: prev },
        P2p::Send { x: &y, peer: prev },
        P2p::Recv { dims: &[5, 3], dtype: DType::I64, peer: next },
    ];
    let mut works = world.send_recv_async(&ops).unwrap();
    assert_eq!(works.len(), 4);
    same_bits(&works.remove(3).wait().unwrap(), &input(10, next, &[5, 3], DType::I64), "batched back");
    same_bits(&works.remove(1).wait().unwrap(), &input(9, prev, &big, DType::F32), "batched forth");
    for w in works {
        w.wait().unwrap();
    }
    // A receiver expecting another shape: an error naming both, on the receiver at once. (On a
    // communicator of its own: the abort that follows fails every call of that one.)
    let world = world.split(0, me).unwrap();
    let s = world.send_async(&input(8, me, &[3, 4], DType::F32), next).unwrap();
    // A rank whose neighbour found the mismatch first hears of it as the group's abort.
    let e = match world.recv_async(&[4, 3], DType::F32, prev) {
        Ok(w) => w.wait().unwrap_err(),
        Err(e) => e,
    };
    assert!(matches!(e, CommError::Mismatch { .. } | CommError::Poisoned { .. }), "{e}");
    assert!(e.to_string().contains("[4, 3]") && e.to_string().contains("[3, 4]"), "{e}");
    drop(s);
}
