//! LoRA serving rows of tp-bench (`--only lora`, opt-in): the engine on the TinyLlama-shaped
//! bf16 checkpoint at TP 1, 16 concurrent requests (64-token prompts, 32 new tokens, greedy)
//!
//! * on the base model alone (an engine with no adapter),
//! * over 4 adapters (rank 16, every projection of every layer: PEFT's `all-linear`), 4 requests
//!   each, on an engine serving the 4 with `max_loras` 4 (the ratio column: against the base),
//! * and the base's requests on that same engine (what serving adapters costs requests that use
//!   none).
//!
//! The adapters are random (A and B uniform in ±0.05), written as PEFT folders under the
//! system's temporary folder.

use crate::serving::{PROMPT_LEN, prompt, row, run_adapted, stop, summarize};
use crate::{Args, Row};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tp_core::{DType, Device, Tensor};
use tp_engine::EngineOptions;

const ADAPTERS: usize = 4;
const RANK: usize = 16;
const CONCURRENT: usize = 16;

/// Writes a random all-linear adapter of rank [`RANK`] for `config`'s projections.
fn write_adapter(dir: &Path, config: &tp_models::ModelConfig, seed: u64) -> Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let (h, i, hd) = (config.hidden_size, config.intermediate_size, config.head_dim);
    let (q, kv) = (config.num_attention_heads * hd, config.num_key_value_heads * hd);
    let mut rng = tp_core::rng::SplitMix64::new(seed);
    let mut tensors = Vec::new();
    for layer in 0..config.num_hidden_layers {
        for (m, out, inp) in [
            ("self_attn.q_proj", q, h),
            ("self_attn.k_proj", kv, h),
            ("self_attn.v_proj", kv, h),
            ("self_attn.o_proj", h, q),
            ("mlp.gate_proj", i, h),
            ("mlp.up_proj", i, h),
            ("mlp.down_proj", h, i),
        ] {
            let name = format!("base_model.model.model.layers.{layer}.{m}");
            for (suffix, dims) in [("lora_A", [RANK, inp]), ("lora_B", [out, RANK])] {
                let v: Vec<f32> = (0..dims[0] * dims[1]).map(|_| rng.uniform(-0.05, 0.05) as f32).collect();
                tensors.push((format!("{name}.{suffix}.weight"), Tensor::from_vec(v, &dims, &Device::Cpu)?));
            }
        }
    }
    let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    tp_layers::save(dir.join("adapter_model.safetensors"), &named)?;
    let cfg = format!(
        "{{\"peft_type\": \"LORA\", \"r\": {RANK}, \"lora_alpha\": {}, \"target_modules\": \"all-linear\", \
         \"lora_dropout\": 0.0, \"bias\": \"none\"}}",
        2 * RANK
    );
    std::fs::write(dir.join("adapter_config.json"), cfg)?;
    Ok(dir.to_path_buf())
}

/// The rows.
pub fn rows(args: &Args, dir: &Path) -> Result<Vec<Row>> {
    let config = tp_models::ModelConfig::from_dir(dir)?;
    let vocab = config.vocab_size;
    let new_tokens = if args.quick { 8 } else { 32 };
    let root = std::env::temp_dir().join(format!("tp-bench-lora-{}", std::process::id()));
    let mut adapters = Vec::new();
    for k in 0..ADAPTERS {
        let path = write_adapter(&root.join(format!("a{k}")), &config, 100 + k as u64)?;
        let a = tp_models::adapter::read_adapter(&path, config.num_hidden_layers)?;
        adapters.push((k as u32 + 1, Arc::new(a)));
    }
    let prompts: Vec<_> = (0..CONCURRENT).map(|i| prompt(i + 5000, PROMPT_LEN, vocab)).collect();
    let at_once = vec![Duration::ZERO; CONCURRENT];
    let measure = |lora: bool, slots: &[u32]| -> Result<f64> {
        let mut opts = EngineOptions::new(dir);
        opts.dtype = Some(DType::BF16);
        if lora {
            opts.lora_adapters = adapters.clone();
            opts.max_loras = ADAPTERS;
        }
        let engine = tp_engine::start(&opts).context("starting the engine")?;
        run_adapted(&engine, &[prompt(999, 8, vocab)], 2, &[Duration::ZERO], &[])?; // warm-up
        let (t, _) = run_adapted(&engine, &prompts, new_tokens, &at_once, slots)?;
        stop(engine);
        Ok(summarize(&t).tps)
    };
    eprint!("\r  measuring LoRA serving: the base alone...          ");
    let base = measure(false, &[])?;
    eprint!("\r  measuring LoRA serving: 4 adapters...              ");
    let slots: Vec<u32> = (0..CONCURRENT).map(|i| (i % ADAPTERS) as u32 + 1).collect();
    let mixed = measure(true, &slots)?;
    eprint!("\r  measuring LoRA serving: the base beside adapters...");
    let beside = measure(true, &[])?;
    let _ = std::fs::remove_dir_all(&root);
    let shape = format!("{CONCURRENT}x({PROMPT_LEN}+{new_tokens})");
    Ok(vec![
        row("LoRA: base alone, 16 conc.".into(), shape.clone(), base, "tokens/s", None),
        row(
            format!("LoRA: {ADAPTERS} adapters r{RANK}, 16 conc."),
            shape.clone(),
            mixed,
            "tokens/s",
            Some(("base alone", base)),
        ),
        row("LoRA: base beside adapters".into(), shape, beside, "tokens/s", Some(("base alone", base))),
    ])
}
