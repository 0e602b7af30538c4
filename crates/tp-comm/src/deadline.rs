//! [`Deadline`]: the one instant by which a wait must end, and the limits on timeouts.
//!
//! An operation computes its deadline once, from its timeout, and hands the same [`Deadline`] to
//! every step (connect, each request, each socket read and write); a step that is interrupted
//! (a signal, a stopped and resumed process) retries with the time *left*, never with a fresh
//! timeout. Building a deadline never panics: timeouts are capped at [`MAX_TIMEOUT`].

use std::time::{Duration, Instant};

/// The longest timeout tp accepts: 7 days (`TP_TIMEOUT_SECS` up to 604800,
/// `LocalGroup::with_timeout`). Longer ones are an error where they are given, and
/// [`Deadline::after`] caps them here.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(7 * 24 * 3600);

/// How long after its deadline a rendezvous error may reach a rank: the time for the store's
/// answer to travel back and for rank 0 to tell the others why it gave up. An error of a
/// rendezvous step whose timeout is `T` reaches every rank within `T + DEADLINE_SLACK`.
pub const DEADLINE_SLACK: Duration = Duration::from_secs(1);

/// An instant by which a wait must end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Deadline(Instant);

impl Deadline {
    /// `timeout` from now (capped at [`MAX_TIMEOUT`]).
    pub fn after(timeout: Duration) -> Deadline {
        let now = Instant::now();
        // A running process's clock is far from overflowing by 7 days; the fallback only keeps
        // this free of panics.
        Deadline(now.checked_add(timeout.min(MAX_TIMEOUT)).unwrap_or(now))
    }

    /// The deadline at `instant`.
    pub fn at(instant: Instant) -> Deadline {
        Deadline(instant)
    }

    /// The instant itself.
    pub fn instant(self) -> Instant {
        self.0
    }

    /// Time left until the deadline; zero once it has passed.
    pub fn remaining(self) -> Duration {
        self.0.saturating_duration_since(Instant::now())
    }

    /// Whether the deadline has passed.
    pub fn has_passed(self) -> bool {
        Instant::now() >= self.0
    }

    /// This deadline moved `by` later (unchanged if that is not representable).
    pub fn extended(self, by: Duration) -> Deadline {
        Deadline(self.0.checked_add(by).unwrap_or(self.0))
    }

    /// The earlier of the two.
    pub fn min(self, other: Deadline) -> Deadline {
        Deadline(self.0.min(other.0))
    }
}

impl From<Instant> for Deadline {
    fn from(instant: Instant) -> Deadline {
        Deadline(instant)
    }
}
