//! `tp-comm-bench`: collective bandwidth in the style of nccl-tests, for whatever backend is
//! present: NCCL over every visible GPU (one process, a thread per GPU) when a GPU and NCCL are
//! found, otherwise `LocalGroup` threads on the CPU.
//!
//! For each collective and message size (8 B doubling up to `--max-bytes`), it reports the
//! median time over `--iters` runs, algbw = bytes / time and busbw = algbw x the collective's
//! bus factor (all-reduce 2(n-1)/n; all-gather and reduce-scatter (n-1)/n; broadcast 1), the
//! figure comparable across world sizes, as nccl-tests defines it.
//!
//! On the CPU backend, when `python3` can import torch, all-reduce is also timed with gloo (torch's
//! CPU backend: `world` processes on this machine, the same sizes, iterations and method) and
//! printed beside ours.
//!
//! With `--mpi-world N` it compares the MPI backend instead: this program as `N` processes under
//! `mpirun` (`--backend mpi`, each process a rank), then gloo over `N` processes, all-reduce of
//! f32 from 4 KiB to 64 MiB, one after the other.
//!
//! Usage: `tp-comm-bench [--backend local|nccl] [--world N] [--max-bytes B] [--iters N]`, or
//! `tp-comm-bench --mpi-world N [--iters N] [--sizes B,B,..] [--out FILE.json]`.

use anyhow::{Context, Result, bail};
use std::time::{Duration, Instant};
use tp_comm::{DeviceGroup, ReduceOp};
use tp_core::{DType, Device, Tensor};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Coll {
    AllReduce,
    /// All-reduce into the input itself (torch.distributed's form).
    AllReduceInto,
    AllGather,
    ReduceScatter,
    Broadcast,
}

impl Coll {
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Coll::AllReduce | Coll::AllReduceInto => 2.0 * (n - 1.0) / n,
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
    let (mut mpi_world, mut sizes, mut out) = (0usize, None::<Vec<usize>>, None::<String>);
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut val = || it.next().context("flag needs a value");
        match a.as_str() {
            "--backend" => backend = Some(val()?),
            "--world" => world = val()?.parse()?,
            "--max-bytes" => max_bytes = val()?.parse()?,
            "--iters" => iters = val()?.parse()?,
            "--mpi-world" => mpi_world = val()?.parse()?,
            "--sizes" => sizes = Some(val()?.split(',').map(str::parse).collect::<Result<_, _>>()?),
            "--out" => out = Some(val()?),
            other => bail!("unknown argument {other:?}"),
        }
    }
    // 4 KiB to 64 MiB, doubling: the sizes the MPI comparison reports.
    let mpi_sizes = || sizes.clone().unwrap_or_else(|| (12..=26).map(|p| 1usize << p).collect());
    if backend.as_deref() == Some("mpi") {
        return mpi_rank(&mpi_sizes(), iters);
    }
    if mpi_world > 0 {
        return mpi_versus_gloo(mpi_world, &mpi_sizes(), iters, out.as_deref());
    }
    let gpus = tp_kernels::device_count().unwrap_or(0);
    let use_nccl = match backend.as_deref() {
        Some("nccl") => true,
        Some("local") => false,
        Some(other) => bail!("unknown backend {other:?}: local, nccl or mpi"),
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
    let sizes: Vec<usize> =
        std::iter::successors(Some(8usize), |b| Some(b * 2)).take_while(|&b| b <= max_bytes).collect();
    let gloo = if use_nccl { Err("NCCL backend".to_string()) } else { gloo_all_reduce(n, &sizes, iters) };
    match &gloo {
        Ok((version, _)) => println!("reference: {version}, all-reduce over {n} processes"),
        Err(why) => println!("gloo reference skipped: {why}"),
    }
    println!(
        "{:>12} {:>12} {:<15} {:>10} {:>12} {:>12} {:>10} {:>8}",
        "size (B)", "count (f32)", "collective", "time (us)", "algbw GB/s", "busbw GB/s", "gloo (us)", "vs gloo"
    );
    for coll in [Coll::AllReduce, Coll::AllGather, Coll::ReduceScatter, Coll::Broadcast] {
        for (i, &bytes) in sizes.iter().enumerate() {
            let secs = time(&groups, coll, bytes, iters)?;
            let algbw = bytes as f64 / secs / 1e9;
            let reference = gloo.as_ref().ok().filter(|_| coll == Coll::AllReduce).map(|(_, t)| t[i]);
            println!(
                "{:>12} {:>12} {:<15} {:>10.1} {:>12.3} {:>12.3} {:>10} {:>8}",
                bytes,
                bytes / 4,
                format!("{coll:?}"),
                secs * 1e6,
                algbw,
                algbw * coll.bus_factor(n),
                reference.map_or("-".into(), |g| format!("{:.1}", g * 1e6)),
                reference.map_or("-".into(), |g| format!("{:.2}x", g / secs)),
            );
        }
    }
    // Host cost of issuing one small all-reduce (NCCL: enqueue and return, the stream does the
    // rest), and what a Work handle adds to the blocking call (issue, then wait); the two forms
    // alternate in one loop, so both see the same conditions.
    let (issue, work) = issue_times(&groups, iters.max(500))?;
    println!(
        "all-reduce of 8 B: the blocking call returns in {:.2} us (median); issued as Work and waited, {:.2} us (Work adds {:+.2} us)",
        issue * 1e6,
        work * 1e6,
        (work - issue) * 1e6
    );
    Ok(())
}

/// Median seconds (slowest rank) for a blocking 8-byte all-reduce to return, and for
/// `all_reduce_async` plus its `wait`, alternating, with no barrier between iterations.
fn issue_times(groups: &[DeviceGroup], iters: usize) -> Result<(f64, f64)> {
    let times: Vec<Result<Vec<f64>>> = std::thread::scope(|s| {
        let hs: Vec<_> = groups
            .iter()
            .map(|g| {
                s.spawn(move || -> Result<Vec<f64>> {
                    let x = g.to_local(&Tensor::rand(&[2], DType::F32, 1, &Device::Cpu)?)?;
                    g.barrier()?;
                    let mut out = Vec::with_capacity(2 * iters);
                    for i in 0..2 * iters {
                        let t = Instant::now();
                        let y = if i % 2 == 1 {
                            g.all_reduce_async(&x, ReduceOp::Sum)?.wait()?
                        } else {
                            g.all_reduce(&x, ReduceOp::Sum)?
                        };
                        out.push(t.elapsed().as_secs_f64());
                        std::hint::black_box(y);
                    }
                    g.barrier()?;
                    Ok(out)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a rank panicked")))).collect()
    });
    let per_rank = times.into_iter().collect::<Result<Vec<_>>>()?;
    let median = |parity: usize| {
        let mut v: Vec<f64> = (0..2 * iters)
            .filter(|i| i % 2 == parity)
            .map(|i| per_rank.iter().map(|t| t[i]).fold(0.0, f64::max))
            .collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Ok((median(0), median(1)))
}

/// One gloo rank: after `init_process_group`, for each size, `iters` timed all-reduces of f32
/// (2 warm-ups, a barrier before each), printed as one line of seconds per size.
const GLOO_SCRIPT: &str = r#"
import os, sys, time
import torch, torch.distributed as dist
rank, world, iters = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=rank, world_size=world)
if rank == 0:
    print(f"gloo (torch {torch.__version__})", flush=True)
for nbytes in map(int, sys.argv[4:]):
    x = torch.rand(max(nbytes // 4, 1))
    ts = []
    for i in range(iters + 2):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(x)
        if i >= 2:
            ts.append(time.perf_counter() - t)
    print(",".join(map(str, ts)), flush=True)
dist.destroy_process_group()
"#;

/// gloo's median all-reduce time per size (slowest rank per iteration), with a version line,
/// or why it could not run.
fn gloo_all_reduce(world: usize, sizes: &[usize], iters: usize) -> Result<(String, Vec<f64>), String> {
    let port =
        std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map_err(|e| e.to_string())?.port();
    let children = (0..world)
        .map(|rank| {
            std::process::Command::new("python3")
                .arg("-c")
                .arg(GLOO_SCRIPT)
                .args([rank.to_string(), world.to_string(), iters.to_string()])
                .args(sizes.iter().map(|b| b.to_string()))
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .map_err(|e| format!("cannot run python3 ({e})"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut outputs = Vec::new();
    for child in children {
        let out = child.wait_with_output().map_err(|e| e.to_string())?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            return Err(format!(
                "{} (pip install torch for the gloo reference)",
                err.lines().last().unwrap_or("python3 failed")
            ));
        }
        outputs.push(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    let version = outputs[0].lines().next().unwrap_or("gloo").to_string();
    let per_rank: Vec<Vec<Vec<f64>>> = outputs
        .iter()
        .enumerate()
        .map(|(r, o)| {
            o.lines()
                .skip(usize::from(r == 0))
                .map(|l| l.split(',').filter_map(|v| v.trim().parse().ok()).collect())
                .collect()
        })
        .collect();
    let mut medians = Vec::with_capacity(sizes.len());
    for i in 0..sizes.len() {
        let mut slowest: Vec<f64> = (0..iters)
            .map(|j| {
                per_rank
                    .iter()
                    .map(|r| r.get(i).and_then(|t| t.get(j)).copied().unwrap_or(f64::NAN))
                    .fold(0.0, f64::max)
            })
            .collect();
        if slowest.iter().any(|t| !t.is_finite()) {
            return Err("gloo printed too few figures".into());
        }
        slowest.sort_by(f64::total_cmp);
        medians.push(slowest[slowest.len() / 2]);
    }
    Ok((version, medians))
}

/// Median seconds of one collective over `iters` runs (after 2 warm-ups), slowest rank.
/// `bytes` is the size nccl-tests reports: the full buffer for all-reduce and broadcast, the
/// gathered output for all-gather, the input for reduce-scatter.
fn time(groups: &[DeviceGroup], coll: Coll, bytes: usize, iters: usize) -> Result<f64> {
    let times: Vec<Result<Vec<f64>>> = std::thread::scope(|s| {
        let hs: Vec<_> = groups.iter().map(|g| s.spawn(move || rank_times(g, coll, bytes, iters))).collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a rank panicked")))).collect()
    });
    let per_rank_times = times.into_iter().collect::<Result<Vec<_>>>()?;
    let mut slowest: Vec<f64> = (0..iters).map(|i| per_rank_times.iter().map(|t| t[i]).fold(0.0, f64::max)).collect();
    slowest.sort_by(f64::total_cmp);
    Ok(slowest[slowest.len() / 2])
}

/// This rank's seconds for each of `iters` runs of `coll` (after 2 warm-ups, a barrier before
/// each run).
fn rank_times(g: &DeviceGroup, coll: Coll, bytes: usize, iters: usize) -> Result<Vec<f64>> {
    let n = g.world_size();
    let count = (bytes / 4).max(1);
    let per_rank = (count / n).max(1);
    let len = if coll == Coll::AllGather { per_rank } else { count };
    let mut x = g.to_local(&Tensor::rand(&[len], DType::F32, g.rank() as u64, &Device::Cpu)?)?;
    let mut out = Vec::with_capacity(iters);
    for i in 0..iters + 2 {
        g.barrier()?;
        let t = Instant::now();
        let y = match coll {
            Coll::AllReduce => g.all_reduce(&x, ReduceOp::Sum)?,
            Coll::AllReduceInto => {
                g.all_reduce_into(&mut x, ReduceOp::Sum)?;
                x.clone()
            }
            Coll::AllGather => g.all_gather(&x, 0)?,
            Coll::ReduceScatter => g.reduce_scatter(&x, 0, ReduceOp::Sum)?,
            Coll::Broadcast => g.broadcast(&x, 0)?,
        };
        std::hint::black_box(&y);
        // GPU collectives return once enqueued: time them to completion.
        if let Device::Cuda(o) = g.device() {
            tp_kernels::Gpu::get(o)?.synchronize()?;
        }
        if i >= 2 {
            out.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(out)
}

/// One process of `mpirun -np N tp-comm-bench --backend mpi`: the all-reduce times of every
/// size (slowest rank per run, median), printed by rank 0 as `mpi-allreduce BYTES SECONDS`.
fn mpi_rank(sizes: &[usize], iters: usize) -> Result<()> {
    let world = tp_comm::mpi::MpiComm::world(Duration::from_secs(300))?;
    let g = DeviceGroup::new(std::sync::Arc::new(world), Device::Cpu);
    if g.rank() == 0 {
        println!("mpi-library {}", tp_comm::mpi::Mpi::get()?.version());
    }
    for &bytes in sizes {
        for (coll, label) in [(Coll::AllReduceInto, "mpi-allreduce-into"), (Coll::AllReduce, "mpi-allreduce")] {
            let mine = rank_times(&g, coll, bytes, iters)?;
            let t = Tensor::from_vec(mine.iter().map(|&x| x as f32).collect::<Vec<f32>>(), &[iters], &Device::Cpu)?;
            let mut slowest = g.all_reduce(&t, ReduceOp::Max)?.to_vec::<f32>()?;
            slowest.sort_by(f32::total_cmp);
            if g.rank() == 0 {
                println!("{label} {bytes} {}", slowest[slowest.len() / 2]);
            }
        }
    }
    g.barrier()?;
    drop(g);
    tp_comm::mpi::finalize()?;
    Ok(())
}

/// `tp-comm-bench --mpi-world N`: runs this program as `N` processes under mpirun (the MPI
/// backend), then gloo's all-reduce over `N` processes (torch.distributed, the same sizes and
/// method), one after the other so that neither runs beside the other; prints both and the
/// ratio, and writes them as JSON to `--out FILE` if given.
fn mpi_versus_gloo(world: usize, sizes: &[usize], iters: usize, out: Option<&str>) -> Result<()> {
    let exe = std::env::current_exe()?;
    let run = std::process::Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", &world.to_string()])
        .arg(&exe)
        .args(["--backend", "mpi", "--iters", &iters.to_string(), "--sizes"])
        .arg(sizes.iter().map(|b| b.to_string()).collect::<Vec<_>>().join(","))
        .output()
        .context("cannot run mpirun (apt-get install openmpi-bin)")?;
    let text = String::from_utf8_lossy(&run.stdout);
    if !run.status.success() {
        bail!("mpirun failed: {}{}", text, String::from_utf8_lossy(&run.stderr));
    }
    let library = text.lines().find_map(|l| l.strip_prefix("mpi-library ")).unwrap_or("?").to_string();
    let figures = |label: &str| -> Vec<f64> {
        text.lines()
            .filter_map(|l| l.strip_prefix(label))
            .filter_map(|l| l.split_whitespace().nth(1)?.parse().ok())
            .collect()
    };
    let (ours, fresh) = (figures("mpi-allreduce-into "), figures("mpi-allreduce "));
    if ours.len() != sizes.len() || fresh.len() != sizes.len() {
        bail!("mpirun printed {} and {} of {} sizes:\n{text}", ours.len(), fresh.len(), sizes.len());
    }
    let (version, gloo) = gloo_all_reduce(world, sizes, iters).map_err(|e| anyhow::anyhow!(e))?;
    println!("all-reduce of f32 over {world} processes: tp --backend mpi ({library}) beside {version}");
    println!("in place (all_reduce_into, as torch.distributed.all_reduce) and into a new tensor (all_reduce)");
    println!(
        "{:>12} {:>14} {:>12} {:>8} {:>14} {:>8}",
        "size (B)", "in place (us)", "gloo (us)", "speedup", "new (us)", "speedup"
    );
    let mut rows = Vec::new();
    for (((&bytes, &t), &f), &g) in sizes.iter().zip(&ours).zip(&fresh).zip(&gloo) {
        println!("{:>12} {:>14.1} {:>12.1} {:>7.2}x {:>14.1} {:>7.2}x", bytes, t * 1e6, g * 1e6, g / t, f * 1e6, g / f);
        rows.push(format!(
            "{{\"bytes\": {bytes}, \"tp_mpi_in_place_us\": {:.2}, \"tp_mpi_new_tensor_us\": {:.2}, \"gloo_us\": {:.2}, \"speedup_in_place\": {:.3}, \"speedup_new_tensor\": {:.3}}}",
            t * 1e6,
            f * 1e6,
            g * 1e6,
            g / t,
            g / f
        ));
    }
    if let Some(path) = out {
        let json = format!(
            "{{\"collective\": \"all_reduce f32\", \"processes\": {world}, \"iters\": {iters}, \"mpi\": {:?}, \"reference\": {:?}, \"rows\": [\n  {}\n]}}\n",
            library,
            version,
            rows.join(",\n  ")
        );
        std::fs::write(path, json).with_context(|| format!("writing {path}"))?;
    }
    Ok(())
}
