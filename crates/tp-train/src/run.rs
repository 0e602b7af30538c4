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
    let groups = StepGroups { pp: &single, dp: &single, trace: None };
    run_stages(std::slice::from_mut(model), &groups, trainer, data, opts, on_step)
}

/// [`run`] on a rank of a pipeline and data-parallel mesh: `chunks` are this rank's model
/// chunks (see [`Trainer::accumulate_stages`]); each step takes the next `D × B × K` rows
/// (`D` the data-parallel replicas), every rank reading the same rows. Checkpoints and the
/// gradient dump need the whole model on one tensor-parallel group: with a pipeline they are
/// refused before the first step; data-parallel replicas hold the same weights, and replica 0
/// writes them.
///
/// Errors: as [`run`]; `save` or `dump_grads` with more than one pipeline stage.
pub fn run_stages(
    chunks: &mut [ParallelCausalLm],
    groups: &StepGroups<'_>,
    trainer: &mut Trainer,
    data: &mut Dataset,
    opts: &RunOptions,
    on_step: &mut dyn FnMut(&StepLog, &[TraceEvent]),
) -> Result<()> {
    if groups.pp.world_size() > 1 && (opts.save.is_some() || opts.dump_grads.is_some()) {
        return Err(TrainError::Model(
            "checkpoints and gradient dumps of a pipeline-parallel run are not written yet; run without --save / \
             --dump-grads, or with --pipeline-parallel-size 1"
                .into(),
        ));
    }
    let writer = groups.dp.rank() == 0;
    let Some(dtype) = chunks.first().map(ParallelCausalLm::dtype) else {
        return Err(TrainError::Model("no model chunk on this rank".into()));
    };
    while trainer.steps_done() < opts.steps {
        let rows = data.next_rows(trainer.rows_per_step() * groups.dp.world_size());
        let acc = trainer.accumulate_stages(chunks, groups, &rows)?;
        let step = trainer.steps_done() + 1;
        if step == 1
            && writer
            && let Some(path) = &opts.dump_grads
        {
            dump_grads(&mut chunks[0], path)?;
        }
        let started = std::time::Instant::now();
        let lr = trainer.apply_stages(chunks, acc.grad_norm)?;
        let log = StepLog::new(step, &acc, lr, started.elapsed().as_secs_f64());
        on_step(&log, &acc.events);
        if let (Some(dir), Some(every)) = (&opts.save, opts.save_every)
            && every > 0
            && step % every == 0
            && step < opts.steps
            && writer
        {
            save(&mut chunks[0], trainer, data, opts, dtype, &dir.join(format!("step-{step}")))?;
        }
    }
    if let Some(dir) = &opts.save
        && writer
    {
        save(&mut chunks[0], trainer, data, opts, dtype, dir)?;
    }
    Ok(())
}

fn save(
    model: &mut ParallelCausalLm,
    trainer: &Trainer,
    data: &Dataset,
    opts: &RunOptions,
    dtype: DType,
    dir: &Path,
) -> Result<()> {
    let info = SaveInfo { source: &opts.source, dtype, data_position: data.position() };
    checkpoint::save(dir, model, trainer, &info)
}

/// Rank 0 writes every parameter's full gradient (f32, checkpoint names) to `path`.
fn dump_grads(model: &mut ParallelCausalLm, path: &Path) -> Result<()> {
    let group = model.group().clone();
    let params = model.params_mut()?;
    let grads = gather_full(&params, Gather::Grads, &group)?;
    if group.rank() == 0 {
        let named: Vec<(&str, &tp_core::Tensor)> = grads.iter().map(|(n, t)| (n.as_str(), t)).collect();
        tp_layers::save(path, &named)
            .map_err(|e| TrainError::Checkpoint { path: path.display().to_string(), why: e.to_string() })?;
    }
    Ok(())
}
