//! Asynchronous work handles over LocalGroup: equal to the blocking calls at every world size,
//! several in flight per rank, and every failure (a missing rank, a panicking rank, an abort
//! from another thread, clones issuing at once, work dropped unwaited) an error within the
//! deadline, never a hang or a panic.

use std::time::{Duration, Instant};
use tp_comm::{CommError, DeviceGroup, ReduceOp, Work};
use tp_core::{DType, Device, Tensor};

const CPU: Device = Device::Cpu;

fn on_ranks<R: Send>(world: usize, timeout: Duration, f: impl Fn(DeviceGroup) -> R + Sync) -> Vec<R> {
    let groups = DeviceGroup::local(world, timeout, |_| CPU).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = groups.into_iter().map(|g| s.spawn(|| f(g))).collect();
        handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
    })
}

fn rank_tensor(rank: usize, n: usize, dtype: DType) -> Tensor {
    Tensor::from_fn_f64(&[n], dtype, &CPU, |i| ((rank * 5 + i) % 9) as f64 - 4.0).unwrap()
}

#[test]
fn async_work_equals_the_blocking_calls_with_several_in_flight() {
    for world in 1..=8 {
        for dtype in DType::FLOATS {
            // Small (each rank reduces alone) and large (the split reduction) all-reduces.
            for n in [7, 100_000] {
                let got = on_ranks(world, Duration::from_secs(30), |g| {
                    let x = rank_tensor(g.rank(), n, dtype);
                    let blocking = (g.all_reduce(&x, ReduceOp::Sum).unwrap(), g.all_gather(&x, 0).unwrap());
                    // Three in flight, waited out of order.
                    let a: Work = g.all_reduce_async(&x, ReduceOp::Sum).unwrap();
                    let b = g.all_gather_async(&x, 0).unwrap();
                    let c = g.all_reduce_async(&x, ReduceOp::Max).unwrap();
                    let (c, b, a) = (c.wait().unwrap(), b.wait().unwrap(), a.wait().unwrap());
                    (blocking, a, b, c, g.all_reduce(&x, ReduceOp::Max).unwrap())
                });
                for (blocking, a, b, c, max) in &got {
                    assert_eq!(a, &blocking.0, "world {world} {dtype} n {n}: async sum");
                    assert_eq!(b, &blocking.1, "world {world} {dtype} n {n}: async gather");
                    assert_eq!(c, max, "world {world} {dtype} n {n}: async max");
                }
                assert!(got.iter().all(|g| g.1 == got[0].1), "ranks agree");
            }
        }
    }
}

#[test]
fn a_rank_that_never_arrives_fails_the_wait_at_the_deadline() {
    let start = Instant::now();
    let got = on_ranks(3, Duration::from_millis(500), |g| {
        if g.rank() == 2 {
            return None; // never issues
        }
        let w = g.all_reduce_async(&rank_tensor(g.rank(), 4, DType::F32), ReduceOp::Sum).unwrap();
        Some(w.wait().unwrap_err())
    });
    assert!(start.elapsed() < Duration::from_secs(5), "within the deadline");
    for e in got.into_iter().flatten() {
        assert!(
            matches!(&e, CommError::Timeout { missing, .. } if missing == &[2])
                || matches!(e, CommError::Poisoned { .. }),
            "{e}"
        );
    }
}

#[test]
fn a_panicking_rank_fails_the_others_waits_at_once() {
    let groups = DeviceGroup::local(2, Duration::from_secs(60), |_| CPU).unwrap();
    let start = Instant::now();
    let results: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = groups
            .into_iter()
            .map(|g| {
                s.spawn(move || {
                    if g.rank() == 1 {
                        std::thread::sleep(Duration::from_millis(50));
                        panic!("rank 1 fails on purpose");
                    }
                    g.all_reduce_async(&rank_tensor(0, 4, DType::F32), ReduceOp::Sum).unwrap().wait()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join()).collect()
    });
    assert!(start.elapsed() < Duration::from_secs(10), "not the 60 s deadline");
    assert!(results[1].is_err(), "rank 1 panicked");
    let e = results[0].as_ref().expect("rank 0 returns").as_ref().unwrap_err();
    assert!(matches!(e, CommError::Poisoned { reason, .. } if reason.contains("panicked")), "{e}");
}

#[test]
fn an_abort_from_another_thread_ends_a_pending_wait() {
    let got = on_ranks(2, Duration::from_secs(60), |g| {
        if g.rank() == 1 {
            std::thread::sleep(Duration::from_millis(100));
            g.abort("test: giving up");
            return None;
        }
        let start = Instant::now();
        let w = g.all_reduce_async(&rank_tensor(0, 4, DType::F32), ReduceOp::Sum).unwrap();
        let e = w.wait().unwrap_err();
        Some((start.elapsed(), e))
    });
    let (took, e) = got[0].as_ref().unwrap();
    assert!(*took < Duration::from_secs(10), "{took:?}");
    assert!(matches!(e, CommError::Poisoned { reason, .. } if reason.contains("giving up")), "{e}");
}

#[test]
fn many_clones_issuing_at_once_never_hang_or_panic() {
    // Each rank's three clones issue 50 all-reduces each, concurrently: the pairing of calls
    // across ranks is whatever the interleaving makes it, but every contribution is the rank's
    // own constant, so every sum is known.
    let world = 3;
    let sums = on_ranks(world, Duration::from_secs(60), |g| {
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|_| {
                    let g = g.clone();
                    s.spawn(move || {
                        let x = Tensor::from_fn_f64(&[5], DType::F32, &CPU, |_| (g.rank() + 1) as f64).unwrap();
                        (0..50)
                            .map(|i| {
                                let y = if i % 2 == 0 {
                                    g.all_reduce(&x, ReduceOp::Sum)
                                } else {
                                    g.all_reduce_async(&x, ReduceOp::Sum).and_then(Work::wait)
                                };
                                y.map(|t| t.to_vec::<f32>().unwrap()[0])
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            hs.into_iter().flat_map(|h| h.join().expect("clone thread")).collect::<Vec<_>>()
        })
    });
    for rank_sums in sums {
        assert_eq!(rank_sums.len(), 150);
        for s in rank_sums {
            assert_eq!(s.unwrap(), 6.0, "1 + 2 + 3");
        }
    }
}

#[test]
fn work_dropped_unwaited_frees_its_exchange() {
    let got = on_ranks(2, Duration::from_secs(30), |g| {
        let x = rank_tensor(g.rank(), 1000, DType::BF16);
        for _ in 0..100 {
            drop(g.all_reduce_async(&x, ReduceOp::Sum).unwrap());
        }
        let mut w = g.all_reduce_async(&x, ReduceOp::Sum).unwrap();
        let y = g.all_reduce(&x, ReduceOp::Sum).unwrap();
        g.barrier().unwrap();
        assert!(w.is_completed());
        (w.wait().unwrap(), y)
    });
    for (a, b) in &got {
        assert_eq!(a, b);
    }
}
