//! Shared by the tests: a seeded generator of values and block scales.
#![allow(dead_code)] // each test binary uses some of it

/// xorshift64.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// A sane finite `f16` scale: sign, magnitude in [2^-12, 2^2).
    pub fn scale(&mut self) -> [u8; 2] {
        let mag = 2f32.powf(-12.0 + 14.0 * (self.unit() * 0.5 + 0.5));
        let v = if self.next() & 1 == 0 { mag } else { -mag };
        half::f16::from_f32(v).to_bits().to_le_bytes()
    }
}
