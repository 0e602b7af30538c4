//! Learning-rate schedules, exactly as transformers' `get_{constant,linear,cosine}_schedule_with_warmup`
//! drive torch's `LambdaLR`.
//!
//! The rate of optimizer step `s` (counted from 1) is `base_lr * lambda(c)` with `c = s - 1` the
//! 0-based `current_step` that `LambdaLR` passes, `w` the warmup steps and `T` the total steps.
//! Every kind warms up linearly: for `c < w`, `lambda(c) = c / max(1, w)` (so the first step of a
//! warmup runs at rate 0, as in transformers). After the warmup (`c >= w`):
//!
//! - constant: `lambda(c) = 1`
//! - linear: `lambda(c) = max(0, (T - c) / max(1, T - w))`
//! - cosine (`num_cycles = 0.5`): with `p = (c - w) / max(1, T - w)`,
//!   `lambda(c) = max(0, 0.5 * (1 + cos(pi * 0.5 * 2 * p)))`
//!
//! The integer differences are taken as Python does (they may be negative; `max(1, T - w)` is 1
//! when `w >= T`), and everything else in f64.

use std::fmt;
use std::str::FromStr;

use crate::{Result, TrainError};

/// Which schedule follows the warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LrScheduleKind {
    /// `get_constant_schedule_with_warmup`: the base rate after the warmup.
    Constant,
    /// `get_linear_schedule_with_warmup`: linear decay to 0 at `total_steps`.
    Linear,
    /// `get_cosine_schedule_with_warmup` with half a cosine cycle: decay to 0 at `total_steps`.
    Cosine,
}

impl FromStr for LrScheduleKind {
    type Err = TrainError;

    /// Parses `constant`, `linear` or `cosine` (transformers' `lr_scheduler_type` names).
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "constant" => Ok(Self::Constant),
            "linear" => Ok(Self::Linear),
            "cosine" => Ok(Self::Cosine),
            _ => Err(TrainError::UnknownSchedule { name: s.chars().take(64).collect() }),
        }
    }
}

impl fmt::Display for LrScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Constant => "constant",
            Self::Linear => "linear",
            Self::Cosine => "cosine",
        })
    }
}

/// A learning-rate schedule: the kind, the peak rate, the warmup and the total number of steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    /// Its shape after the warmup.
    pub kind: LrScheduleKind,
    /// The rate after the warmup (the peak of the linear and cosine schedules).
    pub base_lr: f64,
    /// Steps of linear warmup from 0 to `base_lr`.
    pub warmup_steps: u64,
    /// The step count the linear and cosine schedules decay over (the rate reaches 0 there).
    pub total_steps: u64,
}

impl LrSchedule {
    /// A schedule whose `base_lr` is checked to be finite and non-negative.
    pub fn new(kind: LrScheduleKind, base_lr: f64, warmup_steps: u64, total_steps: u64) -> Result<Self> {
        if !(base_lr.is_finite() && base_lr >= 0.0) {
            return Err(TrainError::InvalidArgument {
                name: "learning rate",
                value: base_lr.to_string(),
                why: "must be finite and non-negative",
            });
        }
        Ok(Self { kind, base_lr, warmup_steps, total_steps })
    }

    /// The rate of optimizer step `step` (counted from 1): `base_lr * lambda(step - 1)`.
    /// Step 0 is read as step 1.
    pub fn lr(&self, step: u64) -> f64 {
        self.base_lr * self.lambda(step.saturating_sub(1))
    }

    /// The multiplier of transformers' lr lambda at the 0-based `current_step`.
    pub fn lambda(&self, current_step: u64) -> f64 {
        let (c, w, t) = (i128::from(current_step), i128::from(self.warmup_steps), i128::from(self.total_steps));
        if c < w {
            return c as f64 / w.max(1) as f64;
        }
        let decay_span = (t - w).max(1) as f64;
        match self.kind {
            LrScheduleKind::Constant => 1.0,
            LrScheduleKind::Linear => ((t - c) as f64 / decay_span).max(0.0),
            LrScheduleKind::Cosine => {
                let num_cycles = 0.5;
                let progress = (c - w) as f64 / decay_span;
                (0.5 * (1.0 + (std::f64::consts::PI * num_cycles * 2.0 * progress).cos())).max(0.0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(kind: LrScheduleKind, warmup: u64, total: u64) -> LrSchedule {
        LrSchedule::new(kind, 2.0, warmup, total).unwrap()
    }

    fn rates(s: &LrSchedule, steps: u64) -> Vec<f64> {
        (1..=steps).map(|k| s.lr(k)).collect()
    }

    fn assert_close(got: &[f64], want: &[f64]) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= 1e-12, "step {}: got {g}, want {w}", i + 1);
        }
    }

    #[test]
    fn parses_and_prints_the_kinds() {
        for name in ["constant", "linear", "cosine"] {
            assert_eq!(name.parse::<LrScheduleKind>().unwrap().to_string(), name);
        }
        let err = "cosine_with_restarts".parse::<LrScheduleKind>().unwrap_err();
        assert!(err.to_string().contains("\"cosine_with_restarts\""), "{err}");
    }

    #[test]
    fn rejects_a_bad_base_rate() {
        assert!(LrSchedule::new(LrScheduleKind::Constant, -1e-3, 0, 10).is_err());
        assert!(LrSchedule::new(LrScheduleKind::Constant, f64::NAN, 0, 10).is_err());
        assert!(LrSchedule::new(LrScheduleKind::Constant, 0.0, 0, 10).is_ok());
    }

    #[test]
    fn constant_with_warmup() {
        // Python: [2 * (c / 4 if c < 4 else 1) for c in range(6)]
        assert_close(&rates(&sched(LrScheduleKind::Constant, 4, 10), 6), &[0.0, 0.5, 1.0, 1.5, 2.0, 2.0]);
        assert_close(&rates(&sched(LrScheduleKind::Constant, 0, 3), 4), &[2.0; 4]);
        // warmup >= total: the warmup still runs to its end, then the rate is flat.
        assert_close(&rates(&sched(LrScheduleKind::Constant, 5, 2), 7), &[0.0, 0.4, 0.8, 1.2, 1.6, 2.0, 2.0]);
    }

    #[test]
    fn linear_with_warmup() {
        // warmup 2, total 6: c < 2 -> c/2; else (6 - c) / 4.
        assert_close(&rates(&sched(LrScheduleKind::Linear, 2, 6), 8), &[0.0, 1.0, 2.0, 1.5, 1.0, 0.5, 0.0, 0.0]);
        // warmup 0, total 4: (4 - c) / 4.
        assert_close(&rates(&sched(LrScheduleKind::Linear, 0, 4), 5), &[2.0, 1.5, 1.0, 0.5, 0.0]);
        // warmup 4 >= total 3: after the warmup max(0, (3 - c) / 1) is 0.
        assert_close(&rates(&sched(LrScheduleKind::Linear, 4, 3), 6), &[0.0, 0.5, 1.0, 1.5, 0.0, 0.0]);
        // warmup == total: the step at c == w is (T - c) / 1 = 0.
        assert_close(&rates(&sched(LrScheduleKind::Linear, 2, 2), 3), &[0.0, 1.0, 0.0]);
        // total 0, warmup 0: every step past the end.
        assert_close(&rates(&sched(LrScheduleKind::Linear, 0, 0), 2), &[0.0, 0.0]);
    }

    #[test]
    fn cosine_with_warmup() {
        // warmup 1, total 5: c = 0 -> 0; else p = (c - 1) / 4, 0.5 * (1 + cos(pi p)).
        let h = std::f64::consts::FRAC_1_SQRT_2;
        let want = [0.0, 2.0, 1.0 + h, 1.0, 1.0 - h, 0.0, 1.0 - h];
        // Past the end the cosine comes back up (p = 1.25 at c = 6), as in transformers.
        assert_close(&rates(&sched(LrScheduleKind::Cosine, 1, 5), 7), &want);
        // warmup 0, total 2: p = c / 2.
        assert_close(&rates(&sched(LrScheduleKind::Cosine, 0, 2), 3), &[2.0, 1.0, 0.0]);
        // warmup 3 >= total 2: p = (c - 3) / 1.
        assert_close(&rates(&sched(LrScheduleKind::Cosine, 3, 2), 6), &[0.0, 2.0 / 3.0, 4.0 / 3.0, 2.0, 0.0, 2.0]);
    }

    #[test]
    fn step_zero_is_step_one_and_huge_steps_do_not_overflow() {
        let s = sched(LrScheduleKind::Linear, 2, 6);
        assert_eq!(s.lr(0), s.lr(1));
        assert_eq!(s.lr(u64::MAX), 0.0);
        assert_eq!(
            sched(LrScheduleKind::Constant, u64::MAX, u64::MAX).lr(u64::MAX),
            2.0 * ((u64::MAX - 1) as f64 / u64::MAX as f64)
        );
    }
}
