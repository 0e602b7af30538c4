//! `all_to_all` with variable counts on LocalGroup at world sizes 1..=8: rank-derived chunks
//! (some empty, some ranks sending nothing at all) arrive at their ranks in rank order with
//! their counts; bad counts are a mismatch on the rank that gave them.

use std::time::Duration;
use tp_comm::{CommError, DeviceGroup};
use tp_core::{DType, Device, Tensor};

const CPU: Device = Device::Cpu;
const WIDTH: usize = 3;

fn on_ranks<R: Send>(world: usize, f: impl Fn(DeviceGroup) -> R + Sync) -> Vec<R> {
    let groups = DeviceGroup::local(world, Duration::from_secs(30), |_| CPU).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = groups.into_iter().map(|g| s.spawn(|| f(g))).collect();
        handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
    })
}

/// Rows rank `r` sends rank `j` (0 to 3; rank 2 of a world over 2 sends nothing).
fn count(r: usize, j: usize, world: usize) -> usize {
    if world > 2 && r == 2 { 0 } else { (r * 3 + j * 5 + world) % 4 }
}

/// Column `c` of the `i`-th row rank `r` sends rank `j`: integers up to 255, exact in every
/// float dtype.
fn value(r: usize, j: usize, i: usize, c: usize) -> f64 {
    let base = (r * 32 + j * 4 + i) as f64;
    [base, -base, 255.0 - base][c]
}

#[test]
fn every_rank_gets_its_chunks_in_rank_order() {
    for world in 1..=8 {
        for dtype in [DType::F32, DType::BF16] {
            let got = on_ranks(world, |g| {
                let r = g.rank();
                let counts: Vec<usize> = (0..world).map(|j| count(r, j, world)).collect();
                let rows: Vec<f64> = (0..world)
                    .flat_map(|j| (0..count(r, j, world)).flat_map(move |i| (0..WIDTH).map(move |c| value(r, j, i, c))))
                    .collect();
                let n = rows.len() / WIDTH;
                let x = Tensor::from_fn_f64(&[n, WIDTH], dtype, &CPU, |k| rows[k]).unwrap();
                g.all_to_all(&x, &counts).unwrap()
            });
            for (j, (y, from)) in got.into_iter().enumerate() {
                let want_counts: Vec<usize> = (0..world).map(|r| count(r, j, world)).collect();
                assert_eq!(from, want_counts, "world {world} {dtype} rank {j}: counts");
                let want: Vec<f64> = (0..world)
                    .flat_map(|r| (0..count(r, j, world)).flat_map(move |i| (0..WIDTH).map(move |c| value(r, j, i, c))))
                    .collect();
                assert_eq!(y.dims(), &[want.len() / WIDTH, WIDTH], "world {world} {dtype} rank {j}");
                assert_eq!(y.to_f64_vec().unwrap(), want, "world {world} {dtype} rank {j}");
            }
        }
    }
}

#[test]
fn counts_that_do_not_fit_the_rows_are_refused() {
    let got = on_ranks(1, |g| {
        let x = Tensor::zeros(&[5, WIDTH], DType::F32, &CPU).unwrap();
        (g.all_to_all(&x, &[4]).unwrap_err(), g.all_to_all(&x, &[2, 3]).unwrap_err())
    });
    for e in [&got[0].0, &got[0].1] {
        assert!(matches!(e, CommError::Mismatch { .. }), "{e}");
        assert!(e.to_string().contains("needs 1 counts"), "{e}");
    }
}
