//! The rendezvous keeps its deadline, measured on real `tp-probe` processes: a missing rank, or
//! a rank 0 that is stopped (SIGSTOP) before or during the rendezvous, gives every rank its
//! error within `TP_TIMEOUT_SECS + DEADLINE_SLACK`; a rank stopped and resumed within the
//! deadline does not break a healthy job.

mod common;
use common::{Done, finish_timed, free_port, probe, signal, timed, wait_listening};
use std::time::Duration;
use tp_comm::DEADLINE_SLACK;

/// What a process's own start-up and the 10 ms exit polling may add to its measured time.
const STARTUP: Duration = Duration::from_millis(500);

/// Every process failed between `t - STARTUP` and `t + DEADLINE_SLACK + STARTUP` after its start.
fn failed_at_the_deadline(results: &[Done], t: Duration, needle: &str) {
    for d in results {
        eprintln!("failed after {:?} (deadline {t:?})", d.took);
        assert!(!d.ok, "{d:?}");
        assert!(d.err.contains(needle), "{d:?}");
        assert_eq!(d.err.trim_end().lines().count(), 1, "one line: {d:?}");
        assert!(d.took + STARTUP >= t, "failed before the deadline: {d:?}");
        assert!(d.took <= t + DEADLINE_SLACK + STARTUP, "failed {:?} after the deadline: {d:?}", d.took - t);
    }
}

#[test]
fn a_missing_rank_fails_every_rank_within_the_deadline_plus_slack() {
    let (t, port) = (2, free_port());
    let kids = vec![timed(probe(0, 3, port, t)), timed(probe(1, 3, port, t))];
    let results = finish_timed(kids, Duration::from_secs(20));
    failed_at_the_deadline(&results, Duration::from_secs(t), "never arrived");
    for d in &results {
        assert!(d.err.contains("[2]"), "{d:?}");
    }
}

#[test]
fn a_stopped_rank_zero_fails_the_others_within_the_deadline_plus_slack() {
    let t = 2;
    // Stopped before the others arrive, and stopped while they wait for a missing rank.
    for stop_late in [false, true] {
        let port = free_port();
        let zero = probe(0, 3, port, 30);
        wait_listening(port, Duration::from_secs(10));
        if !stop_late {
            assert!(signal(&zero, "STOP"));
        }
        let one = timed(probe(1, 3, port, t));
        if stop_late {
            std::thread::sleep(Duration::from_millis(300));
            assert!(signal(&zero, "STOP"));
        }
        let results = finish_timed(vec![one], Duration::from_secs(20));
        signal(&zero, "KILL");
        let mut zero = zero;
        let _ = zero.wait();
        failed_at_the_deadline(&results, Duration::from_secs(t), "did not answer");
        assert!(results[0].err.contains("stopped"), "{:?}", results[0]);
    }
}

#[test]
fn ranks_stopped_and_resumed_within_the_deadline_still_complete() {
    // Ranks 0 and 1 wait for rank 2 in blocking socket reads; each is stopped for half a
    // second and resumed (Ctrl-Z / fg, SLURM suspend, a debugger), which interrupts those reads
    // with EINTR. Then rank 2 arrives and the job must complete.
    let port = free_port();
    let zero = probe(0, 3, port, 8);
    let one = probe(1, 3, port, 8);
    std::thread::sleep(Duration::from_millis(400));
    for (who, name) in [(&one, "rank 1"), (&zero, "rank 0"), (&one, "rank 1 again")] {
        assert!(signal(who, "STOP"), "{name}");
        std::thread::sleep(Duration::from_millis(500));
        assert!(signal(who, "CONT"), "{name}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let two = probe(2, 3, port, 8);
    let results = finish_timed(vec![timed(zero), timed(one), timed(two)], Duration::from_secs(30));
    for (r, d) in results.iter().enumerate() {
        assert!(d.ok && d.out.contains(&format!("rank {r}: ok")), "rank {r}: {d:?}");
    }
}
