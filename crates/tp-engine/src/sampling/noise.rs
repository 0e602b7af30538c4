//! The sampling noise: a uniform number per `(seed, step, id)` from a counter-based hash, so
//! any rank can compute any id's noise without drawing the others'.

/// SplitMix64's first output from state `z` (Steele, Lea & Flood 2014): its output function on
/// `z + golden gamma`, a bijection of 64-bit words that mixes every input bit into every output
/// bit.
fn mix(z: u64) -> u64 {
    tp_core::rng::SplitMix64::new(z).next_u64()
}

/// The uniform number of id `id` for the token `step` of a request seeded `seed`: one of the
/// 2^52 midpoints `(k + 0.5) / 2^52`, each exact in f64, so strictly inside `(0, 1)` (with 53
/// bits the last midpoint would round to 1).
pub(crate) fn uniform(seed: u64, step: u64, id: usize) -> f64 {
    let h = mix(mix(mix(seed) ^ step) ^ id as u64);
    ((h >> 12) as f64 + 0.5) * (1.0 / (1u64 << 52) as f64)
}

/// `ln(E)` for the exponential variable `E = -ln u` of `(seed, step, id)`; the Gumbel key of an
/// id is `x - ln(E)`. Always finite: within `[-36.8, 3.6]` (u is at least `2^-53` away from 0 and 1).
pub(crate) fn ln_exp(seed: u64, step: u64, id: usize) -> f64 {
    (-uniform(seed, step, id).ln()).ln()
}

/// A bound on `-ln_exp` over every input: `x - ln_exp(..) <= x + LN_EXP_BOUND` for every key.
pub(crate) const LN_EXP_BOUND: f64 = 38.0;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn noise_is_keyed_and_bounded() {
        // Different coordinates give different numbers; the same ones the same number.
        assert_eq!(uniform(1, 2, 3), uniform(1, 2, 3));
        assert_ne!(uniform(1, 2, 3), uniform(1, 2, 4));
        assert_ne!(uniform(1, 2, 3), uniform(1, 3, 3));
        assert_ne!(uniform(1, 2, 3), uniform(2, 2, 3));
        // The extreme midpoints stay within the bound the pruning relies on.
        let half = 0.5 / (1u64 << 52) as f64;
        let (lo, hi) = ((0u64 as f64 + 0.5) * 2f64.powi(-52), (((1u64 << 52) - 1) as f64 + 0.5) * 2f64.powi(-52));
        assert_eq!((lo, hi), (half, 1.0 - half));
        for u in [lo, hi] {
            let l = (-u.ln()).ln();
            assert!(l.is_finite() && -l < LN_EXP_BOUND && l < 4.0, "{u} -> {l}");
        }
        // Mean of u over many ids near 1/2 (a weak check that the hash is not degenerate).
        let mean = (0..100_000).map(|i| uniform(7, 0, i)).sum::<f64>() / 100_000.0;
        assert!((mean - 0.5).abs() < 0.005, "mean {mean}");
    }
}
