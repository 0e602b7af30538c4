//! A store (or something posing as rank 0's) that answers with hostile text, malformed
//! replies, or not at all: every rank gets a bounded, escaped error by its deadline.

mod common;
use common::{fake_store, finish_timed, probe_cmd, timed};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tp_comm::store::StoreClient;
use tp_comm::{CommError, DEADLINE_SLACK, LaunchEnv, MAX_PEER_TEXT_CHARS, Rendezvous};

const R_VALUE: u8 = 11;
const R_MISSING: u8 = 12;
const R_EXISTS: u8 = 13;
const R_ERROR: u8 = 14;

/// 20,000 characters with a terminal escape (clear screen, red), a carriage return and a
/// right-to-left override in them.
fn hostile() -> Vec<u8> {
    format!("\x1b[2J\x1b[31m{}\r\n\u{202e}{}", "A".repeat(10_000), "B".repeat(10_000)).into_bytes()
}

/// The message carries no raw control or format characters and is bounded.
fn is_safe(msg: &str) {
    assert!(!msg.chars().any(|c| c.is_control() || c == '\u{202e}'), "raw control characters in {msg:?}");
    assert!(msg.chars().count() < MAX_PEER_TEXT_CHARS + 400, "{} characters", msg.chars().count());
}

fn rank1(port: u16, timeout_secs: &str) -> LaunchEnv {
    let m: HashMap<&str, String> = [
        ("RANK", "1".to_string()),
        ("WORLD_SIZE", "2".to_string()),
        ("MASTER_PORT", port.to_string()),
        ("TP_TIMEOUT_SECS", timeout_secs.to_string()),
    ]
    .into_iter()
    .collect();
    LaunchEnv::from_lookup(|k| m.get(k).cloned()).unwrap()
}

fn port_of(addr: &str) -> u16 {
    addr.rsplit(':').next().unwrap().parse().unwrap()
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

#[test]
fn an_error_reply_is_escaped_and_cut() {
    let addr = fake_store(vec![(R_ERROR, hostile())]);
    let e = StoreClient::connect(&addr, soon()).unwrap().set("k", b"v", soon()).unwrap_err().to_string();
    is_safe(&e);
    assert!(e.contains("set \"k\" at 127.0.0.1:") && e.contains("\\u{1b}[2J\\u{1b}[31mAAA"), "{e}");
    assert!(e.contains(&format!("({} bytes in all)", hostile().len())), "{e}");
}

#[test]
fn a_fake_rank_zero_cannot_inject_text_through_world_size_or_identity() {
    // WORLD_SIZE as published by "rank 0".
    let addr = fake_store(vec![(R_VALUE, hostile())]);
    let e = Rendezvous::join(&rank1(port_of(&addr), "5")).unwrap_err().to_string();
    is_safe(&e);
    assert!(e.contains("WORLD_SIZE mismatch") && e.contains("rank 0 has \\u{1b}[2J"), "{e}");

    // The identity of another claimant of our rank.
    let addr = fake_store(vec![(R_VALUE, b"2".to_vec()), (R_EXISTS, hostile())]);
    let e = Rendezvous::join(&rank1(port_of(&addr), "5")).unwrap_err().to_string();
    is_safe(&e);
    assert!(e.contains("two processes claim rank 1: \\u{1b}[2J"), "{e}");

    // The reason a "rank 0" gives for giving up.
    let addr = fake_store(vec![(R_VALUE, b"2".to_vec()), (10, vec![]), (R_ERROR, hostile())]);
    let e = Rendezvous::join(&rank1(port_of(&addr), "5")).unwrap_err().to_string();
    is_safe(&e);
    assert!(e.contains("wait_all \"rank\" at 127.0.0.1:"), "{e}");
}

#[test]
fn a_probe_process_prints_only_escaped_peer_text() {
    let addr = fake_store(vec![(R_VALUE, hostile())]);
    let d = &finish_timed(vec![timed(probe_cmd(1, 2, port_of(&addr), 5).spawn().unwrap())], Duration::from_secs(20))[0];
    assert!(!d.ok, "{d:?}");
    is_safe(d.err.trim_end());
    assert!(d.err.contains("WORLD_SIZE mismatch"), "{d:?}");
}

#[test]
fn a_store_that_never_answers_fails_the_call_by_its_deadline_plus_slack() {
    let addr = fake_store(vec![]);
    let mut c = StoreClient::connect(&addr, soon()).unwrap();
    let t = Instant::now();
    let e = c.get("k", Instant::now() + Duration::from_secs(1)).unwrap_err().to_string();
    let took = t.elapsed();
    assert!(e.contains("did not answer get \"k\""), "{e}");
    assert!(
        took >= Duration::from_secs(1) && took <= Duration::from_secs(1) + DEADLINE_SLACK + Duration::from_millis(200)
    );

    // The whole join, too: one deadline for all its steps.
    let t = Instant::now();
    let e = Rendezvous::join(&rank1(port_of(&addr), "1")).unwrap_err();
    assert!(matches!(&e, CommError::Rendezvous(m) if m.contains("did not answer")), "{e}");
    assert!(t.elapsed() <= Duration::from_secs(1) + DEADLINE_SLACK + Duration::from_millis(200), "{:?}", t.elapsed());
}

#[test]
fn malformed_replies_are_protocol_errors() {
    let wait_all = |reply: Vec<u8>| {
        let addr = fake_store(vec![(R_MISSING, reply)]);
        let mut c = StoreClient::connect(&addr, soon()).unwrap();
        c.wait_all("rank", 4, soon()).unwrap_err().to_string()
    };
    let with = |count: u64, ranks: &[u32]| {
        let mut v = count.to_le_bytes().to_vec();
        ranks.iter().for_each(|r| v.extend_from_slice(&r.to_le_bytes()));
        v
    };
    for (why, reply) in [
        ("truncated", vec![1, 2, 3]),
        ("count above the world", with(9, &[0, 1, 2, 3])),
        ("rank out of range", with(1, &[7])),
        ("fewer ranks than counted", with(2, &[1])),
        ("ranks out of order", with(2, &[2, 1])),
        ("nothing missing", with(0, &[])),
    ] {
        let e = wait_all(reply);
        assert!(e.contains("protocol error") && e.contains("malformed wait_all reply"), "{why}: {e}");
    }
    // A reply of the wrong kind.
    let addr = fake_store(vec![(99, vec![])]);
    let e = StoreClient::connect(&addr, soon()).unwrap().set("k", b"v", soon()).unwrap_err().to_string();
    assert!(e.contains("unexpected reply 99 to set"), "{e}");
}

#[test]
fn a_reply_announcing_a_huge_value_is_refused_before_allocating() {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut b = [0u8; 64];
        let _ = s.read(&mut b);
        // Magic, R_VALUE, empty key, then a 4 GiB - 1 value length and nothing else.
        let _ = s.write_all(&[b'T', b'P', b'S', b'1', R_VALUE, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]);
        std::thread::sleep(Duration::from_secs(2));
    });
    let e = StoreClient::connect(&addr, soon()).unwrap().get("k", soon()).unwrap_err().to_string();
    assert!(e.contains("exceeds the 1048576-byte limit"), "{e}");
}
