//! Text that came from a file (tensor names, shard file names, paths, a parser's complaint about
//! them), made safe to put in an error message: control, format and other non-printable
//! characters (NUL, newlines, terminal escape sequences, bidirectional overrides) are written as
//! `\u{..}` escapes, as [`tp_comm::peer_text`] writes them, and the text is cut after
//! [`MAX_PEER_TEXT_CHARS`] printed characters with its full length noted, so a 100 MB tensor
//! name makes a one-line message of a few hundred bytes.

use std::path::Path;
use tp_comm::{MAX_PEER_TEXT_CHARS, peer_text};

/// How many leading bytes of `text` fit in [`MAX_PEER_TEXT_CHARS`] characters once escaped as
/// `{:?}` escapes them (`char::escape_debug` escapes at least as much), or `None` if all of it.
fn fitting_prefix(text: &str) -> Option<usize> {
    let mut printed = 0;
    for (at, c) in text.char_indices() {
        printed += c.escape_debug().count();
        if printed > MAX_PEER_TEXT_CHARS {
            return Some(at);
        }
    }
    None
}

/// `text` in double quotes with every non-printable character escaped (as `{:?}` writes a
/// string), cut after [`MAX_PEER_TEXT_CHARS`] printed characters: a cut one reads
/// `"aaaa"… (1000000 bytes in all)`.
///
/// For names and values from a checkpoint or a config file in a one-line error message.
pub fn quote_text(text: &str) -> String {
    match fitting_prefix(text) {
        Some(end) => format!("{:?}… ({} bytes in all)", &text[..end], text.len()),
        None => format!("{text:?}"),
    }
}

/// `text` cut as [`quote_text`] cuts it but not escaped, for an error field that is printed with
/// `{:?}` (which escapes): `aaaa… (1000000 bytes in all)`.
pub(crate) fn cut(text: &str) -> String {
    match fitting_prefix(text) {
        Some(end) => format!("{}… ({} bytes in all)", &text[..end], text.len()),
        None => text.to_string(),
    }
}

/// `path` as escaped, bounded text (bytes that are not UTF-8 become U+FFFD).
pub(crate) fn path_text(path: &Path) -> String {
    peer_text(path.as_os_str().as_encoded_bytes())
}

/// The message of an error whose text may quote a file's contents (a safetensors or JSON
/// parser's), escaped and bounded.
pub(crate) fn foreign(e: impl std::fmt::Display) -> String {
    peer_text(e.to_string().as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_text_is_quoted_and_escaped() {
        assert_eq!(quote_text("model.embed_tokens.weight"), "\"model.embed_tokens.weight\"");
        assert_eq!(quote_text("a\u{1b}[31m\0\n\"b"), "\"a\\u{1b}[31m\\0\\n\\\"b\"");
        assert_eq!(cut("a\nb"), "a\nb");
    }

    #[test]
    fn long_text_is_cut_with_its_length() {
        let long = format!("\u{1b}[31m{}", "a".repeat(1 << 20));
        let q = quote_text(&long);
        assert!(q.starts_with("\"\\u{1b}[31maaa") && q.ends_with(&format!("\"… ({} bytes in all)", long.len())), "{q}");
        assert!(q.len() < MAX_PEER_TEXT_CHARS + 40 && !q.contains('\u{1b}'), "{q}");
        let c = cut(&long);
        assert!(c.starts_with("\u{1b}[31maaa") && format!("{c:?}").len() < MAX_PEER_TEXT_CHARS + 40, "{c:?}");
        // Escapes count toward the limit: 5000 NULs print as at most 200 characters.
        let q = quote_text(&"\0".repeat(5000));
        assert!(q.len() < MAX_PEER_TEXT_CHARS + 40 && q.ends_with("(5000 bytes in all)"), "{q}");
        // A cut never splits a multi-byte character.
        let q = quote_text(&"中".repeat(1000));
        assert!(q.starts_with(&format!("\"{}\"", "中".repeat(MAX_PEER_TEXT_CHARS))), "{q}");
    }

    #[test]
    fn paths_and_parser_errors_are_escaped() {
        assert_eq!(path_text(Path::new("/tmp/a\nb")), "/tmp/a\\nb");
        assert_eq!(foreign("bad \u{7}"), "bad \\u{7}");
    }
}
