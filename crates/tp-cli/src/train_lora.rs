//! `tp train`'s LoRA flags (PEFT's `LoraConfig` names): training adapters on a frozen base
//! instead of every weight.

use crate::error::CliError;
use std::path::{Path, PathBuf};
use tp_layers::lora::{LoraInit, LoraSettings, LoraSpec, LoraTargets};
use tp_models::adapter::{is_adapter_dir, read_adapter};
use tp_models::{Architecture, ModelConfig};

/// The LoRA flags of `tp train`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct LoraArgs {
    /// Train LoRA adapters of rank R on the frozen model (PEFT's `r`) instead of every weight;
    /// `--save` then writes a PEFT adapter folder.
    #[arg(long)]
    pub lora_r: Option<usize>,
    /// The adapters' `lora_alpha` (scale alpha / r; PEFT's default 8).
    #[arg(long)]
    pub lora_alpha: Option<f64>,
    /// Dropout on the adapters' input while training (PEFT's `lora_dropout`; masks drawn from
    /// --seed).
    #[arg(long, default_value_t = 0.0)]
    pub lora_dropout: f64,
    /// Modules to adapt, as PEFT's `target_modules`: names such as q_proj,v_proj (a module
    /// matches when its name ends with one), or all-linear. Default: PEFT's for the family
    /// (q_proj,v_proj; Phi-3's qkv_proj).
    #[arg(long, num_args = 1.., value_delimiter = ',')]
    pub lora_target_modules: Vec<String>,
    /// rsLoRA's scale alpha / sqrt(r) (PEFT's `use_rslora`).
    #[arg(long)]
    pub use_rslora: bool,
    /// Start from this PEFT adapter folder (its r, alpha, targets and weights) instead of a
    /// fresh adapter.
    #[arg(long)]
    pub lora_adapter: Option<PathBuf>,
}

fn bad(msg: impl Into<String>) -> CliError {
    CliError::Args(msg.into())
}

impl LoraArgs {
    /// Whether the run trains adapters: `--lora-r`, `--lora-adapter`, or a resumed adapter.
    pub fn active(&self, resume: Option<&Path>) -> bool {
        self.lora_r.is_some() || self.lora_adapter.is_some() || resume.is_some_and(is_adapter_dir)
    }

    /// The adapters to attach, or `None` for a full fine-tune: a resumed run's adapter (its
    /// checkpoint), `--lora-adapter`'s, or a fresh one from the flags (`A` drawn from `seed`).
    ///
    /// Errors: flags that disagree with the adapter they resume or start from, LoRA flags
    /// without `--lora-r`, a rank of 0, a non-finite alpha, dropout (not supported yet), and
    /// the adapter folder's own errors.
    pub fn spec(&self, resume: Option<&Path>, config: &ModelConfig, seed: u64) -> Result<Option<LoraSpec>, CliError> {
        if !(0.0..1.0).contains(&self.lora_dropout) {
            return Err(bad(format!("--lora-dropout {} must be in [0, 1)", self.lora_dropout)));
        }
        let from = match (resume.filter(|r| is_adapter_dir(r)), &self.lora_adapter) {
            (Some(_), Some(a)) => {
                return Err(bad(format!(
                    "--lora-adapter {}: a resumed LoRA run continues its checkpoint's adapter",
                    a.display()
                )));
            }
            (Some(r), None) => Some(r),
            (None, Some(a)) => Some(a.as_path()),
            (None, None) => None,
        };
        if let Some(dir) = from {
            let adapter = read_adapter(dir, config.num_hidden_layers).map_err(|e| bad(e.to_string()))?;
            self.agrees(&adapter.settings, dir)?;
            return Ok(Some(adapter.spec()));
        }
        let Some(r) = self.lora_r else {
            if self.lora_alpha.is_some() || !self.lora_target_modules.is_empty() || self.use_rslora {
                return Err(bad(
                    "--lora-alpha, --lora-target-modules and --use-rslora need --lora-r (or --lora-adapter)",
                ));
            }
            return Ok(None);
        };
        let alpha = self.lora_alpha.unwrap_or(8.0);
        if r == 0 || !alpha.is_finite() {
            return Err(bad(format!("--lora-r {r} must be at least 1 and --lora-alpha {alpha} finite")));
        }
        let targets = match self.lora_target_modules.as_slice() {
            [] => LoraTargets::Names(default_targets(config.architecture)),
            [one] if one == "all-linear" => LoraTargets::AllLinear,
            names if names.iter().any(|n| n.is_empty() || n == "all-linear") => {
                return Err(bad("--lora-target-modules: module names, or all-linear alone"));
            }
            names => LoraTargets::Names(names.to_vec()),
        };
        Ok(Some(LoraSpec {
            settings: LoraSettings { r, alpha, use_rslora: self.use_rslora },
            targets,
            init: LoraInit::Fresh { seed },
        }))
    }

    /// Checks that the rank, alpha and scale flags given agree with an adapter's (`dir`).
    fn agrees(&self, s: &LoraSettings, dir: &Path) -> Result<(), CliError> {
        let differs = self.lora_r.is_some_and(|r| r != s.r)
            || self.lora_alpha.is_some_and(|a| a != s.alpha)
            || (self.use_rslora && !s.use_rslora);
        if differs || !self.lora_target_modules.is_empty() {
            return Err(bad(format!(
                "{}: the adapter fixes r {}, lora_alpha {}, use_rslora {} and its target modules; drop the flags that \
                 differ and --lora-target-modules",
                dir.display(),
                s.r,
                s.alpha,
                s.use_rslora
            )));
        }
        Ok(())
    }
}

/// PEFT's default `target_modules` for the family (its
/// `TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`): the query and value projections.
fn default_targets(arch: Architecture) -> Vec<String> {
    let names: &[&str] = match arch {
        Architecture::Phi3 => &["qkv_proj"],
        _ => &["q_proj", "v_proj"],
    };
    names.iter().map(|s| s.to_string()).collect()
}
