//! Speculative decoding by n-gram prompt lookup (vLLM's `"method": "ngram"`): rank 0 drafts the
//! next tokens of a decoding sequence by finding its last `n` tokens earlier in its own text
//! (the longest `n` from `prompt_lookup_max` down to `prompt_lookup_min`, the latest match) and
//! proposing the up to `num_speculative_tokens` tokens that followed it. One forward pass then
//! feeds the last token and the draft, and every position is sampled with the random draw it
//! would have had anyway (the noise is keyed by the output index), so the tokens are those of a
//! run without speculation; the draft is accepted up to its first token that differs from the
//! sampled one, and the sampled token at that position is kept too.

/// `--speculative-config` for the n-gram method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramConfig {
    /// Most draft tokens per step (`num_speculative_tokens`, at least 1).
    pub num_speculative_tokens: usize,
    /// Longest n-gram looked up (`prompt_lookup_max`).
    pub prompt_lookup_max: usize,
    /// Shortest n-gram looked up (`prompt_lookup_min`, at least 1).
    pub prompt_lookup_min: usize,
}

/// Most draft tokens per step accepted in a configuration.
pub const MAX_SPECULATIVE_TOKENS: usize = 64;

impl NgramConfig {
    /// Checks the ranges; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=MAX_SPECULATIVE_TOKENS).contains(&self.num_speculative_tokens) {
            return Err(format!("num_speculative_tokens must be 1 to {MAX_SPECULATIVE_TOKENS}"));
        }
        if self.prompt_lookup_min == 0 {
            return Err("prompt_lookup_min must be at least 1".into());
        }
        if self.prompt_lookup_max < self.prompt_lookup_min {
            return Err("prompt_lookup_max must be at least prompt_lookup_min".into());
        }
        Ok(())
    }

    /// The draft for a sequence whose tokens so far are `tokens`: at most `limit` tokens (and
    /// `num_speculative_tokens`), empty when no n-gram of the configured lengths recurs.
    pub fn propose(&self, tokens: &[i64], limit: usize) -> Vec<i64> {
        let k = self.num_speculative_tokens.min(limit);
        if k == 0 {
            return Vec::new();
        }
        let len = tokens.len();
        for n in (self.prompt_lookup_min..=self.prompt_lookup_max.min(len.saturating_sub(1))).rev() {
            let pattern = &tokens[len - n..];
            // The latest earlier occurrence with at least one token after it.
            if let Some(start) = (0..len - n).rev().find(|&i| &tokens[i..i + n] == pattern) {
                let from = start + n;
                return tokens[from..(from + k).min(len)].to_vec();
            }
        }
        Vec::new()
    }
}

/// How many of `draft` the sampled tokens accept: `sampled[j]` is the token sampled after the
/// last token and `draft[..j]`; the draft holds while `sampled[j] == draft[j]`. Returns the
/// tokens to append: the matching draft tokens, then the first sampled token that differs (or
/// the one after the whole draft).
pub fn accept(draft: &[i64], sampled: &[i64]) -> usize {
    let matched = draft.iter().zip(sampled).take_while(|(d, s)| d == s).count();
    (matched + 1).min(sampled.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(k: usize, max: usize, min: usize) -> NgramConfig {
        NgramConfig { num_speculative_tokens: k, prompt_lookup_max: max, prompt_lookup_min: min }
    }

    #[test]
    fn drafts_follow_the_latest_longest_match() {
        // "1 2 3 4 5 ... 1 2 3" -> 4 5 follow the earlier "1 2 3".
        let t = [1, 2, 3, 4, 5, 9, 1, 2, 3];
        assert_eq!(cfg(2, 3, 1).propose(&t, 10), vec![4, 5]);
        assert_eq!(cfg(5, 3, 1).propose(&t, 2), vec![4, 5]);
        // The longest n wins over a later shorter match: "7 3" recurs late, "2 3" earlier.
        let t = [2, 3, 8, 7, 3, 6, 2, 3];
        assert_eq!(cfg(1, 2, 1).propose(&t, 9), vec![8]);
        assert_eq!(cfg(1, 1, 1).propose(&t, 9), vec![6]);
        // No recurrence, too short, or no budget: no draft.
        assert!(cfg(3, 3, 2).propose(&[1, 2, 3, 4], 9).is_empty());
        assert!(cfg(3, 3, 1).propose(&[5], 9).is_empty());
        assert!(cfg(3, 3, 1).propose(&[5, 5, 5], 0).is_empty());
        // A draft stops at the end of the text.
        assert_eq!(cfg(4, 1, 1).propose(&[5, 6, 5], 9), vec![6, 5]);
    }

    #[test]
    fn acceptance_keeps_the_first_difference() {
        assert_eq!(accept(&[4, 5, 6], &[4, 5, 6, 7]), 4);
        assert_eq!(accept(&[4, 5, 6], &[4, 9, 6, 7]), 2);
        assert_eq!(accept(&[4, 5, 6], &[1, 5, 6, 7]), 1);
        assert_eq!(accept(&[], &[3]), 1);
    }

    #[test]
    fn configurations_are_checked() {
        assert!(cfg(0, 3, 1).validate().is_err());
        assert!(cfg(2, 3, 0).validate().is_err());
        assert!(cfg(2, 1, 2).validate().is_err());
        assert!(cfg(2, 3, 1).validate().is_ok());
    }
}
