//! Text that came from another process (a store's reply, a peer's identity, a value rank 0
//! published), made safe to put in an error message or a log line.
//!
//! Every byte a peer sent goes through [`peer_text`] before it is printed: invalid UTF-8 becomes
//! U+FFFD, control, format and other non-printable characters (terminal escape sequences,
//! newlines, bidirectional overrides) are written as `\u{..}` escapes, and the result is cut to
//! [`MAX_PEER_TEXT_CHARS`] characters with the original length noted.

/// Most characters of a peer's text that one error message carries.
pub const MAX_PEER_TEXT_CHARS: usize = 200;

/// `bytes` as printable, escaped, bounded text.
pub fn peer_text(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let mut out = String::new();
    let mut chars = 0;
    for c in text.chars() {
        // Quotes print as they are; everything `escape_debug` would change is escaped.
        let piece: String = if c == '"' || c == '\'' { c.to_string() } else { c.escape_debug().collect() };
        chars += piece.chars().count();
        if chars > MAX_PEER_TEXT_CHARS {
            out.push_str(&format!("… ({} bytes in all)", bytes.len()));
            return out;
        }
        out.push_str(&piece);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_text_is_unchanged() {
        assert_eq!(peer_text(b"pid 12 on node-3 \"x\""), "pid 12 on node-3 \"x\"");
        assert_eq!(peer_text("héllo 中".as_bytes()), "héllo 中");
    }

    #[test]
    fn control_and_format_characters_are_escaped() {
        let t = peer_text("\x1b[2J\r\nred\u{202e}\\".as_bytes());
        assert_eq!(t, "\\u{1b}[2J\\r\\nred\\u{202e}\\\\");
        assert!(!t.chars().any(|c| c.is_control()));
        assert_eq!(peer_text(&[0xff, b'a']), "\u{fffd}a");
    }

    #[test]
    fn long_text_is_cut_and_its_length_named() {
        let t = peer_text(&[b'x'; 20_000]);
        assert!(t.starts_with(&"x".repeat(MAX_PEER_TEXT_CHARS)) && t.ends_with("(20000 bytes in all)"), "{t}");
        assert!(t.chars().count() < MAX_PEER_TEXT_CHARS + 30);
        // Escapes count toward the limit too.
        let t = peer_text(&[0x1b; 5000]);
        assert!(t.chars().count() < MAX_PEER_TEXT_CHARS + 30 && t.ends_with("(5000 bytes in all)"), "{t}");
    }
}
