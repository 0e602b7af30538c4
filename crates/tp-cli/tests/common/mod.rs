//! Test support: a model folder (a tiny synthetic checkpoint, a byte-level BPE `tokenizer.json`
//! and a Llama-3-style `tokenizer_config.json`), the `tp` binary started on a free port, and a
//! small HTTP/1.1 client over std sockets.

#![allow(dead_code)]

pub mod train;

use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tp_testing::synthetic::SyntheticModel;

/// Token id of `<|begin_of_text|>` (the first after the 256 bytes and 3 merges).
pub const BOS: i64 = 259;
/// Token id of `<|eot_id|>`, the model's end of sequence.
pub const EOT: i64 = 263;
/// The folder's `max_position_embeddings`.
pub const MAX_LEN: usize = 256;

/// Llama 3's chat template structure.
pub const TEMPLATE: &str = "{{- bos_token }}{% for message in messages %}{% if message['role'] not in \
    ['system', 'user', 'assistant'] %}{{ raise_exception('Conversation roles must be system, user or assistant') }}\
    {% endif %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim \
    + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";

/// A Qwen2.5-style template: tools in the system turn (`tojson`), `<tool_call>` blocks for an
/// assistant's calls, `<tool_response>` for tool messages, and an `enable_thinking` switch.
pub const TOOLS_TEMPLATE: &str = r#"{%- if tools %}{{- '<|start_header_id|>system\n# Tools\n<tools>' }}{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}{{- '\n</tools><|eot_id|>' }}{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}{{- '<|start_header_id|>assistant\n' + message.content }}
{%- for tc in message.tool_calls %}{%- set tc = tc.function %}{{- '<tool_call>\n{"name": "' + tc.name + '", "arguments": ' + (tc.arguments | tojson) + '}\n</tool_call>' }}{%- endfor %}{{- '<|eot_id|>' }}
{%- elif message.role == 'tool' %}{{- '<|start_header_id|>user\n<tool_response>\n' + message.content + '\n</tool_response><|eot_id|>' }}
{%- else %}{{- '<|start_header_id|>' + message.role + '\n' + message.content + '<|eot_id|>' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant\n' }}{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}"#;

/// GPT-2's byte-to-character map (bytes that are printable stay themselves).
fn byte_chars() -> Vec<char> {
    let mut printable: Vec<u32> = (33..=126).chain(161..=172).chain(174..=255).collect();
    let mut out = vec!['\0'; 256];
    for &b in &printable {
        out[b as usize] = char::from_u32(b).unwrap_or('?');
    }
    let mut n = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            out[b as usize] = char::from_u32(256 + n).unwrap_or('?');
            n += 1;
            printable.push(b);
        }
    }
    out
}

/// Token id of `<think>` (an added token that is not special, as in Qwen3's tokenizer).
pub const THINK: i64 = 264;
/// Token id of `</think>`.
pub const THINK_END: i64 = 265;
/// Token id of `[TOOL_CALLS]`, a special token (Mistral's tool-call marker).
pub const TOOL_CALLS: i64 = 266;
/// OpenAI's harmony markers (gpt-oss's), special tokens from id 267 in this order.
pub const HARMONY: [&str; 7] =
    ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"];
/// The token id of harmony marker `name`.
pub fn harmony_id(name: &str) -> i64 {
    267 + HARMONY.iter().position(|&h| h == name).expect("a harmony marker") as i64
}

/// A byte-level BPE tokenizer: ids 0..256 the bytes, 256..259 three merges, 259..264 Llama 3's
/// specials, 264 and 265 `<think>` and `</think>` (added, not special), 266 `[TOOL_CALLS]` (special),
/// 267.. harmony's markers ([`HARMONY`], special).
pub fn tokenizer_json() -> Value {
    let chars = byte_chars();
    let mut vocab = serde_json::Map::new();
    for (b, c) in chars.iter().enumerate() {
        vocab.insert(c.to_string(), json!(b));
    }
    let specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"];
    let merges = [("h", "e"), ("l", "l"), ("Ġ", "w")];
    for (i, (a, b)) in merges.iter().enumerate() {
        vocab.insert(format!("{a}{b}"), json!(256 + i));
    }
    let mut added: Vec<Value> = specials
        .iter()
        .enumerate()
        .map(|(i, s)| {
            json!({"id": BOS as usize + i, "content": s, "single_word": false, "lstrip": false, "rstrip": false,
            "normalized": false, "special": true})
        })
        .collect();
    for (id, s) in [(THINK, "<think>"), (THINK_END, "</think>")] {
        added.push(json!({"id": id, "content": s, "single_word": false, "lstrip": false, "rstrip": false,
            "normalized": false, "special": false}));
    }
    added.push(json!({"id": TOOL_CALLS, "content": "[TOOL_CALLS]", "single_word": false, "lstrip": false,
        "rstrip": false, "normalized": false, "special": true}));
    for h in HARMONY {
        added.push(json!({"id": harmony_id(h), "content": h, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true}));
    }
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [BOS], "tokens": ["<|begin_of_text|>"]}}
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>()}
    })
}

/// Writes a servable model folder (fresh each call) and returns it.
pub fn model_dir() -> PathBuf {
    model_dir_with_len(MAX_LEN)
}

/// [`model_dir`] with `max_position_embeddings` of `max_len`.
pub fn model_dir_with_len(max_len: usize) -> PathBuf {
    model_dir_of(SyntheticModel { max_position_embeddings: max_len, ..SyntheticModel::tiny() })
}

/// A servable folder of `model` (its end of sequence made the tokenizer's `<|eot_id|>`), with
/// the test tokenizer and template.
pub fn model_dir_of(model: SyntheticModel) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir =
        std::env::temp_dir().join(format!("tp-cli-test-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp folder");
    let model = SyntheticModel { eos_token_id: Some(EOT), ..model };
    model.write(&dir).expect("synthetic checkpoint");
    std::fs::write(dir.join("tokenizer.json"), tokenizer_json().to_string()).expect("tokenizer.json");
    let cfg =
        json!({"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>"}, "chat_template": TEMPLATE});
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).expect("tokenizer_config.json");
    dir
}

/// A running `tp serve`; killed when dropped.
pub struct Server {
    pub child: Child,
    pub addr: String,
    pub dir: PathBuf,
    /// stderr lines after the listening line.
    pub log: mpsc::Receiver<String>,
    /// stderr lines before it (the engine's startup report).
    pub startup: Vec<String>,
}

impl Server {
    /// Starts `tp serve DIR --port 0 ARGS` with `env`, waiting (60 s at most) for its listening line.
    pub fn start_in(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tp"));
        cmd.arg("serve").arg(dir).args(["--port", "0"]).args(args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        Server::spawn(dir, cmd)
    }

    /// Starts `cmd` (a `tp serve` of `dir`, perhaps under a launcher), waiting (60 s at most)
    /// for its listening line.
    pub fn spawn(dir: &Path, mut cmd: Command) -> Server {
        let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("start tp");
        let stderr = child.stderr.take();
        let (tx, log) = mpsc::channel();
        // Dropping the server kills and reaps the child, whatever happens below.
        let mut server = Server { child, addr: String::new(), dir: dir.to_path_buf(), log, startup: Vec::new() };
        std::thread::spawn(move || {
            for line in BufReader::new(stderr.expect("stderr")).lines().map_while(Result::ok) {
                eprintln!("[tp] {line}");
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match server.log.recv_timeout(left) {
                Ok(line) => {
                    if let Some(a) = line.split("listening on http://").nth(1) {
                        server.addr = a.trim().to_string();
                        return server;
                    }
                    server.startup.push(line);
                }
                Err(e) => panic!("tp serve did not start listening within 60 s ({e})"),
            }
        }
    }

    /// A server over a fresh model folder.
    pub fn start(args: &[&str]) -> Server {
        Server::start_in(&model_dir(), args, &[])
    }

    /// `METHOD path` with a JSON body; (status, body).
    pub fn call(&self, method: &str, path: &str, body: Option<&Value>, headers: &[(&str, &str)]) -> (u16, String) {
        let body = body.map(Value::to_string);
        http(&self.addr, method, path, body.as_deref().map(str::as_bytes), headers)
    }

    /// POST `body` to `path`; (status, parsed JSON).
    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (s, b) = self.call("POST", path, Some(body), &[]);
        (s, serde_json::from_str(&b).unwrap_or_else(|e| panic!("{e}: {b}")))
    }

    /// POST a streaming `body`; the `data:` payloads, `[DONE]` included.
    pub fn post_stream(&self, path: &str, body: &Value) -> Vec<String> {
        let (s, b) = self.call("POST", path, Some(body), &[]);
        assert_eq!(s, 200, "{b}");
        b.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).map(str::to_string).collect()
    }

    /// The value of metric line `prefix` in /metrics.
    pub fn metric(&self, prefix: &str) -> f64 {
        let (_, text) = self.call("GET", "/metrics", None, &[]);
        let line = text.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("no {prefix} in {text}"));
        line.rsplit(' ').next().and_then(|v| v.parse().ok()).expect("metric value")
    }

    /// Whether metric `prefix` satisfies `ok` within 5 s (the engine publishes its figures after
    /// each step, a little after the responses).
    pub fn wait_metric(&self, prefix: &str, ok: impl Fn(f64) -> bool) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if ok(self.metric(prefix)) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// Waits (at most `limit`) for the process to exit; its status code.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<i32> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(Some(s)) = self.child.try_wait() {
                return s.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Sends `signal` to the server.
    pub fn signal(&self, signal: i32) {
        let pid = i32::try_from(self.child.id()).expect("pid");
        // SAFETY: kill(2) on our own child's pid with a valid signal number; no memory involved.
        let r = unsafe { libc::kill(pid, signal) };
        assert_eq!(r, 0, "kill failed");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::env::var_os("TP_TEST_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Connects to `addr` with a 30 s read deadline.
pub fn connect(addr: &str) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    s
}

/// Writes a request head (and body) to `s`.
pub fn send(s: &mut TcpStream, method: &str, path: &str, body: Option<&[u8]>, headers: &[(&str, &str)]) {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        head.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n", b.len()));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).expect("write head");
    if let Some(b) = body {
        s.write_all(b).expect("write body");
    }
}

/// One request on a fresh connection; (status, body) with chunked bodies decoded.
pub fn http(addr: &str, method: &str, path: &str, body: Option<&[u8]>, headers: &[(&str, &str)]) -> (u16, String) {
    let mut s = connect(addr);
    send(&mut s, method, path, body, headers);
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read response");
    parse_response(&raw)
}

/// (status, body) of a whole HTTP/1.1 response, a chunked body decoded.
pub fn parse_response(raw: &[u8]) -> (u16, String) {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or_else(|| panic!("no head in {raw:?}"));
    let head = String::from_utf8_lossy(&raw[..split]);
    let mut body = &raw[split + 4..];
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).expect("status");
    let chunked = head.lines().any(|l| l.to_ascii_lowercase().starts_with("transfer-encoding: chunked"));
    if !chunked {
        return (status, String::from_utf8(body.to_vec()).expect("UTF-8 body"));
    }
    let mut out = Vec::new();
    while let Some(eol) = body.windows(2).position(|w| w == b"\r\n") {
        let n = usize::from_str_radix(std::str::from_utf8(&body[..eol]).unwrap_or("0").trim(), 16).unwrap_or(0);
        let rest = &body[eol + 2..];
        if n == 0 || rest.len() < n {
            break;
        }
        out.extend_from_slice(&rest[..n]);
        body = rest[n..].strip_prefix(b"\r\n").unwrap_or(&rest[n..]);
    }
    (status, String::from_utf8(out).expect("UTF-8 body"))
}
