//! A `messages` row: the conversation rendered by the chat template, loss on the assistant turns.
//!
//! With `tok(x) = encode(x, add_special_tokens = false)`, the row's ids are
//! `tok(render(messages, false))`. For each assistant message `i`, let
//! `a = tok(render(messages[..i], true))` (the prompt up to the assistant's header) and
//! `b = tok(render(messages[..=i], false))` (the conversation through its reply); the turn's
//! tokens are the positions from the longest common prefix of `a` and `b` up to
//! `max(len a, len b)` (cut to the row's length). Those positions keep their id as label; every
//! other position is -100.

use serde_json::Value;

use super::{Example, IGNORE_INDEX, TextTokenizer};
use crate::error::one_line;

fn tokenized(
    tokenizer: &dyn TextTokenizer,
    messages: &[Value],
    add_generation_prompt: bool,
) -> Result<Vec<u32>, String> {
    let text = tokenizer
        .render_chat(messages, add_generation_prompt)
        .map_err(|e| format!("chat template: {}", one_line(&e, 200)))?;
    tokenizer.encode(&text, false).map_err(|e| format!("tokenizer: {}", one_line(&e, 200)))
}

/// The ids of the rendered conversation and the labels of its assistant turns.
pub(super) fn assistant_example(messages: &[Value], tokenizer: &dyn TextTokenizer) -> Result<Example, String> {
    let mut assistant_turns = Vec::new();
    for (i, message) in messages.iter().enumerate() {
        match message.get("role") {
            Some(Value::String(role)) if role == "assistant" => assistant_turns.push(i),
            Some(Value::String(_)) => {}
            _ => return Err(format!("messages[{i}] is not an object with a string \"role\"")),
        }
    }
    if assistant_turns.is_empty() {
        return Err("\"messages\" has no assistant message (the loss is on assistant turns only)".into());
    }
    let input_ids = tokenized(tokenizer, messages, false)?;
    let mut labels = vec![IGNORE_INDEX; input_ids.len()];
    for i in assistant_turns {
        let prompt = tokenized(tokenizer, &messages[..i], true)?;
        let through = tokenized(tokenizer, &messages[..=i], false)?;
        let start = prompt.iter().zip(&through).take_while(|(a, b)| a == b).count();
        let end = prompt.len().max(through.len()).min(input_ids.len());
        for (label, &id) in labels.iter_mut().zip(&input_ids).take(end).skip(start) {
            *label = i64::from(id);
        }
    }
    Ok(Example { input_ids, labels })
}
