//! A small seeded generator for test and benchmark data (SplitMix64; Steele, Lea & Flood 2014).
//!
//! Deterministic across platforms for a given seed, so a failing random test can be replayed.
//! Not for cryptography.

/// SplitMix64 state.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator whose whole stream is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.next_f64()
    }

    /// Standard normal (Box–Muller; one draw per call).
    pub fn normal(&mut self) -> f64 {
        // 1 - u is in (0, 1], so the log is finite.
        let u1 = 1.0 - self.next_f64();
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Uniform integer in `[lo, hi]` (inclusive). `lo > hi` is treated as `[hi, lo]`.
    pub fn int_in(&mut self, lo: i64, hi: i64) -> i64 {
        let (lo, hi) = if lo <= hi { (lo, hi) } else { (hi, lo) };
        let span = hi.abs_diff(lo).wrapping_add(1);
        if span == 0 {
            return self.next_u64() as i64; // the full 64-bit range
        }
        // Multiply-shift maps 64 random bits onto [0, span) with negligible bias.
        let offset = ((u128::from(self.next_u64()) * u128::from(span)) >> 64) as u64;
        lo.wrapping_add(offset as i64)
    }
}
