//! The tokenizer as llguidance sees it: every id's bytes (from `tokenizer.json`, special tokens
//! marked so no text can spell them), over the model's whole vocabulary (ids past the
//! tokenizer's have no bytes, so no constraint ever allows them), with the model's
//! end-of-sequence ids.

use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use std::sync::Arc;

/// The trie of token bytes; text is tokenized greedily over it (llguidance uses that only to
/// force tokens, never to decide a mask).
struct Vocab {
    trie: TokTrie,
}

impl TokenizerEnv for Vocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

/// The token environment of a tokenizer given as its `tokenizer.json` value, over a model
/// vocabulary of `vocab_size` ids ending sequences with `eos` (at least one id).
///
/// Errors: a tokenizer whose decoder is neither byte-level nor byte-fallback (llguidance cannot
/// know its tokens' bytes), more tokenizer ids than `vocab_size` that are not empty, no `eos`
/// inside the vocabulary.
pub fn tok_env(tokenizer_json: &serde_json::Value, vocab_size: usize, eos: &[i64]) -> Result<TokEnv, String> {
    let mut bytes = llguidance::token_bytes_from_tokenizer_json(tokenizer_json).map_err(|e| e.to_string())?;
    if let Some(extra) = bytes.get(vocab_size..).and_then(|rest| rest.iter().position(|b| !b.is_empty())) {
        return Err(format!(
            "the tokenizer has token {} past the model's vocabulary of {vocab_size}",
            vocab_size + extra
        ));
    }
    bytes.resize(vocab_size, Vec::new());
    let eos: Vec<TokenId> =
        eos.iter().filter_map(|&e| u32::try_from(e).ok()).filter(|&e| (e as usize) < vocab_size).collect();
    let first = *eos.first().ok_or("the model has no end-of-sequence id inside its vocabulary")?;
    let size = u32::try_from(vocab_size).map_err(|_| format!("a vocabulary of {vocab_size} ids"))?;
    let trie = TokTrie::from(&TokRxInfo::new(size, first), &bytes).with_eos_tokens(&eos);
    Ok(Arc::new(Vocab { trie }))
}
