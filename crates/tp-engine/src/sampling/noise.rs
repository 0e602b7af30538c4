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

/// Whether the Gumbel key `x - ln_exp(seed, step, id)` may reach `best`, by a bound that takes
/// no logarithm: `false` only where the key, as computed, is below `best`.
///
/// With `u` the id's uniform number and `t = x - best`: `E = -ln u >= 1 - u`, and
/// `B = 2^(floor(t log2 e) + 2) >= 2 e^t`; where `1 - u > B`, `ln E > t + ln 2`, so the key is
/// below `best - 0.69`, a margin far above the roundings of `ln`, `ln` and the subtraction as
/// long as the logits are far below `2^40` in size (elsewhere the answer is `true`). Most
/// columns of a row fail this test, so the sampler takes two logarithms only for the few that
/// can win.
pub(crate) fn may_reach(x: f64, best: f64, seed: u64, step: u64, id: usize) -> bool {
    const LIMIT: f64 = (1u64 << 40) as f64;
    if !(x.abs() < LIMIT && best.abs() < LIMIT) {
        return true;
    }
    let a = (x - best) * std::f64::consts::LOG2_E;
    if a >= -2.0 {
        return true;
    }
    if a < -1000.0 {
        return false;
    }
    // 2^k as its bits, `k >= -998` a normal exponent.
    let k = a.floor() as i64 + 2;
    let bound = f64::from_bits(((k + 1023) as u64) << 52);
    1.0 - uniform(seed, step, id) <= bound
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_ruled_out_by_the_bound_is_below_the_best() {
        // Random logits and bests, many ids: wherever `may_reach` says no, the key as the
        // sampler computes it is below the best; and the bound rules out most far columns.
        let mut rng = tp_core::rng::SplitMix64::new(11);
        let (mut ruled_out, mut far) = (0usize, 0usize);
        for i in 0..400_000usize {
            let r = |rng: &mut tp_core::rng::SplitMix64| (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            let scale = [1.0, 30.0, 1e4, 1e11][i % 4];
            let best = (r(&mut rng) - 0.5) * scale;
            let x = best - r(&mut rng) * 40.0 * r(&mut rng);
            let (seed, step) = (rng.next_u64() % 7, rng.next_u64() % 5);
            let key = x - ln_exp(seed, step, i);
            if !may_reach(x, best, seed, step, i) {
                assert!(key < best, "x {x} best {best} id {i}: key {key} ruled out");
                ruled_out += 1;
            }
            far += usize::from(x < best - 8.0 && scale < 1e11);
        }
        assert!(ruled_out * 10 >= far * 9, "{ruled_out} ruled out of {far} far columns");
        // Logits too large for the margin, equal to the best, or not finite are left to the
        // full computation.
        assert!(may_reach(2e12, 2e12 + 100.0, 1, 1, 1));
        assert!(may_reach(5.0, 5.0, 1, 1, 1));
        assert!(may_reach(f64::NEG_INFINITY, 0.0, 1, 1, 1));
        assert!(may_reach(f64::NAN, 0.0, 1, 1, 1));
    }

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
