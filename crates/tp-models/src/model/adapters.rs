//! LoRA adapters on a [`ParallelCausalLm`]: the one a training run trains on the frozen base
//! ([`add_lora`](ParallelCausalLm::add_lora)), and the ones a server serves beside the base
//! ([`add_adapter`](ParallelCausalLm::add_adapter), chosen per token with
//! [`tp_layers::lora::with_token_adapters`]).

use super::ParallelCausalLm;
use crate::error::{ModelError, Result};
use tp_layers::Param;
use tp_layers::lora::LoraSpec;

impl ParallelCausalLm {
    /// Attaches LoRA adapters to the modules `spec` targets and freezes everything else:
    /// from here the training calls add gradients to the adapters only, the base's backward
    /// computes input gradients only, and [`params_mut`](Self::params_mut) lists the adapters.
    /// Returns how many modules this rank adapted (the same on every rank of a stage; zero on
    /// a stage with no targeted module).
    ///
    /// Errors: an adapter tensor missing or of the wrong shape (naming it), a target whose
    /// weight is split in a way LoRA does not follow.
    pub fn add_lora(&mut self, spec: LoraSpec) -> Result<usize> {
        let settings = spec.settings;
        let spec = std::sync::Arc::new(spec);
        let (params, pairs) = tp_layers::lora::attaching(spec, || self.layer_params().map(|p| p.len()));
        params?;
        self.lora = Some(settings);
        Ok(pairs)
    }

    /// Dropout on the trained adapters' input at rate `p` (PEFT's `lora_dropout`), its masks
    /// drawn from `seed` and each micro-batch's number ([`tp_layers::lora::dropout_factor`]).
    ///
    /// Errors: `p` outside `[0, 1)`.
    pub fn set_lora_dropout(&mut self, p: f32, seed: u64) -> Result<()> {
        if !(0.0..1.0).contains(&p) {
            return Err(ModelError::Request(format!("LoRA dropout {p} must be in [0, 1)")));
        }
        self.lora_dropout = (p > 0.0).then_some((seed, p));
        Ok(())
    }

    /// The dropout rate on the trained adapters' input (0 without).
    pub fn lora_dropout(&self) -> f32 {
        self.lora_dropout.map_or(0.0, |(_, p)| p)
    }

    /// The adapters' settings when training LoRA adapters ([`add_lora`](Self::add_lora)).
    pub fn lora(&self) -> Option<&tp_layers::lora::LoraSettings> {
        self.lora.as_ref()
    }

    /// The blocks' parameters (what a frozen base lists: the blocks hold every adapted layer).
    pub(super) fn layer_params(&mut self) -> Result<Vec<Param<'_>>> {
        let names = self.config.architecture.spec().names;
        let sp = self.sequence_parallel;
        let first = self.part.layers.start;
        let mut out = Vec::new();
        for (i, layer) in self.layers.iter_mut().enumerate() {
            layer.params(&format!("model.layers.{}", first + i), &names, sp, &mut |p| out.push(p))?;
        }
        Ok(out)
    }

    /// Attaches `spec`'s adapter in serving slot `id` (`id > 0`; a slot is never given to
    /// another adapter, so cached keys and values of one never pass for another's) beside the
    /// base and any other slots: tokens whose adapter is `id` go through it
    /// ([`tp_layers::lora::with_token_adapters`]). Returns the modules this rank adapted.
    ///
    /// Errors: slot 0 (the trained adapter's), and as [`add_lora`](Self::add_lora).
    pub fn add_adapter(&mut self, id: u32, spec: LoraSpec) -> Result<usize> {
        if id == tp_layers::lora::TRAINED {
            return Err(ModelError::Request("serving adapter slots start at 1".into()));
        }
        let (params, pairs) =
            tp_layers::lora::attaching_as(id, std::sync::Arc::new(spec), || self.layer_params().map(|p| p.len()));
        params?;
        Ok(pairs)
    }

    /// Empties serving slot `id` in every layer (its tokens then get the base alone).
    pub fn remove_adapter(&mut self, id: u32) -> Result<()> {
        tp_layers::lora::detaching(id, || self.layer_params().map(|_| ()))
    }
}
