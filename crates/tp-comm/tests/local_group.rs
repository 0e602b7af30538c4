//! Every collective on LocalGroup at world sizes 1..=8 and every dtype, with inputs derived from
//! the rank and closed-form expected results; failures and deadlines.

use std::time::{Duration, Instant};
use tp_comm::{CommError, DeviceGroup, ReduceOp};
use tp_core::{DType, Device, Tensor, TensorShard};

const CPU: Device = Device::Cpu;

/// Runs `f` on every rank of a fresh local group, one thread per rank; results in rank order.
fn on_ranks<R: Send>(world: usize, timeout: Duration, f: impl Fn(DeviceGroup) -> R + Sync) -> Vec<R> {
    let groups = DeviceGroup::local(world, timeout, |_| CPU).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = groups.into_iter().map(|g| s.spawn(|| f(g))).collect();
        handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
    })
}

/// Rank r's value at flat index i: small integers, exact in every dtype and in every sum here.
fn value(rank: usize, i: usize) -> f64 {
    ((rank * 7 + i * 3) % 11) as f64 - 5.0
}

#[test]
fn all_gather_joins_uneven_shards_in_rank_order() {
    for world in 1..=8 {
        for dtype in DType::FLOATS {
            for dim in 0..2 {
                // Rank r holds its balanced shard of a [10, 13] tensor along `dim`.
                let full = Tensor::from_fn_f64(&[10, 13], dtype, &CPU, |i| value(0, i)).unwrap();
                let got = on_ranks(world, Duration::from_secs(30), |g| {
                    let shard = TensorShard::new(dim, full.dims()[dim], g.rank(), world).unwrap();
                    g.all_gather(&shard.shard(&full).unwrap(), dim).unwrap()
                });
                for y in got {
                    assert_eq!(y, full, "world {world} {dtype} dim {dim}");
                }
            }
        }
    }
}

#[test]
fn all_gather_accepts_arbitrary_lengths_per_rank() {
    // Rank r contributes r + 1 rows filled with r: the result is rows 0, 1, 1, 2, 2, 2, ...
    for world in 1..=8 {
        let got = on_ranks(world, Duration::from_secs(30), |g| {
            let r = g.rank();
            let x = Tensor::from_fn_f64(&[r + 1, 3], DType::BF16, &CPU, |_| r as f64).unwrap();
            g.all_gather(&x, 0).unwrap().to_f64_vec().unwrap()
        });
        let want: Vec<f64> = (0..world).flat_map(|r| std::iter::repeat_n(r as f64, 3 * (r + 1))).collect();
        assert!(got.iter().all(|v| *v == want), "world {world}");
    }
}

#[test]
fn all_reduce_every_op_matches_closed_form() {
    let n = 37;
    for world in 1..=8 {
        for dtype in DType::FLOATS {
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg] {
                let got = on_ranks(world, Duration::from_secs(30), |g| {
                    let x = Tensor::from_fn_f64(&[n], dtype, &CPU, |i| value(g.rank(), i)).unwrap();
                    g.all_reduce(&x, op).unwrap()
                });
                let want = Tensor::from_fn_f64(&[n], dtype, &CPU, |i| {
                    let vals = (0..world).map(|r| value(r, i));
                    match op {
                        ReduceOp::Sum => vals.sum(),
                        ReduceOp::Max => vals.fold(f64::MIN, f64::max),
                        ReduceOp::Min => vals.fold(f64::MAX, f64::min),
                        ReduceOp::Avg => vals.sum::<f64>() / world as f64,
                    }
                })
                .unwrap();
                for (r, y) in got.iter().enumerate() {
                    assert_eq!(y, &want, "world {world} {dtype} {op:?} rank {r}");
                }
            }
        }
    }
}

/// Large enough that the ranks split the reduction between them; random values, so rounding
/// shows: every rank must get the same bits, equal to the documented order (rank 0 + rank 1 +
/// ... left to right in f32, then one rounding to the dtype; Avg divides in f32 first).
#[test]
fn split_all_reduce_is_bit_identical_and_in_rank_order() {
    let n = 70_001;
    for world in 1..=8 {
        for dtype in DType::FLOATS {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                let input = |r: usize| Tensor::randn(&[n], dtype, 10 + r as u64, &CPU).unwrap();
                let got = on_ranks(world, Duration::from_secs(60), |g| g.all_reduce(&input(g.rank()), op).unwrap());
                let vals: Vec<Vec<f64>> = (0..world).map(|r| input(r).to_f64_vec().unwrap()).collect();
                let want = Tensor::from_fn_f64(&[n], dtype, &CPU, |i| {
                    let mut acc = vals[0][i] as f32;
                    for v in &vals[1..] {
                        acc = if op == ReduceOp::Max { acc.max(v[i] as f32) } else { acc + v[i] as f32 };
                    }
                    f64::from(if op == ReduceOp::Avg { acc / world as f32 } else { acc })
                })
                .unwrap();
                for (r, y) in got.iter().enumerate() {
                    assert!(y == &want, "world {world} {dtype} {op:?} rank {r}");
                }
            }
        }
    }
}

#[test]
fn all_reduce_into_overwrites_the_callers_tensor() {
    let got = on_ranks(4, Duration::from_secs(30), |g| {
        let mut x = Tensor::from_fn_f64(&[5], DType::F32, &CPU, |i| (g.rank() + i) as f64).unwrap();
        g.all_reduce_into(&mut x, ReduceOp::Sum).unwrap();
        x.to_f64_vec().unwrap()
    });
    let want: Vec<f64> = (0..5).map(|i| (0..4).map(|r| (r + i) as f64).sum()).collect();
    assert!(got.iter().all(|v| *v == want));
}

#[test]
fn reduce_scatter_gives_each_rank_its_shard_of_the_sum() {
    for world in 1..=8 {
        let dims = [11, 6];
        let got = on_ranks(world, Duration::from_secs(30), |g| {
            let x = Tensor::from_fn_f64(&dims, DType::F16, &CPU, |i| value(g.rank(), i)).unwrap();
            g.reduce_scatter(&x, 0, ReduceOp::Sum).unwrap()
        });
        let sum = Tensor::from_fn_f64(&dims, DType::F16, &CPU, |i| (0..world).map(|r| value(r, i)).sum()).unwrap();
        let want = TensorShard::shard_all(&sum, 0, world).unwrap();
        assert_eq!(got, want, "world {world}");
    }
}

#[test]
fn broadcast_from_every_root() {
    for world in 1..=8 {
        for root in 0..world {
            let got = on_ranks(world, Duration::from_secs(30), |g| {
                let x = Tensor::from_fn_f64(&[2, 3], DType::F32, &CPU, |i| value(g.rank(), i)).unwrap();
                g.broadcast(&x, root).unwrap().to_f64_vec().unwrap()
            });
            let want: Vec<f64> = (0..6).map(|i| value(root, i)).collect();
            assert!(got.iter().all(|v| *v == want), "world {world} root {root}");
        }
    }
}

#[test]
fn many_collectives_in_a_row_stay_in_step() {
    let got = on_ranks(5, Duration::from_secs(30), |g| {
        let mut total = 0.0;
        for step in 0..200 {
            let x = Tensor::from_fn_f64(&[1], DType::F32, &CPU, |_| (g.rank() + step) as f64).unwrap();
            total += g.all_reduce(&x, ReduceOp::Sum).unwrap().to_f64_vec().unwrap()[0];
            g.barrier().unwrap();
        }
        total
    });
    let want: f64 = (0..200).map(|s| (0..5).map(|r| (r + s) as f64).sum::<f64>()).sum();
    assert!(got.iter().all(|&t| t == want));
}

#[test]
fn a_missing_rank_times_out_on_the_others() {
    let timeout = Duration::from_millis(300);
    let start = Instant::now();
    let got = on_ranks(4, timeout, |g| {
        if g.rank() == 2 {
            return None; // never joins
        }
        Some(g.all_reduce(&Tensor::zeros(&[3], DType::F32, &CPU).unwrap(), ReduceOp::Sum))
    });
    let elapsed = start.elapsed();
    assert!(elapsed < timeout * 10, "took {elapsed:?}");
    let mut timeouts = 0;
    for r in got.into_iter().flatten() {
        match r {
            Err(CommError::Timeout { missing, .. }) => {
                assert_eq!(missing, vec![2]);
                timeouts += 1;
            }
            // A rank woken by the first one's timeout sees the poisoned group.
            Err(CommError::Poisoned { reason, .. }) => assert!(reason.contains("timed out"), "{reason}"),
            other => panic!("expected a timeout, got {other:?}"),
        }
    }
    assert!(timeouts >= 1);
}

#[test]
fn a_panicking_rank_poisons_the_group_at_once() {
    let timeout = Duration::from_secs(60);
    let start = Instant::now();
    let groups = DeviceGroup::local(3, timeout, |_| CPU).unwrap();
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                s.spawn(move || {
                    if g.rank() == 1 {
                        panic!("rank 1 fails mid-step");
                    }
                    g.all_reduce(&Tensor::zeros(&[3], DType::F32, &CPU).unwrap(), ReduceOp::Sum)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join()).collect()
    });
    assert!(start.elapsed() < Duration::from_secs(10), "waited for the deadline instead of failing fast");
    assert!(results[1].is_err(), "rank 1 panicked");
    for r in [0, 2] {
        match results[r].as_ref().expect("rank did not panic") {
            Err(CommError::Poisoned { reason, .. }) => assert!(reason.contains("rank 1 panicked"), "{reason}"),
            other => panic!("rank {r}: expected Poisoned, got {other:?}"),
        }
    }
}

#[test]
fn an_aborting_rank_fails_the_others_and_later_calls() {
    let start = Instant::now();
    let got = on_ranks(3, Duration::from_secs(60), |g| {
        let first = if g.rank() == 0 {
            // A rank whose own step failed tells the group instead of vanishing.
            g.abort("loss was NaN");
            Ok(())
        } else {
            g.barrier()
        };
        (first, g.barrier())
    });
    assert!(start.elapsed() < Duration::from_secs(10));
    for (r, (first, later)) in got.into_iter().enumerate() {
        if r != 0 {
            assert!(
                matches!(&first, Err(CommError::Poisoned { reason, .. }) if reason.contains("loss was NaN")),
                "{first:?}"
            );
        }
        assert!(matches!(later, Err(CommError::Poisoned { .. })), "rank {r}: {later:?}");
    }
}

#[test]
fn mismatched_calls_fail_on_every_rank() {
    let got = on_ranks(3, Duration::from_secs(30), |g| {
        let x = Tensor::zeros(&[4], DType::F32, &CPU).unwrap();
        if g.rank() == 1 { g.all_gather(&x, 0).map(drop) } else { g.all_reduce(&x, ReduceOp::Sum).map(drop) }
    });
    for r in got {
        assert!(matches!(r, Err(CommError::Mismatch { .. })), "{r:?}");
    }
    // Same collective, incompatible shapes.
    let got = on_ranks(2, Duration::from_secs(30), |g| {
        let x = Tensor::zeros(&[4 + g.rank()], DType::F32, &CPU).unwrap();
        g.all_reduce(&x, ReduceOp::Sum).map(drop)
    });
    for r in got {
        assert!(matches!(r, Err(CommError::Mismatch { .. })), "{r:?}");
    }
}

#[test]
fn bad_arguments_are_typed_errors() {
    assert!(matches!(DeviceGroup::local(0, Duration::from_secs(1), |_| CPU), Err(CommError::ZeroWorldSize { .. })));
    let got = on_ranks(2, Duration::from_secs(30), |g| g.broadcast(&Tensor::zeros(&[1], DType::F32, &CPU).unwrap(), 2));
    for r in got {
        assert!(matches!(r, Err(CommError::RankOutOfRange { rank: 2, .. })), "{r:?}");
    }
    let got = on_ranks(1, Duration::from_secs(30), |g| {
        let x = Tensor::zeros(&[1], DType::F32, &CPU).unwrap();
        g.all_gather(&x, 3)
    });
    assert!(matches!(got[0], Err(CommError::Mismatch { .. })), "{:?}", got[0]);
}
