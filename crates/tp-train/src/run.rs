//! [`run`]: the training loop of one rank, for library users and `tp train` alike.
//!
//! Every rank of the group calls it with its own model shard and its own copy of the data
//! (every rank reads the same rows: tensor parallelism splits the weights, not the batch).
//! Each step takes the next `B × K` rows in file order (wrapping around), runs
//! [`Trainer::accumulate`], optionally dumps step 1's full gradients, applies the update, and
//! reports a [`StepLog`]; checkpoints go out every `save_every` steps and at the end.

use crate::checkpoint::{self, SaveInfo};
use crate::data::Dataset;
use crate::pipeline::TraceEvent;
use crate::trainer::{StepGroups, StepLog, Trainer, single_groups};
use crate::{Result, TrainError};
use std::path::{Path, PathBuf};
use tp_core::DType;
use tp_layers::{Gather, gather_full};
use tp_models::ParallelCausalLm;

/// What the loop does besides stepping.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Steps of the whole run (a resumed run continues to the same total).
    pub steps: u64,
    /// Write step 1's gradients (full, f32, before clipping) as a safetensors file.
    pub dump_grads: Option<PathBuf>,
    /// Write a checkpoint here at the end.
    pub save: Option<PathBuf>,
    /// Also write `save/step-N` every this many steps.
    pub save_every: Option<u64>,
    /// The folder the model came from (config and tokenizer files for checkpoints).
    pub source: PathBuf,
}

/// Runs steps `trainer.steps_done() + 1 ..= opts.steps` of `model` on `data` (positioned where
/// the run stands), calling `on_step` after each. Collective: every rank calls it alike.
///
/// Errors: the trainer's (no target token in a step, a non-finite loss or norm: nothing is
/// saved after such a step), checkpoint and model errors.
pub fn run(
    model: &mut ParallelCausalLm,
    trainer: &mut Trainer,
    data: &mut Dataset,
    opts: &RunOptions,
    on_step: &mut dyn FnMut(&StepLog, &[TraceEvent]),
) -> Result<()> {
    let single = single_groups(model.group())?;
    let groups = StepGroups::new(&single, &single, None);
    run_stages(std::slice::from_mut(model), &groups, trainer, data, opts, on_step)
}

/// [`run`] on a rank of a pipeline and data-parallel mesh: `chunks` are this rank's model
/// chunks (see [`Trainer::accumulate_stages`]); each step takes the next `D × B × K` rows
/// (`D` the data-parallel replicas), every rank reading the same rows. Checkpoints and the
/// gradient dump hold the whole model: every stage sends its tensors to stage 0, which writes
/// them; data-parallel replicas hold the same weights, and replica 0 writes them.
///
/// Errors: as [`run`].
pub fn run_stages(
    chunks: &mut [ParallelCausalLm],
    groups: &StepGroups<'_>,
    trainer: &mut Trainer,
    data: &mut Dataset,
    opts: &RunOptions,
    on_step: &mut dyn FnMut(&StepLog, &[TraceEvent]),
) -> Result<()> {
    // Replica 0 writes; under expert parallelism, the replicas of its expert-parallel group
    // join in (each holds other experts).
    let writer = match groups.experts {
        Some(x) => x.edp.rank() == 0,
        None => groups.dp.rank() == 0,
    };
    let experts = groups.experts.map(|x| x.ep);
    let Some(dtype) = chunks.first().map(ParallelCausalLm::dtype) else {
        return Err(TrainError::Model("no model chunk on this rank".into()));
    };
    while trainer.steps_done() < opts.steps {
        let rows = data.next_rows(trainer.rows_per_step() * groups.dp.world_size());
        let acc = trainer.accumulate_stages(chunks, groups, &rows)?;
        let step = trainer.steps_done() + 1;
        if step == 1
            && let Some(path) = &opts.dump_grads
        {
            // The distributed optimizer's replicas each hold a range of every gradient.
            trainer.gather_grads(chunks, groups.dp)?;
            if writer {
                dump_grads(chunks, groups.pp, experts, path)?;
            }
        }
        let started = std::time::Instant::now();
        let lr = trainer.apply_over(chunks, acc.grad_norm, groups.dp)?;
        let mut log = StepLog::new(step, &acc, lr, started.elapsed().as_secs_f64());
        log.optimizer_bytes = trainer.state_bytes();
        on_step(&log, &acc.events);
        if let (Some(dir), Some(every)) = (&opts.save, opts.save_every)
            && every > 0
            && step % every == 0
            && step < opts.steps
        {
            let whole = trainer.unsharded(chunks, groups.dp)?;
            if writer {
                let t = whole.as_ref().unwrap_or(trainer);
                save(chunks, (groups.pp, experts), t, data, opts, dtype, &dir.join(format!("step-{step}")))?;
            }
        }
    }
    if let Some(dir) = &opts.save {
        // Under the distributed optimizer every replica sends its range; replica 0 writes.
        let whole = trainer.unsharded(chunks, groups.dp)?;
        if writer {
            save(chunks, (groups.pp, experts), whole.as_ref().unwrap_or(trainer), data, opts, dtype, dir)?;
        }
    }
    Ok(())
}

fn save(
    chunks: &mut [ParallelCausalLm],
    (pp, experts): (&tp_comm::DeviceGroup, Option<&tp_comm::DeviceGroup>),
    trainer: &Trainer,
    data: &Dataset,
    opts: &RunOptions,
    dtype: DType,
    dir: &Path,
) -> Result<()> {
    let info = SaveInfo { source: &opts.source, dtype, data_position: data.position() };
    checkpoint::save_stages(dir, chunks, pp, experts, trainer, &info)
}

/// The first rank writes every parameter's full gradient (f32, checkpoint names and layout; a
/// tied table once; a LoRA run's adapters under PEFT's names) to `path`: each stage gathers its own over its tensor-parallel group and sends them
/// to stage 0.
fn dump_grads(
    chunks: &mut [ParallelCausalLm],
    pp: &tp_comm::DeviceGroup,
    experts: Option<&tp_comm::DeviceGroup>,
    path: &Path,
) -> Result<()> {
    let Some(tp) = chunks.first().map(|c| c.group().clone()) else { return Ok(()) };
    let mut grads = std::collections::BTreeMap::new();
    for c in chunks.iter_mut() {
        let copy = c.holds_tied_copy();
        let params = c.params_mut()?;
        let full = gather_full(&params, Gather::Grads, &tp)?;
        grads.extend(full.into_iter().filter(|(n, _)| !(copy && n == "model.embed_tokens.weight")));
    }
    let arch = chunks[0].config().architecture;
    let lora = chunks[0].lora().is_some();
    let grads = checkpoint::merge_stages(checkpoint::sum_experts(grads, experts)?, pp, &tp)?;
    if tp.rank() == 0 && pp.rank() == 0 && experts.is_none_or(|g| g.rank() == 0) {
        // The checkpoint's names and layout (gpt-oss's experts fused).
        // A LoRA run's: the adapters' under the names of PEFT's adapter_model.safetensors.
        let grads =
            if lora { tp_models::adapter::peft_names(grads)? } else { tp_models::to_checkpoint_layout(arch, grads)? };
        let named: Vec<(&str, &tp_core::Tensor)> = grads.iter().map(|(n, t)| (n.as_str(), t)).collect();
        tp_layers::save(path, &named)
            .map_err(|e| TrainError::Checkpoint { path: path.display().to_string(), why: e.to_string() })?;
    }
    Ok(())
}
