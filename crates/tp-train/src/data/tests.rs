use std::path::PathBuf;

use serde_json::Value;

use super::*;

/// Bytes as ids (with `bos` first when special tokens are asked for), and the template
/// `<|role|>content\n` per message, then `gen_prompt` for a generation prompt.
struct FakeTokenizer {
    bos: Option<u32>,
    gen_prompt: &'static str,
}

const FAKE: FakeTokenizer = FakeTokenizer { bos: Some(256), gen_prompt: "<|assistant|>" };

impl TextTokenizer for FakeTokenizer {
    fn encode(&self, text: &str, add_special_tokens: bool) -> std::result::Result<Vec<u32>, String> {
        if text.contains("FAIL") {
            return Err("cannot encode\nthis".into());
        }
        let bos = self.bos.filter(|_| add_special_tokens);
        Ok(bos.into_iter().chain(text.bytes().map(u32::from)).collect())
    }

    fn render_chat(&self, messages: &[Value], add_generation_prompt: bool) -> std::result::Result<String, String> {
        let mut out = String::new();
        for m in messages {
            let content = m.get("content").and_then(Value::as_str).ok_or("no content")?;
            out += &format!("<|{}|>{content}\n", m["role"].as_str().unwrap_or("?"));
        }
        if add_generation_prompt {
            out += self.gen_prompt;
        }
        Ok(out)
    }
}

fn read(text: &str) -> Result<Dataset> {
    Dataset::from_str(text, "rows.jsonl", 300, 256, Some(&FAKE))
}

fn bytes(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// The error of `text`, checked to name the file and `line`.
fn error_at(text: &str, line: u64, tokenizer: Option<&dyn TextTokenizer>) -> String {
    let err = Dataset::from_str(text, "rows.jsonl", 300, 64, tokenizer).unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, TrainError::BadRow { line: l, .. } if l == line), "{message}");
    assert!(message.starts_with(&format!("rows.jsonl:{line}: ")), "{message}");
    assert!(!message.contains('\n'), "{message}");
    message
}

#[test]
fn ids_rows_in_file_order_wrapping() {
    let mut data = read(
        "{\"input_ids\": [1, 2, 3], \"labels\": [-100, 2, 3]}\n\n  \n{\"input_ids\": [4], \"labels\": [4], \"id\": 7}\n",
    )
    .unwrap();
    assert_eq!(data.len(), 2);
    assert!(!data.is_empty());
    assert_eq!(data.name(), "rows.jsonl");
    let first = Example { input_ids: vec![1, 2, 3], labels: vec![-100, 2, 3] };
    let second = Example { input_ids: vec![4], labels: vec![4] };
    assert_eq!(data.next_rows(3), vec![first.clone(), second.clone(), first.clone()]);
    assert_eq!(data.position(), 3);
    assert_eq!(data.next_rows(0), vec![]);
    assert_eq!(data.next_rows(1), vec![second.clone()]);
    data.set_position(7);
    assert_eq!(data.next_rows(2), vec![second, first]);
    assert_eq!(data.position(), 9);
    data.set_position(u64::MAX);
    assert_eq!(data.next_rows(2).len(), 2);
}

#[test]
fn long_rows_are_truncated_to_seq_len() {
    let data = Dataset::from_str("{\"input_ids\": [1, 2, 3, 4, 5], \"labels\": [1, 2, 3, 4, -100]}", "x", 10, 3, None)
        .unwrap();
    assert_eq!(data.rows(), &[Example { input_ids: vec![1, 2, 3], labels: vec![1, 2, 3] }]);
    let err = Dataset::from_str("{\"input_ids\": [1], \"labels\": [1]}", "x", 10, 0, None).unwrap_err();
    assert!(matches!(err, TrainError::InvalidArgument { name: "seq_len", .. }), "{err}");
}

#[test]
fn targets_count_labels_after_the_first_position() {
    let row = |labels: Vec<i64>| Example { input_ids: vec![0; labels.len()], labels };
    assert_eq!(row(vec![5, -100, 6, 7]).targets(), 2);
    assert_eq!(row(vec![5, -100]).targets(), 0);
    assert_eq!(row(vec![5]).targets(), 0);
}

#[test]
fn text_rows_use_special_tokens_and_label_every_id() {
    let data = read("{\"text\": \"hi\"}\r\n").unwrap();
    assert_eq!(data.rows(), &[Example { input_ids: vec![256, 104, 105], labels: vec![256, 104, 105] }]);
}

#[test]
fn messages_rows_label_the_assistant_turns() {
    let line = r#"{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": "ok"}]}"#
        .replace('\n', " ");
    let data = read(&line).unwrap();
    let full = "<|system|>s\n<|user|>hi\n<|assistant|>yo\n<|user|>q\n<|assistant|>ok\n";
    let row = &data.rows()[0];
    // No special tokens: no BOS.
    assert_eq!(row.input_ids, bytes(full));
    let labelled: String = row
        .labels
        .iter()
        .zip(&row.input_ids)
        .filter(|(l, _)| **l != IGNORE_INDEX)
        .map(|(_, &id)| id as u8 as char)
        .collect();
    assert_eq!(labelled, "yo\nok\n");
    for (&label, &id) in row.labels.iter().zip(&row.input_ids) {
        assert!(label == IGNORE_INDEX || label == i64::from(id));
    }
    // Exactly the reply bytes after each "<|assistant|>".
    let first = full.find("yo").unwrap();
    assert_eq!(row.labels[first - 1], IGNORE_INDEX);
    assert_eq!(row.labels[first], i64::from(b'y'));
}

#[test]
fn an_assistant_turn_first_and_a_prompt_that_is_not_a_prefix() {
    let line = r#"{"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}"#;
    let data = read(line).unwrap();
    let row = &data.rows()[0];
    let labelled: Vec<i64> = row.labels.iter().copied().filter(|&l| l != IGNORE_INDEX).collect();
    assert_eq!(labelled, vec![i64::from(b'a'), i64::from(b'\n')]);

    // The generation prompt "<|assistant|>\n" differs from the rendered reply at the "\n": the
    // turn's tokens start at the first difference and run to the longer rendering's end.
    let tok = FakeTokenizer { bos: None, gen_prompt: "<|assistant|>\n" };
    let line = r#"{"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "xy"}]}"#;
    let data = Dataset::from_str(line, "x", 300, 64, Some(&tok)).unwrap();
    let row = &data.rows()[0];
    let start = "<|user|>u\n<|assistant|>".len();
    assert!(row.labels[..start].iter().all(|&l| l == IGNORE_INDEX));
    assert_eq!(row.labels[start..], [b'x', b'y', b'\n'].map(i64::from));
}

#[test]
fn malformed_rows_name_their_line() {
    let ok = "{\"input_ids\": [1], \"labels\": [1]}\n";
    let cases: &[(&str, &str)] = &[
        ("{\"input_ids\": [1,", "malformed JSON at column"),
        ("[1, 2]", "expected a JSON object, got an array"),
        ("{\"foo\": 1}", "none"),
        ("{\"text\": \"a\", \"messages\": []}", "mixes \"text\" and \"messages\""),
        ("{\"input_ids\": [1], \"labels\": [1], \"text\": \"a\"}", "mixes"),
        ("{\"input_ids\": [1]}", "\"input_ids\" without \"labels\""),
        ("{\"labels\": [1]}", "\"labels\" without \"input_ids\""),
        ("{\"input_ids\": 1, \"labels\": [1]}", "\"input_ids\" must be an array, got a number"),
        ("{\"input_ids\": [1, 2], \"labels\": [1]}", "\"labels\" has 1 entries but \"input_ids\" has 2"),
        ("{\"input_ids\": [1, 300], \"labels\": [1, 2]}", "input_ids[1] = 300 is outside the vocabulary (size 300)"),
        ("{\"input_ids\": [4294967297], \"labels\": [1]}", "input_ids[0] = 4294967297 is outside"),
        ("{\"input_ids\": [1.5], \"labels\": [1]}", "input_ids[0] = 1.5 is not a non-negative integer"),
        ("{\"input_ids\": [-1], \"labels\": [1]}", "input_ids[0] = -1 is not a non-negative integer"),
        ("{\"input_ids\": [\"7\"], \"labels\": [1]}", "input_ids[0] = \"7\" is not"),
        ("{\"input_ids\": [1], \"labels\": [-5]}", "labels[0] = -5 is neither -100 nor in the vocabulary"),
        ("{\"input_ids\": [1], \"labels\": [300]}", "labels[0] = 300 is neither"),
        ("{\"input_ids\": [1], \"labels\": [null]}", "labels[0] = null is not an integer"),
        ("{\"input_ids\": [], \"labels\": []}", "a row with zero tokens"),
        ("{\"text\": 5}", "\"text\" must be a string, got a number"),
        ("{\"text\": \"FAIL\"}", "tokenizer: cannot encode\\nthis"),
        ("{\"messages\": {}}", "\"messages\" must be an array, got an object"),
        ("{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}]}", "no assistant message"),
        ("{\"messages\": []}", "no assistant message"),
        ("{\"messages\": [{\"content\": \"a\"}]}", "messages[0] is not an object with a string \"role\""),
        ("{\"messages\": [\"hi\"]}", "messages[0] is not an object"),
        ("{\"messages\": [{\"role\": \"assistant\"}]}", "chat template: no content"),
    ];
    for (row, want) in cases {
        let message = error_at(&format!("{ok}\n{row}\n{ok}"), 3, Some(&FAKE));
        assert!(message.contains(want), "{row}: {message}");
    }
}

#[test]
fn tokenizer_ids_outside_the_vocabulary_are_errors() {
    let tok = FakeTokenizer { bos: None, gen_prompt: "" };
    let err = Dataset::from_str("{\"text\": \"a\u{e9}\"}", "t.jsonl", 150, 8, Some(&tok)).unwrap_err();
    assert_eq!(err.to_string(), "t.jsonl:1: token id 195 at position 1 is outside the vocabulary (size 150)");
    let err = Dataset::from_str("{\"text\": \"\"}", "t.jsonl", 150, 8, Some(&tok)).unwrap_err();
    assert_eq!(err.to_string(), "t.jsonl:1: a row with zero tokens");
}

#[test]
fn text_and_messages_need_a_tokenizer() {
    let message = error_at("{\"text\": \"a\"}", 1, None);
    assert!(message.contains("a \"text\" row needs the model's tokenizer"), "{message}");
    let message = error_at("\n{\"messages\": [{\"role\": \"assistant\", \"content\": \"a\"}]}", 2, None);
    assert!(message.contains("a \"messages\" row needs the model's tokenizer"), "{message}");
}

#[test]
fn a_file_without_rows_is_an_error() {
    for text in ["", "\n", "  \n\t\n\n"] {
        let err = read(text).unwrap_err();
        assert!(matches!(err, TrainError::NoRows { .. }), "{err}");
        assert!(err.to_string().starts_with("rows.jsonl: no rows"), "{err}");
    }
}

/// A fresh directory for one test's files.
fn temp_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tp-train-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn open_reads_a_file_and_follows_symlinks() {
    let dir = temp_dir("open");
    let path = dir.join("rows.jsonl");
    std::fs::write(&path, "\u{feff}{\"input_ids\": [1], \"labels\": [1]}\n{\"text\": \"a\"}").unwrap();
    let data = Dataset::open(&path, 300, 8, Some(&FAKE)).unwrap();
    assert_eq!(data.len(), 2);
    assert_eq!(data.rows()[1].input_ids, vec![256, 97]);
    #[cfg(unix)]
    {
        let link = dir.join("link.jsonl");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        assert_eq!(Dataset::open(&link, 300, 8, Some(&FAKE)).unwrap().rows(), data.rows());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn open_names_the_line_of_bad_utf8() {
    let dir = temp_dir("utf8");
    let path = dir.join("rows.jsonl");
    std::fs::write(&path, b"{\"input_ids\": [1], \"labels\": [1]}\n{\"text\": \"\xff\"}\n").unwrap();
    let err = Dataset::open(&path, 300, 8, Some(&FAKE)).unwrap_err();
    assert_eq!(err.to_string(), format!("{}:2: not valid UTF-8 (from byte 10 of the line)", path.display()));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn open_refuses_what_is_not_a_regular_file() {
    let dir = temp_dir("kinds");
    let err = Dataset::open(&dir, 300, 8, None).unwrap_err();
    assert_eq!(err.to_string(), format!("{}: is a directory, not a regular file", dir.display()));
    let missing = dir.join("missing.jsonl");
    let err = Dataset::open(&missing, 300, 8, None).unwrap_err();
    assert!(matches!(err, TrainError::Io { action: "inspect", .. }), "{err}");
    assert!(err.to_string().starts_with(&format!("{}: cannot inspect: ", missing.display())), "{err}");
    #[cfg(unix)]
    {
        let err = Dataset::open(Path::new("/dev/null"), 300, 8, None).unwrap_err();
        assert_eq!(err.to_string(), "/dev/null: is a device, not a regular file");
        // A FIFO with no writer would block an open: it must be refused before.
        let fifo = dir.join("fifo");
        if std::process::Command::new("mkfifo").arg(&fifo).status().is_ok_and(|s| s.success()) {
            let err = Dataset::open(&fifo, 300, 8, None).unwrap_err();
            assert!(matches!(err, TrainError::NotRegularFile { kind: "a FIFO", .. }), "{err}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn open_refuses_a_file_over_the_limit() {
    let dir = temp_dir("large");
    let path = dir.join("big.jsonl");
    // Sparse: no disk is used.
    std::fs::File::create(&path).unwrap().set_len(MAX_DATA_FILE_BYTES + 1).unwrap();
    let err = Dataset::open(&path, 300, 8, None).unwrap_err();
    assert_eq!(
        err,
        TrainError::FileTooLarge {
            file: path.display().to_string(),
            bytes: MAX_DATA_FILE_BYTES + 1,
            max: MAX_DATA_FILE_BYTES
        }
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
