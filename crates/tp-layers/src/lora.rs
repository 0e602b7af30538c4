//! LoRA adapters (Hu et al., 2021) on the linear layers, as PEFT defines them.
//!
//! An adapted projection with frozen weight `W: [out, in]` computes
//! `y = x W^T + b + s · (x A^T) B^T` with `A: [r, in]`, `B: [out, r]` and the scale
//! `s = alpha / r` (rsLoRA: `alpha / sqrt(r)`). The adapter's pair is held and trained in f32
//! whatever the base's dtype (f32, bf16 or a GGUF file's blocks); the product is added to the
//! base's output in f32 and rounded to its dtype once, as PEFT does for an f32 adapter.
//!
//! Each rank holds the pair as it holds the base:
//!
//! * a **column-parallel** base (rows of `W` per rank: q/k/v, gate/up) holds its rows of `B`
//!   and the whole `A`. The forward is local. In the backward `du = s · dY_r B_r` is this rank's
//!   share of `A`'s input gradient, so `dA = du^T X` is a partial sum completed with the other
//!   ranks' (`Placement::partial`, one all-reduce of `[r, in]` per step), and `du A` joins the
//!   base's partial `dX`, which the base all-reduces anyway;
//! * a **row-parallel** base (columns of `W`: o_proj, down_proj) holds its columns of `A` and
//!   the whole `B`. Then `X_r A_r^T B^T` is a partial output like `X_r W_r^T`: it is added to
//!   the base's partial before the base's all-reduce, which joins both (no collective of its
//!   own). In the backward `du = s · dY B` is the same on every rank, `dA_r = du^T X_r` is this
//!   rank's columns, and `dB = s · dY^T (X_r A_r^T)` is a partial sum over the ranks.
//!
//! Both are exact at any TP degree, uneven shards and replicated KV heads included: every
//! gradient is the sum torch autograd forms, split where the base is split.
//!
//! A layer holds adapters in numbered slots: slot 0 is the one [`attaching`] trains (and
//! what a forward applies to every row by default); a server attaches more with
//! [`attaching_as`] and picks each token's with [`with_token_adapters`], which groups the rows
//! by adapter and runs one product per group (Punica's and S-LoRA's batched products): a row's
//! result depends on its own adapter only.
//!
//! The base is frozen inside [`frozen_base`]: its parameters get no gradient (its backward
//! computes input gradients only) and the layers list only their adapters as parameters.
//! Adapters are attached to the modules PEFT's `target_modules` name by visiting the layers'
//! parameters inside [`attaching`], where each layer learns its placements.

use crate::error::{LayerError, Result};
use crate::grad::{Grad, Param, Placement, local_from_full};
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;
use tp_core::{DType, Device, Tensor};

/// The numbers of a LoRA adapter: rank `r`, `lora_alpha`, and whether the scale is rsLoRA's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoraSettings {
    /// The rank `r` (columns of `B`, rows of `A`).
    pub r: usize,
    /// `lora_alpha`.
    pub alpha: f64,
    /// rsLoRA's scale `alpha / sqrt(r)` instead of `alpha / r`.
    pub use_rslora: bool,
}

impl LoraSettings {
    /// `s = alpha / r`, or `alpha / sqrt(r)` with rsLoRA (computed in f64, applied in f32).
    pub fn scale(&self) -> f32 {
        let r = self.r as f64;
        (if self.use_rslora { self.alpha / r.sqrt() } else { self.alpha / r }) as f32
    }
}

/// The projections every decoder block can adapt, by their Hugging Face module names: what
/// PEFT's `all-linear` selects in the models tp runs (every linear layer but the LM head; a
/// mixture's router and routed experts are not adapted).
pub const ALL_LINEAR: [&str; 9] =
    ["q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj"];

/// Which modules get an adapter: PEFT's `target_modules`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoraTargets {
    /// A module matches a name when its full name is the name or ends with `.name` (PEFT's
    /// rule for a list).
    Names(Vec<String>),
    /// `all-linear`: the projections of [`ALL_LINEAR`].
    AllLinear,
}

impl LoraTargets {
    /// Whether the module `module` (a full name without `.weight`,
    /// `model.layers.0.self_attn.q_proj`) gets an adapter. A mixture's routed experts
    /// (`...mlp.experts.N...`) never do.
    pub fn matches(&self, module: &str) -> bool {
        if module.contains(".experts.") {
            return false;
        }
        let ends = |t: &str| module == t || module.ends_with(&format!(".{t}"));
        match self {
            LoraTargets::Names(names) => names.iter().any(|t| ends(t)),
            LoraTargets::AllLinear => ALL_LINEAR.iter().any(|t| ends(t)),
        }
    }
}

/// Where an adapter's starting values come from.
#[derive(Debug, Clone)]
pub enum LoraInit {
    /// PEFT's default: `A` from Kaiming's uniform (`U(-1/sqrt(in), 1/sqrt(in))`, drawn per
    /// module from `seed` and the module's name, so every rank draws the same `A`), `B = 0`.
    Fresh {
        /// The draw's seed.
        seed: u64,
    },
    /// Full tensors by module: `{module}.lora_A.weight: [r, in]` and `{module}.lora_B.weight:
    /// [out, r]` (an adapter file's, without PEFT's `base_model.model.` prefix).
    Tensors(Arc<BTreeMap<String, Tensor>>),
}

/// What [`attaching`] attaches: the adapter's numbers, its targets and its starting values.
#[derive(Debug, Clone)]
pub struct LoraSpec {
    /// Rank, alpha, scale kind.
    pub settings: LoraSettings,
    /// Which modules.
    pub targets: LoraTargets,
    /// Starting values.
    pub init: LoraInit,
}

/// The slot [`attaching`] fills: the adapter a training run trains, applied to every row when
/// no per-token adapters are given.
pub const TRAINED: u32 = 0;

/// What a visit inside [`attaching`] / [`attaching_as`] / [`detaching`] does to each layer.
#[derive(Debug, Clone)]
enum Change {
    /// Attach `spec` in slot `id` (replacing what the slot held).
    Attach(u32, Arc<LoraSpec>),
    /// Empty slot `id`.
    Detach(u32),
}

thread_local! {
    static FROZEN: Cell<bool> = const { Cell::new(false) };
    static CHANGE: RefCell<Option<Change>> = const { RefCell::new(None) };
    static TOKENS: RefCell<Option<Arc<[u32]>>> = const { RefCell::new(None) };
    static ATTACHED: Cell<usize> = const { Cell::new(0) };
    static DROPOUT: Cell<Option<(u64, f32)>> = const { Cell::new(None) };
}

/// The dropout in force on this thread ([`with_dropout`]).
fn dropout() -> Option<(u64, f32)> {
    DROPOUT.with(|c| c.get())
}

/// Restores a thread-local on drop (an early return or a panic leaves no mode behind).
struct Restore<F: FnMut()>(F);
impl<F: FnMut()> Drop for Restore<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

/// Runs `f` with the base frozen on this thread: backwards inside add no gradient to any
/// parameter but the adapters' (input gradients still flow through every layer), and the
/// layers' `params` list only adapters (`Linear`, `RowParallel`; a caller drops the other
/// layers' parameters by [`Grad::is_adapter`]).
pub fn frozen_base<R>(f: impl FnOnce() -> R) -> R {
    let was = FROZEN.with(|c| c.replace(true));
    let _restore = Restore(move || FROZEN.with(|c| c.set(was)));
    f()
}

/// Whether the base is frozen on this thread ([`frozen_base`]).
pub(crate) fn base_frozen() -> bool {
    FROZEN.with(|c| c.get())
}

/// Runs `f` (a visit of a model's parameters) with the base frozen and `spec` attached: each
/// linear layer visited gains an adapter on each of its modules `spec` targets (replacing one
/// it had), its values cut from `spec`'s full tensors by the layer's placements.
///
/// Returns `f`'s result and how many modules the visit adapted.
pub fn attaching<R>(spec: Arc<LoraSpec>, f: impl FnOnce() -> R) -> (R, usize) {
    changing(Change::Attach(TRAINED, spec), f)
}

/// [`attaching`] into slot `id` (a served adapter; `id > 0`), the other slots kept.
pub fn attaching_as<R>(id: u32, spec: Arc<LoraSpec>, f: impl FnOnce() -> R) -> (R, usize) {
    changing(Change::Attach(id, spec), f)
}

/// Runs `f` (a visit of a model's parameters) emptying slot `id` of every layer visited.
pub fn detaching<R>(id: u32, f: impl FnOnce() -> R) -> R {
    changing(Change::Detach(id), f).0
}

fn changing<R>(change: Change, f: impl FnOnce() -> R) -> (R, usize) {
    let was = CHANGE.with(|c| c.replace(Some(change)));
    let count = ATTACHED.with(|c| c.replace(0));
    let _restore = Restore(move || {
        CHANGE.with(|c| *c.borrow_mut() = was.clone());
        ATTACHED.with(|c| c.set(count));
    });
    let out = frozen_base(f);
    (out, ATTACHED.with(|c| c.get()))
}

/// Runs `f` (forwards of a flat batch of tokens) with token `t`'s adapter `ids[t]`: 0 the base
/// alone, `k > 0` the adapter in slot `k` (a layer without one there adds nothing). Each
/// layer's adapters then run one product per adapter over that adapter's rows.
pub fn with_token_adapters<R>(ids: Arc<[u32]>, f: impl FnOnce() -> R) -> R {
    let was = TOKENS.with(|c| c.replace(Some(ids)));
    let _restore = Restore(move || TOKENS.with(|c| *c.borrow_mut() = was.clone()));
    f()
}

/// Runs `f` (products over rows `start .. start + len` of the batch alone, as a layer that
/// takes its rows in passes runs them) with the tokens' adapters of
/// [`with_token_adapters`] cut to those rows; `f` as it is outside it.
pub fn with_token_rows<R>(start: usize, len: usize, f: impl FnOnce() -> R) -> R {
    let cut = TOKENS.with(|c| c.borrow().as_ref().map(|ids| ids.get(start..start + len).map(Arc::<[u32]>::from)));
    match cut {
        Some(Some(ids)) => with_token_adapters(ids, f),
        // Rows past the batch: the product reports the mismatch itself.
        Some(None) | None => f(),
    }
}

/// One adapted module's pair, as this rank holds it.
#[derive(Debug, Clone)]
struct Pair {
    /// `A` (f32): `[r, in]` whole beside a column-parallel base, `[r, in_r]` beside a
    /// row-parallel one.
    a: Tensor,
    /// `B` (f32): this rank's rows `[rows, r]` beside a column-parallel base, `[out, r]` whole
    /// beside a row-parallel one.
    b: Tensor,
    /// The layer's local output columns the pair adds to.
    rows: Range<usize>,
    scale: f32,
    grad_a: Grad,
    grad_b: Grad,
    a_place: Vec<Placement>,
    b_place: Vec<Placement>,
    /// The module's name hashed (FNV-1a): its dropout masks are its own.
    key: u64,
    /// The global input column of `A`'s first local column (dropout masks follow the full
    /// input, so that every TP degree drops the same elements).
    col0: usize,
}

/// The factor dropout multiplies input `(row, col)` of module `module` by (PEFT's
/// `lora_dropout` before `A`): `1 / (1 - p)` for a kept element, 0 for a dropped one, drawn
/// from `seed` (one per micro-batch), the module's name, the row and the global column by a
/// counter-based hash, so the forward, the backward and a recompute draw the same mask on
/// every rank.
pub fn dropout_factor(seed: u64, module: &str, row: usize, col: usize, p: f32) -> f32 {
    dropout_keyed(seed, fnv1a(module), row, col, p)
}

fn dropout_keyed(seed: u64, key: u64, row: usize, col: usize, p: f32) -> f32 {
    // SplitMix64's output function over the element's coordinates (a counter-based draw).
    let coords = seed
        ^ key.rotate_left(17)
        ^ (row as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (col as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    let z = tp_core::rng::SplitMix64::new(coords).next_u64();
    let u = (z >> 40) as f32 / (1u64 << 24) as f32;
    if u < p { 0.0 } else { 1.0 / (1.0 - p) }
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// Runs `f` (a micro-batch's training forward or backward) with the trained adapters' input
/// dropped at rate `p` by the masks of `seed` ([`dropout_factor`]); `p = 0`: no dropout.
pub fn with_dropout<R>(seed: u64, p: f32, f: impl FnOnce() -> R) -> R {
    let was = DROPOUT.with(|c| c.replace((p > 0.0).then_some((seed, p))));
    let _restore = Restore(move || DROPOUT.with(|c| c.set(was)));
    f()
}

impl Pair {
    /// `x` (f32, `[T, in_local]`) times this module's dropout mask.
    fn dropped(&self, x32: &Tensor, (seed, p): (u64, f32)) -> Result<Tensor> {
        let mut v = x32.to_vec::<f32>()?;
        let w = out_width(x32).max(1);
        self.mask(&mut v, w, (seed, p));
        Ok(Tensor::from_vec(v, x32.dims(), &x32.device())?)
    }

    /// `v` (rows of `w` local input columns) times this module's dropout mask, in place.
    fn mask(&self, v: &mut [f32], w: usize, (seed, p): (u64, f32)) {
        for (row, chunk) in v.chunks_exact_mut(w).enumerate() {
            for (j, e) in chunk.iter_mut().enumerate() {
                *e *= dropout_keyed(seed, self.key, row, self.col0 + j, p);
            }
        }
    }
}

/// A layer's adapters, by slot: one pair per adapted module of the layer (a merged q/k/v
/// layer has up to three, Phi-3's fused `qkv_proj` one).
#[derive(Debug, Clone, Default)]
pub struct Lora {
    /// `(slot, pairs)`, slots ascending, none empty.
    slots: Vec<(u32, Vec<Pair>)>,
    /// Each served slot's pairs stacked once when attached (their weights never change; the
    /// trained slot's are stacked at each use, since the optimizer updates them).
    stacked: Vec<(u32, Stacked)>,
}

impl Lora {
    /// `y + s · (x A^T) B^T` per pair, on the pair's output columns: `x: [T, in_local]` (any
    /// float dtype), `y: [T, out_local]`; the sum in f32, rounded to `y`'s dtype. Every row
    /// takes the [`TRAINED`] slot's pairs, or inside [`with_token_adapters`] its own
    /// adapter's: the rows of each adapter gathered, one product per adapter, added back.
    pub(crate) fn forward(&self, x: &Tensor, y: Tensor) -> Result<Tensor> {
        let tokens = TOKENS.with(|c| c.borrow().clone());
        let rows = y.dims().first().copied().unwrap_or(0);
        if let Some(ids) = &tokens
            && (ids.len() != rows || y.ndim() != 2)
        {
            return Err(LayerError::Config(format!(
                "{} tokens' adapters given for a product of {:?}",
                ids.len(),
                y.dims()
            )));
        }
        if x.device() != Device::Cpu {
            return self.forward_device(x, y, tokens.as_deref());
        }
        // (slot, its pairs, its rows: `None` for every row).
        type Group<'p> = (u32, &'p [Pair], Option<Vec<usize>>);
        let groups: Vec<Group<'_>> = match &tokens {
            None => self.pairs_of(TRAINED).map(|p| (TRAINED, p, None)).into_iter().collect(),
            Some(ids) => self
                .slots
                .iter()
                .filter(|(id, _)| *id != TRAINED)
                .filter_map(|(id, pairs)| {
                    let mine: Vec<usize> = (0..rows).filter(|&t| ids[t] == *id).collect();
                    (!mine.is_empty()).then(|| (*id, pairs.as_slice(), (mine.len() < rows).then_some(mine)))
                })
                .collect(),
        };
        if groups.is_empty() {
            return Ok(y);
        }
        let x32 = x.to_dtype(DType::F32)?;
        let dtype = y.dtype();
        // Moved, not shared, when already f32: the products add into it in place.
        let mut y32 = if dtype == DType::F32 { y } else { y.to_dtype(DType::F32)? };
        let last = y32.ndim().saturating_sub(1);
        if let (Some(d), None) = (dropout(), &tokens) {
            // The trained adapter under dropout: each module its own mask.
            for p in self.trained() {
                let xd = p.dropped(&x32, d)?;
                Stacked::of(std::slice::from_ref(p), y32.dims()[last])?.add_into(&xd, &mut y32)?;
            }
            return Ok(y32.to_dtype(dtype)?);
        }
        for (id, pairs, rows) in groups {
            let fresh;
            let st = match self.stacked.iter().find(|(s, _)| *s == id) {
                Some((_, st)) => st,
                None => {
                    fresh = Stacked::of(pairs, y32.dims()[last])?;
                    &fresh
                }
            };
            match rows {
                None => st.add_into(&x32, &mut y32)?,
                Some(rows) => {
                    let xg = crate::moe::gather_rows(&x32, &rows)?;
                    let mut d = Tensor::zeros(&[rows.len(), y32.dims()[last]], DType::F32, &y32.device())?;
                    st.add_into(&xg, &mut d)?;
                    y32.add_rows_scaled(&rows, &d, &vec![1.0; rows.len()])?;
                }
            }
        }
        Ok(y32.to_dtype(dtype)?)
    }

    /// [`forward`](Self::forward) on a GPU: per block of output columns one batched product
    /// over every token ([`tp_core::lora::lora_product`], `tp_lora_shrink` and
    /// `tp_lora_expand`), each token through its own slot's pair (`tokens: None`: every token
    /// through the [`TRAINED`] slot).
    ///
    /// Errors: dropout on the trained adapter (its masks are drawn on the host only).
    fn forward_device(&self, x: &Tensor, mut y: Tensor, tokens: Option<&[u32]>) -> Result<Tensor> {
        if tokens.is_none() && dropout().is_some() && !self.trained().is_empty() {
            return Err(LayerError::Config("LoRA dropout is not implemented on a GPU (train with dropout 0)".into()));
        }
        let rows = y.dims().first().copied().unwrap_or(0);
        let last = y.ndim().saturating_sub(1);
        // The layer's slots in a table; each token's index into it (-1: none here).
        let table: Vec<u32> = self.slots.iter().map(|(s, _)| *s).collect();
        let index: Vec<i32> = match tokens {
            None => vec![table.iter().position(|&s| s == TRAINED).map_or(-1, |i| i as i32); rows],
            Some(ids) => ids
                .iter()
                .map(|id| if *id == TRAINED { -1 } else { table.iter().position(|s| s == id).map_or(-1, |i| i as i32) })
                .collect(),
        };
        // Each (output columns, rank) of any slot's pairs: one product.
        let mut blocks: Vec<(Range<usize>, usize)> = Vec::new();
        for (_, pairs) in &self.slots {
            for p in pairs {
                let key = (p.rows.clone(), p.a.dims()[0]);
                if !blocks.contains(&key) {
                    blocks.push(key);
                }
            }
        }
        for (cols, rank) in blocks {
            let factors: Vec<Option<tp_core::lora::LoraFactors<'_>>> =
                self.slots
                    .iter()
                    .map(|(_, pairs)| {
                        pairs
                            .iter()
                            .find(|p| p.rows == cols && p.a.dims()[0] == rank)
                            .map(|p| tp_core::lora::LoraFactors { a: &p.a, b: &p.b, scale: p.scale })
                    })
                    .collect();
            let whole = cols.len() == y.dims()[last];
            let part = if whole { y.clone() } else { y.narrow(last, cols.start, cols.len())? };
            let done = tp_core::lora::lora_product(x, &part, &factors, &index)?;
            if whole {
                y = done;
            } else {
                y.slice_set(&done, last, cols.start)?;
            }
        }
        Ok(y)
    }

    /// Slot `id`'s pairs, if the layer has any there.
    fn pairs_of(&self, id: u32) -> Option<&[Pair]> {
        self.slots.iter().find(|(s, _)| *s == id).map(|(_, p)| p.as_slice())
    }

    /// The [`TRAINED`] slot's pairs (empty when there are none).
    fn trained(&self) -> &[Pair] {
        self.pairs_of(TRAINED).unwrap_or(&[])
    }

    fn trained_mut(&mut self) -> &mut [Pair] {
        match self.slots.iter_mut().find(|(s, _)| *s == TRAINED) {
            Some((_, p)) => p,
            None => &mut [],
        }
    }

    /// `dx + Σ_pairs (s · dY_p B) A` for the output gradient `dy: [T, out_local]` (f32) and the
    /// base's input gradient `dx: [T, in_local]` (f32).
    pub(crate) fn input_grad(&self, dy: &Tensor, mut dx: Tensor) -> Result<Tensor> {
        let pairs = self.trained();
        if pairs.is_empty() {
            return Ok(dx);
        }
        if let Some(d) = dropout() {
            // dx += ((s dY_p B_p) A_p) ⊙ mask_p, module by module.
            for p in pairs {
                let st = Stacked::of(std::slice::from_ref(p), out_width(dy))?;
                let g = st.du(dy)?.matmul(&p.a)?;
                let mut gv = g.to_vec::<f32>()?;
                p.mask(&mut gv, out_width(&g).max(1), d);
                dx.add_assign(&Tensor::from_vec(gv, g.dims(), &g.device())?)?;
            }
            return Ok(dx);
        }
        let st = Stacked::of(pairs, out_width(dy))?;
        let du = st.du(dy)?;
        // dx += du · A_cat, added by the GEMM itself.
        dx.add_t_matmul(&du.transpose2d()?, &st.a)?;
        Ok(dx)
    }

    /// `dA += du^T X` and `dB += (s · dY_p)^T (X A^T)` per pair (deferred with the base's
    /// weight gradients inside `defer_weight_grads`).
    pub(crate) fn accumulate(&mut self, x: &Tensor, dy: &Tensor) -> Result<()> {
        let pairs = self.trained_mut();
        if pairs.is_empty() {
            return Ok(());
        }
        if let Some(d) = dropout() {
            // Module by module, each with its dropped input.
            let x32 = x.to_dtype(DType::F32)?;
            let dy32 = dy.to_dtype(DType::F32)?;
            let (width, last) = (out_width(dy), dy32.ndim().saturating_sub(1));
            for p in pairs.iter_mut() {
                let xd = p.dropped(&x32, d)?;
                let st = Stacked::of(std::slice::from_ref(p), width)?;
                let us = xd.matmul_t(&st.a)?.scale(st.scale)?;
                let du = st.du(dy)?;
                let dy_p =
                    if p.rows.len() == width { dy32.clone() } else { dy32.narrow(last, p.rows.start, p.rows.len())? };
                p.grad_b.add_weight_grad(&us, &dy_p)?;
                p.grad_a.add_weight_grad(&xd, &du)?;
            }
            return Ok(());
        }
        let st = Stacked::of(pairs, out_width(dy))?;
        let x32 = x.to_dtype(DType::F32)?;
        // Every pair's u and du in one product each, then split by pair.
        let us = x32.matmul_t(&st.a)?.scale(st.scale)?;
        let du = st.du(dy)?;
        let dy = dy.to_dtype(DType::F32)?;
        let last = dy.ndim().saturating_sub(1);
        let stacked = pairs.len() > 1;
        for (i, p) in pairs.iter_mut().enumerate() {
            let r = p.a.dims()[0];
            let (us_p, du_p) =
                if stacked { (us.narrow(1, i * r, r)?, du.narrow(1, i * r, r)?) } else { (us.clone(), du.clone()) };
            let dy_p =
                if p.rows.len() == dy.dims()[last] { dy.clone() } else { dy.narrow(last, p.rows.start, p.rows.len())? };
            // dB = (s dY_p)^T u = dY_p^T (s u); dA = du^T X.
            p.grad_b.add_weight_grad(&us_p, &dy_p)?;
            p.grad_a.add_weight_grad(&x32, &du_p)?;
        }
        Ok(())
    }

    /// Every pair's `A` and `B` as parameters, named `{module}.lora_A.weight` and
    /// `{module}.lora_B.weight` (PEFT's names without its `base_model.model.` prefix).
    /// Only the [`TRAINED`] slot's (the others are served, not trained).
    pub(crate) fn params<'a>(&'a mut self, f: &mut dyn FnMut(Param<'a>)) {
        for p in self.trained_mut() {
            f(Param { value: &mut p.a, grad: &mut p.grad_a, placements: p.a_place.clone() });
            f(Param { value: &mut p.b, grad: &mut p.grad_b, placements: p.b_place.clone() });
        }
    }

    /// Modules adapted in slot `id`.
    pub fn modules(&self, id: u32) -> usize {
        self.pairs_of(id).map_or(0, <[Pair]>::len)
    }

    /// The slots holding adapters, ascending.
    pub fn slots(&self) -> Vec<u32> {
        self.slots.iter().map(|(s, _)| *s).collect()
    }
}

/// The last dim of `t` (a layer's local output width).
fn out_width(t: &Tensor) -> usize {
    t.dims().last().copied().unwrap_or(0)
}

/// A slot's pairs of one layer stacked for single products: `a = [A_1; ..; A_P]`
/// (`[P·r, in]`) and `bt`, the block-diagonal `[B_1 | 0 ..; 0 | B_2 ..]` transposed
/// (`[P·r, out]`, `B_p^T` in rows `p·r..` and the pair's output columns, zeros elsewhere), so
/// that `(x a^T) bt` is every pair's `(x A_p^T) B_p^T` on its own columns. The pairs of a slot
/// come from one adapter: one rank, one scale.
#[derive(Debug, Clone)]
struct Stacked {
    a: Tensor,
    bt: Tensor,
    scale: f32,
}

impl Stacked {
    /// `y += s · (x A^T) B^T` of each pair, on its output columns (`x`, `y` f32): one product
    /// for every pair's `x A^T` and one for their expansions, added into `y` by the GEMM.
    fn add_into(&self, x32: &Tensor, y32: &mut Tensor) -> Result<()> {
        let us = x32.matmul_t(&self.a)?.scale(self.scale)?;
        Ok(y32.add_t_matmul(&us.transpose2d()?, &self.bt)?)
    }

    /// The stack of `pairs` for a layer of `width` local output columns.
    fn of(pairs: &[Pair], width: usize) -> Result<Stacked> {
        let scale = pairs.first().map_or(1.0, |p| p.scale);
        if let [p] = pairs
            && p.rows == (0..width)
        {
            return Ok(Stacked { a: p.a.clone(), bt: p.b.transpose2d()?, scale });
        }
        let mut blocks = Vec::with_capacity(pairs.len());
        for p in pairs {
            let r = p.a.dims()[0];
            let mut blk = Tensor::zeros(&[r, width], DType::F32, &p.b.device())?;
            blk.slice_set(&p.b.transpose2d()?, 1, p.rows.start)?;
            blocks.push(blk);
        }
        let a = Tensor::cat(&pairs.iter().map(|p| p.a.clone()).collect::<Vec<_>>(), 0)?;
        Ok(Stacked { a, bt: Tensor::cat(&blocks, 0)?, scale })
    }

    /// `du = s · dY B_bd` (`[T, P·r]`): every pair's `s · dY_p B_p` side by side.
    fn du(&self, dy: &Tensor) -> Result<Tensor> {
        Ok(dy.to_dtype(DType::F32)?.matmul_t(&self.bt)?.scale(self.scale)?)
    }
}

/// What a linear layer's `params` does with the base frozen: attaches adapters to `slot` when
/// inside [`attaching`] (from the layer's weight placements `weight` and its local weight's
/// `[out, in]`), then lists them. Returns false, doing nothing, when the base is not frozen.
pub(crate) fn visit<'a>(
    slot: &'a mut Option<Box<Lora>>,
    weight: &[Placement],
    local: (usize, usize),
    device: &Device,
    f: &mut dyn FnMut(Param<'a>),
) -> Result<bool> {
    if !base_frozen() {
        return Ok(false);
    }
    let change = CHANGE.with(|c| c.borrow().clone());
    let (id, pairs) = match change {
        Some(Change::Attach(id, spec)) => {
            let mut pairs = attach(&spec, weight, local)?;
            for p in &mut pairs {
                p.a = p.a.to_device(device)?;
                p.b = p.b.to_device(device)?;
            }
            ATTACHED.with(|c| c.set(c.get() + pairs.len()));
            (Some(id), pairs)
        }
        Some(Change::Detach(id)) => (Some(id), Vec::new()),
        None => (None, Vec::new()),
    };
    if let Some(id) = id {
        let lora = slot.get_or_insert_with(Box::default);
        lora.slots.retain(|(s, _)| *s != id);
        lora.stacked.retain(|(s, _)| *s != id);
        if !pairs.is_empty() {
            if id != TRAINED && device == &Device::Cpu {
                lora.stacked.push((id, Stacked::of(&pairs, local.0)?));
            }
            lora.slots.push((id, pairs));
            lora.slots.sort_by_key(|(s, _)| *s);
        }
        if lora.slots.is_empty() {
            *slot = None;
        }
    }
    if let Some(l) = slot.as_deref_mut() {
        l.params(f);
    }
    Ok(true)
}

/// The adapters `spec` gives a layer whose local weight `[out, in]` is placed by `weight`.
fn attach(spec: &LoraSpec, weight: &[Placement], (out, width): (usize, usize)) -> Result<Vec<Pair>> {
    let mut modules: Vec<(&str, Vec<&Placement>)> = Vec::new();
    for pl in weight {
        let Some(module) = pl.name.strip_suffix(".weight") else { continue };
        match modules.iter_mut().find(|(m, _)| *m == module) {
            Some((_, v)) => v.push(pl),
            None => modules.push((module, vec![pl])),
        }
    }
    let mut pairs = Vec::new();
    for (module, pls) in modules {
        if spec.targets.matches(module) {
            pairs.push(pair(spec, module, &pls, (out, width))?);
        }
    }
    Ok(pairs)
}

/// The pair of `module`, whose blocks of the local weight are `pls`.
fn pair(spec: &LoraSpec, module: &str, pls: &[&Placement], (out, width): (usize, usize)) -> Result<Pair> {
    let r = spec.settings.r;
    let (a_name, b_name) = (format!("{module}.lora_A.weight"), format!("{module}.lora_B.weight"));
    let config = |why: String| LayerError::Config(format!("LoRA on {module}: {why}"));
    let first = pls.first().ok_or_else(|| config("no weight blocks".into()))?;
    // The rank holding the weight's first element owns the whole, replicated factor.
    let origin = pls.iter().any(|p| p.owned && p.full_start == 0);
    let replicated = |name: &str, dims: [usize; 2]| Placement {
        name: name.to_string(),
        full_dims: dims.to_vec(),
        dim: 0,
        local_start: 0,
        full_start: 0,
        len: dims[0],
        owned: origin,
        partial: true,
    };
    let (a_place, b_place, rows, a_dims, b_dims) = if pls.iter().all(|p| p.dim == 0) {
        // Column-parallel: this rank's rows of B, all of A.
        let lo = pls.iter().map(|p| p.local_start).min().unwrap_or(0);
        let hi = pls.iter().map(|p| p.local_start + p.len).max().unwrap_or(0);
        if pls.iter().map(|p| p.len).sum::<usize>() != hi - lo {
            return Err(config("its rows are not contiguous in the layer".into()));
        }
        let b = pls
            .iter()
            .map(|p| Placement {
                name: b_name.clone(),
                full_dims: vec![p.full_dims[0], r],
                local_start: p.local_start - lo,
                ..(*p).clone()
            })
            .collect();
        let in_full = first.full_dims[1];
        (vec![replicated(&a_name, [r, in_full])], b, lo..hi, [r, width], [hi - lo, r])
    } else if let [p] = pls
        && p.dim == 1
    {
        // Row-parallel: this rank's columns of A, all of B.
        let a = Placement { name: a_name.clone(), full_dims: vec![r, p.full_dims[1]], ..(*p).clone() };
        let full_out = p.full_dims[0];
        (vec![a], vec![replicated(&b_name, [full_out, r])], 0..out, [r, width], [out, r])
    } else {
        return Err(config("its weight is split in a way LoRA does not follow".into()));
    };
    let (a, b) = match &spec.init {
        LoraInit::Tensors(full) => {
            for name in [&a_name, &b_name] {
                if !full.contains_key(name) {
                    return Err(LayerError::MissingTensor { path: String::new(), name: name.clone() });
                }
            }
            (local_from_full(&a_place, &a_dims, full)?, local_from_full(&b_place, &b_dims, full)?)
        }
        LoraInit::Fresh { seed } => {
            let in_full = a_place[0].full_dims[1];
            let mut full = BTreeMap::new();
            full.insert(a_name.clone(), kaiming_uniform(*seed, module, [r, in_full])?);
            full.insert(b_name.clone(), Tensor::zeros(&b_place[0].full_dims, DType::F32, &Device::Cpu)?);
            (local_from_full(&a_place, &a_dims, &full)?, local_from_full(&b_place, &b_dims, &full)?)
        }
    };
    Ok(Pair {
        a,
        b,
        rows,
        scale: spec.settings.scale(),
        grad_a: Grad::for_adapter(),
        grad_b: Grad::for_adapter(),
        col0: a_place.first().map_or(0, |p| if p.dim == 1 { p.full_start } else { 0 }),
        a_place,
        b_place,
        key: fnv1a(module),
    })
}

/// `[r, in]` uniform in `±1/sqrt(in)` (torch's `kaiming_uniform_(a = sqrt(5))`, PEFT's `A`),
/// drawn from `seed` and `module`'s name (FNV-1a), so every rank draws the same tensor.
fn kaiming_uniform(seed: u64, module: &str, [r, width]: [usize; 2]) -> Result<Tensor> {
    let h = fnv1a(module);
    let mut rng = tp_core::rng::SplitMix64::new(seed ^ h);
    let bound = 1.0 / (width.max(1) as f64).sqrt();
    let v: Vec<f32> = (0..r * width).map(|_| rng.uniform(-bound, bound) as f32).collect();
    Ok(Tensor::from_vec(v, &[r, width], &Device::Cpu)?)
}
