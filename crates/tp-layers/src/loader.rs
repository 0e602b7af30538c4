//! [`Loader`]: a checkpoint seen from one rank, scoped to a name prefix.
//!
//! It carries what every layer's `load` needs: the [`Checkpoint`], the [`DeviceGroup`] the layer
//! will run on (rank, world size, device), the [`LoadOptions`] and a prefix. `pp("mlp")` scopes
//! it one level down (candle's `VarBuilder::pp`), so a block builds its tensor names once:
//! `Loader::new(&ckpt, &group, opts).pp("model.layers.3").pp("mlp")` reads
//! `model.layers.3.mlp.gate_proj.weight` as `tensor("gate_proj.weight")`.
//!
//! Reads go through [`Loader::rows`] and [`Loader::columns`], which copy only the requested
//! entries out of the memory-mapped file, so a rank reads only its shard of each tensor.

use crate::checkpoint::Checkpoint;
use crate::error::{LayerError, Result};
use crate::options::LoadOptions;
use crate::weight::Weight;
use tp_comm::DeviceGroup;
use tp_core::{DType, Device, Tensor};

/// One rank's prefix-scoped view of a checkpoint.
#[derive(Debug, Clone)]
pub struct Loader<'a> {
    ckpt: &'a Checkpoint,
    group: &'a DeviceGroup,
    opts: LoadOptions,
    prefix: String,
    /// Why the prefix is not a checkpoint path (an empty segment), reported by every read.
    invalid: Option<String>,
    /// The expert-parallel group of a mesh that places a mixture's experts over replicas.
    experts: Option<&'a DeviceGroup>,
}

impl<'a> Loader<'a> {
    /// The whole checkpoint (empty prefix) for the rank of `group`.
    pub fn new(ckpt: &'a Checkpoint, group: &'a DeviceGroup, opts: LoadOptions) -> Loader<'a> {
        Loader { ckpt, group, opts, prefix: String::new(), invalid: None, experts: None }
    }

    /// The same view one level down: tensor `t` of the result is `{prefix}.{name}.{t}`.
    ///
    /// `name` may hold several levels at once: `pp("model.layers.3")` is
    /// `pp("model").pp("layers").pp(3)`. Each level must be a non-empty segment: a name with an
    /// empty one (`""`, `"a..b"`, `".a"`, `"a."`) gives a loader whose every read fails with
    /// [`LayerError::Config`] naming the path (so a typo is an error at the first read, not a
    /// missing tensor under a mangled name).
    pub fn pp(&self, name: impl std::fmt::Display) -> Loader<'a> {
        let name = name.to_string();
        let prefix = if self.prefix.is_empty() { name.clone() } else { format!("{}.{name}", self.prefix) };
        let invalid = self.invalid.clone().or_else(|| {
            name.split('.')
                .any(str::is_empty)
                .then(|| format!("pp({name:?}) under {:?} has an empty path segment", self.prefix))
        });
        Loader { prefix, invalid, ..self.clone() }
    }

    /// The full name of tensor `t`, checked: an error if the prefix or `t` has an empty
    /// segment.
    fn checked(&self, t: &str) -> Result<String> {
        if let Some(why) = &self.invalid {
            return Err(LayerError::Config(format!("checkpoint path: {why}")));
        }
        if t.split('.').any(str::is_empty) {
            return Err(LayerError::Config(format!(
                "checkpoint path: tensor {t:?} under {:?} has an empty segment",
                self.prefix
            )));
        }
        Ok(self.name(t))
    }

    /// The prefix (empty at the top).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
    /// The full checkpoint name of tensor `t` under this prefix.
    pub fn name(&self, t: &str) -> String {
        if self.prefix.is_empty() { t.to_string() } else { format!("{}.{t}", self.prefix) }
    }
    /// The group the loaded layers run on.
    pub fn group(&self) -> &'a DeviceGroup {
        self.group
    }
    /// The checkpoint.
    pub fn checkpoint(&self) -> &'a Checkpoint {
        self.ckpt
    }
    /// The same view placing a mixture's experts whole over `group` (a mesh's expert-parallel
    /// group, [`ParallelMoe`](crate::ParallelMoe)), each split over this loader's group.
    pub fn with_expert_group(&self, group: &'a DeviceGroup) -> Loader<'a> {
        Loader { experts: Some(group), ..self.clone() }
    }
    /// The expert-parallel group, if any ([`with_expert_group`](Self::with_expert_group)).
    pub fn expert_group(&self) -> Option<&'a DeviceGroup> {
        self.experts
    }
    /// The load options.
    pub fn options(&self) -> &LoadOptions {
        &self.opts
    }
    /// The same view with other options.
    pub fn with_options(&self, opts: LoadOptions) -> Loader<'a> {
        Loader { opts, ..self.clone() }
    }
    /// This rank.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }
    /// The tensor-parallel degree.
    pub fn world_size(&self) -> usize {
        self.group.world_size()
    }
    /// Where the loaded parameters are placed.
    pub fn device(&self) -> Device {
        self.group.device()
    }

    /// Whether tensor `t` exists.
    pub fn contains(&self, t: &str) -> bool {
        self.checked(t).is_ok_and(|n| self.ckpt.contains(&n))
    }

    /// The shape of parameter `t` (a float tensor; otherwise [`LayerError::WrongDtype`]).
    pub fn dims(&self, t: &str) -> Result<Vec<usize>> {
        Ok(self.ckpt.param_info(&self.checked(t)?)?.1)
    }

    /// The shape of the 2-D parameter `t`, `(rows, columns)`.
    pub fn dims2(&self, t: &str) -> Result<(usize, usize)> {
        match self.dims(t)?[..] {
            [r, c] => Ok((r, c)),
            ref dims => Err(LayerError::Config(format!(
                "checkpoint tensor {:?} has shape {dims:?}; a 2-D [out, in] weight was expected",
                self.name(t)
            ))),
        }
    }

    /// Checks that parameter `t` exists with shape `dims`.
    pub fn expect(&self, t: &str, dims: &[usize]) -> Result<()> {
        let name = self.checked(t)?;
        self.ckpt.param_info(&name)?;
        self.ckpt.expect(&name, dims, None)
    }

    /// The whole parameter `t`, converted and placed as the options and group say.
    pub fn full(&self, t: &str) -> Result<Tensor> {
        let name = self.checked(t)?;
        self.ckpt.param_info(&name)?;
        self.ckpt.load(&name, self.opts.dtype, &self.device())
    }

    /// Rows `start..start + len` (dim 0) of parameter `t`, reading only those bytes.
    pub fn rows(&self, t: &str, start: usize, len: usize) -> Result<Tensor> {
        self.range(t, 0, start, len)
    }

    /// Columns `start..start + len` (dim 1) of the 2-D parameter `t`, reading only those bytes.
    pub fn columns(&self, t: &str, start: usize, len: usize) -> Result<Tensor> {
        self.range(t, 1, start, len)
    }

    /// Entry `i` of dim 0 of the 3-D parameter `t` (`[E, a, b]`: one expert of a fused expert
    /// tensor) as `[a, b]`, reading only its bytes.
    pub fn expert(&self, t: &str, i: usize) -> Result<Tensor> {
        let one = self.range(t, 0, i, 1)?;
        match one.dims() {
            &[1, a, b] => Ok(one.reshape(&[a, b])?),
            dims => Err(LayerError::Config(format!(
                "checkpoint tensor {:?} has shape {dims:?} per entry; a 3-D [E, out, in] tensor was expected",
                self.name(t)
            ))),
        }
    }

    /// The shape of the `U8` tensor `t` (packed codes or scales).
    pub fn u8_dims(&self, t: &str) -> Result<Vec<usize>> {
        self.ckpt.u8_dims(&self.checked(t)?)
    }

    /// Entry `i` of dim 0 of the `U8` tensor `t` (one expert's packed codes or scales).
    pub fn u8_entry(&self, t: &str, i: usize) -> Result<Vec<u8>> {
        self.ckpt.u8_entry(&self.checked(t)?, i)
    }

    /// Rows `start..start + len` of the 2-D linear weight `t`: the GGUF file's quantized
    /// blocks when the options keep them, else a tensor as [`rows`](Self::rows) reads it.
    pub fn linear_rows(&self, t: &str, start: usize, len: usize) -> Result<Weight> {
        self.linear_range(t, 0, start, len)
    }

    /// Columns `start..start + len` of the 2-D linear weight `t`, as
    /// [`linear_rows`](Self::linear_rows) (quantized blocks covering the columns, padded).
    pub fn linear_columns(&self, t: &str, start: usize, len: usize) -> Result<Weight> {
        self.linear_range(t, 1, start, len)
    }

    /// Elements per block of the 2-D weight `t` when the options keep it as quantized blocks
    /// (32, or 256 for the K-quants); 1 when it is read as a tensor.
    pub fn quant_block(&self, t: &str) -> Result<usize> {
        if !self.opts.quantized {
            return Ok(1);
        }
        Ok(self.ckpt.quant_type(&self.checked(t)?)?.map_or(1, |q| q.block_elems()))
    }

    fn linear_range(&self, t: &str, dim: usize, start: usize, len: usize) -> Result<Weight> {
        if self.opts.quantized
            && let Some(q) = self.ckpt.quant_range(&self.checked(t)?, dim, start, len)?
        {
            return Ok(Weight::Quant(q));
        }
        Ok(self.range(t, dim, start, len)?.into())
    }

    fn range(&self, t: &str, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        let name = self.checked(t)?;
        self.ckpt.param_info(&name)?;
        Ok(self.ckpt.load_range(&name, dim, start, len, self.opts.dtype, &self.device())?.0)
    }

    /// The dtype parameters are converted to, if the options name one.
    pub fn dtype(&self) -> Option<DType> {
        self.opts.dtype
    }
}
