//! BPE merges of a vocabulary that lists none (SentencePiece-style GGUF files): every split of
//! a token into two tokens of the vocabulary, best score first, as transformers'
//! `generate_merges(vocab, vocab_scores)` derives them.

use std::cmp::Ordering;
use std::collections::HashMap;

/// The merges `tokens` imply, ranked by `scores` (one per token, none NaN).
///
/// Follows transformers' `generate_merges` exactly, because the rank of each merge decides the
/// tokenization: for each distinct token in order of first appearance (its score being that of
/// its last appearance), every split into a left and a right piece that are both tokens, those
/// pairs ordered by the pieces' ids (the last id of a repeated token); then all pairs sorted,
/// stably, by score, left length and right length (in characters), largest first.
pub(super) fn from_scores(tokens: &[String], scores: &[f64]) -> Vec<(String, String)> {
    let mut ids: HashMap<&str, usize> = HashMap::with_capacity(tokens.len());
    for (i, t) in tokens.iter().enumerate() {
        ids.insert(t.as_str(), i);
    }
    // Distinct tokens in order of first appearance, each with its last score.
    let mut order: Vec<(&str, f64)> = Vec::with_capacity(ids.len());
    let mut slot: HashMap<&str, usize> = HashMap::with_capacity(ids.len());
    for (t, &s) in tokens.iter().zip(scores) {
        match slot.get(t.as_str()) {
            Some(&k) => order[k].1 = s,
            None => {
                slot.insert(t.as_str(), order.len());
                order.push((t.as_str(), s));
            }
        }
    }

    struct Pair<'a> {
        left: &'a str,
        right: &'a str,
        score: f64,
        left_chars: usize,
        right_chars: usize,
    }
    let mut pairs: Vec<Pair> = Vec::new();
    let mut local: Vec<(usize, usize, Pair)> = Vec::new();
    for &(token, score) in &order {
        local.clear();
        let chars = token.chars().count();
        for (k, (at, _)) in token.char_indices().enumerate().skip(1) {
            let (left, right) = token.split_at(at);
            if let (Some(&l), Some(&r)) = (ids.get(left), ids.get(right)) {
                local.push((l, r, Pair { left, right, score, left_chars: k, right_chars: chars - k }));
            }
        }
        local.sort_by_key(|&(l, r, _)| (l, r));
        pairs.extend(local.drain(..).map(|(_, _, p)| p));
    }
    // Stable and descending: equal keys keep their order, as Python's sort(reverse=True).
    pairs.sort_by(|a, b| {
        b.score
            .partial_cmp(&a.score)
            .unwrap_or(Ordering::Equal)
            .then(b.left_chars.cmp(&a.left_chars))
            .then(b.right_chars.cmp(&a.right_chars))
    });
    pairs.into_iter().map(|p| (p.left.to_string(), p.right.to_string())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|t| t.to_string()).collect()
    }

    #[test]
    fn ranks_by_score_then_lengths() {
        // "ab" (score -1) beats "abc" (score -2); within "abc" both splits exist and keep the
        // id order of their pieces, then the sort puts the longer left piece first.
        let tokens = s(&["a", "b", "c", "ab", "bc", "abc"]);
        let scores = [0.0, 0.0, 0.0, -1.0, -3.0, -2.0];
        let m = from_scores(&tokens, &scores);
        let m: Vec<(&str, &str)> = m.iter().map(|(l, r)| (l.as_str(), r.as_str())).collect();
        assert_eq!(m, [("a", "b"), ("ab", "c"), ("a", "bc"), ("b", "c")]);
    }

    #[test]
    fn splits_at_characters_not_bytes() {
        let tokens = s(&["\u{2581}", "x", "\u{2581}x"]);
        let m = from_scores(&tokens, &[0.0, 0.0, -1.0]);
        assert_eq!(m, [("\u{2581}".to_string(), "x".to_string())]);
    }

    #[test]
    fn repeated_token_takes_last_score_and_id() {
        // "ab" appears twice: its merge gets the second score (-5), ranking it after "bc".
        let tokens = s(&["a", "b", "c", "ab", "bc", "ab"]);
        let m = from_scores(&tokens, &[0.0, 0.0, 0.0, -1.0, -2.0, -5.0]);
        assert_eq!(m[0], ("b".to_string(), "c".to_string()));
        assert_eq!(m[1], ("a".to_string(), "b".to_string()));
    }
}
