//! `tp serve` over plain HTTP: every endpoint, streaming against non-streaming, stop strings,
//! logprobs, `n`, the bad requests of OpenAI's error format, the bearer key and the body limit.
//!
//! The engine is the real one, on a tiny random checkpoint: checks compare the server's answers
//! with each other (greedy requests are deterministic), never with fixed text.

mod common;

use common::{BOS, MAX_LEN, Server, connect, parse_response, send};
use serde_json::{Value, json};
use std::io::Read;
use std::time::{Duration, Instant};

fn text_of(v: &Value, i: usize) -> String {
    v["choices"][i]["text"].as_str().unwrap_or_else(|| panic!("no text in {v}")).to_string()
}

/// The text of a completions stream, and its finish reasons.
fn streamed(events: &[String]) -> (String, Vec<String>) {
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{events:?}");
    let mut text = String::new();
    let mut reasons = Vec::new();
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        for c in v["choices"].as_array().unwrap() {
            text.push_str(c["text"].as_str().unwrap_or(""));
            if let Some(r) = c["finish_reason"].as_str() {
                reasons.push(r.to_string());
            }
        }
    }
    (text, reasons)
}

#[test]
fn models_health_and_metrics() {
    let s = Server::start(&["--served-model-name", "tiny"]);
    assert_eq!(s.call("GET", "/health", None, &[]).0, 200);
    let (status, body) = s.call("GET", "/v1/models", None, &[]);
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (v["data"][0]["id"].as_str(), v["data"][0]["max_model_len"].as_u64()),
        (Some("tiny"), Some(MAX_LEN as u64))
    );
    let (status, text) = s.call("GET", "/metrics", None, &[]);
    assert_eq!(status, 200);
    for name in [
        "tp_num_requests_running",
        "tp_num_requests_waiting",
        "tp_kv_cache_usage_perc",
        "tp_prefix_cache_hits_total",
        "tp_prompt_tokens_total",
        "tp_generation_tokens_total",
        "tp_time_to_first_token_seconds_bucket",
    ] {
        assert!(text.contains(&format!("# TYPE {}", name.trim_end_matches("_bucket"))), "{name} in {text}");
    }
    let before = s.metric("tp_time_to_first_token_seconds_count");
    let (st, v) =
        s.post("/v1/completions", &json!({"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0}));
    assert_eq!(st, 200, "{v}");
    assert_eq!(s.metric("tp_time_to_first_token_seconds_count"), before + 1.0);
    assert!(s.wait_metric("tp_generation_tokens_total", |v| v >= 3.0));
    // The step phases: at least the three steps of that answer, each with products and
    // attention; the phases of a step add up to no more than the time it took to answer.
    assert!(s.wait_metric("tp_steps_total", |v| v >= 3.0));
    let phase = |p: &str| s.metric(&format!("tp_step_phase_seconds_total{{model_name=\"tiny\",phase=\"{p}\"}}"));
    let phases: Vec<f64> = ["gemm", "attention", "elementwise", "sampling", "scheduler"].map(phase).to_vec();
    assert!(phases[0] > 0.0 && phases[1] > 0.0, "{phases:?}");
    assert!(phases.iter().all(|&v| v >= 0.0) && phases.iter().sum::<f64>() < 60.0, "{phases:?}");
    let (st, body) = s.call("GET", "/nowhere", None, &[]);
    assert_eq!(st, 404, "{body}");
}

#[test]
fn completions_stream_as_they_answer_and_stop_strings_cut() {
    let s = Server::start(&[]);
    let base = json!({"prompt": "hello world, héllo €uro", "max_tokens": 20, "temperature": 0, "ignore_eos": true});
    let (st, v) = s.post("/v1/completions", &base);
    assert_eq!(st, 200, "{v}");
    let full = text_of(&v, 0);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 20);
    assert_eq!(v["object"], "text_completion");
    let mut body = base.clone();
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let events = s.post_stream("/v1/completions", &body);
    let (text, reasons) = streamed(&events);
    assert_eq!((text.as_str(), reasons), (full.as_str(), vec!["length".to_string()]));
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 20, "{usage}");
    // A character split across chunks would show as U+FFFD in the stream but not in the whole
    // text (random weights may also generate invalid bytes, which both show alike).
    assert_eq!(text.matches('\u{FFFD}').count(), full.matches('\u{FFFD}').count());
    // A stop string from the middle of the text: the text ends before its first occurrence.
    let stop: String = full.chars().skip(3).take(2).collect();
    let cut = &full[..full.find(&stop).unwrap()];
    let mut body = base.clone();
    body["stop"] = json!(["zzzz", stop]);
    let (_, v) = s.post("/v1/completions", &body);
    assert_eq!((text_of(&v, 0).as_str(), &v["choices"][0]["finish_reason"]), (cut, &json!("stop")));
    body["stream"] = json!(true);
    let (text, reasons) = streamed(&s.post_stream("/v1/completions", &body));
    assert_eq!((text.as_str(), reasons), (cut, vec!["stop".to_string()]));
}

#[test]
fn completions_batches_prompts_ids_n_and_logprobs() {
    let s = Server::start(&[]);
    let body = json!({"prompt": ["ab", "cd"], "n": 2, "max_tokens": 4, "temperature": 0, "ignore_eos": true});
    let (st, v) = s.post("/v1/completions", &body);
    assert_eq!(st, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
    }
    // Greedy: the n choices of one prompt agree.
    assert_eq!(text_of(&v, 0), text_of(&v, 1));
    assert_eq!(v["usage"]["completion_tokens"], 16);
    let (_, ids) = s.post(
        "/v1/completions",
        &json!({"prompt": [BOS, 97, 98], "max_tokens": 4, "temperature": 0,
        "ignore_eos": true}),
    );
    assert_eq!(text_of(&ids, 0), text_of(&v, 0), "token ids and text prompts agree");
    let (_, lp) =
        s.post("/v1/completions", &json!({"prompt": "ab", "max_tokens": 5, "logprobs": 3, "ignore_eos": true}));
    let l = &lp["choices"][0]["logprobs"];
    let tokens: Vec<&str> = l["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(tokens.len(), 5);
    assert_eq!(l["token_logprobs"].as_array().unwrap().len(), 5);
    let offsets: Vec<u64> = l["text_offset"].as_array().unwrap().iter().map(|o| o.as_u64().unwrap()).collect();
    let mut at = 0;
    for (t, o) in tokens.iter().zip(&offsets) {
        assert_eq!(*o, at);
        at += t.chars().count() as u64;
    }
    for top in l["top_logprobs"].as_array().unwrap() {
        assert!(top.as_object().unwrap().len() <= 3);
    }
}

#[test]
fn chat_renders_the_template_and_streams_role_content_finish() {
    let s = Server::start(&[]);
    let msgs = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]);
    let body = json!({"messages": msgs, "max_completion_tokens": 12, "temperature": 0, "ignore_eos": true,
        "logprobs": true, "top_logprobs": 2});
    let (st, v) = s.post("/v1/chat/completions", &body);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let lp = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(lp.len(), 12);
    assert_eq!(lp[0]["top_logprobs"].as_array().unwrap().len(), 2);
    // The prompt is the template's text: the header, "Be brief.", then the user's turn.
    let expected = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
        <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
    let bytes: usize = expected
        .replace("<|begin_of_text|>", "B")
        .replace("<|start_header_id|>", "B")
        .replace("<|end_header_id|>", "B")
        .replace("<|eot_id|>", "B")
        .len();
    assert_eq!(v["usage"]["prompt_tokens"], bytes, "one id per byte and per special token");
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let events = s.post_stream("/v1/chat/completions", &sb);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, content);
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "length");
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
}

/// (status, error object) of a POST.
fn error(s: &Server, path: &str, body: &Value) -> (u16, Value) {
    let (st, v) = s.post(path, body);
    let e = v["error"].clone();
    assert!(e["message"].is_string() && e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
    (st, e)
}

#[test]
fn bad_requests_get_openai_errors() {
    let s = Server::start(&["--max-model-len", "64", "--max-request-bytes", "4096"]);
    let c = "/v1/completions";
    let chat = "/v1/chat/completions";
    let user = json!([{"role": "user", "content": "x"}]);
    for (path, body, status, param) in [
        (c, json!({"model": "other", "prompt": "x"}), 404, "model"),
        (c, json!({"max_tokens": 3}), 400, "prompt"),
        (c, json!({"prompt": "x", "max_tokens": "3"}), 400, "max_tokens"),
        (c, json!({"prompt": "x", "temperature": -1}), 400, "temperature"),
        (c, json!({"prompt": "x", "top_p": 0}), 400, "top_p"),
        (c, json!({"prompt": "x", "top_p": 1.01}), 400, "top_p"),
        (c, json!({"prompt": [5000]}), 400, "prompt"),
        (chat, json!({"messages": [{"role": "robot", "content": "x"}]}), 400, "messages[0]"),
        (chat, json!({"messages": user, "n": "2"}), 400, "n"),
    ] {
        let (st, e) = error(&s, path, &body);
        assert_eq!((st, e["param"].as_str().unwrap_or("")), (status, param), "{body}: {e}");
    }
    let long = "a".repeat(80);
    let (st, e) = error(&s, c, &json!({"prompt": long}));
    assert_eq!(st, 400);
    assert!(e["message"].as_str().unwrap().contains("64") && e["message"].as_str().unwrap().contains("81"), "{e}");
    let (st, e) = error(&s, c, &json!({"prompt": "abc", "max_tokens": 62}));
    assert_eq!(st, 400);
    assert!(e["message"].as_str().unwrap().contains("62"), "{e}");
    let (st, body) = s.call("POST", c, None, &[]);
    assert_eq!(st, 400, "{body}");
    let (st, body) = common::http(&s.addr, "POST", c, Some(b"{\"prompt\": "), &[]);
    assert_eq!(st, 400, "{body}");
    assert!(body.contains("not valid JSON"), "{body}");
    // Over the limit: refused from the declared length, before the body arrives.
    let mut sock = connect(&s.addr);
    send(&mut sock, "POST", c, None, &[("Content-Length", "1000000000")]);
    let t = Instant::now();
    let mut raw = Vec::new();
    let _ = sock.read_to_end(&mut raw);
    let (st, body) = parse_response(&raw);
    assert_eq!(st, 413, "{body}");
    assert!(t.elapsed() < Duration::from_secs(5));
    // A chunked body passing the limit is cut off too.
    let mut sock = connect(&s.addr);
    let chunk = format!("1000\r\n{}\r\n", "a".repeat(4096));
    let head = "POST /v1/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n";
    std::io::Write::write_all(&mut sock, format!("{head}{chunk}{chunk}").as_bytes()).unwrap();
    let mut raw = Vec::new();
    let _ = sock.read_to_end(&mut raw);
    assert_eq!(parse_response(&raw).0, 413);
}

#[test]
fn the_api_key_is_required_on_v1_only() {
    let s = Server::start(&["--api-key", "sekrit"]);
    let body = json!({"prompt": "x", "max_tokens": 1});
    for headers in [vec![], vec![("Authorization", "Bearer wrong")], vec![("Authorization", "sekrit")]] {
        let (st, b) = s.call("POST", "/v1/completions", Some(&body), &headers);
        assert_eq!(st, 401, "{headers:?}: {b}");
        assert!(b.contains("invalid_api_key"));
    }
    assert_eq!(s.call("GET", "/v1/models", None, &[]).0, 401);
    assert_eq!(s.call("POST", "/v1/completions", Some(&body), &[("Authorization", "Bearer sekrit")]).0, 200);
    assert_eq!(s.call("GET", "/health", None, &[]).0, 200);
}

#[test]
fn pipeline_stages_serve_the_same_text_as_one_rank() {
    let body = json!({"prompt": ["hello world", "pipeline"], "max_tokens": 8, "temperature": 0, "ignore_eos": true});
    let one = Server::start(&[]);
    let (st, want) = one.post("/v1/completions", &body);
    assert_eq!(st, 200, "{want}");
    drop(one);
    let staged = Server::start(&["-pp", "3", "-tp", "2"]);
    let (st, got) = staged.post("/v1/completions", &body);
    assert_eq!(st, 200, "{got}");
    for i in 0..2 {
        assert_eq!(got["choices"][i]["text"], want["choices"][i]["text"], "choice {i}");
    }
    assert_eq!(got["usage"], want["usage"]);
    // Every stage's busy time is in /metrics (each computed part of the step).
    for stage in 0..3 {
        let name = staged.dir.display();
        let line = format!("tp_stage_busy_seconds_total{{model_name=\"{name}\",stage=\"{stage}\"}}");
        let ok = staged.wait_metric(&line, |v| v > 0.0);
        assert!(ok, "stage {stage}'s busy time");
    }
    // More stages than layers is refused before the server listens.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tp"))
        .args(["serve", staged.dir.to_str().unwrap(), "--port", "0", "--pipeline-parallel-size", "4"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("more stages than the model has layers"), "{err}");
}

/// `--kv-cache-dtype fp8` (and `q8_0`) holds 4x the positions of the f32 model's own cache in
/// the same `--kv-cache-memory` and serves; a format the model's heads cannot take, or one tp
/// does not know, stops the start with the reason.
#[test]
fn an_8_bit_kv_cache_holds_4x_the_positions_and_serves() {
    let blocks = |s: &Server| -> usize {
        let line = s.startup.iter().find(|l| l.contains("KV-cache blocks")).expect("the engine's startup line");
        let n = line.split(" KV-cache blocks").next().and_then(|h| h.rsplit(' ').next());
        n.and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("no block count in {line}"))
    };
    let body = json!({"prompt": "hello world", "max_tokens": 8, "temperature": 0, "ignore_eos": true});
    let dir = common::model_dir();
    // A whole number of blocks either way: 2 x 12 heads x 4 x 3 layers x 16 positions x 4 bytes
    // = 18 KiB per f32 block at TP 1, 9 KiB at TP 2.
    let budget = ["--kv-cache-memory", "36KiB", "--max-num-seqs", "64", "-tp", "2"];
    // (The folder goes with the last server, dropped at the end.)
    let fp8 = Server::start_in(&dir, &[&budget[..], &["--kv-cache-dtype", "fp8"]].concat(), &[]);
    let (st, v) = fp8.post("/v1/completions", &body);
    assert_eq!((st, v["usage"]["completion_tokens"].as_u64()), (200, Some(8)), "{v}");
    let plain = Server::start_in(&dir, &budget, &[]);
    assert_eq!(blocks(&fp8), 4 * blocks(&plain), "{:?} {:?}", fp8.startup, plain.startup);
    for (value, why) in [("q8_0", "multiple of 32"), ("int4", "invalid value 'int4'")] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tp"))
            .args(["serve", dir.to_str().unwrap(), "--port", "0", "--kv-cache-dtype", value])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(why), "{value}: {err}");
    }
    drop(fp8);
}

#[test]
fn logit_bias_and_min_tokens_steer_every_token() {
    let s = Server::start(&["-tp", "2"]);
    let ask = |extra: Value| {
        let mut body = json!({"prompt": "ab", "max_tokens": 6, "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        s.post("/v1/completions", &body)
    };
    // +100 on 'x' (byte 120) makes it every greedy token; -100 on it removes it.
    let (st, v) = ask(json!({"logit_bias": {"120": 100}, "ignore_eos": true}));
    assert_eq!(st, 200, "{v}");
    assert_eq!(text_of(&v, 0), "xxxxxx");
    let (_, v) =
        ask(json!({"logit_bias": {"120": -100, "121": 100}, "ignore_eos": true, "temperature": 1.0, "seed": 4}));
    assert_eq!(text_of(&v, 0), "yyyyyy");
    // +100 on the end-of-sequence id ends at once; min_tokens holds it off for 3 tokens.
    let (_, v) = ask(json!({"logit_bias": {"263": 100}}));
    assert_eq!(
        (v["usage"]["completion_tokens"].as_u64(), v["choices"][0]["finish_reason"].as_str()),
        (Some(1), Some("stop"))
    );
    let (_, v) = ask(json!({"logit_bias": {"263": 100}, "min_tokens": 3}));
    assert_eq!(
        (v["usage"]["completion_tokens"].as_u64(), v["choices"][0]["finish_reason"].as_str()),
        (Some(4), Some("stop"))
    );
    // Stop ids are held off too.
    let (_, v) = ask(json!({"logit_bias": {"50": 100}, "stop_token_ids": [50], "min_tokens": 2}));
    assert_eq!(v["usage"]["completion_tokens"].as_u64(), Some(3), "{v}");
    for (extra, param) in [
        (json!({"logit_bias": {"5000": 1}}), "logit_bias"),
        (json!({"logit_bias": {"-1": 1}}), "logit_bias"),
        (json!({"logit_bias": {"abc": 1}}), "logit_bias"),
        (json!({"logit_bias": {"3": 101}}), "logit_bias"),
        (json!({"logit_bias": [3]}), "logit_bias"),
        (json!({"min_tokens": 9}), "min_tokens"),
        (json!({"min_tokens": -1}), "min_tokens"),
    ] {
        let (st, v) = ask(extra.clone());
        assert_eq!((st, v["error"]["param"].as_str()), (400, Some(param)), "{extra} -> {v}");
    }
}

#[test]
fn tokenize_and_detokenize_answer_as_vllm_does() {
    let s = Server::start(&[]);
    let tok: tokenizers::Tokenizer = common::tokenizer_json().to_string().parse().unwrap();
    for text in ["hello world", "", "ünïcödé ✓ <|eot_id|>", "a\nb\tc"] {
        let (st, v) = s.post("/tokenize", &json!({"prompt": text}));
        assert_eq!(st, 200, "{v}");
        let want: Vec<u32> = tok.encode(text, true).unwrap().get_ids().to_vec();
        assert_eq!(v["tokens"], json!(want), "{text:?}");
        assert_eq!(v["count"], want.len());
        assert_eq!(v["max_model_len"], MAX_LEN);
        assert_eq!(v["token_strs"], Value::Null);
        let (_, plain) = s.post("/tokenize", &json!({"prompt": text, "add_special_tokens": false}));
        assert_eq!(plain["tokens"], json!(tok.encode(text, false).unwrap().get_ids()));
        let (st, d) = s.post("/detokenize", &json!({"tokens": want}));
        assert_eq!(st, 200, "{d}");
        assert_eq!(d["prompt"], tok.decode(&want, false).unwrap());
    }
    let (_, v) = s.post("/tokenize", &json!({"prompt": "hello world", "return_token_strs": true}));
    assert_eq!(v["token_strs"], json!(["<|begin_of_text|>", "he", "ll", "o", "Ġw", "o", "r", "l", "d"]));
    // Messages: the template's text (with the generation prompt), its special tokens as text.
    let messages = json!([{"role": "user", "content": "hi"}]);
    let (_, v) = s.post("/tokenize", &json!({"messages": messages}));
    let rendered = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>\
        <|start_header_id|>assistant<|end_header_id|>\n\n";
    assert_eq!(v["tokens"], json!(tok.encode(rendered, false).unwrap().get_ids()));
    let (_, no_gen) = s.post("/tokenize", &json!({"messages": messages, "add_generation_prompt": false}));
    assert!(no_gen["count"].as_u64() < v["count"].as_u64());
    for (path, body, param) in [
        ("/tokenize", json!({}), "prompt"),
        ("/tokenize", json!({"prompt": 5}), "prompt"),
        ("/tokenize", json!({"prompt": "a", "messages": messages}), "messages"),
        ("/tokenize", json!({"messages": [{"role": "wizard", "content": "x"}]}), "messages[0]"),
        ("/tokenize", json!({"prompt": "a", "add_special_tokens": "yes"}), "add_special_tokens"),
        ("/detokenize", json!({"tokens": [1, 5000]}), "tokens"),
        ("/detokenize", json!({"tokens": [-1]}), "tokens"),
        ("/detokenize", json!({"tokens": "12"}), "tokens"),
    ] {
        let (st, v) = s.post(path, &body);
        assert_eq!((st, v["error"]["param"].as_str()), (400, Some(param)), "{path} {body} -> {v}");
    }
    let (st, _) = s.post("/tokenize", &json!({"prompt": "a", "model": "other"}));
    assert_eq!(st, 404);
}

#[test]
fn echo_scores_the_prompt_as_lm_evaluation_harness_asks() {
    let s = Server::start(&["-tp", "2"]);
    // lm-evaluation-harness's log-likelihood request: echo, logprobs, max_tokens 0.
    let (st, v) = s.post(
        "/v1/completions",
        &json!({"prompt": "hello world", "echo": true, "logprobs": 2, "max_tokens": 0, "prompt_logprobs": 2}),
    );
    assert_eq!(st, 200, "{v}");
    let c = &v["choices"][0];
    assert_eq!(c["text"], "hello world");
    assert_eq!(c["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 0);
    let l = &c["logprobs"];
    let tokens: Vec<&str> = l["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(tokens, ["<|begin_of_text|>", "he", "ll", "o", " w", "o", "r", "l", "d"]);
    let lps = l["token_logprobs"].as_array().unwrap();
    assert!(lps[0].is_null() && l["top_logprobs"][0].is_null());
    let offsets: Vec<u64> = l["text_offset"].as_array().unwrap().iter().map(|o| o.as_u64().unwrap()).collect();
    assert_eq!(offsets, [0, 17, 19, 21, 22, 24, 25, 26, 27]);
    // The legacy logprobs and vLLM's prompt_logprobs agree; each token's logprob is at most its
    // best alternative's, and equal to it when its rank is 1.
    let ids = [BOS, 256, 257, 111, 258, 111, 114, 108, 100];
    let dicts = c["prompt_logprobs"].as_array().unwrap();
    assert!(dicts[0].is_null());
    for p in 1..ids.len() {
        let lp = lps[p].as_f64().unwrap();
        assert!(lp < 0.0);
        let own = &dicts[p][ids[p].to_string()];
        assert_eq!(own["logprob"].as_f64(), Some(lp), "position {p}: {}", dicts[p]);
        // Keyed by text: ids past the tokenizer's 267 all decode to "" and share one key.
        let top = l["top_logprobs"][p].as_object().unwrap();
        assert!((1..=2).contains(&top.len()), "{top:?}");
        let best = top.values().map(|x| x.as_f64().unwrap()).fold(f64::NEG_INFINITY, f64::max);
        assert!(lp <= best);
        if own["rank"] == 1 {
            assert_eq!(lp, best);
        }
    }
    // echo with generation: the prompt, then the same text a plain request generates.
    let body = json!({"prompt": "ab", "max_tokens": 5, "temperature": 0, "ignore_eos": true});
    let (_, plain) = s.post("/v1/completions", &body);
    let mut echo = body.clone();
    echo["echo"] = json!(true);
    let (_, e) = s.post("/v1/completions", &echo);
    assert_eq!(text_of(&e, 0), format!("ab{}", text_of(&plain, 0)));
    echo["stream"] = json!(true);
    let (streamed_text, reasons) = streamed(&s.post_stream("/v1/completions", &echo));
    assert_eq!(streamed_text, text_of(&e, 0));
    assert_eq!(reasons, ["length"]);
    for (body, param) in [
        (json!({"prompt": "x", "max_tokens": 0}), "max_tokens"),
        (json!({"prompt": "x", "prompt_logprobs": 21}), "prompt_logprobs"),
    ] {
        let (st, v) = s.post("/v1/completions", &body);
        assert_eq!((st, v["error"]["param"].as_str()), (400, Some(param)), "{body} -> {v}");
    }
    let (st, v) = s.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "x"}],
        "prompt_logprobs": 1}),
    );
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("prompt_logprobs")), "{v}");
}

#[test]
fn return_token_ids_gives_the_prompt_and_answer_ids() {
    let s = Server::start(&[]);
    let (st, v) = s.post(
        "/v1/completions",
        &json!({"prompt": "hello", "max_tokens": 5, "temperature": 0, "ignore_eos": true, "return_token_ids": true}),
    );
    assert_eq!(st, 200, "{v}");
    let c = &v["choices"][0];
    assert_eq!(c["prompt_token_ids"], json!([BOS, 256, 257, 111]));
    let ids: Vec<i64> = c["token_ids"].as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect();
    assert_eq!(ids.len(), 5);
    // The ids are the text: they detokenize to it.
    let (_, d) = s.post("/detokenize", &json!({"tokens": ids}));
    assert_eq!(d["prompt"], c["text"]);
    let (st, e) = s.post("/v1/completions", &json!({"prompt": "x", "stream": true, "return_token_ids": true}));
    assert_eq!((st, e["error"]["param"].as_str()), (400, Some("return_token_ids")), "{e}");
}
