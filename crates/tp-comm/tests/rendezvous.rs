//! Launch environment, the TCP store, and multi-process rendezvous on loopback: N real processes
//! (the `tp-probe` binary) find each other; a missing rank, a duplicate rank, a WORLD_SIZE
//! mismatch and a port in use are clear errors, and nothing outlives its deadline.

mod common;
use common::{finish, free_port, probe};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Child;
use std::time::{Duration, Instant};
use tp_comm::store::{Claim, StoreClient, StoreServer};
use tp_comm::{CommError, LaunchEnv};

fn env_of(pairs: &[(&str, &str)]) -> Result<LaunchEnv, CommError> {
    let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    LaunchEnv::from_lookup(|k| m.get(k).cloned())
}

#[test]
fn launch_env_reads_torchrun_variables() {
    let e = env_of(&[
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "1234"),
    ])
    .unwrap();
    assert_eq!((e.rank, e.world_size, e.local_rank, e.master_addr.as_str(), e.master_port), (3, 8, 1, "node0", 1234));
    let d = env_of(&[("RANK", "0"), ("WORLD_SIZE", "1")]).unwrap();
    assert_eq!((d.local_rank, d.master_addr.as_str(), d.master_port), (0, "127.0.0.1", 29500));
}

#[test]
fn launch_env_errors_are_clear() {
    let msg = |pairs: &[(&str, &str)]| env_of(pairs).unwrap_err().to_string();
    assert!(msg(&[("WORLD_SIZE", "2")]).contains("RANK is not set"));
    assert!(msg(&[("RANK", "0")]).contains("WORLD_SIZE is not set"));
    assert!(msg(&[("RANK", "2"), ("WORLD_SIZE", "2")]).contains("not below WORLD_SIZE"));
    assert!(msg(&[("RANK", "0"), ("WORLD_SIZE", "0")]).contains("at least 1"));
    assert!(msg(&[("RANK", "x"), ("WORLD_SIZE", "2")]).contains("RANK=\"x\""));
    assert!(msg(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "70000")]).contains("MASTER_PORT"));
    assert!(msg(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", " ")]).contains("MASTER_ADDR is empty"));
}

#[test]
fn store_sets_gets_claims_and_times_out() {
    let server = StoreServer::start("127.0.0.1:0").unwrap();
    let addr = server.addr().to_string();
    let soon = || Instant::now() + Duration::from_secs(5);
    let mut a = StoreClient::connect(&addr, soon()).unwrap();
    let mut b = StoreClient::connect(&addr, soon()).unwrap();
    a.set("k", b"v1", soon()).unwrap();
    assert_eq!(b.get("k", soon()).unwrap(), Some(b"v1".to_vec()));
    assert_eq!(a.claim("c", b"first", soon()).unwrap(), Claim::Won);
    assert_eq!(b.claim("c", b"second", soon()).unwrap(), Claim::Taken(b"first".to_vec()));
    // A get blocks until the key appears...
    let waiter = std::thread::spawn(move || b.get("later", Instant::now() + Duration::from_secs(10)).unwrap());
    std::thread::sleep(Duration::from_millis(100));
    a.set("later", b"x", soon()).unwrap();
    assert_eq!(waiter.join().unwrap(), Some(b"x".to_vec()));
    // ...and gives up at its deadline.
    let t = Instant::now();
    assert_eq!(a.get("never", Instant::now() + Duration::from_millis(200)).unwrap(), None);
    assert!(t.elapsed() < Duration::from_secs(3));
}

#[test]
fn garbage_on_the_socket_is_rejected_without_harming_the_store() {
    let server = StoreServer::start("127.0.0.1:0").unwrap();
    let addr = server.addr().to_string();
    let mut raw = TcpStream::connect(&addr).unwrap();
    raw.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let mut buf = [0u8; 16];
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(raw.read(&mut buf).unwrap_or(0), 0, "the server should drop a garbage connection");
    let mut c = StoreClient::connect(&addr, Instant::now() + Duration::from_secs(5)).unwrap();
    c.set("still", b"alive", Instant::now() + Duration::from_secs(5)).unwrap();

    // And a client talking to something that is not a store gets a protocol error.
    let fake = TcpListener::bind("127.0.0.1:0").unwrap();
    let fake_addr = fake.local_addr().unwrap().to_string();
    let t = std::thread::spawn(move || {
        let (mut s, _) = fake.accept().unwrap();
        let mut b = [0u8; 64];
        let _ = s.read(&mut b);
        s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").unwrap();
    });
    let mut c = StoreClient::connect(&fake_addr, Instant::now() + Duration::from_secs(5)).unwrap();
    let e = c.set("k", b"v", Instant::now() + Duration::from_secs(5)).unwrap_err();
    assert!(e.to_string().contains("protocol error") && e.to_string().contains("bad magic"), "{e}");
    t.join().unwrap();
}

#[test]
fn a_port_in_use_is_named() {
    let busy = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    let e = StoreServer::start(&addr).expect_err("bind must fail").to_string();
    assert!(e.contains("port in use") && e.contains(&addr), "{e}");
}

#[test]
fn an_unreachable_rank_zero_fails_at_the_deadline() {
    let port = free_port();
    let t = Instant::now();
    let e =
        StoreClient::connect(&format!("127.0.0.1:{port}"), Instant::now() + Duration::from_millis(500)).err().unwrap();
    assert!(e.to_string().contains("is rank 0 running"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(5));
}

// ---- multi-process: real processes of the tp-probe binary ----

#[test]
fn processes_rendezvous_and_share_rank_zeros_id() {
    for world in [1, 2, 4] {
        let port = free_port();
        let kids: Vec<Child> = (0..world).rev().map(|r| probe(r, world, port, 20)).collect(); // rank 0 last
        let results = finish(kids, Duration::from_secs(60));
        let ids: Vec<String> = results
            .iter()
            .map(|(ok, out, err)| {
                assert!(ok, "world {world}: {out}{err}");
                out.lines()
                    .find(|l| l.contains("received id"))
                    .expect("id line")
                    .split("received id ")
                    .nth(1)
                    .unwrap()
                    .to_string()
            })
            .collect();
        assert!(ids.iter().all(|i| i == &ids[0] && i.starts_with("job-id-from-rank-0")), "{ids:?}");
    }
}

#[test]
fn a_missing_rank_is_named_by_the_others_at_the_deadline() {
    let port = free_port();
    let start = Instant::now();
    let results = finish(vec![probe(0, 3, port, 2), probe(1, 3, port, 2)], Duration::from_secs(30));
    assert!(start.elapsed() < Duration::from_secs(20));
    for (ok, out, err) in results {
        assert!(!ok, "{out}");
        assert!(err.contains("never arrived") && err.contains("[2]"), "{err}");
    }
}

#[test]
fn a_world_size_mismatch_is_reported() {
    let port = free_port();
    // A generous deadline: rank 0 may start late on a loaded machine, and rank 1 must reach it.
    let results = finish(vec![probe(0, 2, port, 8), probe(1, 3, port, 8)], Duration::from_secs(40));
    let (ok1, _, err1) = &results[1];
    assert!(
        !ok1 && err1.contains("WORLD_SIZE mismatch") && err1.contains("rank 0 has 2"),
        "rank 1: {err1}\nrank 0: {}",
        results[0].2
    );
    assert!(!results[0].0, "rank 0 cannot complete without rank 1: {:?}", results[0]);
}

#[test]
fn two_processes_claiming_one_rank_are_reported() {
    // World 3 with rank 2 absent keeps the store up until the deadline, so the second claimant
    // of rank 1 always reaches it, however late it starts.
    let port = free_port();
    let kids = vec![probe(0, 3, port, 6), probe(1, 3, port, 6), probe(1, 3, port, 6)];
    let results = finish(kids, Duration::from_secs(40));
    let dup: Vec<_> = results.iter().filter(|(_, _, err)| err.contains("two processes claim rank 1")).collect();
    assert_eq!(dup.len(), 1, "{results:?}");
    assert!(results.iter().all(|(ok, _, _)| !ok), "no rank can finish without rank 2: {results:?}");
}

#[test]
fn rank_zero_reports_a_busy_port() {
    let busy = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port();
    let results = finish(vec![probe(0, 1, port, 3)], Duration::from_secs(20));
    assert!(!results[0].0 && results[0].2.contains("port in use"), "{:?}", results[0]);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// Whatever bytes arrive — random, or a valid header announcing absurd lengths — the store
    /// drops that connection and keeps serving everyone else.
    #[test]
    fn random_bytes_never_hurt_the_store(noise in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200),
                                         with_magic in proptest::prelude::any::<bool>()) {
        let server = StoreServer::start("127.0.0.1:0").unwrap();
        let addr = server.addr().to_string();
        let mut raw = TcpStream::connect(&addr).unwrap();
        if with_magic {
            raw.write_all(b"TPS1").unwrap();
        }
        let _ = raw.write_all(&noise);
        let _ = raw.shutdown(std::net::Shutdown::Write);
        let soon = || Instant::now() + Duration::from_secs(5);
        let mut c = StoreClient::connect(&addr, soon()).unwrap();
        c.set("k", b"v", soon()).unwrap();
        proptest::prop_assert_eq!(c.get("k", soon()).unwrap(), Some(b"v".to_vec()));
    }
}
