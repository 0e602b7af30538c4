//! `tp train` and `tp serve` as processes of an MPI job (`--backend mpi`), under `mpirun` and
//! `srun` (a one-node SLURM; `.ci/slurm.sh` brings both up): the same log and the same saved
//! weights as one process with threads, bit for bit; bad launches refused in one line.

mod common;

use common::train::{fixture, log_lines, scratch};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use tp_testing::launch::{Finished, Launcher, run_bounded};

fn tp() -> &'static str {
    env!("CARGO_BIN_EXE_tp")
}

/// The pipeline test's flags: 3 steps of 4 micro-batches of one row.
fn train_args(data: &Path, layout: &[&str], out: &Path, name: &str) -> Vec<String> {
    let mut v: Vec<String> = ["--steps", "3", "--micro-batch-size", "1", "--lr", "1e-3", "--seq-len", "16"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    v.extend(["--data".into(), data.display().to_string()]);
    v.extend(["--log-json".into(), out.join(format!("{name}.jsonl")).display().to_string()]);
    v.extend(["--save".into(), out.join(name).display().to_string()]);
    v.extend(layout.iter().map(|s| s.to_string()));
    v
}

/// `tp train MODEL ARGS` as `n` processes under `launcher` with `--backend mpi`.
fn train_mpi(launcher: Launcher, n: usize, model: &Path, args: &[String]) -> Finished {
    let mut cmd = launcher.command(n, tp());
    cmd.arg("train").arg(model).args(args).args(["--backend", "mpi"]);
    bounded(cmd)
}

fn bounded(cmd: Command) -> Finished {
    let f = run_bounded(cmd, Duration::from_secs(240));
    assert!(!f.killed, "ran past its limit:\n{}", f.output);
    f
}

fn train_threads(model: &Path, args: &[String]) {
    let out = Command::new(tp()).arg("train").arg(model).args(args).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// Loss, gradient norm, learning rate and tokens of every step, exactly.
fn same_log(a: &Path, b: &Path, what: &str) {
    let (a, b) = (log_lines(a), log_lines(b));
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().zip(&b) {
        for k in ["step", "loss", "grad_norm", "lr", "tokens"] {
            assert_eq!(x[k], y[k], "{what}: {k} of step {}", x["step"]);
        }
    }
}

fn same_weights(a: &Path, b: &Path, what: &str) {
    let (x, y) =
        (std::fs::read(a.join("model.safetensors")).unwrap(), std::fs::read(b.join("model.safetensors")).unwrap());
    assert!(x == y, "{what}: the saved weights differ");
}

#[test]
fn every_layout_across_processes_matches_one_process_with_threads() {
    let case = fixture("llama");
    let data = case.join("data.jsonl");
    let dir = scratch("mpi-layouts");
    let layouts: [(&str, Vec<&str>); 5] = [
        ("tp2-pp2", vec!["-tp", "2", "-pp", "2", "--grad-accum", "4"]),
        ("dp2-tp2", vec!["-dp", "2", "-tp", "2", "--grad-accum", "2"]),
        ("dp2-pp2", vec!["-dp", "2", "-pp", "2", "--grad-accum", "2", "--pp-schedule", "zb-h1"]),
        // The distributed optimizer, against threads without it: the same bits.
        ("dp2-pp2-zero1", vec!["-dp", "2", "-pp", "2", "--grad-accum", "2", "--zero", "1"]),
        ("dp4-bf16-zero1", vec!["-dp", "4", "--grad-accum", "1", "--dtype", "bf16", "--zero", "1"]),
    ];
    for (name, layout) in &layouts {
        let threads = format!("{name}-threads");
        let unsharded: Vec<&str> = match layout.iter().position(|&f| f == "--zero") {
            Some(i) => [&layout[..i], &layout[i + 2..]].concat(),
            None => layout.clone(),
        };
        train_threads(&case, &train_args(&data, &unsharded, &dir, &threads));
        for launcher in Launcher::ALL {
            let run = format!("{name}-{launcher:?}");
            let out = train_mpi(launcher, 4, &case, &train_args(&data, layout, &dir, &run));
            assert!(out.success, "{run}:\n{}", out.output);
            same_log(&dir.join(format!("{threads}.jsonl")), &dir.join(format!("{run}.jsonl")), &run);
            same_weights(&dir.join(&threads), &dir.join(&run), &run);
            // Only rank 0 reports.
            assert_eq!(out.output.matches("step 3/3").count(), 1, "{run}:\n{}", out.output);
        }
    }
}

#[test]
fn checkpoints_and_traces_cross_processes_and_layouts() {
    let case = fixture("llama");
    let data = case.join("data.jsonl");
    let dir = scratch("mpi-resume");
    // Saved every step by 4 processes at dp2 x pp2 with the distributed optimizer (its state
    // gathered whole into the checkpoint); resumed from step 2 by 2 processes at tp 2 without
    // it, and at dp 2 with it.
    let mut first = train_args(&data, &["-dp", "2", "-pp", "2", "--grad-accum", "2", "--zero", "1"], &dir, "first");
    first.extend(["--save-every".into(), "1".into()]);
    let trace = dir.join("trace.json");
    first.extend(["--trace".into(), trace.display().to_string()]);
    let out = train_mpi(Launcher::Mpirun, 4, &case, &first);
    assert!(out.success, "{}", out.output);
    let resumed_at: PathBuf = dir.join("first/step-2");
    let a = log_lines(&dir.join("first.jsonl"));
    for (name, launcher, layout) in [
        ("tp2", Launcher::Srun, vec!["-tp", "2", "--grad-accum", "4"]),
        ("dp2-zero1", Launcher::Mpirun, vec!["-dp", "2", "--grad-accum", "2", "--zero", "1"]),
    ] {
        let mut second = train_args(&data, &layout, &dir, name);
        second.extend(["--resume".into(), resumed_at.display().to_string()]);
        let out = train_mpi(launcher, 2, &case, &second);
        assert!(out.success, "{name}: {}", out.output);
        let b = log_lines(&dir.join(format!("{name}.jsonl")));
        assert_eq!(b.len(), 1, "{name}: the resumed run does step 3 only");
        let (x, y) = (a[2]["loss"].as_f64().unwrap(), b[0]["loss"].as_f64().unwrap());
        assert!((x - y).abs() <= 1e-6 * x.abs(), "{name}: step 3 loss {x} uninterrupted vs {y} resumed");
        let (x, y) = (a[2]["grad_norm"].as_f64().unwrap(), b[0]["grad_norm"].as_f64().unwrap());
        assert!((x - y).abs() <= 1e-5 * x.abs(), "{name}: step 3 grad_norm {x} uninterrupted vs {y} resumed");
    }
    // Replica 0 held about half the optimizer state.
    let solo = log_lines(&dir.join("tp2.jsonl"))[0]["optimizer_bytes"].as_f64().unwrap();
    let shared = a[2]["optimizer_bytes"].as_f64().unwrap();
    assert!(shared > 0.0 && shared < 0.75 * solo, "optimizer bytes {shared} (dp 2, pp 2, ZeRO-1) vs {solo} (tp 2)");
    // The trace has every process's forwards (one track per rank).
    let t: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = t["traceEvents"].as_array().unwrap();
    for pid in 0..4 {
        let n = events.iter().filter(|e| e["ph"] == "X" && e["pid"] == pid && e["name"] == "forward").count();
        assert_eq!(n, 3 * 2, "rank {pid}: forwards in the trace");
    }
}

#[test]
fn bad_launches_are_refused_in_one_line_and_nothing_hangs() {
    let case = fixture("llama");
    let data = case.join("data.jsonl");
    let dir = scratch("mpi-bad");
    // Three processes for a mesh of four.
    let out = train_mpi(Launcher::Mpirun, 3, &case, &train_args(&data, &["-tp", "2", "-pp", "2"], &dir, "a"));
    assert!(!out.success && out.output.contains("3 processes") && out.output.contains("-np 4"), "{}", out.output);
    // Each process of an MPI job running every rank as threads.
    let mut cmd = Launcher::Mpirun.command(2, tp());
    cmd.arg("train").arg(&case).args(train_args(&data, &["-tp", "2"], &dir, "b"));
    let out = bounded(cmd);
    assert!(!out.success && out.output.contains("pass --backend mpi"), "{}", out.output);
    assert!(
        out.output.contains("rank 1 of 2 launched by mpirun") || out.output.contains("rank 0 of 2"),
        "{}",
        out.output
    );
    assert!(!dir.join("b").exists(), "nothing saved");
    // No MPI library: one line, no hang (a single process; no launcher needed to see it).
    let out = Command::new(tp())
        .arg("train")
        .arg(&case)
        .args(train_args(&data, &[], &dir, "c"))
        .args(["--backend", "mpi"])
        .env("TP_MPI_LIB", "/nonexistent/libmpi.so.40")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("MPI unavailable") && err.contains("openmpi-bin"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

#[test]
fn a_rank_killed_mid_run_ends_the_job_and_leaves_the_last_checkpoint_whole() {
    let case = fixture("llama");
    let data = case.join("data.jsonl");
    for launcher in Launcher::ALL {
        let dir = scratch("mpi-killed");
        let mut args = train_args(&data, &["-tp", "2", "-pp", "2", "--grad-accum", "4"], &dir, "run");
        args.extend(["--save-every".into(), "1".into()]);
        // Rank 1 dies after step 2, while rank 0 gathers step 2's checkpoint; the others wait
        // on it with a 60 s deadline, which the launcher's end of the job comes well before.
        let mut cmd = launcher.command(4, tp());
        cmd.arg("train").arg(&case).args(&args).args(["--backend", "mpi"]);
        cmd.env("TP_DEBUG_FAULT", "1:2").env("TP_TIMEOUT_SECS", "60");
        let out = bounded(cmd);
        assert!(!out.success, "{launcher:?}:\n{}", out.output);
        assert!(out.elapsed < Duration::from_secs(30), "{launcher:?}: {:?}\n{}", out.elapsed, out.output);
        assert!(out.output.contains("rank 1 ends itself"), "{launcher:?}:\n{}", out.output);
        // Step 1's checkpoint is whole; step 2's and the final one were never moved into place.
        let step1 = dir.join("run/step-1");
        for f in ["model.safetensors", "config.json"] {
            assert!(step1.join(f).is_file(), "{launcher:?}: {f} of step 1");
        }
        assert!(!dir.join("run/step-2").exists() && !dir.join("run/model.safetensors").exists(), "{launcher:?}");
        let bytes = std::fs::read(step1.join("model.safetensors")).unwrap();
        safetensors::SafeTensors::deserialize(&bytes).unwrap();
    }
}

/// `tp serve` of `dir` as `n` processes (`--backend mpi` and the layout flags `extra`) under
/// `launcher`, in a process
/// group of its own so that the whole job is ended with the test.
struct MpiServer(common::Server);

impl MpiServer {
    fn start(launcher: Launcher, n: usize, dir: &Path, extra: &[&str]) -> MpiServer {
        use std::os::unix::process::CommandExt;
        let mut cmd = launcher.command(n, tp());
        cmd.arg("serve").arg(dir).args(["--port", "0", "--backend", "mpi"]).args(extra);
        cmd.process_group(0);
        MpiServer(common::Server::spawn(dir, cmd))
    }
}

impl Drop for MpiServer {
    fn drop(&mut self) {
        let pgid = i32::try_from(self.0.child.id()).expect("pid");
        // SAFETY: kill(2) of the process group this test started (its launcher and ranks).
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
    }
}

#[test]
fn serving_across_two_and_three_processes_answers_as_one_process() {
    let greedy = json!({"prompt": "hello world", "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    let sampled =
        json!({"prompt": "hello", "max_tokens": 12, "temperature": 0.8, "top_p": 0.9, "seed": 7, "ignore_eos": true});
    let answers = |s: &common::Server| {
        let (st, a) = s.post("/v1/completions", &greedy);
        assert_eq!(st, 200, "{a}");
        let (st, b) = s.post("/v1/completions", &sampled);
        assert_eq!(st, 200, "{b}");
        (a["choices"][0]["text"].clone(), b["choices"][0]["text"].clone())
    };
    let want = answers(&common::Server::start_in(&common::model_dir(), &[], &[]));
    for (launcher, n, extra) in [
        (Launcher::Mpirun, 2, vec!["-tp", "2"]),
        (Launcher::Mpirun, 3, vec!["-tp", "3"]),
        (Launcher::Srun, 3, vec!["-tp", "3"]),
        // Pipeline stages over processes: 2 stages of 2 ranks, and 3 stages of one.
        (Launcher::Mpirun, 4, vec!["-tp", "2", "-pp", "2"]),
        (Launcher::Srun, 3, vec!["-pp", "3"]),
    ] {
        let mut s = MpiServer::start(launcher, n, &common::model_dir(), &extra);
        assert_eq!(answers(&s.0), want, "{launcher:?} with {n} processes ({extra:?})");
        // Only rank 0 listens. SIGTERM to it stops the engine, which stops the followers (they
        // ignore the signal themselves), and the whole job exits 0.
        let rank0 = rank_zero_pid(&s.0.dir).expect("rank 0's process");
        // SAFETY: kill(2) of a process of the job this test started.
        assert_eq!(unsafe { libc::kill(rank0, libc::SIGTERM) }, 0);
        assert_eq!(s.0.wait_exit(Duration::from_secs(30)), Some(0), "{launcher:?} -n {n} ({extra:?}): the job's exit");
    }
}

/// The pid of rank 0 of the `tp serve` job over `dir` (the process whose command line names
/// `dir` and whose environment holds OMPI_COMM_WORLD_RANK=0 or SLURM_PROCID=0: the launchers
/// start their processes outside the test's process tree and group).
fn rank_zero_pid(dir: &Path) -> Option<i32> {
    let dir = dir.as_os_str().as_encoded_bytes();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        for entry in std::fs::read_dir("/proc").ok()?.flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
            if !(args.iter().any(|a| *a == b"serve") && args.contains(&dir)) {
                continue;
            }
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            if env.split(|&b| b == 0).any(|v| v == b"OMPI_COMM_WORLD_RANK=0" || v == b"SLURM_PROCID=0") {
                return Some(pid);
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

#[test]
fn a_serving_rank_that_dies_ends_the_job_within_the_deadline() {
    // Rank 1 dies at its third step; rank 0 answers with an error and every process exits.
    let env_dir = common::model_dir();
    let mut cmd = Launcher::Mpirun.command(3, tp());
    cmd.arg("serve").arg(&env_dir).args(["--port", "0", "--backend", "mpi", "-tp", "3"]);
    cmd.env("TP_DEBUG_FAULT", "1:3").env("TP_TIMEOUT_SECS", "20");
    use std::os::unix::process::CommandExt;
    cmd.process_group(0);
    let mut s = MpiServer(common::Server::spawn(&env_dir, cmd));
    let (st, _) = s.0.call(
        "POST",
        "/v1/completions",
        Some(&json!({"prompt": "hello", "max_tokens": 40, "temperature": 0, "ignore_eos": true})),
        &[],
    );
    assert_ne!(st, 200, "a request through a dead rank cannot succeed");
    let code = s.0.wait_exit(Duration::from_secs(40));
    assert!(matches!(code, Some(c) if c != 0), "the job must end, failing: {code:?}");
}

#[test]
fn serving_refuses_a_gpu_and_a_job_of_the_wrong_size_in_one_line() {
    let dir = common::model_dir();
    let mut cmd = Launcher::Mpirun.command(2, tp());
    cmd.arg("serve").arg(&dir).args(["--port", "0", "--backend", "mpi", "-tp", "3"]);
    let out = bounded(cmd);
    assert!(
        !out.success && out.output.contains("2 processes") && out.output.contains("--tensor-parallel-size 3"),
        "{}",
        out.output
    );
    let mut cmd = Launcher::Mpirun.command(2, tp());
    cmd.arg("serve").arg(&dir).args(["--port", "0", "--backend", "mpi", "-tp", "2", "--device", "cuda"]);
    let out = bounded(cmd);
    assert!(!out.success && out.output.contains("--device cpu"), "{}", out.output);
    // Each process of an MPI job serving every rank as threads: refused.
    let mut cmd = Launcher::Mpirun.command(2, tp());
    cmd.arg("serve").arg(&dir).args(["--port", "0", "-tp", "2"]);
    let out = bounded(cmd);
    assert!(!out.success && out.output.contains("pass --backend mpi"), "{}", out.output);
}

/// `srun tp serve --backend nccl`: every task knows its rank from SLURM's variables, so task 0
/// leads and the others follow; none starts ranks of its own (as a `tp serve` run by hand does).
/// Without a GPU each of the two tasks fails once, quickly, with the reason.
#[test]
fn srun_tasks_of_an_nccl_server_lead_and_follow_by_their_slurm_rank() {
    let dir = common::model_dir();
    let mut cmd = Launcher::Srun.command(2, tp());
    cmd.arg("serve").arg(&dir).args(["--port", "0", "--backend", "nccl", "--device", "cuda", "-tp", "2"]);
    cmd.env("TP_TIMEOUT_SECS", "20");
    let out = bounded(cmd);
    assert!(!out.success, "{}", out.output);
    let failures = out.output.lines().filter(|l| l.starts_with("tp serve:")).count();
    assert_eq!(failures, 2, "one failure per srun task, no self-started ranks:\n{}", out.output);
    assert!(out.elapsed < Duration::from_secs(30), "{:?}", out.elapsed);
}

/// Pipelined serving over two processes (`-pp 2`, a stage each): 16 concurrent requests get,
/// with batch invariance, exactly the texts one process gives them, and the same as the stages
/// taking turns (`TP_PIPELINE_TURNS=1`).
#[test]
fn pipelined_stages_over_processes_answer_as_one_process() {
    let body =
        |i: usize| json!({"prompt": format!("stream {i}"), "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    let texts = |s: &common::Server| -> Vec<serde_json::Value> {
        let addr = s.addr.as_str();
        std::thread::scope(|sc| {
            let hs: Vec<_> = (0..16)
                .map(|i| {
                    sc.spawn(move || {
                        let b = body(i).to_string();
                        let (st, v) = common::http(addr, "POST", "/v1/completions", Some(b.as_bytes()), &[]);
                        assert_eq!(st, 200, "{v}");
                        serde_json::from_str::<serde_json::Value>(&v).unwrap()["choices"][0]["text"].clone()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    let want = texts(&common::Server::start_in(&common::model_dir(), &["--batch-invariant"], &[]));
    let s = MpiServer::start(Launcher::Mpirun, 2, &common::model_dir(), &["-pp", "2", "--batch-invariant"]);
    assert_eq!(texts(&s.0), want, "pipelined");
    drop(s);
    let dir = common::model_dir();
    use std::os::unix::process::CommandExt;
    let mut cmd = Launcher::Mpirun.command(2, tp());
    cmd.arg("serve").arg(&dir).args(["--port", "0", "--backend", "mpi", "-pp", "2", "--batch-invariant"]);
    cmd.env("TP_PIPELINE_TURNS", "1").process_group(0);
    let s = MpiServer(common::Server::spawn(&dir, cmd));
    assert_eq!(texts(&s.0), want, "stages taking turns");
}
