//! `--reasoning-parser`: a thinking model's `<think>...</think>` moved out of the answer into
//! `reasoning_content`.
//!
//! * `deepseek_r1`: the template opens `<think>` in the prompt, so the output is reasoning from
//!   its start (a leading `<think>` is dropped) until `</think>`; without one, all of it.
//! * `qwen3`: the output is reasoning only if it opens with `<think>` (Qwen3 writes the tag
//!   itself; with `enable_thinking: false` the template closes an empty block in the prompt and
//!   the output is all answer), until `</think>` or the end.
//! * `openai_gptoss`: gpt-oss's harmony messages, the `analysis` channel as reasoning and the
//!   `final` one as the answer (`harmony.rs`; the text keeps its special tokens).

use crate::markers::partial_suffix;
use std::borrow::Cow;

/// Which reasoning format the model writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningParser {
    /// DeepSeek-R1 and its distills.
    DeepSeekR1,
    /// Qwen3.
    Qwen3,
    /// gpt-oss (harmony).
    GptOss,
}

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

impl ReasoningParser {
    /// vLLM's name for `--reasoning-parser`.
    pub fn from_name(name: &str) -> Option<ReasoningParser> {
        match name {
            "deepseek_r1" => Some(ReasoningParser::DeepSeekR1),
            "qwen3" => Some(ReasoningParser::Qwen3),
            "openai_gptoss" => Some(ReasoningParser::GptOss),
            _ => None,
        }
    }

    /// `text` split as far as it is decided: `(reasoning, answer, open)`. `answer` is `None`
    /// while the reasoning has not ended; `open` is whether more text may still extend the
    /// reasoning. Text that might be the start of a tag is left out of both until it is not.
    pub fn split(self, text: &str) -> (Cow<'_, str>, Option<Cow<'_, str>>, bool) {
        let (body, reasoning) = match self {
            ReasoningParser::GptOss => {
                let h = crate::harmony::parse(text, false);
                return (Cow::Owned(h.reasoning), Some(Cow::Owned(h.content)), true);
            }
            ReasoningParser::DeepSeekR1 => {
                if OPEN.starts_with(text) && !text.is_empty() {
                    return ("".into(), None, true);
                }
                (text.strip_prefix(OPEN).unwrap_or(text), true)
            }
            ReasoningParser::Qwen3 => {
                if OPEN.starts_with(text) {
                    return ("".into(), None, true);
                }
                match text.strip_prefix(OPEN) {
                    Some(rest) => (rest, true),
                    None => (text, false),
                }
            }
        };
        if !reasoning {
            return ("".into(), Some(body.into()), false);
        }
        match body.find(CLOSE) {
            Some(end) => (body[..end].into(), Some(body[end + CLOSE.len()..].into()), false),
            None => (body[..body.len() - partial_suffix(body, CLOSE)].into(), None, true),
        }
    }

    /// The final split of a whole output: reasoning (`None` when there was none) and the answer
    /// (`None` when empty).
    pub fn finish(self, text: &str) -> (Option<String>, Option<String>) {
        let some = |s: &str| (!s.is_empty()).then(|| s.to_string());
        let (body, reasoning) = match self {
            ReasoningParser::GptOss => {
                let h = crate::harmony::parse(text, true);
                return (some(&h.reasoning), some(&h.content));
            }
            ReasoningParser::DeepSeekR1 => (text.strip_prefix(OPEN).unwrap_or(text), true),
            ReasoningParser::Qwen3 => match text.strip_prefix(OPEN) {
                Some(rest) => (rest, true),
                None => (text, false),
            },
        };
        if !reasoning {
            return (None, some(body));
        }
        match body.find(CLOSE) {
            Some(end) => (Some(body[..end].to_string()), some(&body[end + CLOSE.len()..])),
            None => (Some(body.to_string()), None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deepseek_splits_at_the_close_tag() {
        let p = ReasoningParser::DeepSeekR1;
        assert_eq!(p.finish("abc</think>\n\nAnswer"), (Some("abc".into()), Some("\n\nAnswer".into())));
        assert_eq!(p.finish("<think>abc</think>x"), (Some("abc".into()), Some("x".into())));
        assert_eq!(p.finish("no end"), (Some("no end".into()), None));
        assert_eq!(p.split("abc</th"), ("abc".into(), None, true));
        assert_eq!(p.split("abc</think>de"), ("abc".into(), Some("de".into()), false));
        assert_eq!(p.split("<thi"), ("".into(), None, true));
    }

    #[test]
    fn qwen3_reasons_only_after_an_open_tag() {
        let p = ReasoningParser::Qwen3;
        assert_eq!(p.finish("<think>\nhm\n</think>\n\nHi"), (Some("\nhm\n".into()), Some("\n\nHi".into())));
        assert_eq!(p.finish("Hi there"), (None, Some("Hi there".into())));
        assert_eq!(p.split("<thi"), ("".into(), None, true));
        assert_eq!(p.split("Hi"), ("".into(), Some("Hi".into()), false));
        assert_eq!(p.split("<think>ab<"), ("ab".into(), None, true));
    }
}
