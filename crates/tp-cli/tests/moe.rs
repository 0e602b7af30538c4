//! Serving a mixture-of-experts model (a tiny Qwen3-MoE: a dense first layer, then experts; and a
//! tiny gpt-oss: attention sinks, sliding-window layers, biases, clamped-SwiGLU experts):
//! `--batch-invariant` answers with the same bits whichever requests share the step and its
//! experts, at uneven TP degrees and with `--enable-expert-parallel`, and `/metrics` counts the
//! tokens routed to each expert.

mod common;

use common::{MAX_LEN, Server, model_dir_of};
use serde_json::{Value, json};
use tp_models::Architecture;
use tp_testing::synthetic::SyntheticModel;

/// Experts, experts per token, and MoE layers of the model.
const EXPERTS: usize = 8;
const TOP_K: usize = 2;
const MOE_LAYERS: u64 = 2;

fn moe_dir() -> std::path::PathBuf {
    model_dir_of(SyntheticModel {
        architecture: Architecture::Qwen3Moe,
        max_position_embeddings: MAX_LEN,
        extra: Some(json!({"num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "moe_intermediate_size": 19,
            "norm_topk_prob": true, "mlp_only_layers": [0]})),
        ..SyntheticModel::tiny()
    })
}

/// A tiny gpt-oss (8 query heads over 2 KV heads, windows of 4 on the even layers, 5 experts).
fn gpt_oss_dir() -> std::path::PathBuf {
    model_dir_of(SyntheticModel {
        architecture: Architecture::GptOss,
        max_position_embeddings: MAX_LEN,
        num_attention_heads: 8,
        num_key_value_heads: 2,
        head_dim: Some(8),
        attention_bias: true,
        sliding_window: Some(4),
        extra: Some(json!({"num_local_experts": 5, "num_experts_per_tok": 2, "swiglu_limit": 1.0})),
        ..SyntheticModel::tiny()
    })
}

fn chat(content: &str) -> Value {
    json!({"messages": [{"role": "user", "content": content}], "max_tokens": 10, "temperature": 0,
        "logprobs": true, "top_logprobs": 2})
}

/// The answer's text and its tokens' logprobs, exactly.
fn answer(v: &Value) -> (String, Vec<Value>) {
    let c = &v["choices"][0];
    (c["message"]["content"].as_str().unwrap_or("").to_string(), c["logprobs"]["content"].as_array().unwrap().clone())
}

#[test]
fn an_moe_model_answers_with_the_same_bits_whatever_shares_its_step() {
    let cases =
        [("qwen3-moe", "1", false), ("qwen3-moe", "3", false), ("qwen3-moe", "3", true), ("gpt-oss", "3", true)];
    for (model, tp, ep) in cases {
        // (A server removes its folder when it stops.)
        let mut args = vec!["-tp", tp, "--batch-invariant", "--no-enable-prefix-caching"];
        if ep {
            args.push("--enable-expert-parallel");
        }
        let dir = if model == "gpt-oss" { gpt_oss_dir() } else { moe_dir() };
        let s = Server::start_in(&dir, &args, &[]);
        let (st, alone) = s.post("/v1/chat/completions", &chat("Hello there"));
        assert_eq!(st, 200, "{alone}");
        let alone = answer(&alone);
        // The same request among others, each routed to its own experts in the same steps.
        let others = ["a", "b c", "different words", "xyz", "hello world, hello tp", "1 2 3 4 5 6"];
        let post = |body: Value| {
            let (st, b) = common::http(&s.addr, "POST", "/v1/chat/completions", Some(body.to_string().as_bytes()), &[]);
            (st, serde_json::from_str::<Value>(&b).unwrap_or(Value::Null))
        };
        let together = std::thread::scope(|scope| {
            let handles: Vec<_> = others.iter().map(|o| scope.spawn(move || post(chat(o)))).collect();
            let mine = post(chat("Hello there"));
            for h in handles {
                assert_eq!(h.join().unwrap().0, 200);
            }
            mine
        });
        assert_eq!(together.0, 200, "{}", together.1);
        assert_eq!(answer(&together.1), alone, "{model} TP {tp} (EP {ep}): the answer changed with its neighbours");
    }
}

/// The metric's per-expert lines, in expert order.
fn routed(metrics: &str) -> Vec<u64> {
    metrics
        .lines()
        .filter(|l| l.starts_with("tp_moe_routed_tokens_total{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
        .collect()
}

#[test]
fn metrics_count_the_tokens_routed_to_each_expert() {
    let s = Server::start_in(&moe_dir(), &["-tp", "2"], &[]);
    let (st, v) = s.post("/v1/completions", &json!({"prompt": "count me", "max_tokens": 7, "temperature": 0}));
    assert_eq!(st, 200, "{v}");
    let (prompt, completion) =
        (v["usage"]["prompt_tokens"].as_u64().unwrap(), v["usage"]["completion_tokens"].as_u64().unwrap());
    // Every token fed through the model (the prompt, then each output but the last) is routed to
    // TOP_K experts in each MoE layer. (The engine publishes its figures after each step, a
    // little after the response.)
    let want = (prompt + completion - 1) * TOP_K as u64 * MOE_LAYERS;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let mut counts = routed(&s.call("GET", "/metrics", None, &[]).1);
    while counts.iter().sum::<u64>() < want && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
        counts = routed(&s.call("GET", "/metrics", None, &[]).1);
    }
    assert_eq!(counts.len(), EXPERTS, "{counts:?}");
    assert_eq!(counts.iter().sum::<u64>(), want, "{counts:?}");
    // A dense model has no such lines.
    let dense = Server::start(&[]);
    assert_eq!(dense.post("/v1/completions", &json!({"prompt": "x", "max_tokens": 2})).0, 200);
    assert!(routed(&dense.call("GET", "/metrics", None, &[]).1).is_empty());
}
