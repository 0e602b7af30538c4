//! `tp serve`'s ranks: `-tp N` on the host runs N rank threads and answers as TP 1 does; the
//! NCCL backend refuses the CPU, and without a GPU fails on every rank it started, quickly and
//! with the reason, leaving no process behind.

mod common;

use common::{Server, model_dir};
use serde_json::json;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn every_tp_degree_answers_as_tp_1() {
    let body = json!({"prompt": "hello world", "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    let sampled =
        json!({"prompt": "hello", "max_tokens": 12, "temperature": 0.8, "top_p": 0.9, "seed": 7, "ignore_eos": true});
    let mut want = None;
    for tp in ["1", "2", "3", "4"] {
        // A folder per server: a server removes its folder when it is dropped.
        let s = Server::start_in(&model_dir(), &["-tp", tp], &[]);
        let (st, a) = s.post("/v1/completions", &body);
        assert_eq!(st, 200, "{a}");
        let (st, b) = s.post("/v1/completions", &sampled);
        assert_eq!(st, 200, "{b}");
        let got = (a["choices"][0]["text"].clone(), b["choices"][0]["text"].clone());
        match &want {
            None => want = Some(got),
            Some(w) => assert_eq!(&got, w, "TP {tp} answers otherwise than TP 1"),
        }
    }
}

/// Runs `tp serve` to its exit (60 s at most): (status, stderr).
fn run_to_exit(args: &[&str]) -> (Option<i32>, String, Duration) {
    run_to_exit_with(args, &[("TP_TIMEOUT_SECS", "20")])
}

/// `run_to_exit` with the environment variables `env`.
fn run_to_exit_with(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String, Duration) {
    let dir = model_dir();
    let start = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_tp"))
        .arg("serve")
        .arg(&dir)
        .args(["--port", "0"])
        .args(args)
        .envs(env.iter().copied())
        .env_remove("RANK")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start tp");
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            let mut err = String::new();
            use std::io::Read;
            let _ = child.stderr.take().map(|mut e| e.read_to_string(&mut err));
            return (status.code(), err, start.elapsed());
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("tp serve did not exit within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_nccl_backend_refuses_the_cpu_and_fails_cleanly_without_a_gpu() {
    let (code, err, _) = run_to_exit(&["--backend", "nccl"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--device cuda"), "{err}");
    // Two ranks on GPUs this machine may not have: every rank fails with the reason (or, on a
    // GPU machine with NCCL, the server would start: this test runs where there is none).
    if tp_kernels_available() {
        return;
    }
    let (code, err, took) = run_to_exit(&["--backend", "nccl", "--device", "cuda", "-tp", "2"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("tp serve:"), "{err}");
    assert!(took < Duration::from_secs(45), "{took:?}");
}

/// Whether this machine has a CUDA device (then the failure case does not apply).
fn tp_kernels_available() -> bool {
    std::path::Path::new("/dev/nvidia0").exists()
}

#[test]
fn bad_engine_variables_are_refused_by_name() {
    for (var, value) in [("TP_TIMEOUT_SECS", "0"), ("TP_TIMEOUT_SECS", "soon"), ("TP_DEBUG_FAULT", "one:two")] {
        let (code, err, _) = run_to_exit_with(&[], &[(var, value)]);
        assert_eq!(code, Some(1), "{var}={value}: {err}");
        assert!(err.contains(var), "{var}={value}: {err}");
    }
}
