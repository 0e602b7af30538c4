//! Point-to-point send/recv between the threads of real `LocalGroup`s: rings at world sizes
//! 2..=8 in f32, bf16 and i64 checked bit for bit, FIFO order per pair with several messages in
//! flight, messages interleaved with collectives, odd shapes, and every failure (wrong dims or
//! dtype, a silent peer, an abort, a bad peer number) a typed error well within the deadline.

use std::sync::mpsc;
use std::time::{Duration, Instant};
use tp_comm::{CommError, DeviceGroup, P2p, ReduceOp};
use tp_core::{DType, Device, Tensor};

const CPU: Device = Device::Cpu;
const LONG: Duration = Duration::from_secs(30);

fn groups(n: usize, timeout: Duration) -> Vec<DeviceGroup> {
    DeviceGroup::local(n, timeout, |_| CPU).unwrap()
}

/// Runs `f` on every rank of `gs`, one thread per rank; the results in rank order.
fn on_ranks<R: Send>(gs: Vec<DeviceGroup>, f: impl Fn(&DeviceGroup) -> R + Sync) -> Vec<R> {
    let f = &f;
    std::thread::scope(|s| {
        let hs: Vec<_> = gs.into_iter().map(|g| s.spawn(move || f(&g))).collect();
        hs.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
    })
}

/// The message rank `r` sends (its `k`-th): distinct per rank, message and element, exact in
/// every dtype used (bf16 holds integers up to 256 exactly; i64 uses bits no float keeps).
fn message(r: usize, k: usize, dims: &[usize], dtype: DType) -> Tensor {
    let n: usize = dims.iter().product();
    match dtype {
        DType::I64 => Tensor::from_vec(
            (0..n).map(|i| ((r as i64) << 40) + ((k as i64) << 20) + i as i64 - 7).collect::<Vec<i64>>(),
            dims,
            &CPU,
        )
        .unwrap(),
        DType::BF16 => Tensor::from_fn_f64(dims, dtype, &CPU, |i| (r * 16 + k * 4 + i % 4) as f64 - 100.0).unwrap(),
        _ => Tensor::from_fn_f64(dims, dtype, &CPU, |i| r as f64 * 1e4 + k as f64 * 100.0 + i as f64 + 0.5).unwrap(),
    }
}

/// The first element of a received f32 message, to identify it.
fn first(t: &Tensor) -> f64 {
    t.to_f64_vec().unwrap()[0]
}

#[test]
fn a_ring_delivers_every_rank_s_tensor_exactly_at_every_world_size_and_dtype() {
    for n in 2..=8 {
        for dtype in [DType::F32, DType::BF16, DType::I64] {
            let dims = [3, 5];
            let got = on_ranks(groups(n, LONG), |g| {
                let (r, w) = (g.rank(), g.world_size());
                assert_eq!(w, n);
                let send = g.send_async(&message(r, 0, &dims, dtype), (r + 1) % w).unwrap();
                let t = g.recv(&dims, dtype, (r + w - 1) % w).unwrap();
                let sent = send.wait().unwrap();
                // The send's work hands back what was sent.
                assert_eq!(sent, message(r, 0, &dims, dtype));
                t
            });
            for (r, t) in got.iter().enumerate() {
                let from = (r + n - 1) % n;
                assert_eq!(t.dims(), &dims);
                assert_eq!(t.dtype(), dtype);
                assert_eq!(t.device(), CPU);
                // Tensor equality compares the bits.
                assert_eq!(t, &message(from, 0, &dims, dtype), "world {n} {dtype} rank {r}");
                if dtype == DType::I64 {
                    let v = t.to_vec::<i64>().unwrap();
                    assert_eq!(v[14], ((from as i64) << 40) + 14 - 7, "world {n} rank {r}");
                }
            }
        }
    }
}

#[test]
fn a_ring_in_the_other_direction_with_blocking_calls_on_alternate_ranks() {
    // Even ranks send first, odd ranks receive first: blocking `send` then `recv` never
    // deadlocks as long as the pairs are ordered, and the data goes r -> r - 1.
    for n in [2, 4, 6, 8] {
        let got = on_ranks(groups(n, LONG), |g| {
            let (r, w) = (g.rank(), g.world_size());
            let (to, from) = ((r + w - 1) % w, (r + 1) % w);
            let x = message(r, 1, &[4], DType::F32);
            if r % 2 == 0 {
                g.send(&x, to).unwrap();
                g.recv(&[4], DType::F32, from).unwrap()
            } else {
                let t = g.recv(&[4], DType::F32, from).unwrap();
                g.send(&x, to).unwrap();
                t
            }
        });
        for (r, t) in got.iter().enumerate() {
            assert_eq!(t, &message((r + 1) % n, 1, &[4], DType::F32), "world {n} rank {r}");
        }
    }
}

#[test]
fn five_messages_in_flight_arrive_in_the_order_they_were_sent() {
    let got = on_ranks(groups(2, LONG), |g| {
        if g.rank() == 0 {
            let works: Vec<_> = (0..5).map(|k| g.send_async(&message(0, k, &[3], DType::F32), 1).unwrap()).collect();
            // Waited for in reverse: each completes once its own message was taken.
            let sent: Vec<f64> = works.into_iter().rev().map(|w| first(&w.wait().unwrap())).collect();
            assert_eq!(sent, (0..5).rev().map(|k| 0.5 + k as f64 * 100.0).collect::<Vec<_>>());
            Vec::new()
        } else {
            // Let all five be posted before the first receive.
            std::thread::sleep(Duration::from_millis(50));
            (0..5).map(|_| g.recv(&[3], DType::F32, 0).unwrap()).collect()
        }
    });
    assert_eq!(got[1].len(), 5);
    for (k, t) in got[1].iter().enumerate() {
        assert_eq!(t, &message(0, k, &[3], DType::F32), "message {k}");
    }
}

#[test]
fn two_receives_posted_and_waited_out_of_order_still_match_in_posting_order() {
    let got = on_ranks(groups(2, LONG), |g| {
        if g.rank() == 0 {
            let works: Vec<_> = (0..2).map(|k| g.send_async(&message(0, k, &[2, 2], DType::F32), 1).unwrap()).collect();
            for w in works {
                w.wait().unwrap();
            }
            None
        } else {
            let one = g.recv_async(&[2, 2], DType::F32, 0).unwrap();
            let two = g.recv_async(&[2, 2], DType::F32, 0).unwrap();
            // The second posted, waited first: it is still the second message.
            let b = two.wait().unwrap();
            let a = one.wait().unwrap();
            Some((a, b))
        }
    });
    let (a, b) = got[1].clone().unwrap();
    assert_eq!(a, message(0, 0, &[2, 2], DType::F32));
    assert_eq!(b, message(0, 1, &[2, 2], DType::F32));
}

#[test]
fn receives_posted_before_the_sends_get_them_in_order() {
    let got = on_ranks(groups(2, LONG), |g| {
        if g.rank() == 1 {
            let works: Vec<_> = (0..3).map(|_| g.recv_async(&[5], DType::I64, 0).unwrap()).collect();
            g.barrier().unwrap(); // the receives are posted before anything is sent
            works.into_iter().map(|w| w.wait().unwrap()).collect()
        } else {
            g.barrier().unwrap();
            for k in 0..3 {
                g.send(&message(0, k, &[5], DType::I64), 1).unwrap();
            }
            Vec::new()
        }
    });
    for (k, t) in got[1].iter().enumerate() {
        assert_eq!(t, &message(0, k, &[5], DType::I64), "message {k}");
    }
}

#[test]
fn each_pair_of_ranks_keeps_its_own_order() {
    // Ranks 1..4 each send three messages to rank 0; rank 0 receives them source by source in
    // an order unrelated to the order of sending.
    let got = on_ranks(groups(4, LONG), |g| {
        let r = g.rank();
        if r == 0 {
            let mut out = Vec::new();
            for src in [3, 1, 2] {
                for _ in 0..3 {
                    out.push((src, g.recv(&[2], DType::F32, src).unwrap()));
                }
            }
            out
        } else {
            let works: Vec<_> = (0..3).map(|k| g.send_async(&message(r, k, &[2], DType::F32), 0).unwrap()).collect();
            for w in works {
                w.wait().unwrap();
            }
            Vec::new()
        }
    });
    assert_eq!(got[0].len(), 9);
    for (i, (src, t)) in got[0].iter().enumerate() {
        assert_eq!(t, &message(*src, i % 3, &[2], DType::F32), "receive {i} from {src}");
    }
}

#[test]
fn sends_and_receives_interleave_with_all_reduce_on_the_same_group() {
    for n in [2, 3, 5] {
        let got = on_ranks(groups(n, LONG), |g| {
            let (r, w) = (g.rank(), g.world_size());
            let send = g.send_async(&message(r, 0, &[6], DType::F32), (r + 1) % w).unwrap();
            let x = Tensor::from_vec(vec![r as f32 + 1.0, 2.0 * r as f32], &[2], &CPU).unwrap();
            let s1 = g.all_reduce(&x, ReduceOp::Sum).unwrap();
            let got1 = g.recv(&[6], DType::F32, (r + w - 1) % w).unwrap();
            let s2 = g.all_reduce(&x, ReduceOp::Max).unwrap();
            // A second message posted after the collectives, and a reduction while it is in flight.
            let send2 = g.send_async(&message(r, 1, &[6], DType::F32), (r + 1) % w).unwrap();
            let s3 = g.all_reduce_async(&x, ReduceOp::Sum).unwrap();
            let got2 = g.recv(&[6], DType::F32, (r + w - 1) % w).unwrap();
            let s3 = s3.wait().unwrap();
            send.wait().unwrap();
            send2.wait().unwrap();
            (s1.to_f64_vec().unwrap(), s2.to_f64_vec().unwrap(), s3.to_f64_vec().unwrap(), got1, got2)
        });
        let sum = vec![(1..=n).sum::<usize>() as f64, (0..n).map(|r| 2 * r).sum::<usize>() as f64];
        let max = vec![n as f64, 2.0 * (n - 1) as f64];
        for (r, (s1, s2, s3, m1, m2)) in got.iter().enumerate() {
            let from = (r + n - 1) % n;
            assert_eq!(s1, &sum, "world {n} rank {r}");
            assert_eq!(s2, &max, "world {n} rank {r}");
            assert_eq!(s3, &sum, "world {n} rank {r}");
            assert_eq!(m1, &message(from, 0, &[6], DType::F32), "world {n} rank {r}");
            assert_eq!(m2, &message(from, 1, &[6], DType::F32), "world {n} rank {r}");
        }
    }
}

#[test]
fn odd_shapes_travel_intact() {
    let shapes: [&[usize]; 6] = [&[7, 13], &[1], &[13, 7], &[2, 3, 5], &[1, 1, 1, 1], &[0, 5]];
    for dims in shapes {
        for dtype in [DType::F32, DType::BF16, DType::I64] {
            let got = on_ranks(groups(3, LONG), |g| {
                let (r, w) = (g.rank(), g.world_size());
                let send = g.send_async(&message(r, 2, dims, dtype), (r + 1) % w).unwrap();
                let t = g.recv(dims, dtype, (r + w - 1) % w).unwrap();
                send.wait().unwrap();
                t
            });
            for (r, t) in got.iter().enumerate() {
                assert_eq!(t.dims(), dims);
                assert_eq!(t, &message((r + 2) % 3, 2, dims, dtype), "{dims:?} {dtype} rank {r}");
            }
        }
    }
}

#[test]
fn writing_to_the_sent_tensor_afterwards_does_not_change_the_message() {
    let got = on_ranks(groups(2, LONG), |g| {
        if g.rank() == 0 {
            let mut x = message(0, 0, &[4], DType::F32);
            let w = g.send_async(&x, 1).unwrap();
            x.as_mut_slice::<f32>().unwrap().fill(-1.0);
            g.barrier().unwrap();
            w.wait().unwrap();
            None
        } else {
            g.barrier().unwrap(); // receive only after the sender overwrote its tensor
            Some(g.recv(&[4], DType::F32, 0).unwrap())
        }
    });
    assert_eq!(got[1].as_ref().unwrap(), &message(0, 0, &[4], DType::F32));
}

#[test]
fn wrong_dims_or_dtype_is_a_mismatch_on_both_sides_well_before_the_deadline() {
    let sent = [3, 4];
    let cases: [(&[usize], DType); 5] = [
        (&[4, 3], DType::F32),  // same count, other dims
        (&[3, 5], DType::F32),  // other count
        (&[12], DType::F32),    // other rank
        (&[3, 4], DType::BF16), // other dtype
        (&[3, 4], DType::I64),  // other dtype, same element size as neither
    ];
    for (dims, dtype) in cases {
        let started = Instant::now();
        let got = on_ranks(groups(2, LONG), |g| {
            if g.rank() == 0 {
                // The send is posted; its wait reports what the receiver found.
                let w = g.send_async(&message(0, 0, &sent, DType::F32), 1).unwrap();
                w.wait().unwrap_err()
            } else {
                g.recv(dims, dtype, 0).unwrap_err()
            }
        });
        let took = started.elapsed();
        assert!(took < Duration::from_secs(2), "{dims:?} {dtype}: {took:?}");
        for (r, e) in got.iter().enumerate() {
            assert!(matches!(e, CommError::Mismatch { .. }), "{dims:?} {dtype} rank {r}: {e:?}");
            let m = e.to_string();
            assert!(m.contains("[3, 4] f32"), "rank {r}: {m}");
            assert!(m.contains(&format!("{dims:?} {dtype}")), "rank {r}: {m}");
        }
    }
}

#[test]
fn the_blocking_send_also_reports_a_mismatch() {
    let started = Instant::now();
    let got = on_ranks(groups(2, LONG), |g| {
        if g.rank() == 0 {
            g.send(&message(0, 0, &[2], DType::BF16), 1).unwrap_err()
        } else {
            g.recv(&[2], DType::F32, 0).unwrap_err()
        }
    });
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    assert!(got.iter().all(|e| matches!(e, CommError::Mismatch { .. })), "{got:?}");
}

#[test]
fn a_receive_whose_peer_never_sends_times_out_naming_it_and_poisons_the_group() {
    let timeout = Duration::from_millis(300);
    let (tx, rx) = mpsc::channel::<()>();
    let rx = std::sync::Mutex::new(rx);
    let started = Instant::now();
    let got = on_ranks(groups(2, timeout), |g| {
        if g.rank() == 1 {
            let t = Instant::now();
            let e = g.recv(&[2], DType::F32, 0).unwrap_err();
            let took = t.elapsed();
            tx.send(()).unwrap();
            (Some(e), took, Vec::new())
        } else {
            // Rank 0 never sends; once rank 1 has timed out, everything it tries fails.
            rx.lock().unwrap().recv().unwrap();
            let x = message(0, 0, &[2], DType::F32);
            let errs = vec![
                g.send_async(&x, 1).map(drop).unwrap_err(),
                g.recv_async(&[2], DType::F32, 1).map(drop).unwrap_err(),
                g.all_reduce(&x, ReduceOp::Sum).map(drop).unwrap_err(),
                g.barrier().unwrap_err(),
            ];
            (None, Duration::ZERO, errs)
        }
    });
    let (e, took, _) = &got[1];
    match e {
        Some(CommError::Timeout { missing, rank, waited, .. }) => {
            assert_eq!(missing, &vec![0]);
            assert_eq!(*rank, 1);
            assert_eq!(*waited, timeout);
        }
        other => panic!("{other:?}"),
    }
    assert!(*took >= timeout - Duration::from_millis(10), "{took:?}");
    assert!(*took < timeout + Duration::from_secs(1), "{took:?}");
    for e in &got[0].2 {
        assert!(matches!(e, CommError::Poisoned { .. }), "{e:?}");
        assert!(e.to_string().contains("timed out"), "{e}");
    }
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
}

#[test]
fn a_send_nobody_receives_times_out_naming_the_receiver_and_poisons_the_group() {
    let timeout = Duration::from_millis(300);
    let gate = std::sync::Barrier::new(3);
    let started = Instant::now();
    let got = on_ranks(groups(3, timeout), |g| {
        if g.rank() == 0 {
            let t = Instant::now();
            let e = g.send(&message(0, 0, &[2], DType::F32), 2).unwrap_err();
            let took = t.elapsed();
            gate.wait();
            Some((e, took))
        } else {
            // Rank 2 never receives; after rank 0's deadline the group is poisoned for all.
            gate.wait();
            let e = g.barrier().unwrap_err();
            assert!(matches!(e, CommError::Poisoned { .. }), "{e:?}");
            let e = g.recv_async(&[2], DType::F32, 0).map(drop).unwrap_err();
            assert!(matches!(e, CommError::Poisoned { .. }), "{e:?}");
            None
        }
    });
    let (e, took) = got[0].clone().unwrap();
    assert!(matches!(&e, CommError::Timeout { missing, rank: 0, .. } if missing == &vec![2]), "{e:?}");
    assert!(took >= timeout - Duration::from_millis(10), "{took:?}");
    assert!(took < timeout + Duration::from_secs(1), "{took:?}");
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
}

#[test]
fn an_abort_ends_a_pending_receive_promptly() {
    let got = on_ranks(groups(2, LONG), |g| {
        if g.rank() == 0 {
            std::thread::sleep(Duration::from_millis(100));
            g.abort("stage 0 died");
            None
        } else {
            let t = Instant::now();
            let e = g.recv(&[2], DType::F32, 0).unwrap_err();
            Some((e, t.elapsed()))
        }
    });
    let (e, took) = got[1].clone().unwrap();
    assert!(matches!(e, CommError::Poisoned { .. }), "{e:?}");
    assert!(e.to_string().contains("stage 0 died"), "{e}");
    assert!(took < Duration::from_secs(1), "{took:?}");
}

#[test]
fn an_abort_ends_a_pending_send_promptly() {
    let got = on_ranks(groups(3, LONG), |g| match g.rank() {
        0 => {
            let t = Instant::now();
            let e = g.send(&message(0, 0, &[2], DType::F32), 1).unwrap_err();
            Some((e, t.elapsed()))
        }
        2 => {
            std::thread::sleep(Duration::from_millis(100));
            g.abort("rank 2 gave up");
            None
        }
        _ => None,
    });
    let (e, took) = got[0].clone().unwrap();
    assert!(matches!(e, CommError::Poisoned { .. }), "{e:?}");
    assert!(e.to_string().contains("rank 2 gave up"), "{e}");
    assert!(took < Duration::from_secs(1), "{took:?}");
}

#[test]
fn a_poisoned_group_refuses_new_sends_and_receives_at_the_call() {
    let got = on_ranks(groups(2, LONG), |g| {
        if g.rank() == 0 {
            g.abort("stage 0 stopped");
            g.barrier().ok();
            None
        } else {
            // Wait until the abort is visible (a barrier fails once the group is poisoned).
            let e = g.barrier().unwrap_err();
            assert!(matches!(e, CommError::Poisoned { .. }), "{e:?}");
            let t = Instant::now();
            let errs = [
                g.recv_async(&[2], DType::F32, 0).map(drop).unwrap_err(),
                g.send_async(&message(1, 0, &[2], DType::F32), 0).map(drop).unwrap_err(),
            ];
            assert!(t.elapsed() < Duration::from_millis(100), "{:?}", t.elapsed());
            Some(errs)
        }
    });
    for e in got[1].as_ref().unwrap() {
        assert!(matches!(e, CommError::Poisoned { .. }), "{e:?}");
        assert!(e.to_string().contains("stage 0 stopped"), "{e}");
    }
}

#[test]
fn sending_to_itself_or_out_of_range_is_refused_at_the_call() {
    for n in [2, 5] {
        let gs = groups(n, Duration::from_secs(5));
        let x = message(0, 0, &[1], DType::F32);
        for g in &gs {
            let r = g.rank();
            assert!(matches!(g.send_async(&x, r), Err(CommError::Mismatch { .. })), "rank {r}");
            assert!(matches!(g.send(&x, r), Err(CommError::Mismatch { .. })), "rank {r}");
            assert!(matches!(g.recv_async(&[1], DType::F32, r), Err(CommError::Mismatch { .. })), "rank {r}");
            assert!(matches!(g.recv(&[1], DType::F32, r), Err(CommError::Mismatch { .. })), "rank {r}");
            for bad in [n, n + 1, usize::MAX] {
                match g.send_async(&x, bad) {
                    Err(CommError::RankOutOfRange { rank, world_size, .. }) => {
                        assert_eq!((rank, world_size), (bad, n));
                    }
                    other => panic!("rank {r} to {bad}: {:?}", other.map(drop)),
                }
                assert!(
                    matches!(g.recv_async(&[1], DType::F32, bad), Err(CommError::RankOutOfRange { .. })),
                    "rank {r} from {bad}"
                );
            }
        }
        // Refused calls take no message number: a real exchange afterwards still matches.
        let got = on_ranks(gs, |g| {
            if g.rank() == 0 {
                g.send(&message(0, 3, &[1], DType::F32), 1).unwrap();
                None
            } else if g.rank() == 1 {
                Some(g.recv(&[1], DType::F32, 0).unwrap())
            } else {
                None
            }
        });
        assert_eq!(got[1].as_ref().unwrap(), &message(0, 3, &[1], DType::F32));
    }
}

#[test]
fn a_one_rank_group_has_no_peer() {
    let gs = groups(1, Duration::from_secs(5));
    let x = message(0, 0, &[1], DType::F32);
    assert!(gs[0].send_async(&x, 0).is_err());
    assert!(gs[0].recv_async(&[1], DType::F32, 0).is_err());
}

/// Polls `w.is_completed()` for up to `limit`; whether it became true.
fn completes_within(w: &mut tp_comm::Work, limit: Duration) -> bool {
    let t = Instant::now();
    while t.elapsed() < limit {
        if w.is_completed() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    w.is_completed()
}

#[test]
fn a_send_completes_once_its_receive_is_posted_before_the_receiver_waits() {
    let gate = std::sync::Barrier::new(2);
    let got = on_ranks(groups(2, LONG), |g| {
        if g.rank() == 0 {
            let mut w = g.send_async(&message(0, 0, &[3], DType::F32), 1).unwrap();
            // Nothing posted at rank 1 yet: the send is pending.
            assert!(!w.is_completed());
            gate.wait(); // rank 1 posts its receive
            gate.wait(); // ... and has not waited for it yet
            assert!(completes_within(&mut w, Duration::from_secs(5)), "the send never completed");
            let sent = w.wait().unwrap();
            gate.wait(); // now rank 1 may wait
            assert_eq!(sent, message(0, 0, &[3], DType::F32));
            None
        } else {
            gate.wait();
            let mut r = g.recv_async(&[3], DType::F32, 0).unwrap();
            // The message was already sent: the receive is complete as soon as it is posted.
            assert!(r.is_completed());
            gate.wait();
            gate.wait();
            Some(r.wait().unwrap())
        }
    });
    assert_eq!(got[1].as_ref().unwrap(), &message(0, 0, &[3], DType::F32));
}

#[test]
fn a_mismatch_reaches_the_sender_without_the_receiver_waiting() {
    let gate = std::sync::Barrier::new(2);
    let got = on_ranks(groups(2, LONG), |g| {
        if g.rank() == 0 {
            let w = g.send_async(&message(0, 0, &[2, 3], DType::F32), 1).unwrap();
            let t = Instant::now();
            let e = w.wait().unwrap_err(); // rank 1 posted its receive and is parked at the gate
            let took = t.elapsed();
            gate.wait();
            (e, took)
        } else {
            let r = g.recv_async(&[3, 2], DType::F32, 0).unwrap();
            gate.wait();
            (r.wait().unwrap_err(), Duration::ZERO)
        }
    });
    assert!(got[0].1 < Duration::from_secs(2), "{:?}", got[0].1);
    for (r, (e, _)) in got.iter().enumerate() {
        assert!(matches!(e, CommError::Mismatch { .. }), "rank {r}: {e:?}");
        let m = e.to_string();
        assert!(m.contains("rank 0 sent [2, 3] f32 but rank 1 expected [3, 2] f32"), "rank {r}: {m}");
    }
}

#[test]
fn after_a_mismatch_the_pair_goes_on_in_step() {
    let got = on_ranks(groups(2, LONG), |g| {
        if g.rank() == 0 {
            assert!(matches!(g.send(&message(0, 0, &[4], DType::F32), 1), Err(CommError::Mismatch { .. })));
            g.send(&message(0, 1, &[4], DType::F32), 1).unwrap();
            None
        } else {
            assert!(matches!(g.recv(&[4], DType::I64, 0), Err(CommError::Mismatch { .. })));
            Some(g.recv(&[4], DType::F32, 0).unwrap())
        }
    });
    assert_eq!(got[1].as_ref().unwrap(), &message(0, 1, &[4], DType::F32));
}

#[test]
fn four_pipeline_stages_pass_activations_forward_and_gradients_back_one_f_one_b() {
    // A 1F1B-like step over 4 stages and 6 micro-batches: stage s adds s + 1 to each
    // activation on the way forward and doubles each gradient on the way back. Neighbours
    // have activations and gradients in flight towards each other at the same time, and every
    // stage runs an all_reduce_async of its loss while messages travel.
    let (stages, mbs, dims) = (4usize, 6usize, [2usize, 3]);
    let got = on_ranks(groups(stages, LONG), |g| {
        let s = g.rank();
        let warmup = (stages - 1 - s).min(mbs);
        let mut sends = Vec::new();
        let mut outs = Vec::new();
        let mut fwd = 0;
        let mut bwd = 0;
        let forward = |mb: usize, sends: &mut Vec<tp_comm::Work>, outs: &mut Vec<Tensor>| {
            let x = if s == 0 {
                Tensor::from_fn_f64(&dims, DType::F32, &CPU, |i| (mb * 10 + i) as f64).unwrap()
            } else {
                g.recv(&dims, DType::F32, s - 1).unwrap()
            };
            let y =
                Tensor::from_vec(x.to_vec::<f32>().unwrap().iter().map(|v| v + (s + 1) as f32).collect(), &dims, &CPU)
                    .unwrap();
            if s + 1 < stages {
                sends.push(g.send_async(&y, s + 1).unwrap());
            } else {
                outs.push(y);
            }
        };
        let backward = |mb: usize, sends: &mut Vec<tp_comm::Work>, outs: &mut Vec<Tensor>| {
            let dy = if s + 1 == stages { outs[mb].clone() } else { g.recv(&dims, DType::F32, s + 1).unwrap() };
            let dx =
                Tensor::from_vec(dy.to_vec::<f32>().unwrap().iter().map(|v| v * 2.0).collect(), &dims, &CPU).unwrap();
            if s > 0 {
                sends.push(g.send_async(&dx, s - 1).unwrap());
                None
            } else {
                Some(dx)
            }
        };
        let mut grads = Vec::new();
        while fwd < warmup {
            forward(fwd, &mut sends, &mut outs);
            fwd += 1;
        }
        while bwd < mbs {
            if fwd < mbs {
                forward(fwd, &mut sends, &mut outs);
                fwd += 1;
            }
            let loss =
                g.all_reduce_async(&Tensor::from_vec(vec![bwd as f32], &[1], &CPU).unwrap(), ReduceOp::Sum).unwrap();
            if let Some(dx) = backward(bwd, &mut sends, &mut outs) {
                grads.push(dx);
            }
            assert_eq!(loss.wait().unwrap().to_vec::<f32>().unwrap(), vec![(bwd * stages) as f32]);
            bwd += 1;
        }
        for w in sends {
            w.wait().unwrap();
        }
        grads
    });
    // Forward adds 1 + 2 + 3 + 4 = 10; backward doubles at each of the 4 stages.
    assert_eq!(got[0].len(), mbs);
    for (mb, dx) in got[0].iter().enumerate() {
        let want: Vec<f32> = (0..6).map(|i| ((mb * 10 + i) as f32 + 10.0) * 16.0).collect();
        assert_eq!(dx.to_vec::<f32>().unwrap(), want, "micro-batch {mb}");
    }
}

#[test]
fn every_rank_sends_to_every_other_with_many_messages_in_flight() {
    let (n, per_pair) = (6usize, 4usize);
    let got = on_ranks(groups(n, LONG), |g| {
        let r = g.rank();
        let mut sends = Vec::new();
        for k in 0..per_pair {
            for d in (0..n).filter(|&d| d != r) {
                let dims = [k + 1, d + 2];
                sends.push(g.send_async(&message(r, k, &dims, DType::BF16), d).unwrap());
            }
        }
        // Receives posted source by source in a rank-dependent order, some waited late.
        let mut srcs: Vec<usize> = (0..n).filter(|&s| s != r).collect();
        let len = srcs.len();
        srcs.rotate_left(r % len);
        let mut pending = Vec::new();
        for &src in &srcs {
            for k in 0..per_pair {
                pending.push((src, k, g.recv_async(&[k + 1, r + 2], DType::BF16, src).unwrap()));
            }
        }
        let got: Vec<(usize, usize, Tensor)> =
            pending.into_iter().rev().map(|(src, k, w)| (src, k, w.wait().unwrap())).collect();
        for w in sends {
            w.wait().unwrap();
        }
        got
    });
    for (r, msgs) in got.iter().enumerate() {
        assert_eq!(msgs.len(), (n - 1) * per_pair);
        for (src, k, t) in msgs {
            assert_eq!(t, &message(*src, *k, &[k + 1, r + 2], DType::BF16), "rank {r} from {src}, message {k}");
        }
    }
}

#[test]
fn an_abort_wakes_waiting_sends_and_receives_on_every_rank() {
    let started = Instant::now();
    let got = on_ranks(groups(4, LONG), |g| match g.rank() {
        3 => {
            std::thread::sleep(Duration::from_millis(100));
            g.abort("stage 3 ran out of memory");
            None
        }
        r => {
            // Rank 0 waits on a send to 1; ranks 1 and 2 wait on receives nobody sends.
            let e = if r == 0 {
                g.send(&message(0, 0, &[2], DType::F32), 1).unwrap_err()
            } else {
                g.recv(&[2], DType::F32, (r + 1) % 3).unwrap_err()
            };
            Some(e)
        }
    });
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    for (r, e) in got.iter().enumerate().take(3) {
        let e = e.as_ref().unwrap();
        assert!(matches!(e, CommError::Poisoned { .. }), "rank {r}: {e:?}");
        assert!(e.to_string().contains("stage 3 ran out of memory"), "rank {r}: {e}");
    }
}

/// A communicator with collectives only: the trait's default point-to-point.
struct NoP2p;

impl tp_comm::Communicator for NoP2p {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        2
    }
    fn all_gather(&self, x: &Tensor, _: usize) -> tp_comm::Result<Tensor> {
        Ok(x.clone())
    }
    fn all_reduce(&self, x: &Tensor, _: ReduceOp) -> tp_comm::Result<Tensor> {
        Ok(x.clone())
    }
    fn reduce_scatter(&self, x: &Tensor, _: usize, _: ReduceOp) -> tp_comm::Result<Tensor> {
        Ok(x.clone())
    }
    fn broadcast(&self, x: &Tensor, _: usize) -> tp_comm::Result<Tensor> {
        Ok(x.clone())
    }
    fn barrier(&self) -> tp_comm::Result<()> {
        Ok(())
    }
    fn abort(&self, _: &str) {}
}

#[test]
fn a_backend_without_point_to_point_says_so() {
    let g = DeviceGroup::new(std::sync::Arc::new(NoP2p), CPU);
    let x = message(0, 0, &[1], DType::F32);
    for e in [
        g.send_async(&x, 1).map(drop).unwrap_err(),
        g.send(&x, 1).unwrap_err(),
        g.recv_async(&[1], DType::F32, 1).map(drop).unwrap_err(),
        g.recv(&[1], DType::F32, 1).map(drop).unwrap_err(),
    ] {
        assert!(matches!(e, CommError::Limit { .. }), "{e:?}");
        assert!(e.to_string().contains("no point-to-point"), "{e}");
    }
}

#[test]
fn a_dropped_receive_still_takes_its_message_so_the_sender_and_later_messages_go_on() {
    let dims = [2];
    for drop_first in [true, false] {
        let got = on_ranks(groups(2, Duration::from_secs(10)), |g| {
            if g.rank() == 0 {
                // Each send waited before the next: the first completes only if its (dropped)
                // receive still takes it.
                for k in 0..2 {
                    g.send(&message(0, k, &dims, DType::F32), 1).unwrap();
                }
                None
            } else {
                if drop_first {
                    drop(g.recv_async(&dims, DType::F32, 0).unwrap()); // before the message arrives
                } else {
                    let w = g.recv_async(&dims, DType::F32, 0).unwrap();
                    std::thread::sleep(Duration::from_millis(100)); // after it arrived
                    drop(w);
                }
                Some(first(&g.recv(&dims, DType::F32, 0).unwrap()))
            }
        });
        assert_eq!(got[1], Some(first(&message(0, 1, &dims, DType::F32))), "drop before arrival: {drop_first}");
    }
    // A dropped send is delivered all the same.
    let got = on_ranks(groups(2, Duration::from_secs(10)), |g| {
        if g.rank() == 0 {
            drop(g.send_async(&message(0, 3, &[1], DType::F32), 1).unwrap());
            None
        } else {
            Some(first(&g.recv(&[1], DType::F32, 0).unwrap()))
        }
    });
    assert_eq!(got[1], Some(first(&message(0, 3, &[1], DType::F32))));
}

#[test]
fn a_batch_of_sends_and_receives_between_neighbours_that_both_send_first() {
    // Every rank sends to both neighbours and receives from both in one batch, at every world
    // size, with an uneven shape, several dtypes, and a bad operation refused at the call.
    for n in 2..=8 {
        let got = on_ranks(groups(n, LONG), |g| {
            let (me, n) = (g.rank(), g.world_size());
            let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
            let (fwd, back) = (message(me, 0, &[33, 17], DType::BF16), message(me, 1, &[5], DType::I64));
            let ops = [
                P2p::Send { x: &fwd, peer: next },
                P2p::Send { x: &back, peer: prev },
                P2p::Recv { dims: &[33, 17], dtype: DType::BF16, peer: prev },
                P2p::Recv { dims: &[5], dtype: DType::I64, peer: next },
            ];
            let works = g.send_recv_async(&ops).unwrap();
            assert_eq!(works.len(), 4);
            let out: Vec<Tensor> = works.into_iter().map(|w| w.wait().unwrap()).collect();
            let bad = g.send_recv_async(&[P2p::Recv { dims: &[1], dtype: DType::F32, peer: n }]).unwrap_err();
            assert!(matches!(bad, CommError::RankOutOfRange { .. }), "{bad}");
            (me, prev, next, out)
        });
        for (me, prev, next, out) in got {
            assert_eq!(out[0].to_f64_vec().unwrap(), message(me, 0, &[33, 17], DType::BF16).to_f64_vec().unwrap());
            assert_eq!(out[1].to_i64_vec().unwrap(), message(me, 1, &[5], DType::I64).to_i64_vec().unwrap());
            let want_fwd = message(prev, 0, &[33, 17], DType::BF16).to_f64_vec().unwrap();
            assert_eq!(out[2].to_f64_vec().unwrap(), want_fwd, "n={n} rank {me} from {prev}");
            assert_eq!(out[3].to_i64_vec().unwrap(), message(next, 1, &[5], DType::I64).to_i64_vec().unwrap());
        }
    }
}

#[test]
fn a_batched_receive_of_the_wrong_shape_is_a_mismatch_naming_both() {
    let got = on_ranks(groups(2, LONG), |g| {
        let peer = 1 - g.rank();
        let x = message(g.rank(), 0, &[3, 4], DType::F32);
        let works = g
            .send_recv_async(&[P2p::Send { x: &x, peer }, P2p::Recv { dims: &[4, 3], dtype: DType::F32, peer }])
            .unwrap();
        works.into_iter().map(|w| w.wait().map(drop)).collect::<Vec<_>>()
    });
    for results in got {
        let e = results.into_iter().find_map(|r| r.err()).expect("a mismatch on each rank");
        assert!(e.to_string().contains("[4, 3]") && e.to_string().contains("[3, 4]"), "{e}");
    }
}
