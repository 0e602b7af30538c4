//! The training data reader: a JSONL file, one JSON object a line, read whole at the start and
//! served in file order, wrapping at the end.
//!
//! A row is one of three forms (extra keys are ignored):
//!
//! 1. `{"input_ids": [...], "labels": [...]}`: ids in `[0, vocab_size)`, labels of the same
//!    length, each -100 ([`IGNORE_INDEX`], no loss) or in `[0, vocab_size)`.
//! 2. `{"text": "..."}`: `ids = encode(text, add_special_tokens = true)`, `labels = ids`.
//! 3. `{"messages": [{"role": ..., "content": ...}, ...]}`: `ids = encode(render(messages,
//!    false), false)`, labels the ids of the assistant turns and -100 elsewhere. The tokens of
//!    assistant message `i` are those by which `encode(render(messages[..=i], false), false)`
//!    extends `encode(render(messages[..i], true), false)`: positions from their longest common
//!    prefix up to the longer one's length. At least one message must be the assistant's.
//!
//! Labels are unshifted, as in transformers: the logits at position `t` predict `labels[t + 1]`.
//! Rows longer than `seq_len` keep their first `seq_len` ids and labels (checked whole first).
//! Blank lines are skipped; line numbers in errors count every line from 1.

mod chat;
mod row;

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use crate::error::one_line;
use crate::{Result, TrainError};

/// The largest data file read (4 GiB); the whole file is parsed into memory at the start.
pub const MAX_DATA_FILE_BYTES: u64 = 4 << 30;

/// The label of a position that takes no loss (torch's `CrossEntropyLoss` `ignore_index`).
pub const IGNORE_INDEX: i64 = -100;

/// The model's tokenizer and chat template, for `text` and `messages` rows.
pub trait TextTokenizer {
    /// Token ids of `text`, as transformers' `tokenizer.encode(text, add_special_tokens=...)`.
    fn encode(&self, text: &str, add_special_tokens: bool) -> std::result::Result<Vec<u32>, String>;
    /// `messages` rendered by the chat template, as transformers' `apply_chat_template(messages,
    /// tokenize=False, add_generation_prompt=...)`.
    fn render_chat(
        &self,
        messages: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> std::result::Result<String, String>;
}

/// One training row: token ids and their unshifted labels, of the same length (at least 1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Example {
    /// The tokens fed.
    pub input_ids: Vec<u32>,
    /// Per position the token it is scored against (transformers' unshifted labels: position
    /// `t` predicts `labels[t + 1]`), `-100` where nothing is scored.
    pub labels: Vec<i64>,
}

impl Example {
    /// The number of positions that take loss: `t < len - 1` with `labels[t + 1] != -100`.
    pub fn targets(&self) -> usize {
        self.labels.iter().skip(1).filter(|&&l| l != IGNORE_INDEX).count()
    }
}

/// The rows of a data file, and how many have been served.
#[derive(Debug, Clone)]
pub struct Dataset {
    name: String,
    rows: Vec<Example>,
    position: u64,
}

/// What each row is checked against, and the rows read so far.
struct Reader<'a> {
    file: String,
    vocab_size: usize,
    seq_len: usize,
    tokenizer: Option<&'a dyn TextTokenizer>,
    rows: Vec<Example>,
}

impl Reader<'_> {
    fn line(&mut self, line: u64, text: &str) -> Result<()> {
        // A UTF-8 byte-order mark may open the file.
        let text = if line == 1 { text.strip_prefix('\u{feff}').unwrap_or(text) } else { text };
        match row::parse(text, self.vocab_size, self.tokenizer) {
            Ok(Some(mut example)) => {
                example.input_ids.truncate(self.seq_len);
                example.labels.truncate(self.seq_len);
                self.rows.push(example);
                Ok(())
            }
            Ok(None) => Ok(()),
            Err(message) => Err(TrainError::BadRow { file: self.file.clone(), line, message }),
        }
    }

    fn finish(self) -> Result<Dataset> {
        if self.rows.is_empty() {
            return Err(TrainError::NoRows { file: self.file });
        }
        Ok(Dataset { name: self.file, rows: self.rows, position: 0 })
    }
}

fn check_seq_len(seq_len: usize) -> Result<()> {
    if seq_len == 0 {
        return Err(TrainError::InvalidArgument { name: "seq_len", value: "0".into(), why: "must be at least 1" });
    }
    Ok(())
}

/// What a non-regular file is, in words.
fn kind_of(file_type: std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if file_type.is_fifo() {
            return "a FIFO";
        }
        if file_type.is_socket() {
            return "a socket";
        }
        if file_type.is_block_device() || file_type.is_char_device() {
            return "a device";
        }
    }
    if file_type.is_dir() { "a directory" } else { "not a file" }
}

impl Dataset {
    /// Reads and checks the JSONL file at `path` (a regular file, after following symlinks, of at
    /// most [`MAX_DATA_FILE_BYTES`]; anything else is refused before it is opened). `tokenizer`
    /// is needed only for `text` and `messages` rows.
    pub fn open(path: &Path, vocab_size: usize, seq_len: usize, tokenizer: Option<&dyn TextTokenizer>) -> Result<Self> {
        check_seq_len(seq_len)?;
        let file = one_line(&path.display().to_string(), 256);
        let io = |action: &'static str| {
            let file = file.clone();
            move |e: std::io::Error| TrainError::Io { file, action, message: one_line(&e.to_string(), 256) }
        };
        let meta = std::fs::metadata(path).map_err(io("inspect"))?;
        if !meta.is_file() {
            return Err(TrainError::NotRegularFile { file, kind: kind_of(meta.file_type()) });
        }
        if meta.len() > MAX_DATA_FILE_BYTES {
            return Err(TrainError::FileTooLarge { file, bytes: meta.len(), max: MAX_DATA_FILE_BYTES });
        }
        let handle = File::open(path).map_err(io("open"))?;
        // The path may have been replaced between the check and the open.
        let meta = handle.metadata().map_err(io("inspect"))?;
        if !meta.is_file() {
            return Err(TrainError::NotRegularFile { file, kind: kind_of(meta.file_type()) });
        }
        let mut input = BufReader::new(handle.take(MAX_DATA_FILE_BYTES + 1));
        let mut reader = Reader { file: file.clone(), vocab_size, seq_len, tokenizer, rows: Vec::new() };
        let (mut buf, mut bytes, mut line) = (Vec::new(), 0u64, 0u64);
        loop {
            buf.clear();
            let n = input.read_until(b'\n', &mut buf).map_err(io("read"))?;
            if n == 0 {
                break;
            }
            bytes += n as u64;
            if bytes > MAX_DATA_FILE_BYTES {
                return Err(TrainError::FileTooLarge { file, bytes, max: MAX_DATA_FILE_BYTES });
            }
            line += 1;
            let text = std::str::from_utf8(&buf).map_err(|e| TrainError::BadRow {
                file: file.clone(),
                line,
                message: format!("not valid UTF-8 (from byte {} of the line)", e.valid_up_to()),
            })?;
            reader.line(line, text)?;
        }
        reader.finish()
    }

    /// Reads rows from JSONL `text` as [`Dataset::open`] does from a file; `name` stands for the
    /// file in error messages.
    pub fn from_str(
        text: &str,
        name: &str,
        vocab_size: usize,
        seq_len: usize,
        tokenizer: Option<&dyn TextTokenizer>,
    ) -> Result<Self> {
        check_seq_len(seq_len)?;
        let mut reader = Reader { file: one_line(name, 256), vocab_size, seq_len, tokenizer, rows: Vec::new() };
        for (i, text) in text.split('\n').enumerate() {
            reader.line(i as u64 + 1, text)?;
        }
        reader.finish()
    }

    /// The file's name, as error messages give it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The number of rows (at least 1).
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Always false: a dataset has at least one row.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// All rows, in file order.
    pub fn rows(&self) -> &[Example] {
        &self.rows
    }

    /// The next `n` rows in file order, wrapping at the end (a row may come more than once).
    pub fn next_rows(&mut self, n: usize) -> Vec<Example> {
        (0..n)
            .map(|_| {
                let row = self.rows[(self.position % self.rows.len() as u64) as usize].clone();
                self.position = self.position.wrapping_add(1);
                row
            })
            .collect()
    }

    /// How many rows have been served since the start (not reduced modulo [`Dataset::len`]).
    pub fn position(&self) -> u64 {
        self.position
    }

    /// Resumes as if `rows_consumed` rows had been served: the next row is row
    /// `rows_consumed % len`.
    pub fn set_position(&mut self, rows_consumed: u64) {
        self.position = rows_consumed;
    }
}

#[cfg(test)]
mod tests;
