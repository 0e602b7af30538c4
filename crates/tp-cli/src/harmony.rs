//! gpt-oss's output in OpenAI's harmony format, split as vLLM splits it
//! (`--reasoning-parser openai_gptoss`, `--tool-call-parser openai`; on by itself when the chat
//! template writes harmony): after the prompt's `<|start|>assistant`, the model writes messages
//!
//! ```text
//! <|channel|>analysis<|message|>...reasoning...<|end|>
//! <|start|>assistant<|channel|>final<|message|>...answer...<|return|>
//! <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
//! ```
//!
//! A header is everything up to `<|message|>`: its channel follows `<|channel|>`, a recipient is
//! `to=...` anywhere in it. The `analysis` channel is reasoning (`reasoning_content`), `final`
//! and `commentary` without a recipient (a preamble the user sees) are content, and a message to
//! `functions.NAME` (a name not empty) is a call of `NAME` with its body as the arguments. A
//! body ends at `<|end|>`, `<|return|>` or `<|call|>` (the last two stop generation, and may be
//! cut from the text).
//! Text that opens with no header (a constrained answer, a model that skips the format) is all
//! content. While streaming, a header not yet closed and text that may be the start of a
//! special token are held back, so each part only grows.

use crate::markers::partial_suffix;
use crate::template::python_json;
use crate::tools::call::Call;

const START: &str = "<|start|>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
const ENDS: [&str; 3] = ["<|end|>", "<|return|>", "<|call|>"];

/// An output split into its parts.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Harmony {
    /// The `analysis` messages, one after the other.
    pub reasoning: String,
    /// The `final` messages and preambles, one after the other.
    pub content: String,
    /// The messages to `functions.*` that ended (or, in a whole output, all of them).
    pub calls: Vec<Call>,
}

/// `text` split as far as it is decided (`done`: the whole output, nothing held back).
pub fn parse(text: &str, done: bool) -> Harmony {
    let mut out = Harmony::default();
    if !opens_with_header(text) {
        // Not (or not yet known to be) harmony: all content, once it cannot be a header.
        if done || !(START.starts_with(text) || CHANNEL.starts_with(text)) {
            out.content = text.to_string();
        }
        return out;
    }
    let mut rest = text;
    while !rest.is_empty() {
        let Some(m) = rest.find(MESSAGE) else { break };
        let header = &rest[..m];
        let body_all = &rest[m + MESSAGE.len()..];
        let ended = ENDS.iter().filter_map(|e| body_all.find(e).map(|at| (at, e.len()))).min();
        let (body, next, closed) = match ended {
            Some((at, len)) => (&body_all[..at], &body_all[at + len..], true),
            None if done => (body_all, "", true),
            None => {
                let held = ENDS.iter().map(|e| partial_suffix(body_all, e)).max().unwrap_or(0);
                (&body_all[..body_all.len() - held], "", false)
            }
        };
        let (channel, recipient) = header_fields(header);
        let function = recipient.and_then(|to| to.strip_prefix("functions.")).filter(|name| !name.is_empty());
        match (channel, function) {
            ("analysis", _) => out.reasoning.push_str(body),
            (_, Some(name)) => {
                if closed {
                    out.calls.push(call(name, body));
                }
            }
            _ => out.content.push_str(body),
        }
        rest = next;
    }
    out
}

/// Whether `text` starts with a message header (`<|channel|>` or `<|start|>`).
fn opens_with_header(text: &str) -> bool {
    text.starts_with(CHANNEL) || text.starts_with(START)
}

/// The channel and the recipient (`to=...`) of a header.
fn header_fields(header: &str) -> (&str, Option<&str>) {
    let channel = header
        .find(CHANNEL)
        .map(|at| &header[at + CHANNEL.len()..])
        .and_then(|c| c.split(|ch: char| ch.is_whitespace() || ch == '<').next())
        .unwrap_or("");
    let recipient = header
        .split(|ch: char| ch.is_whitespace() || ch == '<' || ch == '>' || ch == '|')
        .find_map(|w| w.strip_prefix("to="));
    (channel, recipient)
}

/// A call of `name` with `body` as its arguments, in Python's `json.dumps` form where the body
/// is JSON.
fn call(name: &str, body: &str) -> Call {
    let arguments = match serde_json::from_str::<serde_json::Value>(body.trim()) {
        Ok(v) => python_json(&v, None),
        Err(_) => body.trim().to_string(),
    };
    Call { name: name.trim().to_string(), arguments }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "<|channel|>analysis<|message|>The user asks the weather. Use the tool.<|end|>\
        <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>\
        {\"city\":\"Paris\"}<|call|>";

    #[test]
    fn analysis_is_reasoning_final_is_content_and_a_message_to_a_function_is_a_call() {
        let h = parse(TEXT, true);
        assert_eq!(h.reasoning, "The user asks the weather. Use the tool.");
        assert_eq!(h.content, "");
        assert_eq!(h.calls, vec![Call { name: "get_weather".into(), arguments: "{\"city\": \"Paris\"}".into() }]);
        let answer =
            "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>";
        let h = parse(answer, true);
        assert_eq!((h.reasoning.as_str(), h.content.as_str(), h.calls.len()), ("Easy.", "4", 0));
        // The stop token cut from the text: the last body ends with the output.
        let cut = answer.strip_suffix("<|return|>").unwrap();
        assert_eq!(parse(cut, true).content, "4");
        // The recipient in the role part of the header, a preamble on the commentary channel.
        let other = "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>\
            <|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}<|call|>";
        let h = parse(other, true);
        assert_eq!(
            (h.content.as_str(), h.calls[0].name.as_str(), h.calls[0].arguments.as_str()),
            ("Checking.", "f", "{}")
        );
        // Text without a header is all content; so is a message to a function with no name.
        assert_eq!(parse("{\"a\": 1}", true).content, "{\"a\": 1}");
        let nameless = parse("<|channel|>commentary to=functions. json<|message|>{}<|call|>", true);
        assert_eq!((nameless.content.as_str(), nameless.calls.len()), ("{}", 0));
    }

    /// Every prefix of the output splits into parts that are prefixes of the whole output's
    /// parts: streaming sends each piece once and never takes one back.
    #[test]
    fn every_prefix_splits_into_prefixes_of_the_whole() {
        let answer =
            "<|channel|>analysis<|message|>Think <b>.<|end|><|start|>assistant<|channel|>final<|message|>Hi <|there|>";
        for text in [TEXT, answer] {
            let whole = parse(text, true);
            for cut in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
                let part = parse(&text[..cut], false);
                assert!(whole.reasoning.starts_with(&part.reasoning), "cut {cut}: {part:?}");
                assert!(whole.content.starts_with(&part.content), "cut {cut}: {part:?}");
                assert!(part.calls.len() <= whole.calls.len() && whole.calls.starts_with(&part.calls), "cut {cut}");
            }
        }
    }
}
