//! LoRA adapter folders in PEFT's format: `adapter_config.json` and
//! `adapter_model.safetensors`, as `PeftModel.save_pretrained` writes them and
//! `PeftModel.from_pretrained` (and vLLM's `--lora-modules`) reads them.
//!
//! The weights file names each pair `base_model.model.<module>.lora_A.weight: [r, in]` and
//! `base_model.model.<module>.lora_B.weight: [out, r]`, `<module>` the base's module
//! (`model.layers.0.self_attn.q_proj`). The config gives `r`, `lora_alpha`, `use_rslora` and
//! `target_modules` (a list of names, or `"all-linear"`). tp reads the plain LoRA that PEFT
//! writes by default; what it does not apply (DoRA, trained biases, `modules_to_save`,
//! per-module ranks, embedding adapters, regex targets) is refused by name, never ignored.

use crate::error::{ModelError, Result};
use std::collections::BTreeMap;
use std::path::Path;
use tp_core::{DType, Device, Tensor};
use tp_layers::lora::{ALL_LINEAR, LoraInit, LoraSettings, LoraSpec, LoraTargets};

/// The adapter's config file.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// The adapter's weights file.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// PEFT's prefix of every tensor name in the weights file.
pub const PEFT_PREFIX: &str = "base_model.model.";
/// Largest adapter config read.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// A LoRA adapter read from a PEFT folder.
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    /// `r`, `lora_alpha`, `use_rslora`.
    pub settings: LoraSettings,
    /// `target_modules`.
    pub targets: LoraTargets,
    /// `lora_dropout` (training only; no effect when serving).
    pub dropout: f64,
    /// Every pair's full tensors (f32), named `<module>.lora_A.weight` /
    /// `<module>.lora_B.weight` (PEFT's prefix removed).
    pub tensors: BTreeMap<String, Tensor>,
}

impl LoraAdapter {
    /// The spec that attaches this adapter ([`ParallelCausalLm::add_lora`](crate::ParallelCausalLm::add_lora)).
    pub fn spec(&self) -> LoraSpec {
        LoraSpec {
            settings: self.settings,
            targets: self.targets.clone(),
            init: LoraInit::Tensors(std::sync::Arc::new(self.tensors.clone())),
        }
    }

    /// The adapted modules (`model.layers.0.self_attn.q_proj`), in name order.
    pub fn modules(&self) -> Vec<&str> {
        self.tensors.keys().filter_map(|n| n.strip_suffix(".lora_A.weight")).collect()
    }
}

fn bad(path: &Path, why: impl std::fmt::Display) -> ModelError {
    ModelError::ConfigFile { path: path.display().to_string(), why: why.to_string() }
}

/// Whether `dir` holds a LoRA adapter (its [`ADAPTER_CONFIG`]).
pub fn is_adapter_dir(dir: &Path) -> bool {
    dir.join(ADAPTER_CONFIG).is_file()
}

/// Reads the PEFT adapter folder `dir` for a base of `num_layers` decoder layers.
///
/// Errors (each naming the file, and the key or tensor): a missing or malformed file; an
/// adapter tp does not apply (`peft_type` other than LORA, DoRA, `bias` other than `none`,
/// `fan_in_fan_out`, `modules_to_save`, `rank_pattern`/`alpha_pattern`, a regex
/// `target_modules`); a tensor that is not a pair's factor of a projection tp adapts, of a
/// layer the base has, or whose rank is not `r`; a module with only one of its two factors.
pub fn read_adapter(dir: &Path, num_layers: usize) -> Result<LoraAdapter> {
    let cfg_path = dir.join(ADAPTER_CONFIG);
    let text = tp_layers::read_text_file(&cfg_path, MAX_CONFIG_BYTES)?;
    let cfg: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(&cfg_path, e))?;
    let (settings, targets, dropout) = parse_config(&cfg_path, &cfg)?;
    let weights = dir.join(ADAPTER_WEIGHTS);
    if !weights.is_file() {
        return Err(bad(&weights, "missing (an adapter folder holds adapter_model.safetensors)"));
    }
    let ckpt = tp_layers::Checkpoint::open(&weights)?;
    let mut tensors = BTreeMap::new();
    for name in ckpt.names() {
        let module_name = check_name(&weights, name, num_layers)?;
        let (dtype, dims) = ckpt.info(name)?;
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) || dims.len() != 2 {
            return Err(bad(&weights, format!("{name} is {dtype} {dims:?}; a LoRA factor is a float matrix")));
        }
        let r_dim = if name.ends_with(".lora_A.weight") { dims[0] } else { dims[1] };
        if r_dim != settings.r {
            return Err(bad(&weights, format!("{name} has rank {r_dim} but the config's r is {}", settings.r)));
        }
        tensors.insert(module_name, ckpt.load(name, Some(DType::F32), &Device::Cpu)?);
    }
    for name in tensors.keys() {
        let other = match name.strip_suffix(".lora_A.weight") {
            Some(m) => format!("{m}.lora_B.weight"),
            None => format!("{}.lora_A.weight", name.trim_end_matches(".lora_B.weight")),
        };
        if !tensors.contains_key(&other) {
            return Err(bad(&weights, format!("{PEFT_PREFIX}{name} has no {PEFT_PREFIX}{other}")));
        }
    }
    if tensors.is_empty() {
        return Err(bad(&weights, "holds no LoRA tensors"));
    }
    Ok(LoraAdapter { settings, targets, dropout, tensors })
}

/// The name without PEFT's prefix, checked: a factor of a projection tp adapts, of a layer
/// below `num_layers`.
fn check_name(path: &Path, name: &str, num_layers: usize) -> Result<String> {
    let refuse = |why: &str| Err(bad(path, format!("{name}: {why}")));
    let Some(rest) = name.strip_prefix(PEFT_PREFIX) else {
        return refuse(&format!("not a PEFT LoRA tensor (no {PEFT_PREFIX:?} prefix)"));
    };
    let Some(module) = rest.strip_suffix(".lora_A.weight").or_else(|| rest.strip_suffix(".lora_B.weight")) else {
        return refuse("not a LoRA factor (`.lora_A.weight` or `.lora_B.weight`): tp applies plain LoRA only");
    };
    let layer: Option<usize> =
        module.strip_prefix("model.layers.").and_then(|r| r.split('.').next()).and_then(|n| n.parse().ok());
    match layer {
        // The modules `all-linear` adapts are the ones tp can.
        Some(l) if l < num_layers && LoraTargets::AllLinear.matches(module) => Ok(rest.to_string()),
        Some(l) if l >= num_layers => refuse(&format!("layer {l}, but the base has {num_layers} layers")),
        _ => refuse(&format!("tp adapts the decoder layers' projections ({}) only", ALL_LINEAR.join(", "))),
    }
}

/// `(settings, targets, dropout)` from an adapter config.
fn parse_config(path: &Path, cfg: &serde_json::Value) -> Result<(LoraSettings, LoraTargets, f64)> {
    let field = |k: &str| cfg.get(k).filter(|v| !v.is_null());
    let refuse = |k: &str, why: &str| Err(bad(path, format!("{k}: {why}")));
    if let Some(t) = field("peft_type")
        && t.as_str() != Some("LORA")
    {
        return refuse("peft_type", &format!("{t} is not LORA"));
    }
    let r = match field("r").and_then(|v| v.as_u64()) {
        Some(r) if r > 0 => r as usize,
        _ => return refuse("r", "missing or not a positive integer"),
    };
    let alpha = match field("lora_alpha") {
        None => 8.0, // PEFT's default
        Some(v) => match v.as_f64() {
            Some(a) if a.is_finite() => a,
            _ => return refuse("lora_alpha", "not a finite number"),
        },
    };
    let flag = |k: &str| field(k).and_then(|v| v.as_bool()).unwrap_or(false);
    for k in ["use_dora", "fan_in_fan_out", "lora_bias", "use_qalora"] {
        if flag(k) {
            return refuse(k, "true is not supported (tp applies plain LoRA: x W^T + s (x A^T) B^T)");
        }
    }
    if let Some(b) = field("bias")
        && b.as_str() != Some("none")
    {
        return refuse("bias", &format!("{b}: trained biases are not supported (only \"none\")"));
    }
    for k in [
        "modules_to_save",
        "rank_pattern",
        "alpha_pattern",
        "layers_to_transform",
        "trainable_token_indices",
        "exclude_modules",
        "layer_replication",
        "target_parameters",
        "alora_invocation_tokens",
    ] {
        let empty = match field(k) {
            None => true,
            Some(serde_json::Value::Array(a)) => a.is_empty(),
            Some(serde_json::Value::Object(o)) => o.is_empty(),
            _ => false,
        };
        if !empty {
            return refuse(k, "not supported (every module must take the same r and alpha, nothing else trained)");
        }
    }
    let targets = match field("target_modules") {
        Some(serde_json::Value::String(s)) if s == "all-linear" => LoraTargets::AllLinear,
        Some(serde_json::Value::String(s)) if s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.') => {
            LoraTargets::Names(vec![s.clone()])
        }
        Some(serde_json::Value::String(s)) => {
            return refuse("target_modules", &format!("the pattern {s:?} is not supported; list the module names"));
        }
        Some(serde_json::Value::Array(a)) => {
            let names: Option<Vec<String>> = a.iter().map(|v| v.as_str().map(str::to_string)).collect();
            match names {
                Some(n) if !n.is_empty() => LoraTargets::Names(n),
                _ => return refuse("target_modules", "not a non-empty list of names"),
            }
        }
        _ => return refuse("target_modules", "missing"),
    };
    let dropout = field("lora_dropout").and_then(|v| v.as_f64()).unwrap_or(0.0);
    if !(0.0..1.0).contains(&dropout) {
        return refuse("lora_dropout", "must be in [0, 1)");
    }
    Ok((LoraSettings { r, alpha, use_rslora: flag("use_rslora") }, targets, dropout))
}

/// `adapter_config.json` as PEFT writes it for a causal LM: `settings`, the modules' short
/// names (`q_proj`, ..., as PEFT records even for `all-linear`), `dropout`, and the base's
/// name or path.
pub fn adapter_config(settings: &LoraSettings, modules: &[&str], dropout: f64, base: &str) -> serde_json::Value {
    let mut short: Vec<&str> = modules.iter().map(|m| m.rsplit('.').next().unwrap_or(m)).collect();
    short.sort_unstable();
    short.dedup();
    serde_json::json!({
        "alpha_pattern": {},
        "auto_mapping": null,
        "base_model_name_or_path": base,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "layers_pattern": null,
        "layers_to_transform": null,
        "lora_alpha": settings.alpha,
        "lora_dropout": dropout,
        "modules_to_save": null,
        "peft_type": "LORA",
        "r": settings.r,
        "rank_pattern": {},
        "revision": null,
        "target_modules": short,
        "task_type": "CAUSAL_LM",
        "use_dora": false,
        "use_rslora": settings.use_rslora,
    })
}

/// Adapter tensors under PEFT's names (`base_model.model.` prefixed), f32.
pub fn peft_names(tensors: BTreeMap<String, Tensor>) -> Result<BTreeMap<String, Tensor>> {
    tensors.into_iter().map(|(n, t)| Ok((format!("{PEFT_PREFIX}{n}"), t.to_dtype(DType::F32)?))).collect()
}

/// Every tensor of `base` with the adapter merged in (PEFT's `merge_and_unload`): each adapted
/// module's weight becomes `W + s · B A`, the product and the sum in f32, rounded to the
/// weight's dtype; every other tensor as it is.
///
/// Errors: an adapted module whose weight the base lacks, or of another shape than `[B's rows,
/// A's columns]`; the checkpoint's read errors.
pub fn merge(base: &tp_layers::Checkpoint, adapter: &LoraAdapter) -> Result<BTreeMap<String, Tensor>> {
    let s = adapter.settings.scale();
    let mut out = BTreeMap::new();
    let mut merged = 0;
    for name in base.names() {
        out.insert(name.to_string(), base.load(name, None, &Device::Cpu)?);
    }
    for module in adapter.modules() {
        let (a, b) = (
            &adapter.tensors[&format!("{module}.lora_A.weight")],
            &adapter.tensors[&format!("{module}.lora_B.weight")],
        );
        let name = format!("{module}.weight");
        let w = out.get_mut(&name).ok_or_else(|| {
            ModelError::Layer(tp_layers::LayerError::MissingTensor { path: String::new(), name: name.clone() })
        })?;
        let want = [b.dims()[0], a.dims()[1]];
        if w.dims() != want {
            return Err(ModelError::Layer(tp_layers::LayerError::WrongShape {
                name,
                found: w.dims().to_vec(),
                expected: want.to_vec(),
            }));
        }
        let delta = b.matmul(a)?.scale(s)?;
        *w = w.to_dtype(DType::F32)?.add(&delta)?.to_dtype(w.dtype())?;
        merged += 1;
    }
    debug_assert_eq!(merged, adapter.modules().len());
    Ok(out)
}
