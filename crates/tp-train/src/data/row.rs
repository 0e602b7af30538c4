//! One line of a data file into an [`Example`]: which of the three forms it is, and the checks of
//! each. Errors are the message alone; the reader adds the file and the line.

use serde_json::{Map, Value};

use super::{Example, IGNORE_INDEX, TextTokenizer, chat};
use crate::error::one_line;

/// A JSON value from the file, bounded for an error message.
pub(super) fn shown(value: &Value) -> String {
    one_line(&value.to_string(), 40)
}

/// The row of one line: `None` for a blank line.
pub(super) fn parse(
    line: &str,
    vocab_size: usize,
    tokenizer: Option<&dyn TextTokenizer>,
) -> Result<Option<Example>, String> {
    let line = line.trim();
    if line.is_empty() {
        return Ok(None);
    }
    let value: Value = serde_json::from_str(line).map_err(|e| json_message(&e))?;
    let Value::Object(row) = value else {
        return Err(format!("expected a JSON object, got {}", kind(&value)));
    };
    let forms: Vec<&str> = [
        ("\"input_ids\"/\"labels\"", row.contains_key("input_ids") || row.contains_key("labels")),
        ("\"text\"", row.contains_key("text")),
        ("\"messages\"", row.contains_key("messages")),
    ]
    .into_iter()
    .filter_map(|(name, present)| present.then_some(name))
    .collect();
    let example = match forms[..] {
        [] => Err("a row needs \"input_ids\" and \"labels\", \"text\", or \"messages\"; this one has none".to_string()),
        [_] if row.contains_key("text") => text_row(&row, tokenizer),
        [_] if row.contains_key("messages") => messages_row(&row, tokenizer),
        [_] => ids_row(&row, vocab_size),
        _ => Err(format!("a row has one form, this one mixes {}", forms.join(" and "))),
    }?;
    if example.input_ids.is_empty() {
        return Err("a row with zero tokens".into());
    }
    check_vocab(&example.input_ids, vocab_size)?;
    Ok(Some(example))
}

/// serde_json's message without its " at line 1 column N" (a line is one JSON document).
fn json_message(e: &serde_json::Error) -> String {
    let full = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    let message = full.strip_suffix(&suffix).unwrap_or(&full);
    format!("malformed JSON at column {}: {}", e.column(), one_line(message, 120))
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Every id below `vocab_size` (ids from a tokenizer are checked here too).
fn check_vocab(ids: &[u32], vocab_size: usize) -> Result<(), String> {
    match ids.iter().position(|&id| id as usize >= vocab_size) {
        Some(i) => Err(format!("token id {} at position {i} is outside the vocabulary (size {vocab_size})", ids[i])),
        None => Ok(()),
    }
}

fn array<'a>(row: &'a Map<String, Value>, key: &str) -> Result<&'a [Value], String> {
    match row.get(key) {
        Some(Value::Array(items)) => Ok(items),
        Some(other) => Err(format!("\"{key}\" must be an array, got {}", kind(other))),
        None => Err(format!("\"{key}\" is missing")),
    }
}

/// `{"input_ids": [...], "labels": [...]}`.
fn ids_row(row: &Map<String, Value>, vocab_size: usize) -> Result<Example, String> {
    match (row.contains_key("input_ids"), row.contains_key("labels")) {
        (true, false) => return Err("\"input_ids\" without \"labels\"".into()),
        (false, _) => return Err("\"labels\" without \"input_ids\"".into()),
        (true, true) => {}
    }
    let (ids, labels) = (array(row, "input_ids")?, array(row, "labels")?);
    if ids.len() != labels.len() {
        return Err(format!("\"labels\" has {} entries but \"input_ids\" has {}", labels.len(), ids.len()));
    }
    let input_ids = ids
        .iter()
        .enumerate()
        .map(|(i, id)| match id.as_u64() {
            Some(v) => u32::try_from(v)
                .ok()
                .filter(|&id| (id as usize) < vocab_size)
                .ok_or_else(|| format!("input_ids[{i}] = {v} is outside the vocabulary (size {vocab_size})")),
            None => Err(format!("input_ids[{i}] = {} is not a non-negative integer", shown(id))),
        })
        .collect::<Result<Vec<u32>, String>>()?;
    let labels = labels
        .iter()
        .enumerate()
        .map(|(i, label)| match label.as_i64() {
            Some(v) if v == IGNORE_INDEX || (0 <= v && (v as u64) < vocab_size as u64) => Ok(v),
            Some(v) => Err(format!("labels[{i}] = {v} is neither -100 nor in the vocabulary (size {vocab_size})")),
            None => Err(format!("labels[{i}] = {} is not an integer", shown(label))),
        })
        .collect::<Result<Vec<i64>, String>>()?;
    Ok(Example { input_ids, labels })
}

fn need<'a>(tokenizer: Option<&'a dyn TextTokenizer>, form: &str) -> Result<&'a dyn TextTokenizer, String> {
    tokenizer.ok_or_else(|| format!("a \"{form}\" row needs the model's tokenizer, and none was given"))
}

/// `{"text": "..."}`: the ids with special tokens, every one a label.
fn text_row(row: &Map<String, Value>, tokenizer: Option<&dyn TextTokenizer>) -> Result<Example, String> {
    let Some(Value::String(text)) = row.get("text") else {
        return Err(format!("\"text\" must be a string, got {}", row.get("text").map_or("nothing", kind)));
    };
    let input_ids =
        need(tokenizer, "text")?.encode(text, true).map_err(|e| format!("tokenizer: {}", one_line(&e, 200)))?;
    let labels = input_ids.iter().map(|&id| i64::from(id)).collect();
    Ok(Example { input_ids, labels })
}

/// `{"messages": [...]}`: the rendered conversation, loss on the assistant turns.
fn messages_row(row: &Map<String, Value>, tokenizer: Option<&dyn TextTokenizer>) -> Result<Example, String> {
    let messages = array(row, "messages")?;
    chat::assistant_example(messages, need(tokenizer, "messages")?)
}
