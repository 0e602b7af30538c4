//! `tp serve --enable-lora` from outside: four PEFT adapters and the base model mixed in one
//! batch give every request the tokens a server running its adapter alone gives (greedy and
//! seeded, batch-invariant, at TP 1 and 3); `/v1/models` lists the adapters with their parent;
//! an unknown model is OpenAI's 404; bad adapters stop the start with one line.

mod common;

use common::{Server, model_dir};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

/// Writes a PEFT adapter folder for the test model (hidden 48, intermediate 77, 3 layers):
/// random `A` and `B` on `targets`, rank `r`.
fn write_adapter(dir: &Path, r: usize, alpha: f64, targets: &[&str], seed: u64) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let mut rng = tp_models::tp_core::rng::SplitMix64::new(seed);
    let shape = |t: &str| match t {
        "gate_proj" | "up_proj" => (77, 48),
        "down_proj" => (48, 77),
        _ => (48, 48),
    };
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for layer in 0..3 {
        for t in targets {
            let (out, inp) = shape(t);
            let group = if t.ends_with("_proj") && ["gate_proj", "up_proj", "down_proj"].contains(t) {
                "mlp"
            } else {
                "self_attn"
            };
            let base = format!("base_model.model.model.layers.{layer}.{group}.{t}");
            for (name, dims) in
                [(format!("{base}.lora_A.weight"), vec![r, inp]), (format!("{base}.lora_B.weight"), vec![out, r])]
            {
                let n: usize = dims.iter().product();
                let bytes: Vec<u8> = (0..n).flat_map(|_| (rng.uniform(-0.4, 0.4) as f32).to_le_bytes()).collect();
                tensors.push((name, dims, bytes));
            }
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, b)| {
            (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, d.clone(), b).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("adapter_model.safetensors")).unwrap();
    let cfg = json!({"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": targets,
                     "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"});
    std::fs::write(dir.join("adapter_config.json"), cfg.to_string()).unwrap();
    dir.to_path_buf()
}

/// An adapter for a wider model (q_proj of 64 features): names and ranks fine, shapes not.
fn write_wide_adapter(root: &Path) -> PathBuf {
    let wide = root.join("wide");
    std::fs::create_dir_all(&wide).unwrap();
    let bytes = vec![0u8; 4 * 2 * 64];
    let a = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2, 64], &bytes).unwrap();
    let b = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![64, 2], &bytes).unwrap();
    safetensors::serialize_to_file(
        vec![
            ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight".to_string(), a),
            ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight".to_string(), b),
        ],
        None,
        &wide.join("adapter_model.safetensors"),
    )
    .unwrap();
    std::fs::write(
        wide.join("adapter_config.json"),
        json!({"r": 2, "lora_alpha": 2, "target_modules": ["q_proj"]}).to_string(),
    )
    .unwrap();
    wide
}

/// A fresh folder for adapters (outside the model folders, which a server deletes when it
/// stops).
fn adapter_root(test: &str) -> PathBuf {
    let root = std::env::temp_dir().join(format!("tp-lora-serve-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    root
}

/// Four adapters: all-linear, attention only, the MLP only, q and v at a higher rank.
fn adapters(root: &Path) -> Vec<(String, PathBuf)> {
    let all = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];
    vec![
        ("all".to_string(), write_adapter(&root.join("all"), 4, 8.0, &all, 1)),
        ("attn".to_string(), write_adapter(&root.join("attn"), 2, 4.0, &["q_proj", "k_proj", "v_proj", "o_proj"], 2)),
        ("mlp".to_string(), write_adapter(&root.join("mlp"), 8, 8.0, &["gate_proj", "up_proj", "down_proj"], 3)),
        ("qv".to_string(), write_adapter(&root.join("qv"), 16, 32.0, &["q_proj", "v_proj"], 4)),
    ]
}

/// The requests every model gets: three prompts (one of three full KV-cache blocks, which
/// the prefix cache could share between models), greedy and seeded.
fn requests(model: &str) -> Vec<Value> {
    let mut out = Vec::new();
    let long: Vec<i64> = (0..50).map(|i| 65 + (i * 7) % 50).collect();
    for prompt in [vec![259, 72, 101, 108, 108, 111], vec![259, 84, 104, 101, 32, 113, 117, 105, 99, 107], long] {
        out.push(json!({"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": true,
                        "return_token_ids": true}));
        out.push(json!({"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.9, "seed": 11,
                        "ignore_eos": true, "return_token_ids": true}));
    }
    out
}

fn answer(server: &Server, body: &Value) -> (String, Vec<i64>) {
    answer_at(&server.addr, body)
}

/// [`answer`] from the server at `addr` (from any thread).
fn answer_at(addr: &str, body: &Value) -> (String, Vec<i64>) {
    let (status, text) = common::http(addr, "POST", "/v1/completions", Some(body.to_string().as_bytes()), &[]);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(status, 200, "{v}");
    let ids = v["choices"][0]["token_ids"].as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect();
    (v["model"].as_str().unwrap().to_string(), ids)
}

#[test]
fn four_adapters_and_the_base_in_one_batch_answer_as_each_alone() {
    let adapters = adapters(&adapter_root("mixed"));
    for tp in ["1", "3"] {
        let common_args = ["--tensor-parallel-size", tp, "--batch-invariant", "--served-model-name", "base"];
        // Each model served alone.
        let mut want: Vec<(String, Vec<Vec<i64>>)> = Vec::new();
        // Each server over its own copy of the same synthetic model (a server deletes its folder).
        let alone = Server::start_in(&model_dir(), &common_args, &[]);
        want.push(("base".into(), requests("base").iter().map(|r| answer(&alone, r).1).collect()));
        drop(alone);
        for (name, path) in &adapters {
            let module = format!("{name}={}", path.display());
            let mut args = common_args.to_vec();
            args.extend(["--enable-lora", "--max-lora-rank", "16", "--lora-modules", &module]);
            let alone = Server::start_in(&model_dir(), &args, &[]);
            want.push((name.clone(), requests(name).iter().map(|r| answer(&alone, r).1).collect()));
        }
        // The adapters change the answers (a check that they are applied at all).
        for (name, w) in &want[1..] {
            assert_ne!(w, &want[0].1, "adapter {name} answers as the base at TP {tp}");
        }
        // All of them in one server, the requests at once.
        let modules: Vec<String> = adapters.iter().map(|(n, p)| format!("{n}={}", p.display())).collect();
        let mut args = common_args.to_vec();
        args.extend(["--enable-lora", "--max-loras", "4", "--max-lora-rank", "16", "--lora-modules"]);
        args.extend(modules.iter().map(String::as_str));
        let mixed = Server::start_in(&model_dir(), &args, &[]);
        // The base's blocks of the long prompt cached first: no adapter may reuse them.
        for r in requests("base") {
            answer(&mixed, &r);
        }
        let got: Vec<Vec<(String, Vec<i64>)>> = std::thread::scope(|s| {
            let handles: Vec<_> = want
                .iter()
                .map(|(name, _)| {
                    let addr = mixed.addr.as_str();
                    s.spawn(move || {
                        let inner: Vec<_> =
                            requests(name).into_iter().map(|r| s.spawn(move || answer_at(addr, &r))).collect();
                        inner.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for ((name, w), g) in want.iter().zip(&got) {
            for (i, (model, ids)) in g.iter().enumerate() {
                assert_eq!(model, name, "the response names the model asked for");
                assert_eq!(ids, &w[i], "{name} request {i} at TP {tp}: mixed batch vs alone");
            }
        }
    }
}

#[test]
fn models_lists_the_adapters_and_an_unknown_one_is_a_404() {
    let dir = model_dir();
    let adapters = adapters(&adapter_root("models"));
    let module = format!("{}={}", adapters[1].0, adapters[1].1.display());
    let json_module =
        json!({"name": "qv-json", "path": adapters[3].1.display().to_string(), "base_model_name": "tiny"}).to_string();
    let server = Server::start_in(
        &dir,
        &[
            "--served-model-name",
            "base",
            "--enable-lora",
            "--max-lora-rank",
            "16",
            "--lora-modules",
            &module,
            &json_module,
        ],
        &[],
    );
    let (status, body) = server.call("GET", "/v1/models", None, &[]);
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 3, "{v}");
    assert_eq!((data[0]["id"].as_str(), data[0]["parent"].is_null()), (Some("base"), true));
    assert_eq!((data[1]["id"].as_str(), data[1]["parent"].as_str()), (Some("attn"), Some("base")));
    assert_eq!((data[2]["id"].as_str(), data[2]["parent"].as_str()), (Some("qv-json"), Some("tiny")));
    assert_eq!(data[1]["root"].as_str(), Some(adapters[1].1.display().to_string().as_str()));
    let (status, err) = server.post("/v1/completions", &json!({"model": "nope", "prompt": [259, 72], "max_tokens": 2}));
    assert_eq!(status, 404, "{err}");
    assert_eq!(
        (err["error"]["code"].as_str(), err["error"]["param"].as_str()),
        (Some("model_not_found"), Some("model"))
    );
    let (status, v) = server.post(
        "/v1/chat/completions",
        &json!({"model": "attn", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    );
    assert_eq!((status, v["model"].as_str()), (200, Some("attn")), "{v}");
}

#[test]
fn bad_adapters_stop_the_start_with_one_line() {
    let dir = model_dir();
    let root = adapter_root("bad");
    let adapters = adapters(&root);
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tp"))
            .arg("serve")
            .arg(&dir)
            .args(["--port", "0"])
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} started");
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .filter(|l| l.starts_with("tp serve"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let qv = format!("qv={}", adapters[3].1.display());
    assert!(run(&["--lora-modules", &qv]).contains("--enable-lora"));
    let err = run(&["--enable-lora", "--max-lora-rank", "8", "--lora-modules", &qv]);
    assert!(err.contains("\"qv\"") && err.contains("rank 16 is over --max-lora-rank 8"), "{err}");
    // An adapter of another shape (a wider model's): named with its tensor.
    let wide = write_wide_adapter(&root);
    let err = run(&["--enable-lora", "--lora-modules", &format!("wide={}", wide.display())]);
    assert!(err.contains("q_proj.lora_A.weight"), "{err}");
    assert!(run(&["--enable-lora", "--max-loras", "0"]).contains("--max-loras"));
}

/// vLLM's runtime endpoints: an adapter loaded while serving answers as one given at start, a
/// bad one is refused with the others serving on, an unloaded one is gone (404), and loaded
/// again it answers as before; without the flag the endpoints do not exist.
#[test]
fn adapters_load_and_unload_at_runtime() {
    let root = adapter_root("runtime");
    let adapters = adapters(&root);
    let (name, path) = &adapters[0];
    let module = format!("{name}={}", path.display());
    let reference = Server::start_in(
        &model_dir(),
        &["--served-model-name", "base", "--enable-lora", "--lora-modules", &module],
        &[],
    );
    let want: Vec<Vec<i64>> = requests(name).iter().map(|r| answer(&reference, r).1).collect();
    drop(reference);

    let server = Server::start_in(
        &model_dir(),
        &["--served-model-name", "base", "--enable-lora", "--allow-runtime-lora-updating", "--max-cpu-loras", "2"],
        &[],
    );
    let load = |n: &str, p: &Path| {
        let body = json!({"lora_name": n, "lora_path": p.display().to_string()}).to_string();
        common::http(&server.addr, "POST", "/v1/load_lora_adapter", Some(body.as_bytes()), &[])
    };
    let unload = |n: &str| {
        let body = json!({"lora_name": n}).to_string();
        common::http(&server.addr, "POST", "/v1/unload_lora_adapter", Some(body.as_bytes()), &[])
    };
    let (status, text) = load(name, path);
    assert_eq!((status, text.as_str()), (200, "Success: LoRA adapter 'all' added successfully."));
    let got: Vec<Vec<i64>> = requests(name).iter().map(|r| answer(&server, r).1).collect();
    assert_eq!(got, want, "loaded at runtime vs given at start");
    assert_eq!(load(name, path).0, 400, "a name loaded twice");
    // A bad adapter (ranks over the shapes): refused, and `all` serves on unchanged.
    let wide = write_wide_adapter(&root);
    let (status, text) = load("wide", &wide);
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("q_proj.lora_A.weight"), "{text}");
    let (status, _) = server.post("/v1/completions", &json!({"model": "wide", "prompt": [259, 72], "max_tokens": 2}));
    assert_eq!(status, 404);
    let again: Vec<Vec<i64>> = requests(name).iter().map(|r| answer(&server, r).1).collect();
    assert_eq!(again, want, "after a refused load");
    // Unloaded: gone; unloading again is a 404; loaded again it answers as before.
    let (status, text) = unload(name);
    assert_eq!((status, text.as_str()), (200, "Success: LoRA adapter 'all' removed successfully."));
    assert_eq!(server.post("/v1/completions", &requests(name)[0]).0, 404);
    assert_eq!(unload(name).0, 404);
    assert_eq!(load(name, path).0, 200);
    let reloaded: Vec<Vec<i64>> = requests(name).iter().map(|r| answer(&server, r).1).collect();
    assert_eq!(reloaded, want, "loaded again");
    drop(server);

    let plain = Server::start_in(&model_dir(), &["--enable-lora"], &[]);
    let body = json!({"lora_name": "x", "lora_path": path.display().to_string()}).to_string();
    assert_eq!(common::http(&plain.addr, "POST", "/v1/load_lora_adapter", Some(body.as_bytes()), &[]).0, 404);
}
