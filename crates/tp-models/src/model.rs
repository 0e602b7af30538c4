//! [`ParallelCausalLm`]: a whole Llama-family causal language model, tensor-parallel.
//!
//! Every rank of the group holds: its rows of the embedding table (vocab-parallel), for every
//! decoder layer its query/KV heads of the attention and its intermediate features of the MLP
//! (plus a KV cache of its KV heads), the replicated norms, and its rows of the LM head (the
//! embedding's own shard when tied). A forward over `T` tokens communicates one all-reduce for
//! the embedding, two per layer, and for the next token either an all-gather of the logits or,
//! for the greedy choice alone, a gather of each rank's `(max, index)` pair. Every rank computes
//! the same tokens.

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use std::path::Path;
use std::time::{Duration, Instant};
use tp_comm::DeviceGroup;
use tp_core::{DType, Device, RotaryEmbedding, Tensor};
use tp_layers::{
    AttentionConfig, AttentionHeads, Checkpoint, DecoderConfig, DecoderLayer, KvCache, LoadOptions, ParallelLmHead,
    QkvLayout, RmsNorm, VocabParallelEmbedding,
};

/// Default KV cache length when neither the options nor the config's maximum is smaller.
pub const DEFAULT_MAX_SEQ_LEN: usize = 4096;

/// How a model is loaded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ModelOptions {
    /// Compute dtype; parameters are converted while loading. `None`: the embedding table's.
    pub dtype: Option<DType>,
    /// Positions each KV cache holds at first (`None`: `min(max_position_embeddings, 4096)`);
    /// [`ParallelCausalLm::generate`] grows the caches when a request needs more.
    pub max_seq_len: Option<usize>,
}

impl ModelOptions {
    /// The defaults.
    pub fn new() -> ModelOptions {
        ModelOptions::default()
    }
    /// Compute in `dtype`.
    pub fn with_dtype(mut self, dtype: DType) -> ModelOptions {
        self.dtype = Some(dtype);
        self
    }
    /// KV caches of `len` positions.
    pub fn with_max_seq_len(mut self, len: usize) -> ModelOptions {
        self.max_seq_len = Some(len);
        self
    }
}

/// What [`ParallelCausalLm::generate`] does besides picking tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GenerateOptions {
    /// Keep going past an end-of-sequence token.
    pub ignore_eos: bool,
    /// Return the full logits of the prompt and of every decode step (gathered from all ranks);
    /// otherwise only each rank's maximum travels.
    pub keep_logits: bool,
}

impl GenerateOptions {
    /// The defaults: stop at end of sequence, keep no logits.
    pub fn new() -> GenerateOptions {
        GenerateOptions::default()
    }
    /// Do not stop at end-of-sequence tokens.
    pub fn ignore_eos(mut self, yes: bool) -> GenerateOptions {
        self.ignore_eos = yes;
        self
    }
    /// Keep the logits.
    pub fn keep_logits(mut self, yes: bool) -> GenerateOptions {
        self.keep_logits = yes;
        self
    }
}

/// The result of [`ParallelCausalLm::generate`].
#[derive(Debug, Clone)]
pub struct Generation {
    /// The new tokens (at most `max_new_tokens`; the last is an end-of-sequence id when
    /// generation stopped there).
    pub tokens: Vec<i64>,
    /// With `keep_logits`: `[prompt_len, vocab]` logits of every prompt position (model dtype).
    pub prefill_logits: Option<Tensor>,
    /// With `keep_logits`: `[tokens.len() - 1, vocab]`, row `i` the output of the decode step
    /// that consumed `tokens[i]` at position `prompt_len + i`.
    pub decode_logits: Option<Tensor>,
    /// Wall time of the prefill (to the first token, on the host).
    pub prefill_time: Duration,
    /// Wall time of the decode steps after it.
    pub decode_time: Duration,
}

/// One rank's part of a tensor-parallel causal LM and of its current sequence.
pub struct ParallelCausalLm {
    config: ModelConfig,
    group: DeviceGroup,
    dtype: DType,
    embed: VocabParallelEmbedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: ParallelLmHead,
    caches: Vec<KvCache>,
}

impl std::fmt::Debug for ParallelCausalLm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ParallelCausalLm({:?}, {} layers, {} on {:?}, at position {})",
            self.config.architecture,
            self.layers.len(),
            self.dtype,
            self.group,
            self.position()
        )
    }
}

impl ParallelCausalLm {
    /// Loads the model in folder `dir` (`config.json`, `model.safetensors` or an index over
    /// several files) for `group`: each rank reads only its shards, onto the group's device.
    ///
    /// Errors: config problems, a world size whose heads cannot be placed, any tensor missing or
    /// of another shape than the config implies, checkpoint and device errors; all before any
    /// collective runs.
    pub fn load(dir: impl AsRef<Path>, group: &DeviceGroup, opts: &ModelOptions) -> Result<ParallelCausalLm> {
        let dir = dir.as_ref();
        let config = ModelConfig::from_dir(dir)?;
        let c = &config;
        QkvLayout::new(c.num_attention_heads, c.num_key_value_heads, c.head_dim, group.rank(), group.world_size())?;
        let ckpt = Checkpoint::open(dir)?;
        check_tensors(&ckpt, c)?;
        let dtype = match opts.dtype {
            Some(d) => d,
            None => ckpt.param_info("model.embed_tokens.weight")?.0,
        };
        let load = LoadOptions::new().with_dtype(dtype);
        let attention = AttentionConfig {
            heads: AttentionHeads {
                num_heads: c.num_attention_heads,
                num_kv_heads: c.num_key_value_heads,
                head_dim: c.head_dim,
            },
            rope: RotaryEmbedding::new(c.head_dim, c.rope_theta, c.rope_scaling)?,
            sliding_window: c.sliding_window,
        };
        let layer_config = DecoderConfig { attention, rms_norm_eps: c.rms_norm_eps };
        let embed = VocabParallelEmbedding::load(&ckpt, "model.embed_tokens", group, &load)?;
        let layers = (0..c.num_hidden_layers)
            .map(|i| DecoderLayer::load(&ckpt, &format!("model.layers.{i}"), &layer_config, group, &load))
            .collect::<tp_layers::Result<Vec<_>>>()?;
        let norm = RmsNorm::load(&ckpt, "model.norm", c.rms_norm_eps, group, &load)?;
        let lm_head = if c.tie_word_embeddings {
            ParallelLmHead::tied(&embed)
        } else {
            ParallelLmHead::load(&ckpt, "lm_head", group, &load)?
        };
        let capacity = opts.max_seq_len.unwrap_or(DEFAULT_MAX_SEQ_LEN).min(c.max_position_embeddings);
        let caches = layers.iter().map(|l| l.new_cache(capacity)).collect::<tp_layers::Result<Vec<_>>>()?;
        Ok(ParallelCausalLm { config, group: group.clone(), dtype, embed, layers, norm, lm_head, caches })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }
    /// The compute dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// The group the model runs on.
    pub fn group(&self) -> &DeviceGroup {
        &self.group
    }
    /// Tokens of the current sequence held in the KV caches.
    pub fn position(&self) -> usize {
        self.caches.first().map_or(0, KvCache::len)
    }
    /// Positions the KV caches hold.
    pub fn capacity(&self) -> usize {
        self.caches.first().map_or(0, KvCache::capacity)
    }

    /// Forgets the current sequence.
    pub fn reset(&mut self) {
        self.caches.iter_mut().for_each(KvCache::reset);
    }

    /// Makes the KV caches hold at least `len` positions (a new, empty sequence if they grow).
    pub fn reserve(&mut self, len: usize) -> Result<()> {
        if len > self.config.max_position_embeddings {
            return Err(ModelError::Request(format!(
                "{len} positions exceed the model's max_position_embeddings ({})",
                self.config.max_position_embeddings
            )));
        }
        if len > self.capacity() {
            self.caches = self.layers.iter().map(|l| l.new_cache(len)).collect::<tp_layers::Result<Vec<_>>>()?;
        }
        Ok(())
    }

    /// The final hidden states `[T, H]` (after the last norm) of the next `ids`, appended to
    /// the current sequence.
    fn hidden(&mut self, ids: &[i64]) -> Result<Tensor> {
        if ids.is_empty() {
            return Err(ModelError::Request("no tokens to run".into()));
        }
        let end = self.position() + ids.len();
        if end > self.capacity() {
            return Err(ModelError::Request(format!(
                "the sequence would reach {end} positions; the KV caches hold {} (max_position_embeddings {})",
                self.capacity(),
                self.config.max_position_embeddings
            )));
        }
        let ids = Tensor::from_vec(ids.to_vec(), &[ids.len()], &Device::Cpu)?;
        let mut x = self.embed.forward(&ids, &self.group)?;
        for (layer, cache) in self.layers.iter().zip(&mut self.caches) {
            x = layer.forward(&x, cache, &self.group)?;
        }
        Ok(self.norm.forward(&x)?)
    }

    /// Starts a new sequence with `ids` and returns the logits of every position, `[T, V]` in
    /// the model dtype, on the group's device (identical on every rank).
    pub fn prefill(&mut self, ids: &[i64]) -> Result<Tensor> {
        self.reset();
        let h = self.hidden(ids)?;
        Ok(self.lm_head.logits(&h, &self.group)?)
    }

    /// Appends `id` to the sequence and returns the logits of its position, `[V]`.
    pub fn decode_step(&mut self, id: i64) -> Result<Tensor> {
        let h = self.hidden(&[id])?;
        let v = self.config.vocab_size;
        Ok(self.lm_head.logits(&h, &self.group)?.reshape(&[v])?)
    }

    /// Greedy generation: a new sequence with `prompt`, then up to `max_new_tokens` tokens, each
    /// the argmax of the logits (the lowest id on ties), stopping after an end-of-sequence
    /// token unless `opts.ignore_eos`. Every rank returns the same tokens.
    ///
    /// Errors: an empty prompt, `max_new_tokens == 0`, a prompt id outside the vocabulary, a
    /// prompt plus `max_new_tokens` longer than `max_position_embeddings`; layer errors.
    pub fn generate(&mut self, prompt: &[i64], max_new_tokens: usize, opts: &GenerateOptions) -> Result<Generation> {
        if prompt.is_empty() {
            return Err(ModelError::Request("the prompt is empty".into()));
        }
        if max_new_tokens == 0 {
            return Err(ModelError::Request("max_new_tokens must be at least 1".into()));
        }
        let total = prompt.len().saturating_add(max_new_tokens);
        if total > self.config.max_position_embeddings {
            return Err(ModelError::Request(format!(
                "the prompt ({} tokens) plus {max_new_tokens} new tokens exceeds max_position_embeddings ({})",
                prompt.len(),
                self.config.max_position_embeddings
            )));
        }
        if let Some((i, &id)) = prompt
            .iter()
            .enumerate()
            .find(|(_, id)| usize::try_from(**id).map_or(true, |v| v >= self.config.vocab_size))
        {
            return Err(ModelError::Request(format!(
                "prompt id {id} at position {i} is out of range for the vocabulary of {}",
                self.config.vocab_size
            )));
        }
        self.reserve(total - 1)?;
        self.reset();
        let start = Instant::now();
        let (first, prefill_logits) = self.next_token(prompt, opts.keep_logits)?;
        let prefill_time = start.elapsed();
        let mut tokens = vec![first];
        let mut decode_rows = Vec::new();
        let start = Instant::now();
        while tokens.len() < max_new_tokens {
            let last = tokens[tokens.len() - 1];
            if !opts.ignore_eos && self.config.eos_token_ids.contains(&last) {
                break;
            }
            let (next, logits) = self.next_token(&[last], opts.keep_logits)?;
            decode_rows.extend(logits);
            tokens.push(next);
        }
        let decode_time = start.elapsed();
        let decode_logits = if opts.keep_logits {
            Some(if decode_rows.is_empty() {
                Tensor::zeros(&[0, self.config.vocab_size], self.dtype, &Device::Cpu)?
            } else {
                Tensor::cat(&decode_rows, 0)?
            })
        } else {
            None
        };
        Ok(Generation { tokens, prefill_logits, decode_logits, prefill_time, decode_time })
    }

    /// Runs `ids` and picks the greedy next token from the last position; with `keep`, also
    /// returns the logits of every position (on the host).
    fn next_token(&mut self, ids: &[i64], keep: bool) -> Result<(i64, Option<Tensor>)> {
        let h = self.hidden(ids)?;
        if keep {
            let logits = self.lm_head.logits(&h, &self.group)?.to_device(&Device::Cpu)?;
            let last = logits.narrow(0, ids.len() - 1, 1)?;
            let id = last.argmax()?.to_i64_vec()?;
            return Ok((id.first().copied().unwrap_or(0), Some(logits)));
        }
        let last = h.narrow(0, ids.len() - 1, 1)?;
        let id = self.lm_head.argmax(&last, &self.group)?.to_i64_vec()?;
        Ok((id.first().copied().unwrap_or(0), None))
    }
}

/// Checks every tensor the config implies against the checkpoint: present, of the implied
/// shape, a float dtype; biases present exactly where the architecture has them.
fn check_tensors(ckpt: &Checkpoint, c: &ModelConfig) -> Result<()> {
    let (h, i, q, kv) =
        (c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim);
    let expect = |name: String, dims: &[usize]| -> Result<()> {
        ckpt.param_info(&name)?;
        Ok(ckpt.expect(&name, dims, None)?)
    };
    expect("model.embed_tokens.weight".into(), &[c.vocab_size, h])?;
    expect("model.norm.weight".into(), &[h])?;
    if !c.tie_word_embeddings {
        expect("lm_head.weight".into(), &[c.vocab_size, h])?;
    }
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}");
        expect(format!("{p}.input_layernorm.weight"), &[h])?;
        expect(format!("{p}.post_attention_layernorm.weight"), &[h])?;
        let projections = [
            ("self_attn.q_proj", q, h, c.qkv_bias),
            ("self_attn.k_proj", kv, h, c.qkv_bias),
            ("self_attn.v_proj", kv, h, c.qkv_bias),
            ("self_attn.o_proj", h, q, c.o_bias),
            ("mlp.gate_proj", i, h, c.mlp_bias),
            ("mlp.up_proj", i, h, c.mlp_bias),
            ("mlp.down_proj", h, i, c.mlp_bias),
        ];
        for (name, out, inp, bias) in projections {
            expect(format!("{p}.{name}.weight"), &[out, inp])?;
            let bias_name = format!("{p}.{name}.bias");
            match (bias, ckpt.contains(&bias_name)) {
                (true, _) => expect(bias_name, &[out])?,
                (false, true) => {
                    return Err(ModelError::Unsupported {
                        field: "checkpoint".into(),
                        value: format!("{bias_name:?}"),
                        why: format!(
                            "a {:?} model with this config has no such bias (attention_bias / mlp_bias say so)",
                            c.architecture
                        ),
                    });
                }
                (false, false) => {}
            }
        }
    }
    Ok(())
}
