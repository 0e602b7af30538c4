//! `tp-comm-bench`: collective bandwidth in the style of nccl-tests, for whatever backend is
//! present: NCCL over every visible GPU (one process, a thread per GPU) when a GPU and NCCL are
//! found, otherwise `LocalGroup` threads on the CPU.
//!
//! For each collective and message size (8 B doubling up to `--max-bytes`), it reports the
//! median time over `--iters` runs, algbw = bytes / time and busbw = algbw x the collective's
//! bus factor (all-reduce 2(n-1)/n; all-gather and reduce-scatter (n-1)/n; broadcast 1), the
//! figure comparable across world sizes, as nccl-tests defines it.
//!
//! Usage: `tp-comm-bench [--backend local|nccl] [--world N] [--max-bytes B] [--iters N]`.

use anyhow::{Context, Result, bail};
use std::time::{Duration, Instant};
use tp_comm::{DeviceGroup, ReduceOp};
use tp_core::{DType, Device, Tensor};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Coll {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
}

impl Coll {
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Coll::AllReduce => 2.0 * (n - 1.0) / n,
            Coll::AllGather | Coll::ReduceScatter => (n - 1.0) / n,
            Coll::Broadcast => 1.0,
        }
    }
}

fn main() {
    if let Err(e) = run() {
        eprintln!("tp-comm-bench: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let (mut backend, mut world, mut max_bytes, mut iters) = (None::<String>, 0usize, 0usize, 20usize);
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut val = || it.next().context("flag needs a value");
        match a.as_str() {
            "--backend" => backend = Some(val()?),
            "--world" => world = val()?.parse()?,
            "--max-bytes" => max_bytes = val()?.parse()?,
            "--iters" => iters = val()?.parse()?,
            other => bail!("unknown argument {other:?}"),
        }
    }
    let gpus = tp_kernels::device_count().unwrap_or(0);
    let use_nccl = match backend.as_deref() {
        Some("nccl") => true,
        Some("local") => false,
        Some(other) => bail!("unknown backend {other:?}: local or nccl"),
        None => gpus > 0 && tp_comm::nccl::Nccl::get().is_ok(),
    };
    let timeout = Duration::from_secs(120);
    let groups = if use_nccl {
        let n = if world == 0 { gpus } else { world };
        let ordinals: Vec<usize> = (0..n).collect();
        println!("backend: NCCL {:?} on {n} GPU(s)", tp_comm::nccl::Nccl::get()?.version());
        if max_bytes == 0 {
            max_bytes = 1 << 30;
        }
        DeviceGroup::nccl_local(&ordinals, timeout)?
    } else {
        let n = if world == 0 { 2 } else { world };
        println!("backend: LocalGroup, {n} threads on the CPU (no GPU/NCCL found or --backend local)");
        if max_bytes == 0 {
            max_bytes = 64 << 20;
        }
        DeviceGroup::local(n, timeout, |_| Device::Cpu)?
    };
    let n = groups.len();
    println!(
        "{:>12} {:>12} {:<15} {:>10} {:>12} {:>12}",
        "size (B)", "count (f32)", "collective", "time (us)", "algbw GB/s", "busbw GB/s"
    );
    for coll in [Coll::AllReduce, Coll::AllGather, Coll::ReduceScatter, Coll::Broadcast] {
        let mut bytes = 8usize;
        while bytes <= max_bytes {
            let secs = time(&groups, coll, bytes, iters)?;
            let algbw = bytes as f64 / secs / 1e9;
            println!(
                "{:>12} {:>12} {:<15} {:>10.1} {:>12.3} {:>12.3}",
                bytes,
                bytes / 4,
                format!("{coll:?}"),
                secs * 1e6,
                algbw,
                algbw * coll.bus_factor(n)
            );
            bytes *= 2;
        }
    }
    Ok(())
}

/// Median seconds of one collective over `iters` runs (after 2 warm-ups), slowest rank.
/// `bytes` is the size nccl-tests reports: the full buffer for all-reduce and broadcast, the
/// gathered output for all-gather, the input for reduce-scatter.
fn time(groups: &[DeviceGroup], coll: Coll, bytes: usize, iters: usize) -> Result<f64> {
    let n = groups.len();
    let count = (bytes / 4).max(1);
    let per_rank = (count / n).max(1);
    let times: Vec<Result<Vec<f64>>> = std::thread::scope(|s| {
        let hs: Vec<_> = groups
            .iter()
            .map(|g| {
                s.spawn(move || -> Result<Vec<f64>> {
                    let len = if coll == Coll::AllGather { per_rank } else { count };
                    let x = g.to_local(&Tensor::rand(&[len], DType::F32, g.rank() as u64, &Device::Cpu)?)?;
                    let mut out = Vec::with_capacity(iters);
                    for i in 0..iters + 2 {
                        g.barrier()?;
                        let t = Instant::now();
                        let y = match coll {
                            Coll::AllReduce => g.all_reduce(&x, ReduceOp::Sum)?,
                            Coll::AllGather => g.all_gather(&x, 0)?,
                            Coll::ReduceScatter => g.reduce_scatter(&x, 0, ReduceOp::Sum)?,
                            Coll::Broadcast => g.broadcast(&x, 0)?,
                        };
                        std::hint::black_box(&y);
                        if i >= 2 {
                            out.push(t.elapsed().as_secs_f64());
                        }
                    }
                    Ok(out)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a rank panicked")))).collect()
    });
    let per_rank_times = times.into_iter().collect::<Result<Vec<_>>>()?;
    let mut slowest: Vec<f64> = (0..iters).map(|i| per_rank_times.iter().map(|t| t[i]).fold(0.0, f64::max)).collect();
    slowest.sort_by(f64::total_cmp);
    Ok(slowest[slowest.len() / 2])
}
