//! Text that may still become a marker: what the output parsers (reasoning tags, tool-call
//! markers, harmony's special tokens) hold back while a choice streams.

/// The length of the longest proper suffix of `text` that is a prefix of `tag` (text that may
/// still become `tag`), cut back to a character boundary.
pub fn partial_suffix(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && tag.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_tags_are_held() {
        assert_eq!(partial_suffix("abc<", "</think>"), 1);
        assert_eq!(partial_suffix("abc</thin", "</think>"), 6);
        assert_eq!(partial_suffix("abc", "</think>"), 0);
        assert_eq!(partial_suffix("é", "</think>"), 0);
    }
}
