//! `tp serve` under load and at its end: a full queue gets 429, a client that disconnects
//! mid-stream cancels its request, SIGTERM lets in-flight requests finish and exits 0, and a
//! request past the shutdown deadline is aborted (still exit 0).

mod common;

use common::{Server, connect, model_dir, send};
use serde_json::{Value, json};
use std::io::Read;
use std::time::{Duration, Instant};

/// Steps slow enough that requests overlap (20 ms per token).
const SLOW: &[(&str, &str)] = &[("TP_DEBUG_STEP_DELAY_MS", "20")];

fn long_stream() -> Vec<u8> {
    json!({"prompt": "hello", "max_tokens": 200, "stream": true, "ignore_eos": true}).to_string().into_bytes()
}

#[test]
fn a_full_queue_gets_429() {
    let s = Server::start_in(&model_dir(), &["--max-num-seqs", "1", "--max-waiting-requests", "1"], SLOW);
    let body = long_stream();
    let mut first = connect(&s.addr);
    send(&mut first, "POST", "/v1/completions", Some(&body), &[]);
    assert!(s.wait_metric("tp_num_requests_running", |v| v == 1.0));
    let mut second = connect(&s.addr);
    send(&mut second, "POST", "/v1/completions", Some(&body), &[]);
    assert!(s.wait_metric("tp_num_requests_waiting", |v| v == 1.0));
    let (st, v) = s.post("/v1/completions", &json!({"prompt": "x", "max_tokens": 1}));
    assert_eq!(st, 429, "{v}");
    assert!(v["error"]["message"].as_str().unwrap_or("").contains("overloaded"), "{v}");
    drop((first, second));
    // Both dropped clients are cancelled; the server takes requests again.
    assert!(s.wait_metric("tp_num_requests_running", |v| v == 0.0));
    assert!(s.wait_metric("tp_num_requests_waiting", |v| v == 0.0));
    assert_eq!(s.post("/v1/completions", &json!({"prompt": "x", "max_tokens": 1})).0, 200);
}

#[test]
fn a_client_that_disconnects_mid_stream_cancels_its_request() {
    let s = Server::start_in(&model_dir(), &[], SLOW);
    let mut sock = connect(&s.addr);
    send(&mut sock, "POST", "/v1/completions", Some(&long_stream()), &[]);
    let mut buf = [0u8; 512];
    let n = sock.read(&mut buf).expect("first bytes");
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    assert!(s.wait_metric("tp_num_requests_running", |v| v == 1.0));
    let t = Instant::now();
    drop(sock);
    // 200 tokens at 20 ms would take 4 s; the abort frees it at once.
    assert!(s.wait_metric("tp_num_requests_running", |v| v == 0.0));
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    let aborted = "tp_request_success_total{model_name=";
    let (_, text) = s.call("GET", "/metrics", None, &[]);
    let line = text.lines().find(|l| l.starts_with(aborted) && l.contains("abort")).expect("abort counter");
    assert!(line.ends_with(" 1"), "the dropped stream counts as aborted: {line}");
    assert!(s.metric("tp_generation_tokens_total") < 150.0);
}

/// Reads a whole streamed response from `sock`; its `data:` payloads.
fn events(mut sock: std::net::TcpStream) -> Vec<String> {
    let mut raw = Vec::new();
    let _ = sock.read_to_end(&mut raw);
    let (status, body) = common::parse_response(&raw);
    assert_eq!(status, 200, "{body}");
    body.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).map(str::to_string).collect()
}

#[test]
fn sigterm_finishes_in_flight_requests_and_exits_0() {
    let mut s = Server::start_in(&model_dir(), &[], SLOW);
    let mut sock = connect(&s.addr);
    let body = json!({"prompt": "hello", "max_tokens": 40, "stream": true, "ignore_eos": true}).to_string();
    send(&mut sock, "POST", "/v1/completions", Some(body.as_bytes()), &[]);
    assert!(s.wait_metric("tp_num_requests_running", |v| v == 1.0));
    s.signal(libc::SIGTERM);
    let ev = events(sock);
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
    let last: Value = serde_json::from_str(&ev[ev.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length", "the request ran to its end: {ev:?}");
    assert_eq!(s.wait_exit(Duration::from_secs(10)), Some(0));
    assert!(std::net::TcpStream::connect(&s.addr).is_err(), "no longer accepting");
}

#[test]
fn past_the_shutdown_deadline_requests_are_aborted_and_the_exit_is_0() {
    let mut s = Server::start_in(&model_dir(), &["--shutdown-timeout", "0.3"], SLOW);
    let mut sock = connect(&s.addr);
    send(&mut sock, "POST", "/v1/completions", Some(&long_stream()), &[]);
    assert!(s.wait_metric("tp_num_requests_running", |v| v == 1.0));
    let t = Instant::now();
    s.signal(libc::SIGINT);
    let ev = events(sock);
    let last: Value = serde_json::from_str(&ev[ev.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "abort", "{ev:?}");
    assert_eq!(s.wait_exit(Duration::from_secs(10)), Some(0));
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
}

/// The body of a whole response read from `sock`.
fn body_of(mut sock: std::net::TcpStream) -> String {
    let mut raw = Vec::new();
    let _ = sock.read_to_end(&mut raw);
    String::from_utf8_lossy(&raw).into_owned()
}

#[test]
fn a_rank_that_fails_ends_in_flight_requests_with_an_error_and_the_server_exits() {
    // Rank 1 of 2 fails at its 5th step (injected); rank 0's collective sees the group aborted.
    let env = [("TP_DEBUG_STEP_DELAY_MS", "20"), ("TP_DEBUG_FAULT", "1:5")];
    let mut s = Server::start_in(&model_dir(), &["-tp", "2"], &env);
    let mut sock = connect(&s.addr);
    send(&mut sock, "POST", "/v1/completions", Some(&long_stream()), &[]);
    let body = body_of(sock);
    assert!(body.contains("\"error\""), "the stream ends with an error: {body}");
    assert_eq!(s.wait_exit(Duration::from_secs(20)), Some(1), "the server exits once its engine failed");
}

#[test]
fn a_rank_that_hangs_is_a_failure_within_the_deadline_not_a_hung_server() {
    // Rank 1 stops for 60 s at its 5th step; the deadline is 2 s.
    let env = [("TP_DEBUG_STEP_DELAY_MS", "20"), ("TP_DEBUG_FAULT", "1:5:60"), ("TP_TIMEOUT_SECS", "2")];
    let mut s = Server::start_in(&model_dir(), &["-tp", "2"], &env);
    let t = Instant::now();
    let (st, v) = s.post("/v1/completions", &json!({"prompt": "hello", "max_tokens": 100, "ignore_eos": true}));
    assert_eq!(st, 500, "{v}");
    assert!(v["error"]["message"].as_str().unwrap_or("").contains("never arrived"), "{v}");
    assert_eq!(s.wait_exit(Duration::from_secs(20)), Some(1));
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
}
