//! Connections give way to ranks: a store full of a stray client's connections, idle or busy
//! and reconnecting as they are evicted, still lets a job's ranks in, and its connections and
//! threads stay bounded while it does. (One test in this file: it counts the process's threads.)

mod common;
use common::{frame, free_port, read_frame};
use std::collections::HashMap;
use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tp_comm::{LaunchEnv, Rendezvous};

const OP_GET: u8 = 2;
const R_MISSING: u8 = 12;

fn env(rank: usize, port: u16) -> LaunchEnv {
    let m: HashMap<&str, String> = [
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", "2".to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", port.to_string()),
        ("TP_TIMEOUT_SECS", "20".to_string()),
    ]
    .into_iter()
    .collect();
    LaunchEnv::from_lookup(|k| m.get(k).cloned()).unwrap()
}

fn threads() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status.lines().find_map(|l| l.strip_prefix("Threads:")).unwrap().trim().parse().unwrap()
}

/// One GET of a key nobody sets, waiting 0 ms; true if the store answered "missing".
fn get_once(s: &mut TcpStream, i: u64) -> bool {
    let key = format!("stray/{i:016x}");
    s.write_all(&frame(OP_GET, key.as_bytes(), &0u64.to_le_bytes())).is_ok()
        && read_frame(s).is_ok_and(|(op, _)| op == R_MISSING)
}

fn connect(port: u16) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

/// A stray client: `n` connections, each sending a GET about once a second. An evicted one is
/// replaced by a new connection, at most 20 a second (a client that retries, not a deliberate
/// flood: one that opened 64 connections within the few milliseconds a joining rank takes to
/// register could evict it). Counts the GETs answered and the evictions seen.
fn chatter(port: u16, n: usize, stop: Arc<AtomicBool>, answered: Arc<AtomicUsize>, evicted: Arc<AtomicUsize>) {
    let mut conns: Vec<Option<TcpStream>> = (0..n).map(|_| Some(connect(port))).collect();
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let mut reconnects = 0;
        for slot in conns.iter_mut() {
            i += 1;
            match slot.as_mut().map(|s| get_once(s, i)) {
                Some(true) => {
                    answered.fetch_add(1, Ordering::Relaxed);
                }
                Some(false) => {
                    evicted.fetch_add(1, Ordering::Relaxed);
                    *slot = None;
                }
                None if reconnects < 20 => {
                    reconnects += 1;
                    *slot = Some(connect(port));
                }
                None => {}
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

#[test]
fn a_store_full_of_stray_connections_lets_the_ranks_in() {
    let port = free_port();
    let base = threads();
    // Rank 0 starts its store (world size 2: 66 connections) and waits for rank 1.
    let zero = std::thread::spawn(move || Rendezvous::join(&env(0, port)));
    let until = Instant::now() + Duration::from_secs(10);
    let mut idle = Vec::new();
    while idle.is_empty() {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => idle.push(s),
            Err(_) => assert!(Instant::now() < until, "rank 0's store never listened"),
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // 200 connections that never speak, then 200 that keep asking.
    idle.extend((1..200).map(|_| connect(port)));
    let stop = Arc::new(AtomicBool::new(false));
    let (answered, evicted) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let chat = {
        let (stop, answered, evicted) = (stop.clone(), answered.clone(), evicted.clone());
        std::thread::spawn(move || chatter(port, 200, stop, answered, evicted))
    };
    // Let the flood fill the store: until the chatter's connections have both been answered
    // and been evicted (a fresh connection's answer shows the store full of them, and talking).
    let until = Instant::now() + Duration::from_secs(30);
    while answered.load(Ordering::Relaxed) < 10 || evicted.load(Ordering::Relaxed) == 0 {
        assert!(Instant::now() < until, "the flood never filled the store");
        std::thread::sleep(Duration::from_millis(50));
    }
    let during = threads();

    // Rank 1 arrives while the flood goes on; both ranks join and pass a barrier.
    let t = Instant::now();
    let one = std::thread::spawn(move || Rendezvous::join(&env(1, port)));
    let mut one = one.join().unwrap().unwrap_or_else(|e| panic!("rank 1: {e}"));
    let mut zero = zero.join().unwrap().unwrap_or_else(|e| panic!("rank 0: {e}"));
    let b = std::thread::spawn(move || one.barrier("after-flood").map(|()| one));
    zero.barrier("after-flood").unwrap();
    let one = b.join().unwrap().unwrap();
    let took = t.elapsed();
    let (answered, evicted) = (answered.load(Ordering::Relaxed), evicted.load(Ordering::Relaxed));
    eprintln!("ranks joined in {took:?} beside the flood; {answered} GETs answered, {evicted} evictions seen");
    eprintln!("threads: {base} before, {during} during the flood");
    assert!(took < Duration::from_secs(5), "{took:?}");
    // The store's threads stayed bounded: 66 connections, the accept loop, rank 0's own
    // connection thread, the chatter and rank 0's thread (a few more for slack).
    assert!(during <= base + 66 + 8, "{during} threads (from {base})");

    // Idle strays that never spoke are gone (evicted, or timed out); the chatter's newest are
    // served. Once the flood stops, rank 0 leaves as soon as rank 1 has.
    stop.store(true, Ordering::Relaxed);
    chat.join().unwrap();
    drop(idle);
    let t = Instant::now();
    drop(one);
    drop(zero);
    assert!(t.elapsed() < Duration::from_secs(5), "rank 0 took {:?} to leave", t.elapsed());
}
