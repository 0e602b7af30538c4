//! Text that came from a file (keys, tensor names, the path), made safe and short for an error
//! message: cut after [`MAX_TEXT_CHARS`] printed characters with its full length noted, and, where
//! it is not printed with `{:?}` (which escapes), escaped the way `{:?}` escapes a string (control,
//! format and other non-printable characters as `\u{..}`), so a 100 MB key with terminal escape
//! sequences makes a one-line message of a few hundred bytes.

use std::path::Path;

/// Most characters of a file's text that one error message carries.
pub(crate) const MAX_TEXT_CHARS: usize = 200;

/// How many leading bytes of `text` fit in [`MAX_TEXT_CHARS`] characters once escaped as `{:?}`
/// escapes them (`char::escape_debug` escapes at least as much), or `None` if all of it.
fn fitting_prefix(text: &str) -> Option<usize> {
    let mut printed = 0;
    for (at, c) in text.char_indices() {
        printed += c.escape_debug().count();
        if printed > MAX_TEXT_CHARS {
            return Some(at);
        }
    }
    None
}

/// `text` cut after [`MAX_TEXT_CHARS`] printed characters but not escaped, for an error field that
/// is printed with `{:?}`: `aaaa… (1000000 bytes in all)`.
pub(crate) fn cut(text: &str) -> String {
    match fitting_prefix(text) {
        Some(end) => format!("{}… ({} bytes in all)", &text[..end], text.len()),
        None => text.to_string(),
    }
}

/// `text` in double quotes, escaped as `{:?}` escapes it and cut as [`cut`] cuts it, for a name
/// inside a composed description (`the value of key "general.name"`).
pub(crate) fn quote(text: &str) -> String {
    match fitting_prefix(text) {
        Some(end) => format!("{:?}… ({} bytes in all)", &text[..end], text.len()),
        None => format!("{text:?}"),
    }
}

/// Raw bytes (a bad magic) as a quoted, escaped string; bytes that are not UTF-8 become U+FFFD.
pub(crate) fn bytes_text(bytes: &[u8]) -> String {
    quote(&String::from_utf8_lossy(bytes))
}

/// `path` as escaped, bounded text without quotes (bytes that are not UTF-8 become U+FFFD).
pub(crate) fn path_text(path: &Path) -> String {
    let text = String::from_utf8_lossy(path.as_os_str().as_encoded_bytes());
    let quoted = quote(&text);
    // `quote` wraps the (cut) text in quotes and escapes `"` within; a path reads better without
    // them (a backslash stays doubled, so `\n` in a message is always a newline).
    let (body, tail) = match quoted.rfind('"') {
        Some(end) => (&quoted[1..end], &quoted[end + 1..]),
        None => (quoted.as_str(), ""),
    };
    format!("{}{tail}", body.replace("\\\"", "\""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_text_is_kept_and_escaped_when_quoted() {
        assert_eq!(cut("general.name"), "general.name");
        assert_eq!(quote("a\u{1b}[31m\0\n\"b"), "\"a\\u{1b}[31m\\0\\n\\\"b\"");
        assert_eq!(bytes_text(b"GG\xffF"), "\"GG\u{fffd}F\"");
    }

    #[test]
    fn long_text_is_cut_with_its_length() {
        let long = format!("\u{1b}[31m{}", "a".repeat(1 << 20));
        let q = quote(&long);
        assert!(q.starts_with("\"\\u{1b}[31maaa") && q.ends_with(&format!("\"… ({} bytes in all)", long.len())), "{q}");
        assert!(q.len() < MAX_TEXT_CHARS + 40 && !q.contains('\u{1b}'), "{q}");
        let c = cut(&long);
        assert!(format!("{c:?}").len() < MAX_TEXT_CHARS + 40, "{c:?}");
        // Escapes count toward the limit, and a cut never splits a character.
        assert!(quote(&"\0".repeat(5000)).ends_with("(5000 bytes in all)"));
        assert!(quote(&"中".repeat(1000)).starts_with(&format!("\"{}\"", "中".repeat(MAX_TEXT_CHARS))));
    }

    #[test]
    fn paths_are_escaped_without_quotes() {
        assert_eq!(path_text(Path::new("/tmp/a\nb\"c\\d")), "/tmp/a\\nb\"c\\\\d");
        let long = format!("/{}", "p".repeat(5000));
        let t = path_text(Path::new(&long));
        assert!(t.starts_with("/ppp") && t.ends_with("… (5001 bytes in all)"), "{t}");
    }
}
