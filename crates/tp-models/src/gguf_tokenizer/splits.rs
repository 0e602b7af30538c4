//! The pre-tokenizer regexes transformers gives byte-level vocabularies by their
//! `tokenizer.ggml.pre` name, and the byte alphabet of byte-level BPE.

/// Llama 3's split (also `llama-bpe`, `falcon3`, `dbrx`, `smaug-bpe`...): GPT-4's regex.
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's split: Llama 3's with single digits.
const QWEN2: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 3.5's split: Qwen2's with combining marks kept in words.
const QWEN35: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Mistral's Tekken split.
const TEKKEN: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
);

/// GPT-4o's split (also Llama 4's).
const GPT4O: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
);

/// The split regex transformers (`GGUF_PRE_TOKENIZER_SPLITS`) puts before a byte-level step
/// for the `tokenizer.ggml.pre` name `pre`; `None` for every other name (`default`, `gpt-2`
/// and the rest keep the builder's own pre-tokenizer: GPT-2's regex for byte-level BPE).
pub(super) fn split_regex(pre: &str) -> Option<&'static str> {
    Some(match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2"
        | "jina-v5-nano" | "dbrx" | "smaug-bpe" => LLAMA3,
        "tekken" => TEKKEN,
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => QWEN2,
        "qwen35" => QWEN35,
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => GPT4O,
        _ => return None,
    })
}

/// GPT-2's `bytes_to_unicode`: the character byte-level BPE writes for each byte. Printable
/// Latin-1 bytes stand for themselves; the others map, in order, to U+0100 onwards.
pub(super) fn byte_chars() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in out.iter_mut().enumerate() {
        let printable = matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            b as u32
        } else {
            next += 1;
            next - 1
        };
        // Every code here is below U+0144: a valid scalar value.
        *slot = char::from_u32(code).unwrap_or(char::REPLACEMENT_CHARACTER);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_chars_match_gpt2() {
        let c = byte_chars();
        assert_eq!(c[b' ' as usize], '\u{120}'); // "Ġ"
        assert_eq!(c[b'\n' as usize], '\u{10A}'); // "Ċ"
        assert_eq!(c[0], '\u{100}');
        assert_eq!(c[b'A' as usize], 'A');
        assert_eq!(c[0xAD], '\u{143}');
        let distinct: std::collections::HashSet<char> = c.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }

    #[test]
    fn every_split_compiles() {
        for pre in ["llama-bpe", "qwen2", "qwen35", "tekken", "gpt-4o"] {
            let re = split_regex(pre).map(compiles);
            assert_eq!(re, Some(true), "{pre}");
        }
        assert_eq!(split_regex("gpt-2"), None);
        assert_eq!(split_regex("default"), None);
    }

    /// Compiles the pattern with the tokenizers crate's own regex engine.
    fn compiles(p: &str) -> bool {
        tokenizers::pre_tokenizers::split::Split::new(
            tokenizers::pre_tokenizers::split::SplitPattern::Regex(p.to_string()),
            tokenizers::SplitDelimiterBehavior::Isolated,
            false,
        )
        .is_ok()
    }
}
