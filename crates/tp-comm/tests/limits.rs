//! Extreme and overflowing values: timeouts, world sizes, ports, addresses. Each is a typed
//! error naming the limit, never a panic, a hang or an allocation sized by the value.

mod common;
use common::{Timed, finish_timed, free_port, probe_cmd, timed};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tp_comm::store::{StoreClient, StoreServer};
use tp_comm::{
    CommError, DEADLINE_SLACK, Deadline, DeviceGroup, LaunchEnv, LocalGroup, MAX_TIMEOUT, MAX_TIMEOUT_SECS,
    MAX_WORLD_SIZE,
};
use tp_core::Device;

fn env_of(pairs: &[(&str, &str)]) -> Result<LaunchEnv, CommError> {
    let mut m: HashMap<String, String> =
        [("RANK", "0"), ("WORLD_SIZE", "2")].iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    m.extend(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    LaunchEnv::from_lookup(|k| m.get(k).cloned())
}

fn env_err(pairs: &[(&str, &str)]) -> String {
    match env_of(pairs) {
        Err(CommError::Env(m)) => m,
        other => panic!("{pairs:?}: expected an Env error, got {other:?}"),
    }
}

const U64_MAX: &str = "18446744073709551615";

/// Variables to set, and what the error must say.
type Case<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str]);

#[test]
fn extreme_launch_values_are_env_errors_naming_the_limit() {
    let cases: &[Case] = &[
        (&[("TP_TIMEOUT_SECS", U64_MAX)], &["TP_TIMEOUT_SECS", "maximum of 604800"]),
        (&[("TP_TIMEOUT_SECS", "604801")], &["TP_TIMEOUT_SECS", "maximum"]),
        (&[("TP_TIMEOUT_SECS", "0")], &["TP_TIMEOUT_SECS", "at least 1"]),
        (&[("TP_TIMEOUT_SECS", "99999999999999999999999")], &["TP_TIMEOUT_SECS", "not a valid number"]),
        (&[("TP_TIMEOUT_SECS", "-1")], &["TP_TIMEOUT_SECS"]),
        (&[("WORLD_SIZE", "1000000000")], &["WORLD_SIZE=1000000000", "maximum of 4096"]),
        (&[("WORLD_SIZE", U64_MAX)], &["WORLD_SIZE", "maximum of 4096"]),
        (&[("WORLD_SIZE", "4097")], &["WORLD_SIZE", "maximum"]),
        (&[("WORLD_SIZE", "18446744073709551616")], &["WORLD_SIZE", "not a valid number"]),
        (&[("RANK", U64_MAX)], &["RANK", "not below WORLD_SIZE"]),
        (&[("MASTER_PORT", "0")], &["MASTER_PORT=0", "1..=65535"]),
        (&[("MASTER_PORT", "65536")], &["MASTER_PORT", "1..=65535"]),
        (&[("MASTER_PORT", "-1")], &["MASTER_PORT", "1..=65535"]),
        (&[("MASTER_ADDR", "host name")], &["MASTER_ADDR", "not a host name"]),
    ];
    for (pairs, needles) in cases {
        let m = env_err(pairs);
        for n in *needles {
            assert!(m.contains(n), "{pairs:?}: {m}");
        }
    }
    // The largest values allowed are accepted.
    let e =
        env_of(&[("WORLD_SIZE", "4096"), ("RANK", "4095"), ("TP_TIMEOUT_SECS", "604800"), ("MASTER_PORT", "65535")])
            .unwrap();
    assert_eq!((e.world_size, e.rank, e.timeout, e.master_port), (MAX_WORLD_SIZE, 4095, MAX_TIMEOUT, 65535));
    assert_eq!(MAX_TIMEOUT.as_secs(), MAX_TIMEOUT_SECS);
    // An IPv6 rank 0 gets a usable socket address.
    assert_eq!(env_of(&[("MASTER_ADDR", "::1")]).unwrap().store_addr(), "[::1]:29500");
}

#[test]
fn text_echoed_from_the_environment_is_escaped_and_cut() {
    let hostile = format!("\x1b[2J{}", "9".repeat(20_000));
    let m = env_err(&[("TP_TIMEOUT_SECS", &hostile)]);
    assert!(!m.contains('\x1b') && m.contains("\\u{1b}[2J"), "{m}");
    assert!(m.len() < 400, "{} bytes", m.len());
    let m = env_err(&[("MASTER_ADDR", &"a".repeat(300))]);
    assert!(m.contains("MASTER_ADDR") && m.len() < 400, "{m}");
}

#[test]
fn processes_with_extreme_values_exit_at_once_with_one_line() {
    let cases: &[(&str, &str, &str)] = &[
        ("TP_TIMEOUT_SECS", U64_MAX, "TP_TIMEOUT_SECS"),
        ("WORLD_SIZE", "1000000000", "WORLD_SIZE"),
        ("WORLD_SIZE", U64_MAX, "WORLD_SIZE"),
        ("MASTER_PORT", "0", "MASTER_PORT"),
    ];
    let kids: Vec<Timed> = cases
        .iter()
        .map(|(k, v, _)| {
            let mut c = probe_cmd(0, 2, free_port(), 2);
            c.env(k, v);
            timed(c.spawn().unwrap())
        })
        .collect();
    for (d, (k, v, needle)) in finish_timed(kids, Duration::from_secs(20)).iter().zip(cases) {
        assert!(!d.ok && d.err.contains(needle) && !d.err.contains("panicked"), "{k}={v}: {d:?}");
        assert_eq!(d.err.trim_end().lines().count(), 1, "{k}={v}: {d:?}");
        assert!(d.took < Duration::from_secs(1), "{k}={v} took {:?}", d.took);
    }
}

#[test]
fn the_largest_world_with_every_peer_missing_fails_in_one_round_trip() {
    // Rank 0 of 4096 alone: one wait_all request names the first missing ranks and the count,
    // at the deadline (one request per missing rank would take far longer).
    let (t, port) = (2, free_port());
    let d =
        &finish_timed(vec![timed(probe_cmd(0, MAX_WORLD_SIZE, port, t).spawn().unwrap())], Duration::from_secs(20))[0];
    assert!(!d.ok && d.err.contains("never arrived") && d.err.contains("(4095 in all)"), "{d:?}");
    assert!(d.err.contains("[1, 2, 3,"), "{d:?}");
    assert!(d.err.len() < 600, "{} bytes: {}", d.err.len(), d.err);
    assert!(d.took <= Duration::from_secs(t) + DEADLINE_SLACK + Duration::from_millis(500), "{:?}", d.took);
}

#[test]
fn thread_groups_have_the_same_limits() {
    let limit = |r: Result<Vec<LocalGroup>, CommError>| match r {
        Err(CommError::Limit { why, .. }) => why,
        other => panic!("expected a Limit error, got {:?}", other.map(|v| v.len())),
    };
    assert!(limit(LocalGroup::with_timeout(2, Duration::MAX)).contains("7 days"));
    assert!(limit(LocalGroup::with_timeout(MAX_WORLD_SIZE + 1, Duration::from_secs(1))).contains("4096"));
    let t = Instant::now();
    assert!(matches!(
        DeviceGroup::local(usize::MAX, Duration::from_secs(1), |_| Device::Cpu),
        Err(CommError::Limit { .. })
    ));
    assert!(matches!(
        DeviceGroup::local(1_000_000_000, Duration::from_secs(1), |_| Device::Cpu),
        Err(CommError::Limit { .. })
    ));
    assert!(t.elapsed() < Duration::from_secs(1), "no allocation sized by the world size");
    assert_eq!(LocalGroup::with_timeout(MAX_WORLD_SIZE, MAX_TIMEOUT).unwrap().len(), MAX_WORLD_SIZE);
}

#[test]
fn deadlines_never_overflow() {
    let d = Deadline::after(Duration::MAX);
    assert!(d.remaining() <= MAX_TIMEOUT && d.remaining() > MAX_TIMEOUT - Duration::from_secs(60));
    assert_eq!(d.extended(Duration::MAX), d, "an unrepresentable extension leaves it unchanged");
    assert!(Deadline::after(Duration::ZERO).has_passed());
    // A store call with a deadline years away is capped by the server, and answers at once when
    // the key is there.
    let server = StoreServer::start("127.0.0.1:0").unwrap();
    let far = Instant::now() + Duration::from_secs(10 * 365 * 24 * 3600);
    let mut c = StoreClient::connect(&server.addr().to_string(), far).unwrap();
    c.set("k", b"v", far).unwrap();
    assert_eq!(c.get("k", far).unwrap(), Some(b"v".to_vec()));
    // Waiting for more keys than a job can have is refused without a request.
    let e = c.wait_all("rank", MAX_WORLD_SIZE + 1, far).unwrap_err().to_string();
    assert!(e.contains("at most 4096"), "{e}");
}

#[test]
fn an_error_chain_names_each_op_once() {
    let g = DeviceGroup::local(1, Duration::from_secs(5), |_| Device::Cpu).unwrap().pop().unwrap();
    let x = tp_core::Tensor::zeros(&[2, 3], tp_core::DType::F32, &Device::Cpu).unwrap();
    let e = g.reduce_scatter(&x, 5, tp_comm::ReduceOp::Sum).unwrap_err().to_string();
    assert_eq!(e.matches("reduce_scatter").count(), 1, "{e}");
    assert!(e.starts_with("reduce_scatter: dim 5 out of range"), "{e}");
}
