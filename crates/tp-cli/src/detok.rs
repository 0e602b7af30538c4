//! Streaming detokenization: [`TextStream`] turns generated ids into text pieces that never split
//! a UTF-8 character and never show a stop string.
//!
//! Ids are decoded with vLLM's prefix-offset method: the text of `ids[prefix..]` minus that of
//! `ids[prefix..read]`, so that tokenizers whose pieces depend on their left neighbours (leading
//! spaces, byte fallback) decode as the whole text does. While the new text ends in U+FFFD (the
//! bytes of a character are not all there yet), nothing is added. Text that could be the start
//! of a stop string is held back until it cannot be; once a stop string appears, the text is cut
//! before it.

use crate::text::TextModel;

/// Decodes ids to text (special tokens left out).
pub trait Decode {
    /// The text of `ids`.
    fn decode(&self, ids: &[i64]) -> String;
}

impl Decode for TextModel {
    fn decode(&self, ids: &[i64]) -> String {
        TextModel::decode(self, ids)
    }
}

/// A model's text with its special tokens kept (for output parsers that read them, as Mistral's
/// `[TOOL_CALLS]`).
pub struct WithSpecials<'a>(pub &'a TextModel);

impl Decode for WithSpecials<'_> {
    fn decode(&self, ids: &[i64]) -> String {
        self.0.decode_with_specials(ids)
    }
}

/// Prompt ids kept as left context for the first generated ids (vLLM's offset).
const PROMPT_CONTEXT: usize = 5;

/// One sequence's generated text, as it streams.
#[derive(Debug, Clone)]
pub struct TextStream {
    /// Left context (the prompt's last ids) then the generated ids.
    ids: Vec<i64>,
    prefix_offset: usize,
    read_offset: usize,
    /// Generated text so far (cut before a stop string once one appeared).
    text: String,
    /// Bytes of `text` already handed out.
    sent: usize,
    stops: Vec<String>,
    /// Whether a stop string was found.
    stopped: bool,
}

impl TextStream {
    /// A stream after `prompt`, stopping at any of `stops` (empty strings are ignored).
    pub fn new(prompt: &[i64], stops: Vec<String>) -> TextStream {
        let ids = prompt[prompt.len().saturating_sub(PROMPT_CONTEXT)..].to_vec();
        let read_offset = ids.len();
        TextStream {
            ids,
            prefix_offset: 0,
            read_offset,
            text: String::new(),
            sent: 0,
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            stopped: false,
        }
    }

    /// Adds generated id `id`; returns `true` when the text now holds a stop string (the text is
    /// cut before it; later ids are ignored).
    pub fn push(&mut self, d: &impl Decode, id: i64) -> bool {
        if self.stopped {
            return true;
        }
        self.ids.push(id);
        self.decode_new(d, false);
        self.stopped
    }

    /// Whether a stop string was found (also by [`finish`](Self::finish)'s last decode).
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The text that is ready to show and not shown yet.
    pub fn take_ready(&mut self) -> String {
        let end = if self.stopped { self.text.len() } else { self.text.len() - self.held_back() };
        self.take_to(end)
    }

    /// At the end of the sequence: the rest of the text, incomplete characters (as U+FFFD) and
    /// held-back text included.
    pub fn finish(&mut self, d: &impl Decode) -> String {
        if !self.stopped && self.read_offset < self.ids.len() {
            self.decode_new(d, true);
        }
        let end = self.text.len();
        self.take_to(end)
    }

    fn take_to(&mut self, end: usize) -> String {
        if end <= self.sent {
            return String::new();
        }
        let out = self.text[self.sent..end].to_string();
        self.sent = end;
        out
    }

    /// Appends the text the ids after `read_offset` add; `force` takes it even when it ends in
    /// an incomplete character.
    fn decode_new(&mut self, d: &impl Decode, force: bool) {
        let prefix = d.decode(&self.ids[self.prefix_offset..self.read_offset]);
        let full = d.decode(&self.ids[self.prefix_offset..]);
        if full.len() <= prefix.len() || (full.ends_with('\u{FFFD}') && !force) {
            return;
        }
        let delta = match full.strip_prefix(prefix.as_str()) {
            Some(rest) => rest.to_string(),
            None => full.chars().skip(prefix.chars().count()).collect(),
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        let old_len = self.text.len();
        self.text.push_str(&delta);
        self.check_stops(old_len);
    }

    /// Cuts the text before the first stop string that ends after byte `old_len`.
    fn check_stops(&mut self, old_len: usize) {
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        if longest == 0 {
            return;
        }
        let mut start = old_len.saturating_sub(longest - 1);
        while !self.text.is_char_boundary(start) {
            start -= 1;
        }
        let found = self.stops.iter().filter_map(|s| self.text[start..].find(s.as_str()).map(|p| start + p)).min();
        if let Some(p) = found {
            self.text.truncate(p.max(self.sent));
            self.stopped = true;
        }
    }

    /// Bytes at the end of the text that could begin a stop string.
    fn held_back(&self) -> usize {
        let t = &self.text[self.sent..];
        let mut best = 0;
        for s in &self.stops {
            for k in (best + 1..s.len().min(t.len() + 1)).rev() {
                if t.is_char_boundary(t.len() - k) && s.starts_with(&t[t.len() - k..]) {
                    best = k;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte tokenizer: id `b` is byte `b`; ids 256.. are special (decode to nothing). Decodes
    /// as a byte-level tokenizer does: invalid UTF-8 becomes U+FFFD.
    struct Bytes;
    impl Decode for Bytes {
        fn decode(&self, ids: &[i64]) -> String {
            let b: Vec<u8> = ids.iter().filter(|&&i| i < 256).map(|&i| i as u8).collect();
            String::from_utf8_lossy(&b).into_owned()
        }
    }

    fn ids(s: &str) -> Vec<i64> {
        s.bytes().map(i64::from).collect()
    }

    /// Streams `out` after `prompt`; returns the pieces and whether a stop ended it.
    fn stream(prompt: &str, out: &[i64], stops: &[&str]) -> (Vec<String>, bool) {
        let mut t = TextStream::new(&ids(prompt), stops.iter().map(|s| s.to_string()).collect());
        let mut pieces = Vec::new();
        for &id in out {
            let stop = t.push(&Bytes, id);
            pieces.push(t.take_ready());
            if stop {
                return (pieces, true);
            }
        }
        pieces.push(t.finish(&Bytes));
        (pieces, false)
    }

    #[test]
    fn multibyte_characters_are_never_split() {
        let text = "aé€😀b";
        let (pieces, _) = stream("x", &ids(text), &[]);
        assert_eq!(pieces.concat(), text);
        // Each piece is whole characters: é (2 bytes) appears only with its second byte.
        assert_eq!(pieces, ["a", "", "é", "", "", "€", "", "", "", "😀", "b", ""]);
    }

    #[test]
    fn a_stop_string_is_never_shown() {
        let (pieces, stopped) = stream("", &ids("hello STOP world"), &["STOP"]);
        assert!(stopped);
        assert_eq!(pieces.concat(), "hello ");
        assert!(pieces.iter().all(|p| !p.contains('S')), "{pieces:?}");
    }

    #[test]
    fn held_back_text_comes_out_when_it_is_no_stop() {
        let (pieces, stopped) = stream("", &ids("a STOn STO"), &["STOP", "xyz"]);
        assert!(!stopped);
        assert_eq!(pieces.concat(), "a STOn STO");
        // "STO" at the end is held until the end.
        assert_eq!(pieces.last().map(String::as_str), Some("STO"));
    }

    #[test]
    fn the_earliest_of_several_stops_wins_and_specials_add_nothing() {
        let mut out = ids("ab");
        out.push(300);
        out.extend(ids("cd--ef"));
        let (pieces, stopped) = stream("", &out, &["ef", "--", "d-"]);
        assert!(stopped);
        assert_eq!(pieces.concat(), "abc");
    }

    #[test]
    fn a_stop_across_a_multibyte_character() {
        let (pieces, stopped) = stream("", &ids("naïve café"), &["é"]);
        assert!(stopped);
        assert_eq!(pieces.concat(), "naïve caf");
    }

    #[test]
    fn an_incomplete_character_at_the_end_is_flushed_as_replacement() {
        let mut out = ids("ok");
        out.push(0xE2);
        let (pieces, _) = stream("", &out, &[]);
        assert_eq!(pieces.concat(), "ok\u{FFFD}");
    }
}
