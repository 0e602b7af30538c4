//! Gradients and trainable parameters, as each rank holds them.
//!
//! A layer owns an fp32 accumulator ([`Grad`]) per parameter; its backward adds into it, so
//! micro-batches accumulate until the optimizer takes them. A training loop sees every
//! parameter through [`Param`]: this rank's tensor, its gradient, and where its blocks sit in
//! the checkpoint's full tensors ([`Placement`]). From the placements alone, without knowing
//! the layer, the loop can
//!
//! * complete gradients that are partial sums ([`sync_partial_grads`]): a KV head replicated
//!   on several ranks, or a q/k norm weight every rank applies to its own heads, gets a
//!   gradient from each of those ranks, and the true one is their sum;
//! * take the global gradient norm counting every element of the model once
//!   ([`owned_sum_squares`]: a sharded parameter once per shard, a replicated one once);
//! * gather full tensors (weights to save, gradients to dump: [`gather_full`]).

use crate::error::{LayerError, Result};
use std::collections::BTreeMap;
use tp_comm::{DeviceGroup, ReduceOp};
use tp_core::{DType, Device, Tensor};

/// An fp32 gradient accumulator: empty until the first backward adds to it.
///
/// Weight gradients can be *deferred* (zero-bubble pipeline schedules split a backward into its
/// input gradient, needed at once by the previous stage, and its weight gradient, computed
/// later to fill the pipeline's idle time): inside [`defer_weight_grads`], the linear layers'
/// `dW += dY^T X` and `db += Σ_t dY[t]` keep their operands here instead of computing, and
/// [`flush_one`](Grad::flush_one) computes the oldest kept contribution. Each contribution is
/// added on its own, in the order the backwards made them, so a deferred gradient has the same
/// bits as an immediate one.
#[derive(Debug, Clone, Default)]
pub struct Grad {
    acc: Option<Tensor>,
    deferred: std::collections::VecDeque<Deferred>,
    /// A LoRA adapter's accumulator, which [`frozen_base`](crate::lora::frozen_base) does not
    /// stop.
    adapter: bool,
}

/// A weight-gradient contribution kept for later.
#[derive(Debug, Clone)]
enum Deferred {
    /// `dW += dY^T X`.
    Weight { x: Tensor, dy: Tensor },
    /// `db += Σ_t dY[t]`.
    Bias { dy: Tensor },
}

thread_local! {
    static DEFER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with the linear layers' weight gradients deferred on this thread (see [`Grad`]):
/// the backward inside computes input gradients only; [`Grad::flush_one`] on each parameter
/// then adds the weight gradients, one backward's worth per call.
pub fn defer_weight_grads<R>(f: impl FnOnce() -> R) -> R {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            DEFER.with(|d| d.set(self.0));
        }
    }
    let _reset = Reset(DEFER.with(|d| d.replace(true)));
    f()
}

fn deferring() -> bool {
    DEFER.with(|d| d.get())
}

impl Grad {
    /// An adapter's accumulator: it keeps accumulating inside
    /// [`frozen_base`](crate::lora::frozen_base), where every other one is frozen.
    pub fn for_adapter() -> Grad {
        Grad { adapter: true, ..Grad::default() }
    }
    /// Whether this is an adapter's accumulator ([`for_adapter`](Self::for_adapter)).
    pub fn is_adapter(&self) -> bool {
        self.adapter
    }
    /// Whether contributions are dropped now: a base parameter's, inside
    /// [`frozen_base`](crate::lora::frozen_base).
    fn frozen(&self) -> bool {
        !self.adapter && crate::lora::base_frozen()
    }

    /// Adds `g` (converted to f32) to the accumulated gradient (nothing for a frozen base
    /// parameter).
    pub fn add(&mut self, g: &Tensor) -> Result<()> {
        if self.frozen() {
            return Ok(());
        }
        let g = g.to_dtype(DType::F32)?;
        match &mut self.acc {
            None => self.acc = Some(g),
            Some(acc) => {
                if acc.dims() != g.dims() {
                    return Err(LayerError::Config(format!(
                        "gradient {:?} cannot add to the accumulated {:?}",
                        g.dims(),
                        acc.dims()
                    )));
                }
                acc.add_assign(&g)?
            }
        }
        Ok(())
    }
    /// `dW += dY^T X` of a linear layer (`x: [T, in]`, `dy: [T, out]`), or kept for later
    /// inside [`defer_weight_grads`].
    pub(crate) fn add_weight_grad(&mut self, x: &Tensor, dy: &Tensor) -> Result<()> {
        if self.frozen() {
            return Ok(());
        }
        if deferring() {
            self.deferred.push_back(Deferred::Weight { x: x.clone(), dy: dy.clone() });
            return Ok(());
        }
        self.accumulate_weight_grad(x, dy)
    }

    /// `dW += dY^T X` now (never deferred): the product added into the accumulated gradient by
    /// the GEMM itself when there is one ([`Tensor::add_t_matmul`]: no `[out, in]` temporary,
    /// no fresh pages), else computed into a new one.
    pub(crate) fn accumulate_weight_grad(&mut self, x: &Tensor, dy: &Tensor) -> Result<()> {
        if self.frozen() {
            return Ok(());
        }
        match &mut self.acc {
            Some(acc) if acc.dtype() == DType::F32 && acc.device() == x.device() => {
                Ok(acc.add_t_matmul(&dy.to_dtype(x.dtype())?, x)?)
            }
            _ => self.add(&crate::linear::grad_weight(x, dy)?),
        }
    }

    /// Zeroes the accumulated gradient in place, keeping its buffer for the next step's
    /// accumulation (deferred contributions are dropped); nothing when there is none.
    pub fn zero(&mut self) -> Result<()> {
        self.deferred.clear();
        if let Some(acc) = &mut self.acc {
            if acc.device() == tp_core::Device::Cpu && acc.dtype() == DType::F32 {
                acc.as_mut_slice::<f32>()?.fill(0.0);
            } else {
                *acc = Tensor::zeros(acc.dims(), DType::F32, &acc.device())?;
            }
        }
        Ok(())
    }
    /// `db += Σ_t dY[t]`, or kept for later inside [`defer_weight_grads`].
    pub(crate) fn add_bias_grad(&mut self, dy: &Tensor) -> Result<()> {
        if self.frozen() {
            return Ok(());
        }
        if deferring() {
            self.deferred.push_back(Deferred::Bias { dy: dy.clone() });
            return Ok(());
        }
        self.add(&dy.sum_rows()?)
    }
    /// Contributions kept by [`defer_weight_grads`] and not yet added.
    pub fn deferred(&self) -> usize {
        self.deferred.len()
    }
    /// Computes and adds the oldest deferred contribution; false when there is none.
    pub fn flush_one(&mut self) -> Result<bool> {
        let Some(d) = self.deferred.pop_front() else { return Ok(false) };
        match d {
            Deferred::Weight { x, dy } => self.accumulate_weight_grad(&x, &dy)?,
            Deferred::Bias { dy } => self.add(&dy.sum_rows()?)?,
        }
        Ok(true)
    }
    /// The accumulated gradient, if any backward ran.
    pub fn get(&self) -> Option<&Tensor> {
        self.acc.as_ref()
    }
    /// The accumulated gradient, writable (for clipping and syncing).
    pub fn get_mut(&mut self) -> Option<&mut Tensor> {
        self.acc.as_mut()
    }
    /// Replaces the accumulated gradient.
    pub fn set(&mut self, g: Option<Tensor>) {
        self.acc = g;
    }
    /// Takes the gradient, leaving the accumulator empty (deferred contributions are dropped).
    pub fn take(&mut self) -> Option<Tensor> {
        self.deferred.clear();
        self.acc.take()
    }
}

/// Where a block of a rank's parameter tensor sits in a full checkpoint tensor: elements
/// `local_start..local_start + len` of the local tensor along `dim` are elements
/// `full_start..full_start + len` of the tensor `name` (shape `full_dims`) along the same dim;
/// every other dim is whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The checkpoint tensor's full name (`model.layers.0.self_attn.q_proj.weight`).
    pub name: String,
    /// Its full shape.
    pub full_dims: Vec<usize>,
    /// The dim the block is cut along.
    pub dim: usize,
    /// First element of the block in the local tensor, along `dim`.
    pub local_start: usize,
    /// First element of the block in the full tensor, along `dim`.
    pub full_start: usize,
    /// Length of the block along `dim`.
    pub len: usize,
    /// This rank is the one that counts the block (exactly one rank owns each element).
    pub owned: bool,
    /// This rank's gradient of the block is one of several partial sums (one per rank holding
    /// the block) whose total is the gradient.
    pub partial: bool,
}

impl Placement {
    /// A whole tensor held by this rank alone or sharded (`owned`, not partial): the block
    /// `full_start..+len` along `dim`, at the same place locally counted from `local_start`.
    pub fn block(
        name: String,
        full_dims: &[usize],
        dim: usize,
        (local_start, full_start, len): (usize, usize, usize),
    ) -> Placement {
        Placement {
            name,
            full_dims: full_dims.to_vec(),
            dim,
            local_start,
            full_start,
            len,
            owned: true,
            partial: false,
        }
    }
    /// A tensor every rank holds whole: owned by rank 0; `partial` when each rank's gradient is
    /// only its share.
    pub fn replicated(name: String, full_dims: &[usize], rank: usize, partial: bool) -> Placement {
        let len = full_dims.first().copied().unwrap_or(0);
        Placement {
            name,
            full_dims: full_dims.to_vec(),
            dim: 0,
            local_start: 0,
            full_start: 0,
            len,
            owned: rank == 0,
            partial,
        }
    }
}

/// One trainable parameter as this rank holds it.
#[derive(Debug)]
pub struct Param<'a> {
    /// The local tensor (the model's dtype), updated in place by the optimizer.
    pub value: &'a mut Tensor,
    /// Its fp32 gradient.
    pub grad: &'a mut Grad,
    /// Where its blocks sit in the checkpoint's tensors (together they cover the local tensor).
    pub placements: Vec<Placement>,
}

impl Param<'_> {
    /// Whether weight decay applies: false for parameters whose checkpoint tensors are 1-D
    /// (biases, norm weights), as Megatron-LM and transformers' Trainer decide.
    pub fn decays(&self) -> bool {
        self.placements.first().is_some_and(|p| p.full_dims.len() > 1)
    }
}

/// The `[outer, size, inner]` view of `dims` around `dim`.
fn around(dims: &[usize], dim: usize) -> (usize, usize, usize) {
    let outer = dims[..dim].iter().product();
    let inner = dims[dim + 1..].iter().product();
    (outer, dims[dim], inner)
}

/// Copies the block of `p` from `src` (local, f32) into `dst` (full, f32), adding.
fn add_block(p: &Placement, local_dims: &[usize], src: &[f32], dst: &mut [f32]) {
    let (outer, lsize, inner) = around(local_dims, p.dim);
    let (_, fsize, _) = around(&p.full_dims, p.dim);
    for o in 0..outer {
        let s = (o * lsize + p.local_start) * inner;
        let d = (o * fsize + p.full_start) * inner;
        dst[d..d + p.len * inner].iter_mut().zip(&src[s..s + p.len * inner]).for_each(|(a, &b)| *a += b);
    }
}

/// Copies the block of `p` from `src` (full) back into `dst` (local).
fn read_block(p: &Placement, local_dims: &[usize], src: &[f32], dst: &mut [f32]) {
    let (outer, lsize, inner) = around(local_dims, p.dim);
    let (_, fsize, _) = around(&p.full_dims, p.dim);
    for o in 0..outer {
        let s = (o * fsize + p.full_start) * inner;
        let d = (o * lsize + p.local_start) * inner;
        dst[d..d + p.len * inner].copy_from_slice(&src[s..s + p.len * inner]);
    }
}

/// The checkpoint names the placements mention, with their full shapes, in name order (the
/// same list on every rank of a model).
fn names<'p>(
    params: impl Iterator<Item = &'p [Placement]>,
    keep: impl Fn(&Placement) -> bool,
) -> BTreeMap<String, Vec<usize>> {
    let mut out = BTreeMap::new();
    for p in params.flatten().filter(|p| keep(p)) {
        out.entry(p.name.clone()).or_insert_with(|| p.full_dims.clone());
    }
    out
}

/// Completes partial gradients: every block marked `partial` becomes the sum over the ranks of
/// their gradients of it (one all-reduce of a full-size buffer per tensor with partial blocks;
/// every rank of the group must call it with the same parameters). Parameters with no gradient
/// count as zeros.
pub fn sync_partial_grads(params: &mut [Param<'_>], group: &DeviceGroup) -> Result<()> {
    if group.world_size() == 1 {
        return Ok(());
    }
    // The tensors with a partial block on any rank (a rank may hold none of a shared head's
    // copies): one all-reduce (max) of a flag per name, the names being the same on every rank.
    let all = names(params.iter().map(|p| p.placements.as_slice()), |_| true);
    let mine = names(params.iter().map(|p| p.placements.as_slice()), |p| p.partial);
    let flags: Vec<f32> = all.keys().map(|n| if mine.contains_key(n) { 1.0 } else { 0.0 }).collect();
    let n = flags.len();
    let flags =
        group.all_reduce(&Tensor::from_vec(flags, &[n], &Device::Cpu)?.to_device(&group.device())?, ReduceOp::Max)?;
    let flags = flags.to_f64_vec()?;
    let partial: Vec<(String, Vec<usize>)> =
        all.into_iter().zip(flags).filter(|(_, f)| *f > 0.0).map(|(named, _)| named).collect();
    for (name, full) in partial {
        let mut buf = vec![0f32; full.iter().product()];
        for p in params.iter() {
            if let Some(g) = p.grad.get() {
                let src = g.to_dtype(DType::F32)?;
                for pl in p.placements.iter().filter(|pl| pl.partial && pl.name == name) {
                    add_block(pl, g.dims(), src.as_slice::<f32>()?, &mut buf);
                }
            }
        }
        let total = group.all_reduce(&Tensor::from_vec(buf, &full, &group.device())?, ReduceOp::Sum)?;
        let total = total.to_device(&Device::Cpu)?;
        for p in params.iter_mut() {
            let dims = p.value.dims().to_vec();
            let mine: Vec<&Placement> = p.placements.iter().filter(|pl| pl.partial && pl.name == name).collect();
            if mine.is_empty() {
                continue;
            }
            let mut g = match p.grad.take() {
                Some(g) => g.to_dtype(DType::F32)?.to_device(&Device::Cpu)?,
                None => Tensor::zeros(&dims, DType::F32, &Device::Cpu)?,
            };
            for pl in mine {
                read_block(pl, &dims, total.as_slice::<f32>()?, g.as_mut_slice::<f32>()?);
            }
            p.grad.set(Some(g));
        }
    }
    Ok(())
}

/// Elements per chunk of a gradient's sum of squares ([`owned_chunk_squares`]).
pub const NORM_CHUNK: usize = 256;

/// The sum of squares (f64) of this rank's owned gradient elements; summed over the ranks (an
/// all-reduce), it is the squared global norm with every element of the model counted once.
/// Call after [`sync_partial_grads`].
///
/// Order: each parameter's flat gradient is cut into chunks of [`NORM_CHUNK`] elements; a
/// chunk's owned squares are summed in f32 in element order and widened, the chunks summed in
/// f64 in order ([`sum_chunks`]), and the parameters' totals in order. A rank that holds only
/// some chunks' gradient (the distributed optimizer's shards) gets the same bits by gathering
/// the chunk values of the others.
pub fn owned_sum_squares(params: &[Param<'_>]) -> Result<f64> {
    let mut total = 0f64;
    for p in params {
        let chunks = p.value.numel().div_ceil(NORM_CHUNK);
        total += sum_chunks(&owned_chunk_squares(p, 0..chunks)?);
    }
    Ok(total)
}

/// A parameter's total from its chunk values, in order.
pub fn sum_chunks(values: &[f64]) -> f64 {
    values.iter().fold(0f64, |a, &v| a + v)
}

/// The values of chunks `chunks` of `p`'s gradient (see [`owned_sum_squares`]): for each, the
/// f32 sum in element order of the squares of the owned elements among its [`NORM_CHUNK`],
/// widened to f64 (0 where `p` has no gradient). Long ranges run on two threads (split at a
/// chunk boundary, so the same bits).
pub fn owned_chunk_squares(p: &Param<'_>, chunks: std::ops::Range<usize>) -> Result<Vec<f64>> {
    let Some(g) = p.grad.get() else { return Ok(vec![0.0; chunks.len()]) };
    let g = g.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
    let (g, dims) = (g.as_slice::<f32>()?, p.value.dims());
    let mut segments: Vec<(usize, usize)> = Vec::new();
    for pl in p.placements.iter().filter(|pl| pl.owned) {
        let (outer, lsize, inner) = around(dims, pl.dim);
        for o in 0..outer {
            let s = (o * lsize + pl.local_start) * inner;
            segments.push((s, s + pl.len * inner));
        }
    }
    segments.sort_unstable();
    let values = |range: std::ops::Range<usize>| -> Vec<f64> {
        let mut acc = vec![0f32; range.len()];
        let (lo, hi) = (range.start * NORM_CHUNK, (range.end * NORM_CHUNK).min(g.len()));
        for &(s, e) in &segments {
            let (mut i, e) = (s.max(lo), e.min(hi));
            while i < e {
                let c = i / NORM_CHUNK;
                let end = ((c + 1) * NORM_CHUNK).min(e);
                let a = &mut acc[c - range.start];
                *a = g[i..end].iter().fold(*a, |a, &x| a + x * x);
                i = end;
            }
        }
        acc.into_iter().map(f64::from).collect()
    };
    if chunks.len() * NORM_CHUNK < 1 << 18 {
        return Ok(values(chunks));
    }
    let mid = chunks.start + chunks.len() / 2;
    let (a, b) = std::thread::scope(|s| {
        let h = s.spawn(|| values(chunks.start..mid));
        let b = values(mid..chunks.end);
        (h.join(), b)
    });
    let mut a = a.unwrap_or_else(|_| values(chunks.start..mid));
    a.extend(b);
    Ok(a)
}

/// Which tensor of a parameter [`gather_full`] gathers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gather {
    /// The values.
    Values,
    /// The gradients (zeros where none).
    Grads,
}

/// The full checkpoint tensors, f32, on every rank: each rank adds its owned blocks into a
/// zero tensor and one all-reduce (sum) per tensor completes it (every element comes from
/// exactly one rank, so the sum is exact). Every rank must call it with the same parameters.
pub fn gather_full(params: &[Param<'_>], what: Gather, group: &DeviceGroup) -> Result<BTreeMap<String, Tensor>> {
    let items = params
        .iter()
        .map(|p| {
            let t = match what {
                Gather::Values => Some(p.value.clone()),
                Gather::Grads => p.grad.get().cloned(),
            };
            (p.placements.as_slice(), p.value.dims(), t)
        })
        .collect::<Vec<_>>();
    gather_blocks(&items, group)
}

/// [`gather_full`] of any per-parameter tensors (optimizer moments, master weights): each item
/// is a parameter's placements, its local shape, and the tensor to gather (`None`: zeros).
pub fn gather_blocks(
    items: &[(&[Placement], &[usize], Option<Tensor>)],
    group: &DeviceGroup,
) -> Result<BTreeMap<String, Tensor>> {
    let all = names(items.iter().map(|i| i.0), |_| true);
    let hosts = items
        .iter()
        .map(|(_, _, t)| t.as_ref().map(|t| t.to_dtype(DType::F32)?.to_device(&Device::Cpu)).transpose())
        .collect::<std::result::Result<Vec<_>, tp_core::Error>>()?;
    let mut out = BTreeMap::new();
    for (name, full) in all {
        let mut buf = vec![0f32; full.iter().product()];
        for ((placements, dims, _), src) in items.iter().zip(&hosts) {
            let Some(src) = src else { continue };
            for pl in placements.iter().filter(|pl| pl.owned && pl.name == name) {
                add_block(pl, dims, src.as_slice::<f32>()?, &mut buf);
            }
        }
        let t = Tensor::from_vec(buf, &full, &group.device())?;
        let t = if group.world_size() == 1 { t } else { group.all_reduce(&t, ReduceOp::Sum)? };
        out.insert(name, t.to_device(&Device::Cpu)?);
    }
    Ok(out)
}

/// This rank's local tensor (shape `local_dims`, f32) of a parameter placed by `placements`,
/// read from full tensors by name: the inverse of [`gather_blocks`] (resuming a checkpoint
/// written at any TP degree).
///
/// Errors: a tensor the placements name missing from `full`, or of another shape.
pub fn local_from_full(
    placements: &[Placement],
    local_dims: &[usize],
    full: &BTreeMap<String, Tensor>,
) -> Result<Tensor> {
    let mut out = vec![0f32; local_dims.iter().product()];
    for pl in placements {
        let t = full
            .get(&pl.name)
            .ok_or_else(|| LayerError::MissingTensor { path: String::new(), name: pl.name.clone() })?;
        if t.dims() != pl.full_dims.as_slice() {
            return Err(LayerError::WrongShape {
                name: pl.name.clone(),
                found: t.dims().to_vec(),
                expected: pl.full_dims.clone(),
            });
        }
        let t = t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
        read_block(pl, local_dims, t.as_slice::<f32>()?, &mut out);
    }
    Ok(Tensor::from_vec(out, local_dims, &Device::Cpu)?)
}
