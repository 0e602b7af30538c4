//! Checkpoints of a training run: a Hugging Face folder (`config.json`, `model.safetensors` in
//! the training dtype, the tokenizer files) that transformers' `from_pretrained` and `tp serve`
//! load, plus what resuming needs: `optimizer.safetensors` (AdamW's moments and, under a narrow
//! dtype, the fp32 master weights, every tensor full and named after its parameter, so a run
//! may resume at another TP degree) and `trainer_state.json` (the step and the data position).
//!
//! A run training LoRA adapters on a frozen base writes a PEFT adapter folder instead of the
//! model (`adapter_config.json`, `adapter_model.safetensors` in f32, what
//! `PeftModel.from_pretrained` loads), with the same optimizer and state files beside it.
//!
//! Saving is collective (every rank gathers its shards; rank 0 writes). A checkpoint is written
//! into a temporary folder beside its destination and moved into place with `trainer_state.json`
//! last: a folder holding that file is complete, and a failed save leaves no partial checkpoint.

use crate::trainer::{ParamState, Trainer};
use crate::{Result, TrainError};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tp_comm::{DeviceGroup, ReduceOp};
use tp_core::{DType, Device, Tensor};
use tp_layers::{gather_blocks, local_from_full};
use tp_models::ParallelCausalLm;

/// The file that marks a complete tp checkpoint.
pub const STATE_FILE: &str = "trainer_state.json";
/// The optimizer's state.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// `trainer_state.json`'s `format`.
const FORMAT: &str = "tp-train-checkpoint";
/// The model folder's files copied into a checkpoint besides the weights and config.
const TEXT_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
];
/// Largest file copied from the model folder, or optimizer file read back.
const MAX_COPY_BYTES: u64 = 1 << 30;
const MAX_OPTIMIZER_BYTES: u64 = 1 << 40;

fn err(path: &Path, why: impl std::fmt::Display) -> TrainError {
    TrainError::Checkpoint { path: path.display().to_string(), why: why.to_string() }
}

/// Whether `dir` may receive checkpoints: absent, an empty folder, or one holding a tp
/// checkpoint (its [`STATE_FILE`], or only `step-N` checkpoint folders). Anything else is an
/// error, checked before training starts so that nothing is overwritten.
pub fn check_save_dir(dir: &Path) -> Result<()> {
    let meta = match std::fs::metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(err(dir, e)),
    };
    if !meta.is_dir() {
        return Err(err(dir, "exists and is not a folder"));
    }
    if dir.join(STATE_FILE).is_file() {
        return Ok(());
    }
    for entry in std::fs::read_dir(dir).map_err(|e| err(dir, e))? {
        let entry = entry.map_err(|e| err(dir, e))?;
        let name = entry.file_name().to_string_lossy().to_string();
        let ours = name.starts_with("step-") && entry.path().join(STATE_FILE).is_file();
        if !ours {
            return Err(err(
                dir,
                format!("is not empty and not a tp checkpoint (it holds {name:?}); pick another --save folder"),
            ));
        }
    }
    Ok(())
}

/// What a checkpoint records besides the model and optimizer.
#[derive(Debug, Clone)]
pub struct SaveInfo<'a> {
    /// The folder the model came from (its config and tokenizer files are copied).
    pub source: &'a Path,
    /// The training dtype (the weights are written in it).
    pub dtype: DType,
    /// Rows of the data consumed so far.
    pub data_position: u64,
}

/// Writes a checkpoint of `model` and `trainer` into `dir` (collective: every rank calls it).
pub fn save(dir: &Path, model: &mut ParallelCausalLm, trainer: &Trainer, info: &SaveInfo<'_>) -> Result<()> {
    let single = crate::trainer::single_groups(model.group())?;
    save_stages(dir, std::slice::from_mut(model), &single, None, trainer, info)
}

/// [`save`] of a pipeline: every rank of every stage calls it with its chunks and its pipeline
/// group (one data-parallel replica's ranks; the replicas hold the same weights). Each stage
/// gathers its tensors over its tensor-parallel group; the stages send theirs to stage 0, whose
/// first tensor-parallel rank writes one checkpoint of the whole model, as [`save`] does.
/// Under expert parallelism (`experts`: the expert-parallel group, whose every replica calls
/// it), each replica's experts are summed over that group first (the others hold zeros for
/// them), and its first replica writes.
pub fn save_stages(
    dir: &Path,
    chunks: &mut [ParallelCausalLm],
    pp: &DeviceGroup,
    experts: Option<&DeviceGroup>,
    trainer: &Trainer,
    info: &SaveInfo<'_>,
) -> Result<()> {
    let Some(tp) = chunks.first().map(|c| c.group().clone()) else {
        return Err(err(dir, "no model chunk on this rank"));
    };
    let arch = chunks[0].config().architecture;
    let lora = chunks[0].lora().copied().map(|s| (s, f64::from(chunks[0].lora_dropout())));
    let (weights, optimizer) = gather(chunks, trainer, &tp)?;
    let (weights, optimizer) = (sum_experts(weights, experts)?, sum_experts(optimizer, experts)?);
    let (weights, optimizer) = (merge_stages(weights, pp, &tp)?, merge_stages(optimizer, pp, &tp)?);
    let writer = pp.rank() == 0 && tp.rank() == 0 && experts.is_none_or(|g| g.rank() == 0);
    let written = if writer {
        // The weights in the family's checkpoint layout (gpt-oss's experts fused, as transformers
        // loads them); the optimizer's tensors keep tp's per-parameter names.
        (|| {
            let step = trainer.steps_done();
            if let Some((settings, dropout)) = lora {
                return write(dir, |tmp| fill_adapter(tmp, (&settings, dropout), weights, &optimizer, step, info));
            }
            let mut weights = tp_models::to_checkpoint_layout(arch, weights)?;
            for t in weights.values_mut() {
                *t = t.to_dtype(info.dtype)?;
            }
            write(dir, |tmp| fill(tmp, &weights, &optimizer, step, info))
        })()
    } else {
        Ok(())
    };
    // Every rank learns whether the write worked.
    let mut failed = f32::from(u8::from(written.is_err()));
    for g in [Some(pp), Some(&tp), experts].into_iter().flatten() {
        if g.world_size() > 1 {
            let t = Tensor::from_vec(vec![failed], &[1], &Device::Cpu)?.to_device(&g.device())?;
            failed = g.all_reduce(&t, ReduceOp::Max)?.to_f64_vec()?[0] as f32;
        }
    }
    written?;
    if failed > 0.0 {
        return Err(err(dir, "rank 0 could not write the checkpoint"));
    }
    Ok(())
}

/// Under expert parallelism over `experts`, every routed expert's full tensor (named
/// `...experts.{e}...`, held by one replica, zeros on the others) summed over the group, so
/// that each replica has every expert; the others unchanged.
pub fn sum_experts(
    mut tensors: BTreeMap<String, Tensor>,
    experts: Option<&DeviceGroup>,
) -> Result<BTreeMap<String, Tensor>> {
    let Some(g) = experts.filter(|g| g.world_size() > 1) else { return Ok(tensors) };
    for (name, t) in tensors.iter_mut() {
        if crate::trainer::is_routed_expert_name(name) {
            *t = g.all_reduce(&t.to_device(&g.device())?, ReduceOp::Sum)?.to_device(&Device::Cpu)?;
        }
    }
    Ok(tensors)
}

/// Every stage's tensors on stage 0 (the others return theirs unchanged): each stage's first
/// tensor-parallel rank sends its names and shapes (as bytes), then its tensors, f32, to stage 0.
pub(crate) fn merge_stages(
    mine: BTreeMap<String, Tensor>,
    pp: &DeviceGroup,
    tp: &DeviceGroup,
) -> Result<BTreeMap<String, Tensor>> {
    if pp.world_size() == 1 || tp.rank() != 0 {
        return Ok(mine);
    }
    let bytes_tensor = |b: &[u8]| Tensor::from_vec(b.iter().map(|&x| i64::from(x)).collect(), &[b.len()], &Device::Cpu);
    if pp.rank() != 0 {
        let index: Vec<(&String, Vec<usize>)> = mine.iter().map(|(n, t)| (n, t.dims().to_vec())).collect();
        let text = serde_json::to_vec(&index).map_err(|e| TrainError::Model(e.to_string()))?;
        pp.send(&Tensor::from_vec(vec![text.len() as i64], &[1], &Device::Cpu)?.to_device(&pp.device())?, 0)?;
        pp.send(&bytes_tensor(&text)?.to_device(&pp.device())?, 0)?;
        for t in mine.values() {
            pp.send(&t.to_dtype(DType::F32)?.to_device(&pp.device())?, 0)?;
        }
        return Ok(mine);
    }
    let mut all = mine;
    for s in 1..pp.world_size() {
        let len = pp.recv(&[1], DType::I64, s)?.to_i64_vec()?[0];
        let len = usize::try_from(len).map_err(|_| TrainError::Model(format!("stage {s} sent a bad index length")))?;
        let text: Vec<u8> = pp.recv(&[len], DType::I64, s)?.to_i64_vec()?.into_iter().map(|b| b as u8).collect();
        let index: Vec<(String, Vec<usize>)> =
            serde_json::from_slice(&text).map_err(|e| TrainError::Model(format!("stage {s}'s index: {e}")))?;
        for (name, dims) in index {
            let t = pp.recv(&dims, DType::F32, s)?.to_device(&Device::Cpu)?;
            all.insert(name, t);
        }
    }
    Ok(all)
}

/// The full weights (f32) and the optimizer's full tensors of this rank's chunks, gathered over
/// `group`; a last stage's copy of a tied table is left out (the first stage's is the one).
fn gather(
    chunks: &mut [ParallelCausalLm],
    trainer: &Trainer,
    group: &DeviceGroup,
) -> Result<(BTreeMap<String, Tensor>, BTreeMap<String, Tensor>)> {
    let mut weights = BTreeMap::new();
    let mut optimizer = BTreeMap::new();
    let mut states = trainer.states();
    for c in chunks.iter_mut() {
        let copy = c.holds_tied_copy();
        let params = c.params_mut()?;
        let (mine, rest) = states.split_at(params.len().min(states.len()));
        states = rest;
        let keep = |name: &str| !(copy && name == "model.embed_tokens.weight");
        let values: Vec<_> =
            params.iter().map(|p| (p.placements.as_slice(), p.value.dims(), Some(p.value.clone()))).collect();
        weights.extend(gather_blocks(&values, group)?.into_iter().filter(|(n, _)| keep(n)));
        if mine.is_empty() {
            continue;
        }
        let local = |p: &tp_layers::Param<'_>, v: &[f32]| Tensor::from_slice(v, p.value.dims(), &Device::Cpu);
        for (kind, pick) in [
            ("exp_avg", (|s: &ParamState| Some(s.adam.m.as_slice())) as fn(&ParamState) -> Option<&[f32]>),
            ("exp_avg_sq", |s: &ParamState| Some(s.adam.v.as_slice())),
            ("master", |s: &ParamState| s.master.as_deref()),
        ] {
            let items = params
                .iter()
                .zip(mine)
                .map(|(p, s)| Ok((p.placements.as_slice(), p.value.dims(), pick(s).map(|v| local(p, v)).transpose()?)))
                .collect::<Result<Vec<_>>>()?;
            if items.iter().all(|i| i.2.is_none()) {
                continue;
            }
            for (name, t) in gather_blocks(&items, group)? {
                if keep(&name) {
                    optimizer.insert(format!("{kind}/{name}"), t);
                }
            }
        }
    }
    Ok((weights, optimizer))
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    }
}

/// Rank 0's part: the files (`fill`) into a temporary folder, then moved into `dir`.
fn write(dir: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| err(parent, e))?;
    let name = dir.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_else(|| "checkpoint".into());
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| err(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| err(&tmp, e))?;
    let result = fill(&tmp).and_then(|()| move_into(&tmp, dir));
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

fn fill(
    tmp: &Path,
    weights: &BTreeMap<String, Tensor>,
    optimizer: &BTreeMap<String, Tensor>,
    step: u64,
    info: &SaveInfo<'_>,
) -> Result<()> {
    save_map(&tmp.join("model.safetensors"), weights)?;
    save_optimizer(tmp, optimizer)?;
    let cfg_path = info.source.join("config.json");
    let text = tp_layers::read_text_file(&cfg_path, tp_models::MAX_CONFIG_BYTES)?;
    let mut cfg: serde_json::Value = serde_json::from_str(&text).map_err(|e| err(&cfg_path, e))?;
    if let Some(obj) = cfg.as_object_mut() {
        let dt = serde_json::Value::from(dtype_name(info.dtype));
        let mut set = false;
        for key in ["torch_dtype", "dtype"] {
            if obj.contains_key(key) {
                obj.insert(key.into(), dt.clone());
                set = true;
            }
        }
        if !set {
            obj.insert("torch_dtype".into(), dt);
        }
    }
    write_json(&tmp.join("config.json"), &cfg)?;
    copy_text_files(tmp, info)?;
    write_state(tmp, step, info)
}

/// A LoRA run's checkpoint: the adapters (full, f32, PEFT's names) and their config, the
/// optimizer's state, the tokenizer files and the state file.
fn fill_adapter(
    tmp: &Path,
    (settings, dropout): (&tp_layers::lora::LoraSettings, f64),
    adapters: BTreeMap<String, Tensor>,
    optimizer: &BTreeMap<String, Tensor>,
    step: u64,
    info: &SaveInfo<'_>,
) -> Result<()> {
    use tp_models::adapter;
    let modules: Vec<&str> = adapters.keys().filter_map(|n| n.strip_suffix(".lora_A.weight")).collect();
    let config = adapter::adapter_config(settings, &modules, dropout, &info.source.display().to_string());
    save_map(&tmp.join(adapter::ADAPTER_WEIGHTS), &adapter::peft_names(adapters)?)?;
    write_json(&tmp.join(adapter::ADAPTER_CONFIG), &config)?;
    save_optimizer(tmp, optimizer)?;
    copy_text_files(tmp, info)?;
    write_state(tmp, step, info)
}

/// `tensors` as a safetensors file at `path`.
fn save_map(path: &Path, tensors: &BTreeMap<String, Tensor>) -> Result<()> {
    let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    Ok(tp_layers::save(path, &named)?)
}

/// The optimizer's tensors as [`OPTIMIZER_FILE`] in `tmp` (none before the first step).
fn save_optimizer(tmp: &Path, optimizer: &BTreeMap<String, Tensor>) -> Result<()> {
    if optimizer.is_empty() { Ok(()) } else { save_map(&tmp.join(OPTIMIZER_FILE), optimizer) }
}

/// The model folder's tokenizer and generation files, copied.
fn copy_text_files(tmp: &Path, info: &SaveInfo<'_>) -> Result<()> {
    for f in TEXT_FILES {
        let src = info.source.join(f);
        match std::fs::metadata(&src) {
            Ok(m) if m.is_file() && m.len() <= MAX_COPY_BYTES => {
                std::fs::copy(&src, tmp.join(f)).map_err(|e| err(&src, e))?;
            }
            Ok(m) if m.is_file() => {
                return Err(err(&src, format!("{} bytes, over the {MAX_COPY_BYTES} copied", m.len())));
            }
            _ => {}
        }
    }
    Ok(())
}

/// The state file (written last: it marks the checkpoint complete).
fn write_state(tmp: &Path, step: u64, info: &SaveInfo<'_>) -> Result<()> {
    let state = serde_json::json!({
        "format": FORMAT,
        "version": 1,
        "step": step,
        "data_position": info.data_position,
        "dtype": dtype_name(info.dtype),
    });
    write_json(&tmp.join(STATE_FILE), &state)
}

fn write_json(path: &Path, v: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v).map_err(|e| err(path, e))?;
    std::fs::write(path, text + "\n").map_err(|e| err(path, e))
}

/// Moves the files of `tmp` into `dir` (created if absent), the state file last.
fn move_into(tmp: &Path, dir: &Path) -> Result<()> {
    if !dir.exists() {
        return std::fs::rename(tmp, dir).map_err(|e| err(dir, e));
    }
    let state = dir.join(STATE_FILE);
    if state.exists() {
        std::fs::remove_file(&state).map_err(|e| err(&state, e))?;
    }
    let mut files: Vec<PathBuf> =
        std::fs::read_dir(tmp).map_err(|e| err(tmp, e))?.filter_map(|e| e.ok().map(|e| e.path())).collect();
    files.sort_by_key(|p| p.file_name().is_some_and(|n| n == STATE_FILE));
    for f in files {
        let Some(name) = f.file_name() else { continue };
        std::fs::rename(&f, dir.join(name)).map_err(|e| err(&dir.join(name), e))?;
    }
    std::fs::remove_dir_all(tmp).map_err(|e| err(tmp, e))
}

/// What a checkpoint says of where its run stood.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resumed {
    /// Steps done.
    pub step: u64,
    /// Rows of the data consumed.
    pub data_position: u64,
}

/// Reads `ckpt`'s [`STATE_FILE`].
pub fn read_state(ckpt: &Path) -> Result<Resumed> {
    let path = ckpt.join(STATE_FILE);
    let text =
        tp_layers::read_text_file(&path, 1 << 20).map_err(|e| err(&path, format!("not a tp checkpoint: {e}")))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| err(&path, e))?;
    if v["format"] != FORMAT {
        return Err(err(&path, "not a tp checkpoint (no \"format\": \"tp-train-checkpoint\")"));
    }
    let field = |k: &str| v[k].as_u64().ok_or_else(|| err(&path, format!("{k} is missing or not a count")));
    Ok(Resumed { step: field("step")?, data_position: field("data_position")? })
}

/// Restores `trainer`'s optimizer state from `ckpt` into this rank's shards of `model` (which
/// was loaded from `ckpt`), at any TP degree.
pub fn resume(ckpt: &Path, model: &mut ParallelCausalLm, trainer: &mut Trainer) -> Result<Resumed> {
    resume_stages(ckpt, std::slice::from_mut(model), trainer)
}

/// [`resume`] into this rank's pipeline chunks (loaded from `ckpt` with
/// [`ParallelCausalLm::load_part`]), at any TP and pipeline layout: the optimizer's tensors are
/// full and named, so each rank reads its blocks of its own parameters.
pub fn resume_stages(ckpt: &Path, chunks: &mut [ParallelCausalLm], trainer: &mut Trainer) -> Result<Resumed> {
    let state = read_state(ckpt)?;
    let path = ckpt.join(OPTIMIZER_FILE);
    let full = if state.step == 0 { BTreeMap::new() } else { read_tensors(&path)? };
    let mut states = Vec::new();
    if state.step > 0 {
        for c in chunks.iter_mut() {
            for p in c.params_mut()? {
                let dims = p.value.dims().to_vec();
                let pick = |kind: &str| -> Result<Option<Vec<f32>>> {
                    let named: BTreeMap<String, Tensor> = p
                        .placements
                        .iter()
                        .filter_map(|pl| full.get(&format!("{kind}/{}", pl.name)).map(|t| (pl.name.clone(), t.clone())))
                        .collect();
                    if named.is_empty() {
                        return Ok(None);
                    }
                    Ok(Some(local_from_full(&p.placements, &dims, &named)?.to_vec::<f32>()?))
                };
                let (m, v) = (pick("exp_avg")?, pick("exp_avg_sq")?);
                let (Some(m), Some(v)) = (m, v) else {
                    let name = p.placements.first().map_or("?", |pl| pl.name.as_str());
                    return Err(err(&path, format!("no optimizer state for {name}")));
                };
                let master = match p.value.dtype() {
                    DType::F32 => None,
                    _ => Some(
                        pick("master")?
                            .ok_or_else(|| err(&path, "a bf16 run's checkpoint needs its fp32 master weights"))?,
                    ),
                };
                states.push(ParamState { master, adam: crate::optim::AdamState { m, v } });
            }
        }
    }
    trainer.restore(state.step, states);
    Ok(state)
}

/// Every tensor of a safetensors file, f32, by name (the file checked: regular, bounded).
fn read_tensors(path: &Path) -> Result<BTreeMap<String, Tensor>> {
    let meta = std::fs::metadata(path).map_err(|e| err(path, e))?;
    if !meta.is_file() || meta.len() > MAX_OPTIMIZER_BYTES {
        return Err(err(path, "not a regular file of a bounded size"));
    }
    let bytes = std::fs::read(path).map_err(|e| err(path, e))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| err(path, e))?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        if view.dtype() != safetensors::Dtype::F32 {
            return Err(err(path, format!("{name} is {:?}, expected F32", view.dtype())));
        }
        let t = Tensor::from_bytes(view.data(), view.shape(), DType::F32, &Device::Cpu)?;
        out.insert(name, t);
    }
    Ok(out)
}
