//! The process's peak resident memory, step by step, for `tp train --log-json` (Linux).
//!
//! The kernel keeps a high-water mark of resident memory (`VmHWM` in `/proc/self/status`) and
//! resets it to the current resident size when `5` is written to `/proc/self/clear_refs`. So
//! reading it at the end of a step and resetting it right after gives each step's peak: the most
//! memory the process held at once during that step (for the first, loading included). With
//! ranks as threads it is the whole process's; with a process per rank, the logging rank's.
//! Elsewhere (or where `/proc` is not readable) there is no figure.

/// The peak resident bytes since the last call (or the start), and a reset for the next.
pub(crate) fn take() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: u64 =
        status.lines().find_map(|l| l.strip_prefix("VmHWM:"))?.trim().strip_suffix("kB")?.trim().parse().ok()?;
    // Best effort: without the reset the next figure is the peak since an earlier step.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    /// A step that touches 64 MiB more than the last reports at least that much more.
    #[test]
    fn a_step_s_peak_covers_what_it_touched() {
        if !cfg!(target_os = "linux") {
            return;
        }
        super::take().expect("VmHWM in /proc/self/status");
        let before = super::take().unwrap();
        let block = vec![1u8; 64 << 20];
        std::hint::black_box(&block);
        drop(block);
        let during = super::take().unwrap();
        assert!(during >= before + (60 << 20), "{before} then {during}");
        let after = super::take().unwrap();
        assert!(after + (32 << 20) < during, "the reset did not take: {during} then {after}");
    }
}
