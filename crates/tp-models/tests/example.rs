//! The `generate` example, run as a user runs it (the compiled example binary, which `cargo
//! test` builds) on models the test writes, at world sizes 1..=4 on the CPU; and its errors,
//! each one line and exit status 1 with nothing written; a full or closed stdout, and SIGTERM /
//! SIGINT during the logits write.

mod common;
use common::*;
use serde_json::json;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};
use tp_core::DType;
use tp_layers::Checkpoint;
use tp_models::{GenerateOptions, ModelOptions, ParallelCausalLm};
use tp_testing::synthetic::SyntheticModel;

/// target/<profile>/examples/generate, next to this test's binary in target/<profile>/deps.
fn binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let bin = exe.parent().and_then(|d| d.parent()).unwrap().join("examples").join("generate");
    assert!(bin.exists(), "{} missing: cargo test builds examples", bin.display());
    bin
}

fn run(args: &[&str]) -> Output {
    Command::new(binary()).args(args).env("TP_TIMEOUT_SECS", "60").output().unwrap()
}

fn model(name: &str, spec: &SyntheticModel) -> PathBuf {
    let dir = tmpdir(name);
    spec.write(&dir).unwrap();
    dir
}

const PROMPT: &str = "1,523,17,999,1000,4";

#[test]
fn example_matches_the_library_and_the_f64_forward_at_every_world_size() {
    let spec = SyntheticModel { tie_word_embeddings: true, ..SyntheticModel::tiny() };
    let dir = model("example", &spec);
    let prompt: Vec<i64> = PROMPT.split(',').map(|s| s.parse().unwrap()).collect();
    let want = on_ranks(1, CPU, |g| {
        let mut lm = ParallelCausalLm::load(&dir, &g, &ModelOptions::new()).unwrap();
        lm.generate(&prompt, 5, &GenerateOptions::new().ignore_eos(true)).unwrap().tokens
    })
    .remove(0);
    let line: Vec<String> = want.iter().map(i64::to_string).collect();
    for world in 1..=4 {
        let out_file = dir.join(format!("logits-{world}.safetensors"));
        let w = world.to_string();
        let o = run(&[
            "--model",
            dir.to_str().unwrap(),
            "--prompt-ids",
            PROMPT,
            "--max-new-tokens",
            "5",
            "--world-size",
            &w,
            "--ignore-eos",
            "--logits-out",
            out_file.to_str().unwrap(),
        ]);
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "world {world}: {}", String::from_utf8_lossy(&o.stderr));
        let lines: Vec<&str> = stdout.lines().collect();
        assert_eq!(lines[0], line.join(","), "world {world}: the ids line");
        assert!(lines.iter().any(|l| l.starts_with("prefill: 6 tokens") && l.ends_with("tokens/s")), "{stdout}");
        assert!(lines.iter().any(|l| l.starts_with("decode: 4 tokens") && l.ends_with("tokens/s")), "{stdout}");
        // The logits file: tokens, every prompt position, every decode step.
        let ckpt = Checkpoint::open(&out_file).unwrap();
        let tokens = ckpt.load("tokens", None, &CPU).unwrap();
        assert_eq!(tokens.dtype(), DType::I64);
        assert_eq!(tokens.to_i64_vec().unwrap(), want);
        let prefill = ckpt.load("prefill_logits", None, &CPU).unwrap();
        let decode = ckpt.load("decode_logits", None, &CPU).unwrap();
        assert_eq!((prefill.dtype(), prefill.dims()), (DType::F32, &[6, 1001][..]));
        assert_eq!((decode.dtype(), decode.dims()), (DType::F32, &[4, 1001][..]));
        assert_close(&format!("world {world} prefill"), &f64s(&prefill), &reference_logits(&dir, &prompt), 2e-5);
        // Decode row i: the step that consumed tokens[i] at position prompt_len + i.
        let seq: Vec<i64> = prompt.iter().chain(&want[..4]).copied().collect();
        let full = reference_logits(&dir, &seq);
        assert_close(&format!("world {world} decode"), &f64s(&decode), &full[6 * 1001..], 2e-5);
    }
}

#[test]
fn example_runs_in_bf16_and_stops_at_eos() {
    let spec = SyntheticModel { eos_token_id: None, ..SyntheticModel::tiny() };
    let dir = model("example-eos", &spec);
    let args = |n: &str, extra: &[&str]| {
        let mut v =
            vec!["--model", dir.to_str().unwrap(), "--prompt-ids", PROMPT, "--max-new-tokens", n, "--world-size", "2"];
        v.extend_from_slice(extra);
        v.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let call = |a: Vec<String>| {
        let r: Vec<&str> = a.iter().map(String::as_str).collect();
        run(&r)
    };
    let free = call(args("6", &[]));
    assert!(free.status.success(), "{}", String::from_utf8_lossy(&free.stderr));
    let ids: Vec<String> =
        String::from_utf8_lossy(&free.stdout).lines().next().unwrap().split(',').map(String::from).collect();
    assert_eq!(ids.len(), 6);
    std::fs::write(
        dir.join("generation_config.json"),
        json!({"eos_token_id": ids[1].parse::<i64>().unwrap()}).to_string(),
    )
    .unwrap();
    let stopped = call(args("6", &[]));
    assert_eq!(String::from_utf8_lossy(&stopped.stdout).lines().next().unwrap(), ids[..2].join(","));
    let ignored = call(args("6", &["--ignore-eos"]));
    assert_eq!(String::from_utf8_lossy(&ignored.stdout).lines().next().unwrap(), ids.join(","));
    let bf16 = call(args("3", &["--dtype", "bf16"]));
    assert!(bf16.status.success(), "{}", String::from_utf8_lossy(&bf16.stderr));
}

/// Runs the example expecting failure: exit status 1, one line on stderr containing `needle`,
/// nothing on stdout, no output file.
fn expect_failure(args: &[&str], needle: &str, out_file: &Path) {
    let o = run(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: one line expected, got {err}");
    assert!(err.contains(needle), "{args:?}: {err:?} should mention {needle:?}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(o.stdout.is_empty(), "{args:?}: stdout {}", String::from_utf8_lossy(&o.stdout));
    assert!(!out_file.exists(), "{args:?}: {} was written", out_file.display());
}

#[test]
fn bad_inputs_are_one_line_errors_and_write_nothing() {
    let dir = model("example-bad", &SyntheticModel::tiny());
    let d = dir.to_str().unwrap();
    let out = dir.join("out.safetensors");
    let o = out.to_str().unwrap();
    let base = |extra: &[&'static str]| -> Vec<String> {
        let mut v: Vec<String> = ["--model", d, "--max-new-tokens", "3", "--world-size", "2", "--logits-out", o]
            .iter()
            .map(|s| s.to_string())
            .collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let check = |args: Vec<String>, needle: &str| {
        let r: Vec<&str> = args.iter().map(String::as_str).collect();
        expect_failure(&r, needle, &out);
    };
    check(base(&["--prompt-ids", "1,1001"]), "1001");
    check(base(&["--prompt-ids", "1,x"]), "\"x\"");
    check(base(&["--prompt-ids", "-4"]), "-4");
    check(base(&["--prompt-ids", "1", "--max-new-tokens", "0"]), "at least 1");
    check(base(&["--prompt-ids", "1", "--max-new-tokens", "64"]), "max_position_embeddings");
    check(base(&["--prompt-ids", "1", "--world-size", "0"]), "--world-size");
    check(base(&["--prompt-ids", "1", "--dtype", "i64"]), "--dtype");
    check(base(&["--prompt-ids", "1", "--backend", "nccl"]), "needs --device cuda");
    check(base(&["--prompt-ids", "1", "--frobnicate"]), "unknown argument");
    check(base(&[]), "--prompt-ids");
    check(base(&["--prompt-ids", "1", "--prompt", "hello"]), "--prompt");
    // Broken model folders.
    let bad = tmpdir("example-bad-config");
    check(
        vec!["--model", bad.to_str().unwrap(), "--prompt-ids", "1", "--max-new-tokens", "2", "--world-size", "1"]
            .into_iter()
            .map(String::from)
            .collect(),
        "config.json",
    );
    std::fs::write(bad.join("config.json"), r#"{"architectures": ["FalconForCausalLM"]}"#).unwrap();
    check(
        vec!["--model", bad.to_str().unwrap(), "--prompt-ids", "1", "--max-new-tokens", "2", "--world-size", "1"]
            .into_iter()
            .map(String::from)
            .collect(),
        "FalconForCausalLM",
    );
    // Heads that cannot be placed: 16 query heads over 17 ranks (one would hold none).
    let gqa = model(
        "example-gqa",
        &SyntheticModel {
            num_attention_heads: 16,
            num_key_value_heads: 4,
            head_dim: Some(6),
            ..SyntheticModel::tiny()
        },
    );
    let g = gqa.to_str().unwrap();
    let args: Vec<String> =
        ["--model", g, "--prompt-ids", "1,2", "--max-new-tokens", "2", "--world-size", "17", "--logits-out", o]
            .iter()
            .map(|s| s.to_string())
            .collect();
    check(args, "16 query heads cannot be placed on 17 ranks");
    // A missing layer tensor: the config claims one more layer than the files hold.
    let mut c = SyntheticModel::tiny().config_json();
    c["num_hidden_layers"] = json!(4);
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
    check(base(&["--prompt-ids", "1"]), "model.layers.3");
}

#[cfg(unix)]
#[test]
fn a_non_utf8_argument_is_an_error_not_a_panic() {
    use std::os::unix::ffi::OsStrExt;
    let o = Command::new(binary()).arg("--model").arg(std::ffi::OsStr::from_bytes(b"\xff\xfe")).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("UTF-8") && !err.contains("panicked"), "{err}");
}

/// Waits for `child` to exit, at most `secs` seconds (then kills it and fails).
fn wait_at_most(child: &mut std::process::Child, secs: u64) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the example did not exit within {secs} s");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The child's whole stderr (read after it exited; the example writes at most a line).
fn stderr_of(child: &mut std::process::Child) -> String {
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    err
}

/// Asserts `err` is the one-line stdout error, with no panic.
fn assert_stdout_error(err: &str) {
    assert_eq!(err.lines().count(), 1, "one line expected: {err}");
    assert!(err.starts_with("generate: cannot write to standard output: "), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[cfg(target_os = "linux")]
#[test]
fn stdout_on_a_full_device_is_a_one_line_error_after_a_complete_logits_file() {
    let dir = model("example-full", &SyntheticModel::tiny());
    let out_file = dir.join("full.safetensors");
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    let o = Command::new(binary())
        .args(["--model", dir.to_str().unwrap(), "--prompt-ids", PROMPT, "--max-new-tokens", "4", "--world-size", "2"])
        .args(["--ignore-eos", "--logits-out", out_file.to_str().unwrap()])
        .env("TP_TIMEOUT_SECS", "60")
        .stdout(full)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_stdout_error(&err);
    assert!(err.contains("No space left on device"), "{err}");
    // The logits file came first and is whole: byte for byte what the safetensors crate writes
    // for the same tensors (through tp_layers::save), and loadable.
    let ckpt = Checkpoint::open(&out_file).unwrap();
    let names = ["tokens", "prefill_logits", "decode_logits"];
    let tensors: Vec<_> = names.iter().map(|n| ckpt.load(n, None, &CPU).unwrap()).collect();
    assert_eq!(tensors[0].dims(), [4]);
    assert_eq!((tensors[1].dims(), tensors[2].dims()), (&[6, 1001][..], &[3, 1001][..]));
    let again = dir.join("again.safetensors");
    let named: Vec<(&str, &tp_core::Tensor)> = names.iter().copied().zip(&tensors).collect();
    tp_layers::save(&again, &named).unwrap();
    assert!(std::fs::read(&out_file).unwrap() == std::fs::read(&again).unwrap(), "not safetensors' bytes");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_closed_stdout_is_a_one_line_error_not_a_panic() {
    let dir = model("example-closed", &SyntheticModel::tiny());
    // Another test's child forked at the same moment may hold a copy of the pipe's read end
    // until it execs (close-on-exec), so a write can rarely still succeed: such a try (exit
    // status 0) is repeated; the error must show within a few tries.
    let (mut status, mut err) = (None, String::new());
    for _ in 0..5 {
        let mut child = Command::new(binary())
            .args([
                "--model",
                dir.to_str().unwrap(),
                "--prompt-ids",
                PROMPT,
                "--max-new-tokens",
                "3",
                "--world-size",
                "1",
            ])
            .env("TP_TIMEOUT_SECS", "60")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take()); // the reader goes away before the example prints anything
        status = wait_at_most(&mut child, 120).code();
        err = stderr_of(&mut child);
        if status != Some(0) {
            break;
        }
    }
    assert_eq!(status, Some(1), "{err}");
    assert_stdout_error(&err);
    assert!(err.contains("Broken pipe"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The names in `dir`.
#[cfg(target_os = "linux")]
fn entries(dir: &Path) -> std::collections::BTreeSet<std::ffi::OsString> {
    std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name()).collect()
}

/// The process state letter in /proc/PID/stat (`T` stopped, `Z` exited and not yet reaped).
#[cfg(target_os = "linux")]
fn proc_state(pid: u32) -> char {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    stat.rsplit(')').next().and_then(|s| s.trim_start().chars().next()).unwrap()
}

#[cfg(target_os = "linux")]
fn send(pid: u32, signal: i32) {
    // SAFETY: kill has no memory effects; `pid` is a child this test has not reaped yet, so the
    // id cannot have been reused by another process.
    assert_eq!(unsafe { libc::kill(pid as i32, signal) }, 0, "kill {pid} {signal}");
}

/// SIGTERM and SIGINT while the logits file is being written: the example stops with 143 / 130
/// and the folder holds exactly what it held before (no temporary file, no partial target).
/// Each try watches the folder for the temporary file, stops the process (SIGSTOP), checks the
/// file is still there (so the write is under way and the handlers installed), then sends the
/// signal and SIGCONT. A try whose write finished first only checks the folder and tries again.
#[cfg(target_os = "linux")]
#[test]
fn a_signal_during_the_logits_write_leaves_no_file_behind() {
    // A large vocabulary makes a 36 MB logits file: tens of milliseconds to write and sync.
    let spec = SyntheticModel {
        vocab_size: 200_000,
        hidden_size: 16,
        intermediate_size: 16,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        num_key_value_heads: 2,
        max_position_embeddings: 128,
        tie_word_embeddings: true,
        files: 1,
        ..SyntheticModel::tiny()
    };
    let dir = model("example-signal", &spec);
    let target = dir.join("logits.safetensors");
    for (signal, code) in [(libc::SIGTERM, 143), (libc::SIGINT, 130)] {
        let mut caught = false;
        for _ in 0..8 {
            let _ = std::fs::remove_file(&target);
            let before = entries(&dir);
            let mut command = Command::new(binary());
            command
                .args(["--model", dir.to_str().unwrap(), "--prompt-ids", PROMPT, "--max-new-tokens", "40"])
                .args(["--world-size", "1", "--ignore-eos", "--logits-out", target.to_str().unwrap()])
                .env("TP_TIMEOUT_SECS", "60")
                .stdout(Stdio::null())
                .stderr(Stdio::piped());
            // A test run started in the background by a non-interactive shell (`nohup cmd &`)
            // ignores SIGINT, and an ignored signal stays ignored across exec; the example then
            // rightly keeps ignoring it. Give the child the default disposition, as a terminal's
            // foreground job has, so the handler under test is the one installed.
            // SAFETY: between fork and exec only async-signal-safe calls are allowed; `signal`
            // is one, and it touches nothing of the parent's.
            unsafe {
                use std::os::unix::process::CommandExt;
                command.pre_exec(|| {
                    libc::signal(libc::SIGINT, libc::SIG_DFL);
                    libc::signal(libc::SIGTERM, libc::SIG_DFL);
                    Ok(())
                });
            }
            let mut child = command.spawn().unwrap();
            let pid = child.id();
            let is_temporary =
                |n: &std::ffi::OsString| !before.contains(n) && n.as_os_str() != target.file_name().unwrap();
            let deadline = Instant::now() + Duration::from_secs(120);
            let mut seen = false;
            while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
                if entries(&dir).iter().any(is_temporary) {
                    seen = true;
                    break;
                }
            }
            let mut in_write = false;
            if seen {
                send(pid, libc::SIGSTOP);
                let stop_deadline = Instant::now() + Duration::from_secs(10);
                while !matches!(proc_state(pid), 'T' | 'Z') {
                    assert!(Instant::now() < stop_deadline, "SIGSTOP did not stop the example");
                    std::thread::sleep(Duration::from_millis(1));
                }
                in_write = proc_state(pid) == 'T' && entries(&dir).iter().any(is_temporary);
                send(pid, signal);
                send(pid, libc::SIGCONT);
            }
            let status = wait_at_most(&mut child, 120);
            let err = stderr_of(&mut child);
            assert!(!err.contains("panicked"), "{err}");
            let after = entries(&dir);
            assert!(
                after.iter().all(|n| before.contains(n) || n.as_os_str() == target.file_name().unwrap()),
                "left behind: {after:?}"
            );
            if in_write {
                assert_eq!(status.code(), Some(code), "signal {signal} during the write: {err}");
                let said = if signal == libc::SIGINT { "interrupted by SIGINT" } else { "terminated by SIGTERM" };
                assert!(err.contains(said) && err.contains("logits file"), "no word of the signal: {err}");
                assert!(!target.exists(), "a target from an interrupted write");
                caught = true;
                break;
            }
            // Finished first (or was stopped after the rename): the target must be whole.
            let ckpt = Checkpoint::open(&target).unwrap();
            assert_eq!(ckpt.load("decode_logits", None, &CPU).unwrap().dims(), [39, 200_000]);
        }
        assert!(caught, "signal {signal}: no try stopped the example during its write");
    }
    let _ = std::fs::remove_dir_all(&dir); // 50 MB
}

/// `--enable-expert-parallel` (vLLM's flag): the placement is printed at start and the tokens
/// are transformers' greedy ones (the Qwen3-MoE fixture of tests/moe.rs); more ranks than
/// experts is refused before any rank starts, naming both.
#[test]
fn the_example_runs_experts_whole_on_ranks_and_prints_where() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/moe/qwen3_moe");
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids = |name: &str| -> Vec<String> {
        st.tensor(name)
            .unwrap()
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()).to_string())
            .collect()
    };
    let (prompt, tokens) = (ids("prompt").join(","), ids("tokens"));
    let n = tokens.len().to_string();
    let model = dir.to_str().unwrap();
    let base = ["--model", model, "--prompt-ids", &prompt, "--max-new-tokens", &n, "--ignore-eos"];
    let o = run(&[&base[..], &["--world-size", "3", "--enable-expert-parallel"]].concat());
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(
        stderr.contains("experts: expert parallelism: rank 0 experts 0-2, rank 1 experts 3-5, rank 2 experts 6-7"),
        "{stderr}"
    );
    assert_eq!(String::from_utf8_lossy(&o.stdout).lines().next(), Some(tokens.join(",").as_str()));
    let o = run(&[&base[..], &["--world-size", "3"]].concat());
    assert!(String::from_utf8_lossy(&o.stderr).contains("expert tensor parallelism: each of 8 experts split over 3"));
    let o = run(&[&base[..], &["--world-size", "9", "--enable-expert-parallel"]].concat());
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && stderr.lines().count() == 1, "{stderr}");
    assert!(stderr.contains("over 9 ranks needs at least 9 experts; the model has 8"), "{stderr}");
}
