//! Point-to-point between ranks of a `LocalGroup` (pipeline stages): rings at every world size
//! and dtype, FIFO order per pair of ranks, messages beside collectives, and every failure a
//! typed error on both sides well within the deadline.

use std::time::{Duration, Instant};
use tp_comm::{CommError, DeviceGroup, ReduceOp};
use tp_core::{DType, Device, Tensor};

fn groups(n: usize, timeout: Duration) -> Vec<DeviceGroup> {
    DeviceGroup::local(n, timeout, |_| Device::Cpu).unwrap()
}

/// Runs `f` on every rank's thread and returns the results in rank order.
fn on_ranks<R: Send>(gs: Vec<DeviceGroup>, f: impl Fn(&DeviceGroup) -> R + Sync) -> Vec<R> {
    let f = &f;
    std::thread::scope(|s| {
        let hs: Vec<_> = gs.into_iter().map(|g| s.spawn(move || f(&g))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn filled(v: f64, dims: &[usize], dtype: DType) -> Tensor {
    let n: usize = dims.iter().product();
    let t = Tensor::from_vec((0..n).map(|i| (v * 100.0 + i as f64) as f32).collect(), dims, &Device::Cpu).unwrap();
    match dtype {
        DType::I64 => {
            Tensor::from_vec((0..n).map(|i| (v as i64) * 1000 + i as i64).collect(), dims, &Device::Cpu).unwrap()
        }
        d => t.to_dtype(d).unwrap(),
    }
}

#[test]
fn a_ring_at_every_world_size_and_dtype_delivers_exactly() {
    for n in 2..=8 {
        for dtype in [DType::F32, DType::BF16, DType::I64] {
            let dims = [7, 13];
            let got = on_ranks(groups(n, Duration::from_secs(30)), |g| {
                let (r, w) = (g.rank(), g.world_size());
                let send = g.send_async(&filled(r as f64, &dims, dtype), (r + 1) % w).unwrap();
                let t = g.recv(&dims, dtype, (r + w - 1) % w).unwrap();
                send.wait().unwrap();
                t
            });
            for (r, t) in got.iter().enumerate() {
                let from = (r + n - 1) % n;
                let want = filled(from as f64, &dims, dtype);
                assert_eq!(t.dims(), &dims);
                assert_eq!(t.to_f64_vec().unwrap(), want.to_f64_vec().unwrap(), "n {n} {dtype} rank {r}");
            }
        }
    }
}

#[test]
fn messages_between_two_ranks_arrive_in_the_order_they_were_sent() {
    let got = on_ranks(groups(2, Duration::from_secs(30)), |g| {
        if g.rank() == 0 {
            let works: Vec<_> = (0..5).map(|i| g.send_async(&filled(i as f64, &[3], DType::F32), 1).unwrap()).collect();
            for w in works {
                w.wait().unwrap();
            }
            Vec::new()
        } else {
            let mut out: Vec<f64> =
                (0..3).map(|_| g.recv(&[3], DType::F32, 0).unwrap().to_f64_vec().unwrap()[0]).collect();
            // Two receives posted, the second waited first: it is still the fifth message.
            let fourth = g.recv_async(&[3], DType::F32, 0).unwrap();
            let fifth = g.recv_async(&[3], DType::F32, 0).unwrap();
            let b = fifth.wait().unwrap().to_f64_vec().unwrap()[0];
            let a = fourth.wait().unwrap().to_f64_vec().unwrap()[0];
            out.extend([a, b]);
            out
        }
    });
    assert_eq!(got[1], vec![0.0, 100.0, 200.0, 300.0, 400.0]);
}

#[test]
fn messages_in_flight_do_not_disturb_collectives() {
    let got = on_ranks(groups(3, Duration::from_secs(30)), |g| {
        let r = g.rank();
        let send = if r < 2 { Some(g.send_async(&filled(r as f64, &[4], DType::F32), r + 1).unwrap()) } else { None };
        let sum =
            g.all_reduce(&Tensor::from_vec(vec![r as f32 + 1.0], &[1], &Device::Cpu).unwrap(), ReduceOp::Sum).unwrap();
        let got = if r > 0 { Some(g.recv(&[4], DType::F32, r - 1).unwrap().to_f64_vec().unwrap()) } else { None };
        if let Some(s) = send {
            s.wait().unwrap();
        }
        (sum.to_f64_vec().unwrap()[0], got)
    });
    for (r, (sum, msg)) in got.iter().enumerate() {
        assert_eq!(*sum, 6.0);
        if r > 0 {
            assert_eq!(msg.as_ref().unwrap()[..2], [(r - 1) as f64 * 100.0, (r - 1) as f64 * 100.0 + 1.0]);
        }
    }
}

#[test]
fn a_wrong_shape_or_dtype_is_an_error_on_both_sides() {
    for (dims, dtype) in [([4, 3], DType::F32), ([3, 4], DType::BF16)] {
        let started = Instant::now();
        let got = on_ranks(groups(2, Duration::from_secs(30)), |g| {
            if g.rank() == 0 {
                g.send(&filled(0.0, &[3, 4], DType::F32), 1).unwrap_err()
            } else {
                g.recv(&dims, dtype, 0).unwrap_err()
            }
        });
        assert!(started.elapsed() < Duration::from_secs(5));
        for e in &got {
            assert!(matches!(e, CommError::Mismatch { .. }), "{e}");
            let m = e.to_string();
            assert!(m.contains("[3, 4] f32") && m.contains("expected"), "{m}");
        }
    }
}

#[test]
fn a_peer_that_never_sends_is_a_timeout_naming_it_and_poisons_the_group() {
    let started = Instant::now();
    let got = on_ranks(groups(2, Duration::from_millis(300)), |g| {
        if g.rank() == 1 {
            let e = g.recv(&[2], DType::F32, 0).unwrap_err();
            Some(e)
        } else {
            std::thread::sleep(Duration::from_millis(600));
            // The group is poisoned by the timeout: a later collective fails at once.
            let e = g.barrier().unwrap_err();
            assert!(matches!(e, CommError::Poisoned { .. }), "{e}");
            None
        }
    });
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    match &got[1] {
        Some(CommError::Timeout { missing, .. }) => assert_eq!(missing, &vec![0]),
        other => panic!("{other:?}"),
    }
    // A send nobody receives also ends at the deadline.
    let got = on_ranks(groups(2, Duration::from_millis(300)), |g| {
        if g.rank() == 0 { Some(g.send(&filled(0.0, &[2], DType::F32), 1).unwrap_err()) } else { None }
    });
    assert!(matches!(&got[0], Some(CommError::Timeout { missing, .. }) if missing == &vec![1]), "{:?}", got[0]);
}

#[test]
fn an_abort_ends_a_pending_receive_promptly() {
    let got = on_ranks(groups(2, Duration::from_secs(30)), |g| {
        if g.rank() == 0 {
            std::thread::sleep(Duration::from_millis(100));
            g.abort("stage 0 died");
            None
        } else {
            let t = Instant::now();
            let e = g.recv(&[2], DType::F32, 0).unwrap_err();
            Some((e.to_string(), t.elapsed()))
        }
    });
    let (e, took) = got[1].clone().unwrap();
    assert!(e.contains("stage 0 died"), "{e}");
    assert!(took < Duration::from_secs(1), "{took:?}");
}

#[test]
fn sending_to_itself_or_past_the_group_is_refused_at_the_call() {
    let g = groups(2, Duration::from_secs(5));
    let x = filled(0.0, &[1], DType::F32);
    assert!(matches!(g[0].send_async(&x, 0), Err(CommError::Mismatch { .. })));
    assert!(matches!(g[0].send_async(&x, 2), Err(CommError::RankOutOfRange { .. })));
    assert!(matches!(g[1].recv_async(&[1], DType::F32, 1), Err(CommError::Mismatch { .. })));
    assert!(matches!(g[1].recv_async(&[1], DType::F32, 7), Err(CommError::RankOutOfRange { .. })));
}

#[test]
fn a_dropped_receive_still_takes_its_message_so_the_sender_and_later_messages_go_on() {
    for drop_first in [true, false] {
        let got = on_ranks(groups(2, Duration::from_secs(10)), |g| {
            if g.rank() == 0 {
                // Each send waited before the next: the first completes only if its (dropped)
                // receive still takes it.
                for i in 0..2 {
                    g.send(&filled(i as f64, &[2], DType::F32), 1).unwrap();
                }
                None
            } else {
                if drop_first {
                    drop(g.recv_async(&[2], DType::F32, 0).unwrap()); // before the message arrives
                } else {
                    let w = g.recv_async(&[2], DType::F32, 0).unwrap();
                    std::thread::sleep(Duration::from_millis(100)); // after it arrived
                    drop(w);
                }
                Some(g.recv(&[2], DType::F32, 0).unwrap().to_f64_vec().unwrap())
            }
        });
        assert_eq!(got[1].as_deref(), Some(&[100.0, 101.0][..]), "drop before arrival: {drop_first}");
    }
    // A dropped send is delivered all the same.
    let got = on_ranks(groups(2, Duration::from_secs(10)), |g| {
        if g.rank() == 0 {
            drop(g.send_async(&filled(3.0, &[1], DType::F32), 1).unwrap());
            None
        } else {
            Some(g.recv(&[1], DType::F32, 0).unwrap().to_f64_vec().unwrap()[0])
        }
    });
    assert_eq!(got[1], Some(300.0));
}
