//! GPU suite of the collectives: NCCL at world size 1 (one GPU: NCCL refuses two ranks on one
//! device) for every collective and dtype, and LocalGroup with 2, 4 and 8 ranks sharing GPU 0,
//! each checked against the same collectives run on the CPU.

use std::time::Duration;
use tp_comm::{DeviceGroup, LaunchEnv, ReduceOp};
use tp_core::{DType, Device, Tensor};

const GPU: Device = Device::Cuda(0);
const CPU: Device = Device::Cpu;

fn value(rank: usize, i: usize) -> f64 {
    ((rank * 7 + i * 3) % 11) as f64 - 5.0
}

/// Runs every collective on `groups` (one thread per rank) and returns each rank's results on
/// the host, in a fixed order.
fn exercise(groups: Vec<DeviceGroup>, dtype: DType) -> Vec<Vec<Tensor>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                s.spawn(move || {
                    let r = g.rank();
                    let x = Tensor::from_fn_f64(&[6, 10 + r], dtype, &CPU, |i| value(r, i)).unwrap();
                    let y = Tensor::from_fn_f64(&[12, 5], dtype, &CPU, |i| value(r, i)).unwrap();
                    let (x, y) = (g.to_local(&x).unwrap(), g.to_local(&y).unwrap());
                    let mut out = vec![g.all_gather(&x, 1).unwrap(), g.all_gather(&y, 0).unwrap()];
                    for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg] {
                        out.push(g.all_reduce(&y, op).unwrap());
                        out.push(g.reduce_scatter(&y, 0, op).unwrap());
                        out.push(g.reduce_scatter(&y, 1, op).unwrap());
                    }
                    for root in 0..g.world_size() {
                        out.push(g.broadcast(&y, root).unwrap());
                    }
                    g.barrier().unwrap();
                    out.into_iter().map(|t| t.to_device(&CPU).unwrap()).collect()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank panicked")).collect()
    })
}

/// Every test's first call: a GPU must be present, and a kernel fault's panic says that it
/// fails every later test too.
fn setup() {
    tp_kernels::note_sticky_errors_on_panic();
    assert!(tp_kernels::device_count().expect("needs a CUDA device") > 0);
}

#[test]
fn local_group_ranks_sharing_one_gpu_match_the_cpu() {
    setup();
    for world in [2, 4, 8] {
        for dtype in DType::FLOATS {
            let on_gpu = exercise(DeviceGroup::local(world, Duration::from_secs(60), |_| GPU).unwrap(), dtype);
            let on_cpu = exercise(DeviceGroup::local(world, Duration::from_secs(60), |_| CPU).unwrap(), dtype);
            assert_eq!(on_gpu, on_cpu, "world {world} {dtype}");
        }
    }
}

#[test]
fn nccl_at_world_size_one_runs_every_collective() {
    setup();
    let port = tp_comm::free_local_port().expect("a free loopback port");
    let vars = [("RANK", "0".to_string()), ("WORLD_SIZE", "1".into()), ("MASTER_PORT", port.to_string())];
    let env = LaunchEnv::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())).unwrap();
    let g = DeviceGroup::from_launch_env(&env).expect("NCCL group of one");
    eprintln!("NCCL {:?}", tp_comm::nccl::Nccl::get().unwrap().version());
    assert_eq!((g.rank(), g.world_size(), g.device()), (0, 1, GPU));
    for dtype in DType::FLOATS {
        let on_gpu = exercise(vec![g.clone()], dtype);
        let on_cpu = exercise(DeviceGroup::local(1, Duration::from_secs(60), |_| CPU).unwrap(), dtype);
        assert_eq!(on_gpu, on_cpu, "{dtype}");
    }
    // A host tensor is refused with a typed error.
    let host = Tensor::zeros(&[2], DType::F32, &CPU).unwrap();
    assert!(g.communicator().all_reduce(&host, ReduceOp::Sum).is_err());
}

fn nccl_world_one() -> DeviceGroup {
    let port = tp_comm::free_local_port().expect("a free loopback port");
    let vars = [("RANK", "0".to_string()), ("WORLD_SIZE", "1".into()), ("MASTER_PORT", port.to_string())];
    let env = LaunchEnv::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())).unwrap();
    DeviceGroup::from_launch_env(&env).expect("NCCL group of one")
}

#[test]
fn nccl_work_handles_clones_and_abort_never_hang() {
    setup();
    let g = nccl_world_one();
    let x = g.to_local(&Tensor::from_fn_f64(&[1000], DType::F32, &CPU, |i| i as f64).unwrap()).unwrap();
    // Async equals blocking; both are stream-ordered.
    let blocking = g.all_reduce(&x, ReduceOp::Sum).unwrap();
    let work = g.all_reduce_async(&x, ReduceOp::Sum).unwrap();
    assert_eq!(work.wait().unwrap().to_device(&CPU).unwrap(), blocking.to_device(&CPU).unwrap());
    let gathered = g.all_gather_async(&x, 0).unwrap().wait().unwrap();
    assert_eq!(gathered.to_device(&CPU).unwrap(), x.to_device(&CPU).unwrap());
    // Many clones issuing at once: every call serialised on the communicator, all correct.
    std::thread::scope(|s| {
        for t in 0..8 {
            let (g, x) = (g.clone(), x.clone());
            s.spawn(move || {
                for i in 0..50 {
                    let y = if (t + i) % 2 == 0 {
                        g.all_reduce(&x, ReduceOp::Max).unwrap()
                    } else {
                        g.all_reduce_async(&x, ReduceOp::Max).unwrap().wait().unwrap()
                    };
                    assert_eq!(y.to_device(&CPU).unwrap(), x.to_device(&CPU).unwrap());
                }
            });
        }
    });
    // An abort from another thread while a wait is pending: the GPU is kept busy by a long
    // product queued first, so the all-reduce's wait is still pending when the abort lands.
    let a = g.to_local(&Tensor::rand(&[8192, 8192], DType::BF16, 1, &CPU).unwrap()).unwrap();
    let busy: Vec<Tensor> = (0..4).map(|_| a.matmul_t(&a).unwrap()).collect();
    let pending = g.all_reduce_async(&x, ReduceOp::Sum).unwrap();
    let start = std::time::Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| g.abort("test: abort from another thread"));
        let r = pending.wait();
        let e = r.expect_err("a wait pending across an abort fails");
        assert!(e.to_string().contains("abort"), "{e}");
    });
    assert!(start.elapsed() < Duration::from_secs(30), "the abort ended the wait");
    let e = g.all_reduce(&x, ReduceOp::Sum).expect_err("an aborted group stays failed");
    assert!(matches!(e, tp_comm::CommError::Poisoned { .. }), "{e}");
    drop(busy);
    drop(g); // Drop of an aborted communicator returns at once
}

#[test]
fn nccl_issue_time_is_measured() {
    // Host time to enqueue one small all-reduce and return, median of 1000 (the goal is <= 10 µs).
    setup();
    let g = nccl_world_one();
    let x = g.to_local(&Tensor::zeros(&[2], DType::F32, &CPU).unwrap()).unwrap();
    let mut t = Vec::new();
    for _ in 0..1000 {
        let start = std::time::Instant::now();
        std::hint::black_box(g.all_reduce(&x, ReduceOp::Sum).unwrap());
        t.push(start.elapsed());
    }
    t.sort();
    eprintln!("NCCL all-reduce issue time: median {:?}, p90 {:?}", t[500], t[900]);
    g.barrier().unwrap();
}
