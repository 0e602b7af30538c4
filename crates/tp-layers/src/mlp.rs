//! [`ParallelMlp`]: the gated MLP of Llama-style decoders, tensor-parallel.
//!
//! `MLP(x) = down(act(gate(x)) * up(x))` with `gate, up: [I, H]` and `down: [H, I]`: SwiGLU for
//! `act = silu` (Llama, Qwen, Mistral, Phi-3, OLMo 2), GeGLU with tanh-approximated GELU for
//! Gemma. Rank `r` holds its balanced shard of the intermediate features `I` in all three: rows
//! of gate and up (one merged column-parallel GEMM giving `[G_r | U_r]`; the checkpoint may hold
//! them separately or fused as Phi-3's `gate_up_proj`) and columns of down (row-parallel).
//! `act(G_r) * U_r` is exactly rank `r`'s block of the activation, so the only communication
//! is the one all-reduce inside `down`.

use crate::error::{LayerError, Result};
use crate::linear::Linear;
use crate::loader::Loader;
use crate::merged::MergedColumnParallel;
use crate::parts::Projections;
use crate::row::RowParallel;
use tp_comm::{DeviceGroup, ReduceOp};
use tp_core::{Activation, Device, Tensor};

/// Bytes of `[G_r | U_r]` (`f32`) per pass of a host forward over many rows: under glibc's
/// largest threshold for serving an allocation from a fresh mapping (32 MiB), so that the
/// passes' buffers come back from the heap step after step instead of being mapped and
/// page-faulted in anew (measured on Zen 4, TinyLlama shape, Q4_K_M, a 2048-token prefill step:
/// page faults took about 10% of it with one pass).
const HOST_PASS_BYTES: usize = 24 << 20;

/// The checkpoint names of an MLP's projections, relative to its prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlpNames {
    /// Gate and up: Hugging Face's `gate_proj` and `up_proj`, or a fused `gate_up_proj`.
    pub gate_up: Projections<2>,
    /// The down projection, `down_proj`.
    pub down: &'static str,
}

impl Default for MlpNames {
    fn default() -> Self {
        MlpNames { gate_up: Projections::default(), down: "down_proj" }
    }
}

/// Rank `r`'s part of a gated MLP.
#[derive(Debug, Clone)]
pub struct ParallelMlp {
    gate_up: MergedColumnParallel,
    down: RowParallel,
    act: Activation,
}

impl ParallelMlp {
    /// Packs both projections' host weights once ([`Linear::pack_host`](crate::Linear::pack_host)).
    pub fn pack_host(&mut self) -> Result<()> {
        self.gate_up.pack_host()?;
        self.down.pack_host()
    }

    /// `group`'s rank's part of full layers `gate`, `up` (`[I, H]`) and `down` (`[H, I]`).
    pub fn from_full(
        gate: &Linear,
        up: &Linear,
        down: &Linear,
        act: Activation,
        group: &DeviceGroup,
    ) -> Result<ParallelMlp> {
        let gate_up = MergedColumnParallel::from_full(&[gate, up], group)?;
        let down = RowParallel::from_full(down.weight()?, down.bias(), group)?;
        Self::new(gate_up, down, act)
    }

    /// Loads the projections named by `names` under the loader's prefix (biases optional),
    /// reading only this rank's rows/columns, checking that the shapes agree (`gate, up:
    /// [I, H]`, `down: [H, I]`).
    ///
    /// The intermediate features are split in balanced ranges, or, when the down projection is
    /// kept as quantized blocks, in whole blocks of it (uneven where they do not divide; see
    /// [`MergedColumnParallel::load_aligned`]), so that no rank's columns of it cut a block.
    pub fn load(ld: &Loader<'_>, names: MlpNames, act: Activation) -> Result<ParallelMlp> {
        Self::load_inner(ld, names, act)
    }

    /// [`load`](Self::load) with the activation named as a Hugging Face config names it
    /// (`hidden_act`: `silu`, `swish`, `gelu_pytorch_tanh`); any other name is
    /// [`LayerError::Config`].
    pub fn load_hf(ld: &Loader<'_>, names: MlpNames, hidden_act: &str) -> Result<ParallelMlp> {
        let act = Activation::from_hidden_act(hidden_act).ok_or_else(|| {
            LayerError::Config(format!(
                "hidden_act {hidden_act:?}: tp's gated MLPs take silu, swish or gelu_pytorch_tanh"
            ))
        })?;
        Self::load_inner(ld, names, act)
    }

    /// The whole MLP on this rank (every intermediate feature), as expert parallelism places
    /// an expert: no rank shares it, so its partial product is its output.
    pub fn load_whole(ld: &Loader<'_>, names: MlpNames, act: Activation) -> Result<ParallelMlp> {
        let gate_up = MergedColumnParallel::load_whole(ld, names.gate_up)?;
        let (inter, hidden) = (gate_up.shards()[0].global_len(), gate_up.local().in_features());
        let down_name = format!("{}.weight", names.down);
        ld.expect(&down_name, &[hidden, inter])?;
        let down = RowParallel::load_columns(&ld.pp(names.down), 0..inter)?;
        Self::new(gate_up, down, act)
    }

    /// [`from_full`](Self::from_full), every feature on this rank (see
    /// [`load_whole`](Self::load_whole)).
    pub fn from_whole(
        gate: &Linear,
        up: &Linear,
        down: &Linear,
        act: Activation,
        group: &DeviceGroup,
    ) -> Result<ParallelMlp> {
        let gate_up = MergedColumnParallel::from_full_whole(&[gate, up], group)?;
        let down = RowParallel::from_full_columns(down.weight()?, down.bias(), 0..down.in_features(), group)?;
        Self::new(gate_up, down, act)
    }

    fn load_inner(ld: &Loader<'_>, names: MlpNames, act: Activation) -> Result<ParallelMlp> {
        let down_name = format!("{}.weight", names.down);
        let granule = ld.quant_block(&down_name)?;
        let gate_up = MergedColumnParallel::load_aligned(ld, names.gate_up, granule)?;
        let (inter, hidden) = (gate_up.shards()[0].global_len(), gate_up.local().in_features());
        ld.expect(&down_name, &[hidden, inter])?;
        let s = gate_up.shards()[0];
        let down = RowParallel::load_columns(&ld.pp(names.down), s.start()..s.end())?;
        Self::new(gate_up, down, act)
    }

    /// The MLP of this rank's parts, built elsewhere (an expert read from its own layout).
    ///
    /// Errors: gate/up and down splitting different intermediate features.
    pub(crate) fn from_parts(gate_up: MergedColumnParallel, down: RowParallel, act: Activation) -> Result<ParallelMlp> {
        Self::new(gate_up, down, act)
    }

    fn new(gate_up: MergedColumnParallel, down: RowParallel, act: Activation) -> Result<ParallelMlp> {
        let s = gate_up.shards();
        if s.len() != 2
            || s[0] != s[1]
            || s[0].global_len() != down.shard().global_len()
            || s[0].start() != down.shard().start()
        {
            return Err(LayerError::Config("gate, up and down must split the same intermediate features".into()));
        }
        Ok(ParallelMlp { gate_up, down, act })
    }

    /// `act(G_r) * U_r`: this rank's block of the intermediate activation. No communication.
    /// On quantized host weights with many rows the activation is fused into the product
    /// (bitwise the same; [`MergedColumnParallel::forward_glu`]).
    pub fn activation(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(y) = self.gate_up.forward_glu(x, self.act)? {
            return Ok(y);
        }
        Ok(self.gate_up.forward(x)?.glu(self.act)?)
    }

    /// `down(act(gate(x)) * up(x))`, with one all-reduce. `x: [.., H]` is the full input on
    /// every rank; every rank returns the full output. On the host, many rows (a prefill step)
    /// go through it in passes of at most 24 MiB of `[G_r | U_r]`
    /// ([`forward_in_passes`](Self::forward_in_passes)).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.device() == Device::Cpu {
            self.forward_in_passes(x, HOST_PASS_BYTES)
        } else {
            self.down.forward(&self.activation(x)?)
        }
    }

    /// [`forward`](Self::forward) with the rows of a 2-D `x: [T, H]` taken in passes of equal
    /// size (a multiple of 16 rows) whose `[G_r | U_r]` (as `f32`) holds at most about
    /// `pass_bytes`: gate/up, the activation and this rank's partial product of down per pass
    /// (the rows are independent), the partials put back in order, then the one all-reduce.
    pub fn forward_in_passes(&self, x: &Tensor, pass_bytes: usize) -> Result<Tensor> {
        let rows = x.dims().first().copied().unwrap_or(0);
        let per_row = 2 * self.down.shard().len() * std::mem::size_of::<f32>();
        let passes = rows.saturating_mul(per_row).div_ceil(pass_bytes.max(1));
        if x.ndim() != 2 || x.numel() == 0 || passes <= 1 {
            return self.down.forward(&self.activation(x)?);
        }
        let pass = rows.div_ceil(passes).next_multiple_of(16);
        let partials = (0..rows)
            .step_by(pass)
            .map(|r0| {
                let n = pass.min(rows - r0);
                // LoRA adapters chosen per token: those of this pass's rows.
                crate::lora::with_token_rows(r0, n, || {
                    self.down.forward_partial(&self.activation(&x.narrow(0, r0, n)?)?)
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let partial = Tensor::cat(&partials, 0)?;
        self.down.add_bias(self.down.group().all_reduce(&partial, ReduceOp::Sum)?)
    }

    /// The merged gate/up layer.
    pub fn gate_up(&self) -> &MergedColumnParallel {
        &self.gate_up
    }
    /// The down projection.
    pub fn down(&self) -> &RowParallel {
        &self.down
    }
    /// The gate's activation.
    pub fn act(&self) -> Activation {
        self.act
    }
}

/// What [`ParallelMlp::backward`] needs of a training forward.
#[derive(Debug, Clone)]
pub struct MlpSaved {
    x: Tensor,
    gate_up: Tensor,
    act: Tensor,
    batch: crate::SeqBatch,
}

/// Training.
///
/// With `[G_r | U_r] = x [Wg_r; Wu_r]^T`, `A_r = act(G_r) ⊙ U_r`, `y = Σ_r A_r Wd_r^T`:
/// `dA_r = dy Wd_r` (local), `dG_r = dA_r ⊙ U_r ⊙ act'(G_r)`, `dU_r = dA_r ⊙ act(G_r)`, and
/// `dx = Σ_r [dG_r | dU_r] [Wg_r; Wu_r]` with one all-reduce; the weight gradients are local.
impl ParallelMlp {
    /// The forward of this rank's rows `x` of `batch` (all of them, or its sequence shard,
    /// all-gathered first), keeping what the backward needs; the output in the same rows.
    pub fn forward_train(&self, x: &Tensor, batch: &crate::SeqBatch) -> Result<(Tensor, MlpSaved)> {
        let group = self.down.group();
        let x_full = batch.gather(x, group)?;
        let gate_up = self.gate_up.forward(&x_full)?;
        let act = gate_up.glu(self.act)?;
        let y = self.down.add_bias(batch.reduce(&self.down.forward_partial(&act)?, group)?)?;
        Ok((y, MlpSaved { x: x.clone(), gate_up, act, batch: batch.clone() }))
    }

    /// `dx` (f32, the forward's input rows) from `dy` (the output's rows), accumulating every
    /// weight's gradient.
    pub fn backward(&mut self, saved: MlpSaved, dy: &Tensor) -> Result<Tensor> {
        let group = self.down.group().clone();
        let dy = saved.batch.gather(dy, &group)?;
        let da = self.down.backward(&saved.act, &dy)?;
        let dgu = saved.gate_up.glu_backward(self.act, &da)?;
        let x_full = saved.batch.gather(&saved.x, &group)?; // gathered again, not kept
        self.gate_up.backward_batch(&x_full, &dgu, &saved.batch)
    }

    /// The forward of rows `x` (this rank's full rows), keeping `(G_r|U_r, act)` and returning
    /// this rank's partial output `A_r Wd_r^T` (no communication): an expert's, whose partial
    /// sums the mixture joins.
    pub(crate) fn forward_partial_saved(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let gate_up = self.gate_up.forward(x)?;
        let act = gate_up.glu(self.act)?;
        let out = self.down.forward_partial(&act)?;
        Ok((gate_up, act, out))
    }

    /// The backward of [`forward_partial_saved`](Self::forward_partial_saved): this rank's
    /// partial `dx` (f32, no communication) from the partial output's gradient `dy`,
    /// accumulating every weight's gradient.
    pub(crate) fn backward_partial(
        &mut self,
        x: &Tensor,
        gate_up: &Tensor,
        act: &Tensor,
        dy: &Tensor,
    ) -> Result<Tensor> {
        let da = self.down.backward(act, dy)?;
        let dgu = gate_up.glu_backward(self.act, &da)?;
        self.gate_up.local_mut().backward(x, &dgu)
    }

    /// The projections as parameters under `prefix` (named by `names`).
    pub fn params<'a>(&'a mut self, prefix: &str, names: MlpNames, f: &mut dyn FnMut(crate::Param<'a>)) -> Result<()> {
        self.gate_up.params(prefix, names.gate_up, f)?;
        self.down.params(&crate::parts::join(prefix, names.down), f)
    }
}
