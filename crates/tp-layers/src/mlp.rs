//! [`ParallelMlp`]: the Llama-style SwiGLU block, tensor-parallel.
//!
//! `MLP(x) = down(silu(gate(x)) * up(x))` with `gate, up: [I, H]` and `down: [H, I]`. Rank `r`
//! holds its balanced shard of the intermediate features `I` in all three: rows of gate and up
//! (one merged column-parallel GEMM giving `[G_r | U_r]`) and columns of down (row-parallel).
//! `silu(G_r) * U_r` is exactly rank `r`'s block of the activation, so the only communication is
//! the one all-reduce inside `down`.

use crate::checkpoint::Checkpoint;
use crate::error::{LayerError, Result};
use crate::linear::Linear;
use crate::merged::MergedColumnParallel;
use crate::options::LoadOptions;
use crate::row::RowParallel;
use tp_comm::DeviceGroup;
use tp_core::Tensor;

/// Rank `r`'s part of a SwiGLU MLP.
#[derive(Debug, Clone)]
pub struct ParallelMlp {
    gate_up: MergedColumnParallel,
    down: RowParallel,
}

impl ParallelMlp {
    /// Rank `rank`'s part of full layers `gate`, `up` (`[I, H]`) and `down` (`[H, I]`).
    pub fn from_full(gate: &Linear, up: &Linear, down: &Linear, rank: usize, world_size: usize) -> Result<ParallelMlp> {
        let gate_up = MergedColumnParallel::from_full(&[gate, up], rank, world_size)?;
        let down = RowParallel::from_full(down.weight(), down.bias(), rank, world_size)?;
        Self::new(gate_up, down)
    }

    /// Loads `{prefix}.gate_proj`, `{prefix}.up_proj` and `{prefix}.down_proj` (Hugging Face
    /// names; biases optional), reading only this rank's rows/columns, checking that the shapes
    /// agree (`gate, up: [I, H]`, `down: [H, I]`); rank, world size and device come from `group`.
    pub fn load(ckpt: &Checkpoint, prefix: &str, group: &DeviceGroup, opts: &LoadOptions) -> Result<ParallelMlp> {
        let (gate, up, down) =
            (format!("{prefix}.gate_proj"), format!("{prefix}.up_proj"), format!("{prefix}.down_proj"));
        let (_, g) = ckpt.param_info(&format!("{gate}.weight"))?;
        let [inter, hidden] = g[..] else {
            return Err(LayerError::Config(format!(
                "checkpoint tensor \"{gate}.weight\" has shape {g:?}; a 2-D [intermediate, hidden] weight was expected"
            )));
        };
        ckpt.expect(&format!("{up}.weight"), &[inter, hidden], None)?;
        ckpt.expect(&format!("{down}.weight"), &[hidden, inter], None)?;
        let gate_up = MergedColumnParallel::load(ckpt, &[&gate, &up], group, opts)?;
        let down = RowParallel::load(ckpt, &down, group, opts)?;
        Self::new(gate_up, down)
    }

    fn new(gate_up: MergedColumnParallel, down: RowParallel) -> Result<ParallelMlp> {
        let s = gate_up.shards();
        if s.len() != 2
            || s[0] != s[1]
            || s[0].global_len() != down.shard().global_len()
            || s[0].start() != down.shard().start()
        {
            return Err(LayerError::Config("gate, up and down must split the same intermediate features".into()));
        }
        Ok(ParallelMlp { gate_up, down })
    }

    /// `silu(G_r) * U_r`: this rank's block of the intermediate activation. No communication.
    pub fn activation(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.gate_up.forward(x)?.swiglu()?)
    }

    /// `down(silu(gate(x)) * up(x))`, with one all-reduce. `x: [.., H]` is the full input on every
    /// rank; every rank returns the full output.
    pub fn forward(&self, x: &Tensor, group: &DeviceGroup) -> Result<Tensor> {
        self.down.forward(&self.activation(x)?, group)
    }

    /// The merged gate/up layer.
    pub fn gate_up(&self) -> &MergedColumnParallel {
        &self.gate_up
    }
    /// The down projection.
    pub fn down(&self) -> &RowParallel {
        &self.down
    }
}
