//! The `mlp` example, run as the user runs it (the compiled example binary, which `cargo test`
//! builds), at world sizes 1..=4, against a float64 reference computed here; and its errors.

mod common;
use common::*;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tp_core::{DType, Tensor};
use tp_layers::{Checkpoint, save};

/// target/<profile>/examples/mlp, next to this test's own binary in target/<profile>/deps.
fn example_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(|d| d.parent()).unwrap();
    let bin = profile_dir.join("examples").join("mlp");
    assert!(
        bin.exists(),
        "{} missing: cargo test builds examples; build it with cargo build --examples",
        bin.display()
    );
    bin
}

fn setup(name: &str) -> (PathBuf, MlpRef, usize) {
    let dir = std::env::temp_dir().join(format!("tp-example-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (hidden, inter, tokens) = (24, 43, 7);
    let gate = linear(inter, hidden, false, DType::F32, 1);
    let up = linear(inter, hidden, false, DType::F32, 3);
    let down = linear(hidden, inter, true, DType::F32, 5);
    let p = "model.layers.3.mlp";
    save(
        dir.join("model.safetensors"),
        &[
            (&format!("{p}.gate_proj.weight"), gate.weight().unwrap()),
            (&format!("{p}.up_proj.weight"), up.weight().unwrap()),
            (&format!("{p}.down_proj.weight"), down.weight().unwrap()),
            (&format!("{p}.down_proj.bias"), down.bias().unwrap()),
        ],
    )
    .unwrap();
    let x = Tensor::rand(&[tokens, hidden], DType::F32, 7, &CPU).unwrap();
    save(dir.join("x.safetensors"), &[("x", &x)]).unwrap();
    let r = mlp_f64(&x, &gate, &up, &down);
    (dir, r, tokens * hidden)
}

fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(example_binary()).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).to_string())
}

/// Runs `cmd` (stderr captured), killing it and failing the test if it takes over `limit`;
/// returns (exit code, stderr). A process killed by a signal (an abort) fails the test.
fn run_within(mut cmd: Command, limit: Duration) -> (i32, String) {
    use std::io::Read;
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} blocked past {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let code = status.code().unwrap_or_else(|| panic!("{cmd:?} died of a signal: {status}; {err}"));
    (code, err)
}

/// One clean failure: exit code 1, one line containing `needle`, no panic.
fn fails_cleanly(what: &str, (code, err): (i32, String), needle: &str) {
    assert_eq!(code, 1, "{what}: {err}");
    assert!(err.contains(needle), "{what}: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{what}: one line: {err}");
    assert!(!err.contains("panicked"), "{what}: {err}");
}

fn example(args: &[&str]) -> Command {
    let mut c = Command::new(example_binary());
    c.args(args);
    c
}

#[test]
fn example_matches_the_f64_reference_at_world_sizes_1_to_4() {
    let (dir, r, n) = setup("ok");
    let d = dir.to_string_lossy().to_string();
    for dtype in ["f32", "bf16"] {
        for world in 1..=4 {
            let out = format!("{d}/y-{dtype}-{world}.safetensors");
            let (ok, err) = run(&[
                "--checkpoint",
                &d,
                "--prefix",
                "model.layers.3.mlp",
                "--input",
                &format!("{d}/x.safetensors"),
                "--world-size",
                &world.to_string(),
                "--dtype",
                dtype,
                "--output",
                &out,
            ]);
            assert!(ok, "world {world} {dtype}: {err}");
            let y = Checkpoint::open(&out).unwrap().load("y", None, &CPU).unwrap();
            assert_eq!(y.dims(), &[7, 24]);
            assert_eq!(y.dtype().as_str(), dtype);
            let got = f64s(&y);
            assert_eq!(got.len(), n);
            let u = y.dtype().unit_roundoff();
            let c = if dtype == "f32" { 16.0 } else { 4.0 };
            assert_close(&format!("world {world} {dtype}"), &got, &r.y, |i| {
                c * u * r.scale[i] + 2.0 * u * r.y[i].abs() + 1e-6
            });
        }
    }
}

#[test]
fn example_errors_are_one_line_and_non_zero() {
    let (dir, _, _) = setup("err");
    let d = dir.to_string_lossy().to_string();
    let x = format!("{d}/x.safetensors");
    let base =
        ["--checkpoint", &d, "--prefix", "model.layers.3.mlp", "--input", &x, "--output", "/tmp/unused-y.safetensors"];
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--world-size", "0"], "at least 1"),
        (vec!["--world-size", "two"], "not a number"),
        (vec!["--world-size", "2", "--dtype", "f64"], "unknown dtype"),
        (vec!["--world-size", "2", "--backend", "mpi"], "expected local or nccl"),
        (vec!["--world-size", "2", "--device", "tpu"], "expected cpu or cuda"),
        (vec!["--world-size", "2", "--bogus"], "unknown argument"),
        (vec!["--world-size", "2", "--backend", "nccl"], "needs --device cuda"),
        (vec![], "--world-size is required"),
    ];
    // `--device cuda` fails only where CUDA cannot run; with a GPU it must work.
    let gpu = tp_kernels::NOT_COMPILED.is_none() && tp_kernels::device_count().is_ok_and(|n| n > 0);
    let cuda = ["--world-size", "2", "--device", "cuda"];
    let args: Vec<&str> = base.iter().copied().chain(cuda).collect();
    let (ok, err) = run(&args);
    if gpu {
        assert!(ok, "--device cuda on a GPU machine: {err}");
    } else {
        assert!(!ok && err.contains("--device cuda") && err.trim_end().lines().count() == 1, "{err}");
    }
    for (extra, needle) in cases {
        let args: Vec<&str> = base.iter().copied().chain(extra.iter().copied()).collect();
        let (ok, err) = run(&args);
        assert!(!ok, "{extra:?} should fail");
        assert!(err.contains(needle), "{extra:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // Wrong prefix, missing input file.
    let (ok, err) =
        run(&["--checkpoint", &d, "--prefix", "nope", "--input", &x, "--world-size", "1", "--output", "/tmp/y.st"]);
    assert!(!ok && err.contains("no tensor named"), "{err}");
    let (ok, err) = run(&[
        "--checkpoint",
        &d,
        "--prefix",
        "p",
        "--input",
        "/nonexistent.safetensors",
        "--world-size",
        "1",
        "--output",
        "/tmp/y.st",
    ]);
    assert!(!ok && err.contains("cannot open"), "{err}");
}

#[test]
fn pipes_and_devices_as_inputs_fail_at_once() {
    let (dir, _, _) = setup("special");
    let d = dir.to_string_lossy().to_string();
    let x = format!("{d}/x.safetensors");
    let fifo = dir.join("pipe.safetensors");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let fifo = fifo.to_string_lossy().to_string();
    // An index whose entry is the pipe.
    let empty_dir = format!("{d}/empty");
    std::fs::create_dir_all(&empty_dir).unwrap();
    let index = format!("{d}/pipe.index.json");
    std::fs::write(&index, r#"{"weight_map": {"model.layers.3.mlp.gate_proj.weight": "pipe.safetensors"}}"#).unwrap();
    let cases = [
        ("--input a pipe", fifo.as_str(), d.as_str(), "named pipe (FIFO)"),
        ("--input /dev/zero", "/dev/zero", d.as_str(), "character device"),
        ("--input /dev/null", "/dev/null", d.as_str(), "character device"),
        ("--input a directory", empty_dir.as_str(), d.as_str(), "directory has neither"),
        ("--checkpoint a pipe", x.as_str(), fifo.as_str(), "named pipe (FIFO)"),
        ("--checkpoint /dev/zero", x.as_str(), "/dev/zero", "character device"),
        ("--checkpoint an index naming a pipe", x.as_str(), index.as_str(), "named pipe (FIFO)"),
    ];
    for (what, input, ckpt, needle) in cases {
        let args = ["--checkpoint", ckpt, "--prefix", "model.layers.3.mlp", "--input", input, "--world-size", "2"];
        let out = format!("{d}/y.safetensors");
        let cmd = example(&[&args[..], &["--output", &out]].concat());
        fails_cleanly(what, run_within(cmd, Duration::from_secs(30)), needle);
    }
    // The output, too.
    let args = ["--checkpoint", &d, "--prefix", "model.layers.3.mlp", "--input", &x, "--world-size", "1"];
    let cmd = example(&[&args[..], &["--output", &fifo]].concat());
    fails_cleanly("--output a pipe", run_within(cmd, Duration::from_secs(30)), "named pipe (FIFO)");
}

#[test]
fn zero_byte_tensors_with_huge_dims_are_errors_not_aborts() {
    let dir = std::env::temp_dir().join(format!("tp-example-huge-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let empty = |dims: &[usize]| Tensor::zeros(dims, DType::F32, &CPU).unwrap();
    let p = "m";
    let weights = |inter: usize, hidden: usize, file: &str| {
        let (gu, down) = (empty(&[inter, hidden]), empty(&[hidden, inter]));
        let names = [format!("{p}.gate_proj.weight"), format!("{p}.up_proj.weight"), format!("{p}.down_proj.weight")];
        save(dir.join(file), &[(&names[0], &gu), (&names[1], &gu), (&names[2], &down)]).unwrap();
    };
    // [2^40, 0] weights with a [1, 0] input; [8, 0] weights with a [2^36, 0] input.
    weights(1 << 40, 0, "huge-w.safetensors");
    weights(8, 0, "small-w.safetensors");
    save(dir.join("x1.safetensors"), &[("x", &empty(&[1, 0]))]).unwrap();
    save(dir.join("x-huge.safetensors"), &[("x", &empty(&[1 << 36, 0]))]).unwrap();
    let d = dir.to_string_lossy().to_string();
    for (w, x, world) in
        [("huge-w", "x1", "1"), ("huge-w", "x1", "2"), ("small-w", "x-huge", "1"), ("small-w", "x-huge", "3")]
    {
        let (w, x, y) = (format!("{d}/{w}.safetensors"), format!("{d}/{x}.safetensors"), format!("{d}/y.safetensors"));
        let cmd = example(&["--checkpoint", &w, "--prefix", p, "--input", &x, "--world-size", world, "--output", &y]);
        fails_cleanly(&format!("{w} {x} world {world}"), run_within(cmd, Duration::from_secs(60)), "is too large");
    }
}

#[test]
fn world_sizes_past_the_limit_or_past_what_threads_allow_are_errors() {
    let (dir, _, _) = setup("world");
    let d = dir.to_string_lossy().to_string();
    let x = format!("{d}/x.safetensors");
    let y = format!("{d}/y.safetensors");
    let args = |world: &'static str| {
        vec!["--checkpoint", &d, "--prefix", "model.layers.3.mlp", "--input", &x, "--world-size", world, "--output", &y]
            .into_iter()
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    for world in ["1000000000", "18446744073709551615", "4097"] {
        let cmd = example(&args(world).iter().map(String::as_str).collect::<Vec<_>>());
        fails_cleanly(world, run_within(cmd, Duration::from_secs(30)), "exceeds the maximum of 4096 ranks");
    }
    // 4096 rank threads in 700 MB of address space: some cannot start, which is an error (the
    // started ranks are stopped), not a panic or an abort. (Two malloc arenas: glibc reserves
    // 64 MB of address space per arena, up to 16 here, as threads first allocate, so otherwise
    // the space can run out inside an allocation rather than at a thread's start.)
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg("ulimit -v 700000 && MALLOC_ARENA_MAX=2 exec \"$@\"")
        .arg("sh")
        .arg(example_binary())
        .args(args("4096"));
    fails_cleanly("4096 threads, 700 MB", run_within(cmd, Duration::from_secs(120)), "cannot start the thread of rank");
}

#[test]
fn a_rank_of_an_nccl_job_names_itself_and_each_cause_once() {
    // A one-rank NCCL job whose GPU cannot be had (no CUDA here; LOCAL_RANK 999 anywhere).
    let (dir, _, _) = setup("nccl-rank");
    let d = dir.to_string_lossy().to_string();
    let (x, y) = (format!("{d}/x.safetensors"), format!("{d}/y.safetensors"));
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut cmd = example(&[
        "--checkpoint",
        &d,
        "--prefix",
        "model.layers.3.mlp",
        "--input",
        &x,
        "--world-size",
        "1",
        "--backend",
        "nccl",
        "--device",
        "cuda",
        "--output",
        &y,
    ]);
    cmd.env("RANK", "0").env("WORLD_SIZE", "1").env("LOCAL_RANK", "999").env("MASTER_PORT", port.to_string());
    let (code, err) = run_within(cmd, Duration::from_secs(30));
    fails_cleanly("rank 0 without its GPU", (code, err.clone()), "CUDA unavailable");
    assert!(err.starts_with("mlp: rank 0: from_env: CUDA unavailable: "), "{err}");
    for part in ["mlp:", "rank 0:", "from_env:", "CUDA unavailable"] {
        assert_eq!(err.matches(part).count(), 1, "{part:?} repeated: {err}");
    }
}

#[cfg(unix)]
#[test]
fn a_non_utf8_argument_and_an_unwritable_output_are_plain_errors() {
    use std::os::unix::ffi::OsStrExt;
    let out =
        Command::new(example_binary()).arg("--checkpoint").arg(std::ffi::OsStr::from_bytes(b"\xff")).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("not valid UTF-8") && !err.contains("panicked"), "{err}");
    // An output in a folder that does not exist: an error about writing it, not about a checkpoint.
    let (dir, _, _) = setup("unwritable");
    let d = dir.to_string_lossy().to_string();
    let x = format!("{d}/x.safetensors");
    let y = format!("{d}/no/such/folder/y.safetensors");
    let (ok, err) = run(&[
        "--checkpoint",
        &d,
        "--prefix",
        "model.layers.3.mlp",
        "--input",
        &x,
        "--world-size",
        "1",
        "--output",
        &y,
    ]);
    assert!(!ok, "{err}");
    assert!(err.contains(&format!("cannot write {y}")) && !err.contains("checkpoint"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}
