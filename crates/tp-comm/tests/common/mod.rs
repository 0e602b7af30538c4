//! Shared helpers for the multi-process tests: real `tp-probe` processes on loopback, waited
//! for with a limit, timed, stopped and resumed.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A port for rank 0's store, outside the ephemeral range so that no other test's connection
/// takes it before rank 0 binds it.
pub fn free_port() -> u16 {
    tp_comm::free_local_port().expect("a free loopback port")
}

/// A `tp-probe` command for one rank, output captured; callers may add or override variables.
pub fn probe_cmd(rank: usize, world: usize, port: u16, timeout_secs: u64) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tp-probe"));
    c.env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("TP_TIMEOUT_SECS", timeout_secs.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

pub fn probe(rank: usize, world: usize, port: u16, timeout_secs: u64) -> Child {
    probe_cmd(rank, world, port, timeout_secs).spawn().expect("spawn tp-probe")
}

/// A started process and when it was started.
pub struct Timed {
    pub child: Child,
    pub started: Instant,
}

pub fn timed(child: Child) -> Timed {
    Timed { child, started: Instant::now() }
}

/// How a process ended.
#[derive(Debug)]
pub struct Done {
    pub ok: bool,
    pub out: String,
    pub err: String,
    /// From its start to its exit (polled every 10 ms).
    pub took: Duration,
}

/// Waits for every process, killing all and failing the test if any outlives `limit`.
pub fn finish_timed(mut kids: Vec<Timed>, limit: Duration) -> Vec<Done> {
    let deadline = Instant::now() + limit;
    let mut done: Vec<Option<Done>> = kids.iter().map(|_| None).collect();
    while done.iter().any(Option::is_none) {
        for (k, d) in kids.iter_mut().zip(done.iter_mut()) {
            if d.is_some() {
                continue;
            }
            if let Some(status) = k.child.try_wait().unwrap() {
                let took = k.started.elapsed();
                let (mut out, mut err) = (String::new(), String::new());
                k.child.stdout.take().unwrap().read_to_string(&mut out).unwrap();
                k.child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
                *d = Some(Done { ok: status.success(), out, err, took });
            }
        }
        if Instant::now() > deadline {
            for k in &mut kids {
                let _ = signal(&k.child, "CONT");
                let _ = k.child.kill();
                let _ = k.child.wait();
            }
            panic!("a tp-probe process hung past {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    done.into_iter().map(Option::unwrap).collect()
}

/// Waits for every child, killing any that outlives `limit`; returns (exit ok, stdout, stderr).
pub fn finish(children: Vec<Child>, limit: Duration) -> Vec<(bool, String, String)> {
    finish_timed(children.into_iter().map(timed).collect(), limit).into_iter().map(|d| (d.ok, d.out, d.err)).collect()
}

/// Sends `SIG{name}` (STOP, CONT, KILL) to `child` with `kill(1)`.
pub fn signal(child: &Child, name: &str) -> bool {
    Command::new("kill").arg(format!("-{name}")).arg(child.id().to_string()).status().is_ok_and(|s| s.success())
}

/// Waits until something listens on `port` (rank 0's store is up), at most `limit`.
pub fn wait_listening(port: u16, limit: Duration) {
    let deadline = Instant::now() + limit;
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "nothing listens on port {port} after {limit:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Resident memory of process `pid` in bytes (Linux: VmRSS in /proc/PID/status).
pub fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS line");
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

/// One store frame's bytes (magic, op, u32 key length, key, u32 value length, value).
pub fn frame(op: u8, key: &[u8], value: &[u8]) -> Vec<u8> {
    let mut f = b"TPS1".to_vec();
    f.push(op);
    f.extend_from_slice(&(key.len() as u32).to_le_bytes());
    f.extend_from_slice(key);
    f.extend_from_slice(&(value.len() as u32).to_le_bytes());
    f.extend_from_slice(value);
    f
}

/// Reads one frame from `s`: (op, value).
pub fn read_frame(s: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; 9];
    s.read_exact(&mut head)?;
    let klen = u32::from_le_bytes(head[5..9].try_into().unwrap()) as usize;
    let mut key = vec![0u8; klen];
    s.read_exact(&mut key)?;
    let mut vlen = [0u8; 4];
    s.read_exact(&mut vlen)?;
    let mut value = vec![0u8; u32::from_le_bytes(vlen) as usize];
    s.read_exact(&mut value)?;
    Ok((head[4], value))
}

/// A fake store on `127.0.0.1`: for each connection it accepts, reads requests and answers the
/// n-th one with `replies[n]` (op, value); past the list it reads and never answers. Returns
/// its address.
pub fn fake_store(replies: Vec<(u8, Vec<u8>)>) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut s) = conn else { return };
            let replies = replies.clone();
            std::thread::spawn(move || {
                for (op, value) in replies {
                    if read_frame(&mut s).is_err() || s.write_all(&frame(op, b"", &value)).is_err() {
                        return;
                    }
                }
                let mut sink = [0u8; 256];
                while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
            });
        }
    });
    addr
}
