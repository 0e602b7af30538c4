//! One chat choice's output as it streams: reasoning, answer text and tool calls, each piece
//! sent once it is decided. Text that may start a tool call (or a reasoning tag) is held back
//! until it cannot; a call is sent whole (id, name and arguments in one delta) once its format
//! closes or the choice ends, so the streamed calls equal the non-streamed ones.

use super::forced::{CallSyntax, parse_forced};
use super::{Call, ToolChoice, ToolParser, parse};
use crate::markers::partial_suffix;
use crate::reasoning::ReasoningParser;

/// What a chat's output is read for.
#[derive(Debug, Clone, PartialEq)]
pub struct OutputRules {
    /// `--reasoning-parser`, if set.
    pub reasoning: Option<ReasoningParser>,
    /// How tool calls appear in the answer.
    pub tools: ToolMode,
    /// Whether a choice may make several calls (`parallel_tool_calls`); without, only its first
    /// call is kept.
    pub parallel_calls: bool,
}

/// How tool calls appear in a choice's answer.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolMode {
    /// Not at all: the answer is content.
    Off,
    /// Maybe, written in this format (`tool_choice: "auto"`).
    Auto(ToolParser),
    /// The whole answer is the call(s) (`"required"` or a named function), enforced in this
    /// syntax.
    Forced(ToolChoice, CallSyntax),
}

/// A streamed piece of a choice.
#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    /// Reasoning text.
    Reasoning(String),
    /// Answer text.
    Content(String),
    /// A tool call's start: its position, id and name, and its first arguments text.
    CallStart {
        /// Index among the choice's calls.
        index: usize,
        /// `chatcmpl-tool-...`.
        id: String,
        /// The function.
        name: String,
        /// Arguments text sent with the start (all of it for a whole call).
        arguments: String,
    },
    /// More of the arguments of call `index`.
    CallArgs {
        /// Index among the choice's calls.
        index: usize,
        /// The next arguments text.
        arguments: String,
    },
}

/// The whole output of a choice, split.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Final {
    /// `reasoning_content`.
    pub reasoning: Option<String>,
    /// `content` (`None` when empty or all calls).
    pub content: Option<String>,
    /// `tool_calls`.
    pub calls: Vec<Call>,
}

impl OutputRules {
    /// Whether the answer's text keeps special tokens: Mistral's `[TOOL_CALLS]` is one, and its
    /// parser reads the text with them kept (as vLLM keeps them); harmony's headers are all
    /// special tokens.
    pub fn keeps_special(&self) -> bool {
        self.reasoning == Some(ReasoningParser::GptOss)
            || matches!(
                self.tools,
                ToolMode::Auto(ToolParser::Mistral | ToolParser::Harmony)
                    | ToolMode::Forced(_, CallSyntax::Parser(ToolParser::Mistral))
            )
    }

    /// Splits a whole output.
    pub fn finish(&self, text: &str) -> Final {
        let (reasoning, answer) = match self.reasoning {
            Some(p) => p.finish(text),
            None => (None, (!text.is_empty()).then(|| text.to_string())),
        };
        let answer_text = answer.clone().unwrap_or_default();
        let mut out = match &self.tools {
            ToolMode::Off => Final { reasoning, content: answer, calls: Vec::new() },
            // Harmony's calls are messages of their own, outside the answer.
            ToolMode::Auto(ToolParser::Harmony) if self.reasoning == Some(ReasoningParser::GptOss) => {
                Final { reasoning, content: answer, calls: crate::harmony::parse(text, true).calls }
            }
            ToolMode::Auto(p) => {
                let parsed = parse(*p, &answer_text);
                Final { reasoning, content: parsed.content, calls: parsed.calls }
            }
            ToolMode::Forced(choice, syntax) => match parse_forced(choice, *syntax, &answer_text) {
                Some(calls) => Final { reasoning, content: None, calls },
                None => Final { reasoning, content: answer, calls: Vec::new() },
            },
        };
        if !self.parallel_calls {
            out.calls.truncate(1);
        }
        out
    }
}

/// One choice's streaming state: the text so far and how much of each part was sent.
pub struct ChoiceOutput {
    rules: OutputRules,
    text: String,
    sent_reasoning: usize,
    sent_content: usize,
    /// A named function's call, started (its arguments stream as content arrives).
    named_id: Option<String>,
}

impl ChoiceOutput {
    /// A choice read by `rules`.
    pub fn new(rules: OutputRules) -> ChoiceOutput {
        ChoiceOutput { rules, text: String::new(), sent_reasoning: 0, sent_content: 0, named_id: None }
    }

    /// The deltas that `piece` (the next text of the choice) decides.
    pub fn push(&mut self, piece: &str) -> Vec<Delta> {
        self.text.push_str(piece);
        let mut out = Vec::new();
        let (reasoning, answer) = match self.rules.reasoning {
            Some(p) => {
                let (r, a, _) = p.split(&self.text);
                (r, a)
            }
            None => ("".into(), Some(std::borrow::Cow::Borrowed(self.text.as_str()))),
        };
        if reasoning.len() > self.sent_reasoning {
            out.push(Delta::Reasoning(reasoning[self.sent_reasoning..].to_string()));
            self.sent_reasoning = reasoning.len();
        }
        let Some(answer) = answer else { return out };
        let answer: &str = &answer;
        let ready = match &self.rules.tools {
            ToolMode::Off => answer.len(),
            ToolMode::Auto(ToolParser::Llama3Json) => {
                let t = answer.trim_start();
                // A JSON call opens the answer; until it is clear none does, hold it all.
                if t.is_empty()
                    || t.starts_with('{')
                    || t.starts_with("<|python_tag|>")
                    || "<|python_tag|>".starts_with(t)
                {
                    self.sent_content.min(answer.len())
                } else {
                    answer.len()
                }
            }
            ToolMode::Auto(p) => match answer.find(p.marker()) {
                Some(at) => at,
                None => answer.len() - partial_suffix(answer, p.marker()),
            },
            ToolMode::Forced(ToolChoice::Named(name), CallSyntax::Vllm) => {
                let name = name.clone();
                let id = self.named_id.get_or_insert_with(super::call_id).clone();
                if self.sent_content == 0 && !answer.is_empty() {
                    out.push(Delta::CallStart { index: 0, id, name, arguments: answer.to_string() });
                } else if answer.len() > self.sent_content {
                    out.push(Delta::CallArgs { index: 0, arguments: answer[self.sent_content..].to_string() });
                }
                self.sent_content = answer.len();
                return out;
            }
            // The parser's format, or vLLM's list: the calls go out whole at the end.
            ToolMode::Forced(..) => 0,
        };
        if ready > self.sent_content {
            out.push(Delta::Content(answer[self.sent_content..ready].to_string()));
            self.sent_content = ready;
        }
        out
    }

    /// The deltas left when the choice ends, and whether it made tool calls.
    pub fn finish(&mut self) -> (Vec<Delta>, bool) {
        let f = self.rules.finish(&self.text);
        let mut out = Vec::new();
        let reasoning = f.reasoning.as_deref().unwrap_or("");
        if reasoning.len() > self.sent_reasoning {
            out.push(Delta::Reasoning(reasoning[self.sent_reasoning..].to_string()));
        }
        if self.named_id.is_some() {
            // The arguments were streamed as they came; nothing is left but the verdict.
            return (out, !f.calls.is_empty());
        }
        let content = f.content.as_deref().unwrap_or("");
        // What was sent is always a prefix of the final content.
        if content.len() > self.sent_content {
            out.push(Delta::Content(content[self.sent_content..].to_string()));
        }
        for (index, c) in f.calls.iter().enumerate() {
            out.push(Delta::CallStart {
                index,
                id: super::call_id(),
                name: c.name.clone(),
                arguments: c.arguments.clone(),
            });
        }
        (out, !f.calls.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(tools: ToolMode) -> OutputRules {
        OutputRules { reasoning: None, tools, parallel_calls: true }
    }

    fn run(rules: OutputRules, pieces: &[&str]) -> (Vec<Delta>, bool) {
        let mut o = ChoiceOutput::new(rules);
        let mut all = Vec::new();
        for p in pieces {
            all.extend(o.push(p));
        }
        let (rest, called) = o.finish();
        all.extend(rest);
        (all, called)
    }

    fn joined(d: &[Delta]) -> (String, String, Vec<(String, String)>) {
        let (mut r, mut c, mut calls) = (String::new(), String::new(), Vec::<(String, String)>::new());
        for x in d {
            match x {
                Delta::Reasoning(t) => r.push_str(t),
                Delta::Content(t) => c.push_str(t),
                Delta::CallStart { name, arguments, .. } => calls.push((name.clone(), arguments.clone())),
                Delta::CallArgs { index, arguments } => calls[*index].1.push_str(arguments),
            }
        }
        (r, c, calls)
    }

    #[test]
    fn streamed_hermes_calls_equal_the_whole_parse() {
        let rules = OutputRules {
            reasoning: Some(ReasoningParser::Qwen3),
            tools: ToolMode::Auto(ToolParser::Hermes),
            parallel_calls: true,
        };
        let text = "<think>plan</think>Sure.<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>";
        // Every split of the text into two pieces streams the same result.
        let whole = rules.finish(text);
        for cut in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
            let (d, called) = run(rules.clone(), &[&text[..cut], &text[cut..]]);
            let (r, c, calls) = joined(&d);
            assert!(called);
            assert_eq!(Some(r), whole.reasoning, "cut {cut}");
            assert_eq!(Some(c), whole.content, "cut {cut}");
            let want: Vec<(String, String)> =
                whole.calls.iter().map(|c| (c.name.clone(), c.arguments.clone())).collect();
            assert_eq!(calls, want, "cut {cut}");
        }
    }

    #[test]
    fn plain_text_streams_at_once_and_a_named_call_streams_its_arguments() {
        let (d, called) = run(rules(ToolMode::Auto(ToolParser::Hermes)), &["Hello <", "b>"]);
        assert_eq!(d, vec![Delta::Content("Hello ".into()), Delta::Content("<b>".into())]);
        assert!(!called);
        let named = rules(ToolMode::Forced(ToolChoice::Named("f".into()), CallSyntax::Vllm));
        let (d, called) = run(named, &["{\"a\":", " 1}"]);
        assert!(called);
        let (_, c, calls) = joined(&d);
        assert_eq!((c.as_str(), calls), ("", vec![("f".to_string(), "{\"a\": 1}".to_string())]));
    }

    #[test]
    fn calls_in_the_parsers_format_stream_whole_and_one_without_parallel_calls() {
        let text = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call>";
        let forced = ToolMode::Forced(ToolChoice::Required, CallSyntax::Parser(ToolParser::Hermes));
        let (d, called) = run(rules(forced.clone()), &[&text[..30], &text[30..]]);
        assert!(called);
        let (_, c, calls) = joined(&d);
        assert_eq!(c, "");
        assert_eq!(calls, vec![("f".to_string(), "{\"a\": 1}".to_string()), ("g".to_string(), "{}".to_string())]);
        // parallel_tool_calls false keeps the first call, forced or free.
        for tools in [forced, ToolMode::Auto(ToolParser::Hermes)] {
            let one = OutputRules { reasoning: None, tools, parallel_calls: false };
            let (d, _) = run(one.clone(), &[text]);
            assert_eq!(joined(&d).2.len(), 1);
            assert_eq!(one.finish(text).calls.len(), 1);
        }
    }
}
