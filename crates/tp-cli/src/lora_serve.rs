//! Serving LoRA adapters beside the base model, with vLLM's flags: `--enable-lora`,
//! `--lora-modules name=path` (or its JSON form `{"name", "path", "base_model_name"}`),
//! `--max-loras`, `--max-lora-rank`, `--max-cpu-loras`. A request's `model` names an adapter
//! (or the base); `/v1/models` lists each adapter with its `parent`.
//!
//! Adapter `i` of `--lora-modules` (from 1, in the order given) takes engine slot `i`; the
//! engine runs the tokens of every adapter of a step in one batched product per adapter.

use crate::error::CliError;
use std::path::PathBuf;
use std::sync::Arc;
use tp_models::adapter::{LoraAdapter, read_adapter};

/// The LoRA flags of `tp serve`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct LoraServeArgs {
    /// Serve LoRA adapters (`--lora-modules`).
    #[arg(long)]
    pub enable_lora: bool,
    /// Adapters to serve: `name=path` or `{"name": .., "path": .., "base_model_name": ..}`,
    /// one or more.
    #[arg(long, num_args = 1..)]
    pub lora_modules: Vec<String>,
    /// Most distinct adapters in one step (vLLM's default 1); requests of others wait.
    #[arg(long, default_value_t = 1)]
    pub max_loras: usize,
    /// Largest adapter rank accepted (vLLM's default 16).
    #[arg(long, default_value_t = 16)]
    pub max_lora_rank: usize,
    /// Most adapters held in memory (default: --max-loras, at least the adapters given).
    #[arg(long)]
    pub max_cpu_loras: Option<usize>,
    /// Serve `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (also on with vLLM's
    /// `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`).
    #[arg(long)]
    pub allow_runtime_lora_updating: bool,
}

/// One served adapter, as the server names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraModule {
    /// The name a request's `model` gives.
    pub name: String,
    /// Its PEFT folder.
    pub path: PathBuf,
    /// The base model's name (`/v1/models`' `parent`; default: the served name).
    pub base_model_name: Option<String>,
    /// Its engine slot.
    pub slot: u32,
}

/// The checked LoRA settings both the engine and the server read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoraServing {
    /// The adapters, slots 1, 2, ...
    pub modules: Vec<LoraModule>,
    /// `--max-loras`.
    pub max_loras: usize,
    /// `--max-lora-rank`.
    pub max_lora_rank: usize,
    /// `--max-cpu-loras`: most adapters loaded at once.
    pub max_cpu_loras: usize,
    /// Whether adapters may be loaded and unloaded while serving.
    pub runtime_updates: bool,
    /// The base's decoder layers (what an adapter is checked against; set at start).
    pub num_layers: usize,
}

fn bad(msg: impl Into<String>) -> CliError {
    CliError::Args(msg.into())
}

impl LoraServeArgs {
    /// The flags checked (no file read yet).
    ///
    /// Errors: `--lora-modules` without `--enable-lora`, a module that is neither `name=path`
    /// nor the JSON form, a name given twice, `--max-loras` or `--max-lora-rank` of 0, more
    /// adapters than `--max-cpu-loras`, or `--max-cpu-loras` below `--max-loras`.
    pub fn check(&self) -> Result<LoraServing, CliError> {
        let env =
            std::env::var("VLLM_ALLOW_RUNTIME_LORA_UPDATING").is_ok_and(|v| v.eq_ignore_ascii_case("true") || v == "1");
        if !self.enable_lora {
            if !self.lora_modules.is_empty() || self.allow_runtime_lora_updating {
                return Err(bad("--lora-modules and --allow-runtime-lora-updating need --enable-lora"));
            }
            return Ok(LoraServing::default());
        }
        if self.max_loras == 0 || self.max_lora_rank == 0 {
            return Err(bad("--max-loras and --max-lora-rank must be at least 1"));
        }
        let cpu = self.max_cpu_loras.unwrap_or(self.max_loras.max(self.lora_modules.len()));
        if cpu < self.max_loras {
            return Err(bad(format!("--max-cpu-loras {cpu} must be at least --max-loras {}", self.max_loras)));
        }
        if self.lora_modules.len() > cpu {
            return Err(bad(format!("{} --lora-modules, over --max-cpu-loras {cpu}", self.lora_modules.len())));
        }
        let mut modules: Vec<LoraModule> = Vec::new();
        for (i, m) in self.lora_modules.iter().enumerate() {
            let mut module = parse_module(m)?;
            if modules.iter().any(|x| x.name == module.name) {
                return Err(bad(format!("--lora-modules: the name {:?} is given twice", module.name)));
            }
            module.slot = u32::try_from(i + 1).map_err(|_| bad("--lora-modules: too many adapters"))?;
            modules.push(module);
        }
        Ok(LoraServing {
            modules,
            max_loras: self.max_loras,
            max_lora_rank: self.max_lora_rank,
            max_cpu_loras: cpu,
            runtime_updates: self.allow_runtime_lora_updating || env,
            num_layers: 0,
        })
    }
}

/// `name=path` or vLLM's JSON form.
fn parse_module(s: &str) -> Result<LoraModule, CliError> {
    let module = if s.trim_start().starts_with('{') {
        let v: serde_json::Value =
            serde_json::from_str(s).map_err(|e| bad(format!("--lora-modules {s:?}: not valid JSON: {e}")))?;
        let field = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_string);
        let (Some(name), Some(path)) = (field("name"), field("path")) else {
            return Err(bad(format!("--lora-modules {s:?}: the JSON form needs \"name\" and \"path\"")));
        };
        LoraModule { name, path: path.into(), base_model_name: field("base_model_name"), slot: 0 }
    } else {
        let Some((name, path)) = s.split_once('=') else {
            return Err(bad(format!("--lora-modules {s:?}: expected name=path or a JSON object")));
        };
        LoraModule { name: name.to_string(), path: path.into(), base_model_name: None, slot: 0 }
    };
    if module.name.is_empty() || module.path.as_os_str().is_empty() {
        return Err(bad(format!("--lora-modules {s:?}: empty name or path")));
    }
    Ok(module)
}

impl LoraServing {
    /// Every adapter read and checked against the base (`num_layers` layers) and
    /// `--max-lora-rank`, in slot order.
    ///
    /// Errors: the adapter folder's own (naming the file and tensor), a rank over the limit.
    pub fn load(&self, num_layers: usize) -> Result<Vec<(u32, Arc<LoraAdapter>)>, CliError> {
        self.modules
            .iter()
            .map(|m| Ok((m.slot, Arc::new(self.read(&m.name, &m.path, num_layers).map_err(bad)?))))
            .collect()
    }

    /// The adapter `name` at `path`, read and checked against `--max-lora-rank`.
    pub fn read(&self, name: &str, path: &std::path::Path, num_layers: usize) -> Result<LoraAdapter, String> {
        let a = read_adapter(path, num_layers).map_err(|e| format!("LoRA adapter {name:?}: {e}"))?;
        if a.settings.r > self.max_lora_rank {
            return Err(format!(
                "LoRA adapter {name:?} ({}): rank {} is over --max-lora-rank {}",
                path.display(),
                a.settings.r,
                self.max_lora_rank
            ));
        }
        Ok(a)
    }

    /// The adapter a request's `model` names, if any.
    pub fn find(&self, model: &str) -> Option<&LoraModule> {
        self.modules.iter().find(|m| m.name == model)
    }
}
