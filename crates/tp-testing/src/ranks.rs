//! Ranks of a tensor-parallel job on one machine, for the examples and the tests: as named
//! threads of this process over a `LocalGroup`, or as copies of this program forming an NCCL
//! job (the environment torchrun would set).

use std::time::Duration;
use tp_comm::{CommError, DeviceGroup};
use tp_core::Device;

/// The collective deadline: `TP_TIMEOUT_SECS` (whole seconds, clamped to 1 s..7 days), else
/// [`tp_comm::DEFAULT_TIMEOUT_SECS`].
pub fn timeout() -> Duration {
    let secs = std::env::var("TP_TIMEOUT_SECS").ok().and_then(|v| v.parse::<u64>().ok());
    Duration::from_secs(secs.unwrap_or(tp_comm::DEFAULT_TIMEOUT_SECS).clamp(1, 7 * 24 * 3600))
}

/// The device of `rank`: the host, or (`cuda`) the GPUs round-robin. Errors name `--device
/// cuda` (no GPU, or no driver).
pub fn device_for(cuda: bool, rank: usize) -> Result<Device, String> {
    if !cuda {
        return Ok(Device::Cpu);
    }
    match tp_kernels::device_count() {
        Ok(n) if n > 0 => Ok(Device::Cuda(rank % n)),
        Ok(_) => Err("--device cuda: no CUDA device found".into()),
        Err(e) => Err(format!("--device cuda: {e}")),
    }
}

/// Why a rank's thread returned no result.
#[derive(Debug)]
pub enum RankFailure<E> {
    /// The rank's own function failed.
    Failed(E),
    /// The rank's thread panicked.
    Panicked,
    /// The rank's thread could not be started (the group was aborted for the others).
    NotStarted(std::io::Error),
}

/// Runs `f` on every rank of `groups`, each on a thread named `{name}-{rank}`, and returns the
/// results in rank order. A rank whose `f` fails, or whose thread cannot start, aborts the
/// group (`"this rank failed"`, `"a rank's thread could not be started"`), so the others stop
/// waiting for it at once rather than at their deadline. No thread is started after one could
/// not be (the process is out of threads or memory, and trying on could abort it): the results
/// then end with that rank's [`RankFailure::NotStarted`].
pub fn run_threads<R: Send, E: Send>(
    groups: Vec<DeviceGroup>,
    name: &str,
    f: impl Fn(&DeviceGroup) -> Result<R, E> + Sync,
) -> Vec<Result<R, RankFailure<E>>> {
    let f = &f;
    // Each thread says it has started before the next is spawned: the runtime sets a new
    // thread up (its signal stack) after `spawn` returns, and a later spawn taking the last of
    // the address space meanwhile would abort the process there instead of failing cleanly.
    let (started, has_started) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        let mut handles = Vec::with_capacity(groups.len());
        let mut not_started = None;
        for g in groups {
            let spare = g.clone(); // to stop the others if this rank's thread cannot start
            let started = started.clone();
            let spawned = std::thread::Builder::new().name(format!("{name}-{}", g.rank())).spawn_scoped(s, move || {
                let _ = started.send(());
                let out = f(&g);
                if out.is_err() {
                    g.abort("this rank failed"); // the others stop waiting for it
                }
                out
            });
            match spawned {
                Ok(h) => {
                    handles.push(h);
                    // (Bounded: a thread that never reports only slows the start.)
                    let _ = has_started.recv_timeout(std::time::Duration::from_secs(10));
                }
                Err(e) => {
                    spare.abort("a rank's thread could not be started");
                    not_started = Some(e);
                    break;
                }
            }
        }
        let mut results: Vec<_> = handles
            .into_iter()
            .map(|h| match h.join() {
                Ok(out) => out.map_err(RankFailure::Failed),
                Err(_) => Err(RankFailure::Panicked),
            })
            .collect();
        results.extend(not_started.map(|e| Err(RankFailure::NotStarted(e))));
        results
    })
}

/// The failure worth reporting among `results`: the first rank's own, not another rank's
/// report (`is_echo`) that the group was aborted because of it; `None` if every rank succeeded.
pub fn root_cause<R, E>(
    results: &[Result<R, RankFailure<E>>],
    is_echo: impl Fn(&E) -> bool,
) -> Option<(usize, &RankFailure<E>)> {
    let failures: Vec<(usize, &RankFailure<E>)> =
        results.iter().enumerate().filter_map(|(r, res)| res.as_ref().err().map(|e| (r, e))).collect();
    let own = |f: &RankFailure<E>| !matches!(f, RankFailure::Failed(e) if is_echo(e));
    failures.iter().find(|(_, f)| own(f)).or(failures.first()).copied()
}

/// Whether `e` is a rank's report that another rank aborted the group.
pub fn is_poisoned(e: &CommError) -> bool {
    matches!(e, CommError::Poisoned { .. })
}

/// Starts `world_size` copies of this program with `args` as an NCCL job on this machine
/// (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR=127.0.0.1`, a free `MASTER_PORT`) and
/// waits for them. If one cannot be started, those already started are killed; once one
/// fails, the others (which would only wait for it until their deadlines) are stopped.
pub fn spawn_ranks(world_size: usize, args: &[String]) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    let port = tp_comm::free_local_port().ok_or("no free loopback port")?;
    let mut children = Vec::new();
    for r in 0..world_size {
        let child = std::process::Command::new(&exe)
            .args(args)
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", world_size.to_string())
            .env("LOCAL_RANK", r.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .spawn();
        match child {
            Ok(c) => children.push(c),
            Err(e) => {
                // The ranks already started would wait for this one until their deadline.
                for mut c in children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(format!("cannot start rank {r}: {e}"));
            }
        }
    }
    // Wait for all; once one fails, the others would only wait for it until their deadline:
    // stop them, and reap every child either way.
    let mut status: Vec<Option<bool>> = vec![None; children.len()];
    while status.iter().any(Option::is_none) {
        for (r, c) in children.iter_mut().enumerate() {
            if status[r].is_none() {
                match c.try_wait() {
                    Ok(Some(s)) => status[r] = Some(s.success()),
                    Ok(None) => {}
                    Err(_) => status[r] = Some(false),
                }
            }
        }
        if status.contains(&Some(false)) {
            for (r, c) in children.iter_mut().enumerate() {
                if status[r].is_none() {
                    let _ = c.kill();
                    let _ = c.wait();
                    status[r] = Some(true); // stopped, not failed by itself
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let failed: Vec<usize> = status.iter().enumerate().filter_map(|(r, s)| (*s == Some(false)).then_some(r)).collect();
    if failed.is_empty() { Ok(()) } else { Err(format!("rank(s) {failed:?} failed")) }
}

/// Runs `f` on every rank of a `LocalGroup` of `world` ranks on `device` (120 s deadlines),
/// results in rank order; panics if a rank panics (tests only).
pub fn on_ranks<R: Send>(world: usize, device: Device, f: impl Fn(DeviceGroup) -> R + Sync) -> Vec<R> {
    let groups = DeviceGroup::local(world, Duration::from_secs(120), |_| device).expect("a local group");
    std::thread::scope(|s| {
        let hs: Vec<_> = groups.into_iter().map(|g| s.spawn(|| f(g))).collect();
        hs.into_iter().map(|h| h.join().expect("rank panicked")).collect()
    })
}
