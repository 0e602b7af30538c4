//! A free loopback port for rank 0's store, for launchers that start the ranks themselves.

use std::collections::HashSet;
use std::net::TcpListener;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};
use tp_core::rng::SplitMix64;

/// Lowest port tried: below it lie well-known and registered services.
const LOWEST: u16 = 10_000;

/// Records `port` as handed out by this process; false if it already was.
fn handed_out(port: u16) -> bool {
    static GIVEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    given.get_or_insert_with(HashSet::new).insert(port)
}

/// The kernel's range for outgoing connections' local ports, from
/// `/proc/sys/net/ipv4/ip_local_port_range` (Linux's default 32768..=60999 where unreadable).
fn ephemeral_range() -> (u16, u16) {
    let read = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok();
    let parsed = read.and_then(|s| {
        let mut it = s.split_whitespace().map(|v| v.parse::<u16>().ok());
        Some((it.next()??, it.next()??))
    });
    match parsed {
        Some((lo, hi)) if lo <= hi => (lo, hi),
        _ => (32_768, 60_999),
    }
}

/// A loopback TCP port that is free now, for `MASTER_PORT` of a job this process launches.
///
/// The port is outside the kernel's ephemeral range, so no outgoing connection of this machine
/// can take it before rank 0 binds it (a port from `bind(0)` can be: it comes from that range).
/// Candidates are drawn at random (mixing the clock, the process id and a per-process count, so
/// that callers at the same instant get different ports), and a port this process handed out
/// before is never handed out again (two jobs of one process, tests side by side, whose rank 0s
/// have not bound yet would otherwise both get it). Another program binding that exact port in
/// between is still possible, and rank 0 then reports the port in use. Tries up to 256
/// candidates; `None` if none was free.
pub fn free_local_port() -> Option<u16> {
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let (eph_lo, eph_hi) = ephemeral_range();
    // Allowed ports: LOWEST..eph_lo and eph_hi+1..=65535, indexed as one list.
    let below = u64::from(eph_lo.saturating_sub(LOWEST));
    let above = u64::from(u16::MAX - eph_hi.max(LOWEST - 1));
    let allowed = below + above;
    if allowed == 0 {
        return None;
    }
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    let call = CALLS.fetch_add(1, Ordering::Relaxed);
    let mut rng =
        SplitMix64::new(nanos ^ (u64::from(std::process::id()) << 32) ^ call.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    for _ in 0..256 {
        let i = rng.next_u64() % allowed;
        let port = if i < below { LOWEST as u64 + i } else { u64::from(eph_hi.max(LOWEST - 1)) + 1 + (i - below) };
        let port = port as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() && handed_out(port) {
            return Some(port);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_port_is_free_and_outside_the_ephemeral_range() {
        let (lo, hi) = ephemeral_range();
        for _ in 0..20 {
            let p = free_local_port().expect("a free port");
            assert!(p >= LOWEST && !(lo..=hi).contains(&p), "{p} in {lo}..={hi}");
            TcpListener::bind(("127.0.0.1", p)).expect("still free");
        }
    }

    #[test]
    fn no_port_is_handed_out_twice() {
        let ports: Vec<u16> = (0..200).map(|_| free_local_port().expect("a free port")).collect();
        let distinct: HashSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len());
    }
}
