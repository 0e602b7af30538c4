//! The store is bounded: keys, bytes, value size, bytes in flight, connections, and clients
//! that stall or never speak. A flood against a real rank 0 keeps its memory bounded, and the
//! legitimate ranks complete, or fail with a clear error, by their deadline.

mod common;
use common::{finish_timed, frame, free_port, probe, rss_bytes, timed, wait_listening};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};
use tp_comm::store::{Claim, MAX_STORE_BYTES, MAX_VALUE_BYTES, StoreClient, StoreLimits, StoreServer};

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

fn server(limits: StoreLimits) -> (StoreServer, String) {
    let s = StoreServer::start_with("127.0.0.1:0", limits).unwrap();
    let addr = s.addr().to_string();
    (s, addr)
}

#[test]
fn keys_and_bytes_are_bounded_and_the_store_keeps_serving() {
    // Bytes: 8 KiB values under new keys until the 256 KiB limit refuses one.
    let limits = StoreLimits { max_keys: 1000, max_bytes: 256 << 10, ..StoreLimits::default() };
    let (_s, addr) = server(limits);
    let mut flood = StoreClient::connect(&addr, soon()).unwrap();
    let value = vec![7u8; 8 << 10];
    let mut stored = 0;
    let e = loop {
        match flood.set(&format!("flood/{stored}"), &value, soon()) {
            Ok(()) => stored += 1,
            Err(e) => break e.to_string(),
        }
        assert!(stored <= 32, "the byte limit never refused");
    };
    assert!(stored >= 30, "refused too early, after {stored}");
    assert!(e.contains("the store is full") && e.contains("262144 bytes"), "{e}");
    // What is left takes small keys, each costing its bytes plus 64, until nothing fits.
    let mut small = 0;
    while flood.set(&format!("s{small}"), b"", soon()).is_ok() {
        small += 1;
        assert!(small <= (8 << 10) / 64, "the byte limit never refused small keys");
    }
    // The flooding connection and a new one are still served: reads, and overwrites that fit.
    assert_eq!(flood.get("flood/0", soon()).unwrap(), Some(value.clone()));
    let mut legit = StoreClient::connect(&addr, soon()).unwrap();
    legit.set("flood/1", &value, soon()).unwrap();
    assert!(legit.set("new", b"", soon()).unwrap_err().to_string().contains("full"));
    assert!(legit.wait_all("flood", stored, soon()).unwrap().is_empty());

    // Keys: tiny values until the key limit refuses one.
    let (_s, addr) = server(StoreLimits { max_keys: 50, ..StoreLimits::default() });
    let mut c = StoreClient::connect(&addr, soon()).unwrap();
    for i in 0..50 {
        c.set(&format!("k{i}"), b"", soon()).unwrap();
    }
    let e = c.claim("k50", b"", soon()).unwrap_err().to_string();
    assert!(e.contains("holds 50 keys") && e.contains("limits: 50 keys"), "{e}");
}

#[test]
fn oversized_values_are_refused_and_the_connection_goes_on() {
    let (_s, addr) = server(StoreLimits { max_value_bytes: 1024, ..StoreLimits::default() });
    let mut c = StoreClient::connect(&addr, soon()).unwrap();
    let e = c.set("big", &[0u8; 2048], soon()).unwrap_err().to_string();
    assert!(e.contains("2048 bytes exceeds the store's limit of 1024"), "{e}");
    c.set("small", b"ok", soon()).unwrap();
    assert_eq!(c.get("small", soon()).unwrap(), Some(b"ok".to_vec()));
    // Past the protocol's own limit the client refuses before sending anything.
    let e = c.set("huge", &vec![0u8; MAX_VALUE_BYTES + 1], soon()).unwrap_err().to_string();
    assert!(e.contains("values up to 1048576"), "{e}");
}

/// A client that has sent one request (a set of `key`).
fn client(addr: &str, key: &str) -> StoreClient {
    let mut c = StoreClient::connect(addr, soon()).unwrap();
    c.set(key, b"", soon()).unwrap();
    c
}

/// A client that has won the claim of `key`.
fn claimant(addr: &str, key: &str) -> StoreClient {
    let mut c = StoreClient::connect(addr, soon()).unwrap();
    assert_eq!(c.claim(key, b"me", soon()).unwrap(), Claim::Won, "{key}");
    c
}

/// Whether `c`'s connection was closed by the store (evicted): its next request fails.
fn was_evicted(c: &mut StoreClient) -> bool {
    c.set("still-here", b"", soon()).is_err()
}

#[test]
fn connections_give_way_to_ranks_and_are_refused_only_when_all_are_ranks() {
    // A job of 2 ranks, 4 connections: the ranks' two, and two others.
    let limits = StoreLimits { max_connections: 4, world_size: 2, ..StoreLimits::default() };
    let (s, addr) = server(limits);
    let _ranks = [claimant(&addr, "rank/0"), claimant(&addr, "rank/1")];
    assert_eq!(s.rank_connections(), 2);
    let (mut a, mut b) = (client(&addr, "a"), client(&addr, "b"));
    // A newcomer evicts the oldest connection that is not a rank's (a), not the ranks'.
    let mut c = client(&addr, "c");
    assert!(s.wait_for_connections(4, soon()));
    assert!(was_evicted(&mut a), "the oldest non-rank connection gives way");
    // Claims that are no rank's do not protect a connection: another rank's key, a rank past
    // the world size, a rank written with a leading zero or a sign.
    for key in ["rank/01", "rank/+1", "rank/2", "ranks/0"] {
        assert_eq!(c.claim(key, b"", soon()).unwrap(), Claim::Won, "{key}");
    }
    assert_eq!(s.rank_connections(), 2);
    let _d = client(&addr, "d"); // evicts b
    let _e = client(&addr, "e"); // evicts c
    assert!(was_evicted(&mut b) && was_evicted(&mut c));
    assert!(s.connections() <= 4 && s.rank_connections() == 2);

    // A connection evicted while it waits in a get is let go at once.
    let limits = StoreLimits { max_connections: 2, world_size: 1, ..StoreLimits::default() };
    let (_s, addr) = server(limits);
    let _rank = claimant(&addr, "rank/0");
    let mut waiter = client(&addr, "w");
    let t = Instant::now();
    let waiting = std::thread::spawn(move || waiter.get("never", Instant::now() + Duration::from_secs(30)));
    std::thread::sleep(Duration::from_millis(100));
    let _newcomer = client(&addr, "n");
    let e = waiting.join().unwrap().unwrap_err().to_string();
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert!(e.contains("closed the connection") || e.contains("evicted") || e.contains("make room"), "{e}");

    // When every connection is a rank's, a newcomer is refused with the reason.
    let limits = StoreLimits { max_connections: 4, world_size: 4, ..StoreLimits::default() };
    let (s, addr) = server(limits);
    let mut held: Vec<StoreClient> = (0..4).map(|r| claimant(&addr, &format!("rank/{r}"))).collect();
    let e = StoreClient::connect(&addr, soon()).unwrap().set("x", b"", soon()).unwrap_err().to_string();
    assert!(e.contains("too many connections (limit 4), every one a rank's"), "{e}");
    // A slot frees when a client leaves.
    held.pop();
    assert!(s.wait_for_connections(3, soon()));
    assert!(s.wait_for_rank_connections(3, soon()));
    client(&addr, "x");
}

#[test]
fn clients_that_stall_or_never_speak_are_dropped_and_release_their_budget() {
    let limits = StoreLimits {
        max_in_flight_bytes: 600 << 10,
        frame_timeout: Duration::from_millis(300),
        ..StoreLimits::default()
    };
    let (s, addr) = server(limits);
    // One connection never speaks; another announces a 512 KiB value and sends 10 bytes of it.
    let mut silent = TcpStream::connect(&addr).unwrap();
    let mut stalled = TcpStream::connect(&addr).unwrap();
    let f = frame(1, b"k", &vec![0u8; 512 << 10]);
    stalled.write_all(&f[..f.len() - (512 << 10) + 10]).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    // While the stalled frame holds its 512 KiB, a 200 KiB value does not fit in flight...
    let mut c = StoreClient::connect(&addr, soon()).unwrap();
    let e = c.set("v", &vec![1u8; 200 << 10], soon()).unwrap_err().to_string();
    assert!(e.contains("receiving too much at once"), "{e}");
    // ...until the server drops both (frame timeout), and then it does.
    for conn in [&mut silent, &mut stalled] {
        conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let t = Instant::now();
        assert_eq!(conn.read(&mut [0u8; 16]).unwrap_or(0), 0, "the server should close it");
        assert!(t.elapsed() < Duration::from_secs(2));
    }
    assert!(s.wait_for_connections(1, soon()), "only the legitimate client is left");
    c.set("v", &vec![1u8; 200 << 10], soon()).unwrap();
}

/// Sets 1 MiB values under new keys from `conns` connections until the store refuses, then
/// empty ones until not even those fit; returns how many MiB it took.
fn flood_bytes(addr: &str, conns: usize) -> usize {
    let workers: Vec<_> = (0..conns)
        .map(|w| {
            let addr = addr.to_string();
            std::thread::spawn(move || {
                let mut c = StoreClient::connect(&addr, soon()).unwrap();
                let value = vec![0x5a; MAX_VALUE_BYTES];
                for i in 0.. {
                    if let Err(e) = c.set(&format!("flood/{w}/{i}"), &value, soon()) {
                        assert!(e.to_string().contains("the store is full"), "{e}");
                        return i;
                    }
                }
                unreachable!()
            })
        })
        .collect();
    let mib = workers.into_iter().map(|w| w.join().unwrap()).sum();
    let mut c = StoreClient::connect(addr, soon()).unwrap();
    for i in 0.. {
        if c.set(&format!("small/{i}"), b"", soon()).is_err() {
            break;
        }
        assert!(i < MAX_VALUE_BYTES, "small keys never refused");
    }
    mib
}

#[test]
fn a_flood_keeps_rank_zeros_memory_bounded_and_legitimate_ranks_finish_cleanly() {
    const MIB: u64 = 1 << 20;
    // Job A: the byte flood fills rank 0's store; rank 1 then fails cleanly, naming the full
    // store, and rank 0 names the rank that never arrived, both by their deadlines.
    let port = free_port();
    let zero = timed(probe(0, 2, port, 6));
    wait_listening(port, Duration::from_secs(10));
    let before = rss_bytes(zero.child.id());
    let stored = flood_bytes(&format!("127.0.0.1:{port}"), 4);
    let after = rss_bytes(zero.child.id());
    eprintln!("byte flood: {stored} MiB stored; rank 0 RSS {} -> {} MiB", before / MIB, after / MIB);
    assert!(stored as u64 <= MAX_STORE_BYTES as u64 / MIB && stored >= 60, "{stored}");
    assert!(after < before + MAX_STORE_BYTES as u64 + 48 * MIB, "rank 0 grew to {} MiB", after / MIB);
    let one = timed(probe(1, 2, port, 6));
    let results = finish_timed(vec![zero, one], Duration::from_secs(30));
    assert!(!results[1].ok && results[1].err.contains("the store is full"), "{:?}", results[1]);
    assert!(!results[0].ok && results[0].err.contains("never arrived"), "{:?}", results[0]);
    for d in &results {
        assert_eq!(d.err.trim_end().lines().count(), 1, "{d:?}");
        assert!(d.took < Duration::from_secs(6) + tp_comm::DEADLINE_SLACK + Duration::from_millis(500), "{d:?}");
    }

    // Job B: a connection flood far past the limit (world size + 64) is never refused: each
    // newcomer evicts the oldest connection that is not a rank's, so connections, threads and
    // memory stay bounded, and rank 1 joins while the flood is held open.
    let port = free_port();
    let zero = timed(probe(0, 2, port, 20));
    wait_listening(port, Duration::from_secs(10));
    let before = rss_bytes(zero.child.id());
    let mut flood = Vec::new();
    for i in 0..200 {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.write_all(&frame(2, b"never", &0u64.to_le_bytes())).unwrap(); // a GET that waits 0 ms
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut reply = vec![0u8; 256];
        let n = s.read(&mut reply).unwrap_or(0);
        assert_eq!(reply.get(4), Some(&12), "connection {i}: a GET is answered 'missing': {:?}", &reply[..n]);
        flood.push(s);
    }
    let after = rss_bytes(zero.child.id());
    // The flood's connections still open: 64 (66 less rank 0's own and the newest's room).
    let open = flood
        .iter()
        .filter(|s| {
            s.set_nonblocking(true).unwrap();
            let alive = matches!(s.peek(&mut [0u8; 1]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
            s.set_nonblocking(false).unwrap();
            alive
        })
        .count();
    eprintln!("connection flood: {open} of 200 still open; rank 0 RSS {} -> {} MiB", before / MIB, after / MIB);
    assert!((60..=65).contains(&open), "{open} flood connections open");
    assert!(after < before + 64 * MIB, "rank 0 grew to {} MiB", after / MIB);
    let mut one = timed(probe(1, 2, port, 20));
    let until = Instant::now() + Duration::from_secs(30);
    while one.child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < until, "rank 1 did not finish beside the flood");
        std::thread::sleep(Duration::from_millis(10));
    }
    // Rank 0 leaves once the others have disconnected: the flood too (it waits for every
    // connection, not only ranks').
    drop(flood);
    let results = finish_timed(vec![zero, one], Duration::from_secs(60));
    for (r, d) in results.iter().enumerate() {
        assert!(d.ok && d.out.contains(&format!("rank {r}: ok")), "rank {r}: {d:?}");
    }
}

#[test]
fn no_request_waits_past_the_stores_longest_wait() {
    // A rendezvous's store waits at most its job's timeout, whatever a client asks for.
    let (_s, addr) = server(StoreLimits { max_wait: Duration::from_millis(300), ..StoreLimits::default() });
    let mut c = StoreClient::connect(&addr, soon()).unwrap();
    let far = Instant::now() + Duration::from_secs(3600);
    let t = Instant::now();
    assert_eq!(c.get("never", far).unwrap(), None);
    let missing = c.wait_all("rank", 3, far).unwrap();
    assert_eq!((missing.count, missing.ranks.clone()), (3, vec![0, 1, 2]));
    assert_eq!(missing.to_string(), "[0, 1, 2]");
    let took = t.elapsed();
    assert!(took >= Duration::from_millis(600) && took < Duration::from_secs(3), "{took:?}");
}
