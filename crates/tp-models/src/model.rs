//! [`ParallelCausalLm`]: a whole Llama-family causal language model, tensor-parallel.
//!
//! Every rank of the group holds: its rows of the embedding table (vocab-parallel), for every
//! decoder layer its query/KV heads of the attention and its intermediate features of the MLP
//! (plus a KV cache of its KV heads), the replicated norms, and its rows of the LM head (the
//! embedding's own shard when tied). A forward over `T` tokens communicates one all-reduce for
//! the embedding, two per layer, and for the next token either an all-gather of the logits or,
//! for the greedy choice alone, a gather of each rank's `(max, index)` pair. Every rank computes
//! the same tokens.

mod adapters;
mod batch;
mod load_balancing;
mod stage;
mod train;

pub use batch::StageOutput;
pub use stage::{StagePart, parse_layer_partition, partition_layers, stage_parts};
pub use train::{BlockHook, Handoff, MicroBatch, MicroBatchLoss, Recompute, StageForward, StageSaved, TrainRow};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::source::ModelSource;
use crate::tensors::check_tensors;
use std::path::Path;
use std::time::{Duration, Instant};
use tp_comm::DeviceGroup;
use tp_core::{DType, Device, Tensor};
use tp_layers::{
    Block, Checkpoint, KvCache, LoadOptions, Loader, ParallelLmHead, QkvLayout, RmsNorm, VocabParallelEmbedding,
};

/// Positions each KV cache holds at first; caches grow (doubling) as a sequence needs, up to
/// the model's limit.
pub const INITIAL_CACHE_POSITIONS: usize = 256;

/// How a model is loaded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ModelOptions {
    /// Compute dtype; parameters are converted while loading. `None`: the embedding table's.
    pub dtype: Option<DType>,
    /// The longest sequence the KV caches may grow to (`None`: `max_position_embeddings`;
    /// larger values are capped there). Caches start small and grow as sequences need.
    pub max_seq_len: Option<usize>,
    /// A mixture-of-experts model's experts whole on ranks (expert parallelism, vLLM's
    /// `--enable-expert-parallel`) instead of each split over them.
    pub expert_parallel: bool,
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
    /// KV caches that grow to at most `len` positions.
    pub fn with_max_seq_len(mut self, len: usize) -> ModelOptions {
        self.max_seq_len = Some(len);
        self
    }
    /// Experts whole on ranks (expert parallelism) or, with `false`, split over them.
    pub fn with_expert_parallel(mut self, yes: bool) -> ModelOptions {
        self.expert_parallel = yes;
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
    /// Which part of the model this is (the whole model unless it is a pipeline stage).
    part: StagePart,
    /// The embedding (first stage).
    embed: Option<VocabParallelEmbedding>,
    /// Layers `part.layers`.
    layers: Vec<Box<dyn Block>>,
    /// The final norm and the LM head (last stage).
    head: Option<(RmsNorm, ParallelLmHead)>,
    caches: Vec<KvCache>,
    /// KV heads this rank holds in every layer (replicated ones included).
    kv_heads: usize,
    /// Training: norms and residuals on sequence shards.
    sequence_parallel: bool,
    /// Training LoRA adapters on a frozen base ([`add_lora`](Self::add_lora)).
    lora: Option<tp_layers::lora::LoraSettings>,
    /// Dropout on the trained adapters' input: `(seed, p)` ([`set_lora_dropout`](Self::set_lora_dropout)).
    lora_dropout: Option<(u64, f32)>,
    /// Micro-batches made so far (each draws its own dropout masks).
    micro_batches: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for ParallelCausalLm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ParallelCausalLm({:?}, layers {:?}{}{}, {} on {:?}, at position {})",
            self.config.architecture,
            self.part.layers,
            if self.part.embedding { " + embedding" } else { "" },
            if self.part.head { " + head" } else { "" },
            self.dtype,
            self.group,
            self.position()
        )
    }
}

impl ParallelCausalLm {
    /// Loads the model in folder `dir` (`config.json`, `model.safetensors` or an index over
    /// several files) for `group`: each rank reads only its shards, onto the group's device.
    /// The config is read here; [`load_with_config`](Self::load_with_config) takes one read
    /// already (so that every rank of a process uses one copy).
    ///
    /// `dir` may instead be a GGUF file, or a folder holding one and no `config.json`
    /// ([`crate::gguf`]): the config comes from its metadata. With no dtype in `opts` its linear
    /// weights stay quantized blocks (computing in f32); with one, every tensor is dequantized
    /// to it while loading.
    pub fn load(dir: impl AsRef<Path>, group: &DeviceGroup, opts: &ModelOptions) -> Result<ParallelCausalLm> {
        let source = ModelSource::open(dir)?;
        let config = source.config()?;
        Self::load_part_from(&source, &config, group, opts, &StagePart::whole(config.num_hidden_layers))
    }

    /// Loads the model's tensors from `dir` as `config` describes them, for `group`.
    ///
    /// Every rank checks first that the others hold the same config (one all-gather of a
    /// digest): ranks that read different files (one replaced during start-up) fail together,
    /// at once, rather than running apart.
    ///
    /// Errors: config problems, a world size whose heads cannot be placed, any tensor missing or
    /// of another shape than the config implies, checkpoint and device errors, all before any
    /// other collective runs; ranks holding different configs.
    pub fn load_with_config(
        dir: impl AsRef<Path>,
        config: &ModelConfig,
        group: &DeviceGroup,
        opts: &ModelOptions,
    ) -> Result<ParallelCausalLm> {
        Self::load_part(dir, config, group, opts, &StagePart::whole(config.num_hidden_layers))
    }

    /// Loads only `part` of the model (a pipeline stage: its layers, plus the embedding on the
    /// first stage and the final norm and LM head on the last), for `group` (the stage's
    /// tensor-parallel group). Every rank of `group` must load the same part. With tied
    /// embeddings, a last stage without the embedding reads the table as its head's weight (a
    /// copy that training keeps equal to the first stage's, see `tp-train`).
    ///
    /// Errors: as [`load_with_config`](Self::load_with_config); a part whose layers lie outside
    /// the model.
    pub fn load_part(
        dir: impl AsRef<Path>,
        config: &ModelConfig,
        group: &DeviceGroup,
        opts: &ModelOptions,
        part: &StagePart,
    ) -> Result<ParallelCausalLm> {
        Self::load_part_from(&ModelSource::open(dir)?, config, group, opts, part)
    }

    /// [`load_part`](Self::load_part) from a model already opened: a GGUF file's one mapping
    /// and parsed header are shared, not opened again (every rank of a process can load from
    /// clones of one [`ModelSource`]).
    ///
    /// Errors: as [`load_part`](Self::load_part).
    pub fn load_part_from(
        source: &ModelSource,
        config: &ModelConfig,
        group: &DeviceGroup,
        opts: &ModelOptions,
        part: &StagePart,
    ) -> Result<ParallelCausalLm> {
        Self::load_part_inner(source, config, group, None, opts, part)
    }

    /// [`load_part`](Self::load_part) on an expert-parallel mesh (Megatron's
    /// `--expert-model-parallel-size`): a mixture's experts placed whole over `experts` (the
    /// mesh's expert-parallel group, replicas holding different tokens), each split over
    /// `group`; tokens reach them by all-to-all. Such a model trains (it does not generate);
    /// a dense model loads as [`load_part`](Self::load_part) does.
    ///
    /// Errors: as [`load_part`](Self::load_part); more replicas than experts; expert
    /// parallelism over `group` too.
    pub fn load_part_expert_parallel(
        dir: impl AsRef<Path>,
        config: &ModelConfig,
        group: &DeviceGroup,
        experts: &DeviceGroup,
        opts: &ModelOptions,
        part: &StagePart,
    ) -> Result<ParallelCausalLm> {
        Self::load_part_inner(&ModelSource::open(dir)?, config, group, Some(experts), opts, part)
    }

    fn load_part_inner(
        source: &ModelSource,
        config: &ModelConfig,
        group: &DeviceGroup,
        experts: Option<&DeviceGroup>,
        opts: &ModelOptions,
        part: &StagePart,
    ) -> Result<ParallelCausalLm> {
        let c = config;
        if part.layers.start > part.layers.end || part.layers.end > c.num_hidden_layers {
            return Err(ModelError::Request(format!(
                "a stage of layers {:?} does not fit a model of {} layers",
                part.layers, c.num_hidden_layers
            )));
        }
        let layout =
            QkvLayout::new(c.num_attention_heads, c.num_key_value_heads, c.head_dim, group.rank(), group.world_size())?;
        let (ckpt, quantized) = match source {
            ModelSource::Gguf(m) => {
                let tensors = crate::gguf::tensor_map(c, &m.arch);
                (Checkpoint::from_gguf(m.file.clone(), &m.path, tensors)?, opts.dtype.is_none())
            }
            // A folder's MXFP4 experts (gpt-oss on the Hub) stay blocks unless a dtype is asked for.
            ModelSource::Folder(dir) => (Checkpoint::open(dir)?, opts.dtype.is_none()),
        };
        check_tensors(&ckpt, c)?;
        let dtype = match opts.dtype {
            Some(d) => d,
            None => ckpt.param_info("model.embed_tokens.weight")?.0,
        };
        check_same_config(c, group)?;
        let mut root = Loader::new(&ckpt, group, LoadOptions::new().with_dtype(dtype).with_quantized(quantized));
        if let Some(ep) = experts {
            root = root.with_expert_group(ep);
        }
        let model = root.pp("model");
        let embed = if part.embedding {
            let mut embed = VocabParallelEmbedding::load(&model.pp("embed_tokens"))?.with_padding_idx(c.pad_token_id);
            if let Some(s) = c.embedding_scale {
                embed = embed.with_scale(s as f32);
            }
            Some(embed)
        } else {
            None
        };
        let layers = part
            .layers
            .clone()
            .map(|i| crate::blocks::decoder_layer(&model.pp("layers").pp(i), c, i, opts.expert_parallel))
            .collect::<Result<Vec<_>>>()?;
        let head = if part.head {
            let norm = RmsNorm::load(&model.pp("norm"), c.rms_norm_eps, c.norm_style)?;
            let mut lm_head = match (&embed, c.tie_word_embeddings) {
                // The table itself (shared): training updates one tensor.
                (Some(embed), true) if !quantized => ParallelLmHead::tied(embed),
                // The embedding's rows read again: quantized rows the head reads as they are, or
                // a last stage's own copy of the table.
                (_, true) => ParallelLmHead::load(&model.pp("embed_tokens"))?,
                (_, false) => ParallelLmHead::load(&root.pp("lm_head"))?,
            };
            if let Some(cap) = c.final_logit_softcapping {
                lm_head = lm_head.with_softcap(cap as f32)?;
            }
            Some((norm, lm_head))
        } else {
            None
        };
        let limit = opts.max_seq_len.unwrap_or(c.max_position_embeddings).min(c.max_position_embeddings);
        let caches = layers
            .iter()
            .map(|l| Ok(l.new_cache(INITIAL_CACHE_POSITIONS.min(limit))?.with_limit(limit)))
            .collect::<Result<Vec<_>>>()?;
        Ok(ParallelCausalLm {
            config: c.clone(),
            group: group.clone(),
            dtype,
            part: part.clone(),
            embed,
            layers,
            head,
            caches,
            kv_heads: layout.kv_len,
            sequence_parallel: false,
            lora: None,
            lora_dropout: None,
            micro_batches: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// Which part of the model this rank holds ([`StagePart::whole`] unless loaded with
    /// [`load_part`](Self::load_part)).
    pub fn part(&self) -> &StagePart {
        &self.part
    }

    /// The embedding, or an error naming `what` for a pipeline stage without it.
    fn embedding(&self, what: &str) -> Result<&VocabParallelEmbedding> {
        self.embed.as_ref().ok_or_else(|| self.missing(what, "the embedding"))
    }

    /// The final norm and the LM head, or an error naming `what` for a stage without them.
    fn norm_and_head(&self, what: &str) -> Result<&(RmsNorm, ParallelLmHead)> {
        self.head.as_ref().ok_or_else(|| self.missing(what, "the LM head"))
    }

    fn missing(&self, what: &str, part: &str) -> ModelError {
        ModelError::Request(format!(
            "{what} needs {part}, which this pipeline stage (layers {:?}) does not hold",
            self.part.layers
        ))
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
    /// Positions the KV caches hold now (they grow as sequences need, up to
    /// [`max_seq_len`](Self::max_seq_len)).
    pub fn capacity(&self) -> usize {
        self.caches.first().map_or(0, KvCache::capacity)
    }
    /// The longest sequence the KV caches may grow to.
    pub fn max_seq_len(&self) -> usize {
        self.caches.first().map_or(0, KvCache::limit)
    }

    /// Packs every host weight of the blocks and the LM head once into the host GEMM's panels
    /// (a no-op on a GPU): products of many rows (prefill, batched decode) then stop repacking
    /// the weights on every call, with bitwise the same results, for as much memory again as
    /// the weights. Few-row products (single-sequence decode) read the weights as stored.
    pub fn pack_host_weights(&mut self) -> Result<()> {
        for layer in &mut self.layers {
            layer.pack_host()?;
        }
        if let Some((_, lm_head)) = &mut self.head {
            lm_head.pack_host()?;
        }
        Ok(())
    }

    /// Forgets the current sequence.
    pub fn reset(&mut self) {
        self.caches.iter_mut().for_each(KvCache::reset);
    }

    /// Makes the KV caches hold at least `len` positions now (the filled ones kept).
    ///
    /// Errors: `len` past [`max_seq_len`](Self::max_seq_len), or memory that cannot be had,
    /// said in terms of the request (positions, bytes).
    pub fn reserve(&mut self, len: usize) -> Result<()> {
        if len > self.max_seq_len() {
            return Err(ModelError::Request(format!(
                "{len} positions exceed the longest sequence this model holds ({}; max_position_embeddings {})",
                self.max_seq_len(),
                self.config.max_position_embeddings
            )));
        }
        let per_position: usize = self.caches.iter().map(KvCache::bytes_per_position).sum();
        for cache in &mut self.caches {
            cache.reserve(len).map_err(|e| match e {
                tp_layers::LayerError::CacheAlloc { why, .. } => ModelError::Request(format!(
                    "cannot hold {len} positions: the KV caches need {} bytes on this rank ({per_position} per position): {why}",
                    len.saturating_mul(per_position)
                )),
                e => e.into(),
            })?;
        }
        Ok(())
    }

    /// The final hidden states `[T, H]` (after the last norm) of the next `ids`, appended to
    /// the current sequence.
    fn hidden(&mut self, ids: &[i64]) -> Result<Tensor> {
        if ids.is_empty() {
            return Err(ModelError::Request("no tokens to run".into()));
        }
        self.reserve(self.position() + ids.len())?;
        let ids = Tensor::from_vec(ids.to_vec(), &[ids.len()], &Device::Cpu)?;
        let mut x = self.embedding("a forward from token ids")?.forward(&ids)?;
        for (layer, cache) in self.layers.iter().zip(&mut self.caches) {
            x = layer.forward(&x, cache)?;
        }
        Ok(self.norm_and_head("the final norm")?.0.forward(&x)?)
    }

    /// Starts a new sequence with `ids` and returns the logits of every position, `[T, V]` in
    /// the model dtype, on the group's device (identical on every rank).
    pub fn prefill(&mut self, ids: &[i64]) -> Result<Tensor> {
        self.reset();
        let h = self.hidden(ids)?;
        Ok(self.norm_and_head("logits")?.1.logits(&h)?)
    }

    /// Appends `id` to the sequence and returns the logits of its position, `[V]`.
    pub fn decode_step(&mut self, id: i64) -> Result<Tensor> {
        let h = self.hidden(&[id])?;
        let v = self.config.vocab_size;
        Ok(self.norm_and_head("logits")?.1.logits(&h)?.reshape(&[v])?)
    }

    /// Greedy generation: a new sequence with `prompt`, then up to `max_new_tokens` tokens, each
    /// the argmax of the logits (the lowest id on ties), stopping after an end-of-sequence
    /// token unless `opts.ignore_eos`. Every rank returns the same tokens. Under LongRoPE, the
    /// step where the sequence first grows past `original_max_position_embeddings` recomputes
    /// it whole with the long factors, as transformers' Phi-3 generation does.
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
        self.reset();
        self.reserve(prompt.len())?;
        let start = Instant::now();
        let (first, prefill_logits) = self.next_token(prompt, opts.keep_logits)?;
        let prefill_time = start.elapsed();
        let mut tokens = vec![first];
        let mut decode_rows = Vec::new();
        let start = Instant::now();
        let switch = match &self.config.rope_scaling {
            tp_core::RopeScaling::LongRope { original_max_position_embeddings, .. } => {
                Some(*original_max_position_embeddings as usize)
            }
            _ => None,
        };
        while tokens.len() < max_new_tokens {
            let last = tokens[tokens.len() - 1];
            if !opts.ignore_eos && self.config.eos_token_ids.contains(&last) {
                break;
            }
            // LongRoPE: when the sequence first grows past the original length, transformers
            // drops the cache (computed with the short factors) and recomputes the whole
            // sequence with the long ones; so does this.
            let len = prompt.len() + tokens.len();
            let (next, logits) = if switch.is_some_and(|at| len == at + 1 && prompt.len() <= at) {
                let all: Vec<i64> = prompt.iter().chain(&tokens).copied().collect();
                self.reset();
                self.reserve(all.len())?;
                let (next, logits) = self.next_token(&all, opts.keep_logits)?;
                (next, logits.map(|l| l.narrow(0, all.len() - 1, 1)).transpose()?)
            } else {
                self.next_token(&[last], opts.keep_logits)?
            };
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
            let logits = self.norm_and_head("logits")?.1.logits(&h)?.to_device(&Device::Cpu)?;
            let last = logits.narrow(0, ids.len() - 1, 1)?;
            let id = last.argmax()?.to_i64_vec()?;
            return Ok((id.first().copied().unwrap_or(0), Some(logits)));
        }
        let last = h.narrow(0, ids.len() - 1, 1)?;
        let id = self.norm_and_head("logits")?.1.argmax(&last)?.to_i64_vec()?;
        Ok((id.first().copied().unwrap_or(0), None))
    }
}

/// Checks that every rank of `group` holds the same config: one all-gather of a digest.
fn check_same_config(c: &ModelConfig, group: &DeviceGroup) -> Result<()> {
    if group.world_size() == 1 {
        return Ok(());
    }
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    format!("{c:?}").hash(&mut h);
    let mine = h.finish() as i64;
    let t = group.to_local(&Tensor::from_vec(vec![mine], &[1], &Device::Cpu)?)?;
    let all = group.all_gather(&t, 0)?.to_i64_vec()?;
    if let Some(r) = all.iter().position(|&d| d != mine) {
        return Err(ModelError::Request(format!(
            "rank {} read another config than rank {r} (config.json or generation_config.json changed while the ranks started)",
            group.rank()
        )));
    }
    Ok(())
}
