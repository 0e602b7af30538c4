//! [`ParallelMoe`]: a mixture-of-experts block in place of a decoder layer's MLP,
//! tensor-parallel over each expert's intermediate features.
//!
//! For a token `x` (every rank holds all `T` tokens, as after attention's all-reduce):
//!
//! * the router `l = x R^T (+ b)` (`R: [E, H]`, replicated; gpt-oss's has a bias) gives the
//!   expert weights ([`tp_core::moe::route`]: softmax, the top `k`, renormalised where the
//!   family says so; gpt-oss's softmax over the top `k` logits is the renormalised form);
//! * each chosen expert `e` is a gated MLP `E_e(x) = down_e(act(gate_e x) ⊙ up_e x)` (with
//!   biases on gate, up and down where the family has them: gpt-oss, whose activation is the
//!   clamped SwiGLU), and `y = Σ_{e chosen} w_e · E_e(x)`;
//! * Qwen2-MoE adds a shared expert, gated per token: `y += sigmoid(x g^T) · S(x)`.
//!
//! Where the experts live is data ([`ExpertPlacement`]). By default (expert tensor
//! parallelism) rank `r` holds its balanced shard of every expert's intermediate features (rows
//! of gate and up, columns of down), as Megatron and vLLM split experts without expert
//! parallelism, and so computes a partial sum of every expert's output. With expert
//! parallelism (vLLM's `--enable-expert-parallel`) each expert lives whole on one rank, the
//! experts split over the ranks in balanced contiguous ranges (uneven where they do not
//! divide), and rank `r` computes its experts' whole outputs. Either way every rank holds all
//! `T` tokens, so no token moves: the all-reduce the MLP pays joins the partial sums. The
//! experts run as a grouped product: the
//! tokens routed to expert `e` are gathered (tokens ascending) and go through its GEMMs
//! together, never a dense product over all experts; their partial outputs are added into an
//! `f32` buffer, weighted, each token's experts in ascending id (so a row's bits never depend on
//! which other rows share its experts). One all-reduce of that buffer, as the MLP's, completes
//! the block, rounded to the model's dtype at the end.

use crate::error::{LayerError, Result};
use crate::linear::Linear;
use crate::loader::Loader;
use crate::mlp::{MlpNames, ParallelMlp};
use crate::moe_dispatch::Dispatch;
use crate::parts::Projections;
use tp_comm::{DeviceGroup, ReduceOp};
use tp_core::moe::route;
use tp_core::{Activation, DType, Device, RouterKind, Routing, Tensor};

/// Rows per expert up to which a step's experts run side by side (see
/// [`ParallelMoe::forward`]).
const FEW_ROWS: usize = 4;

/// What an MoE block computes besides its weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeConfig {
    /// Routed experts `E`.
    pub num_experts: usize,
    /// Experts per token `k`.
    pub top_k: usize,
    /// How the router weighs them.
    pub router: RouterKind,
    /// Whether the weights are rounded to the model's dtype before they scale the experts'
    /// outputs (Qwen2/3-MoE and OLMoE cast them back; Mixtral keeps them in f32).
    pub weights_in_dtype: bool,
    /// The experts' gate activation.
    pub activation: Activation,
    /// Whole experts on ranks (expert parallelism) instead of every expert split over them.
    pub expert_parallel: bool,
}

/// Which rank computes which part of which expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertPlacement {
    num_experts: usize,
    world: usize,
    expert_parallel: bool,
}

impl ExpertPlacement {
    /// `num_experts` over `world` ranks, whole (`expert_parallel`) or split.
    ///
    /// Errors: expert parallelism over more ranks than experts, naming both.
    pub fn new(num_experts: usize, world: usize, expert_parallel: bool) -> Result<ExpertPlacement> {
        if expert_parallel && world > num_experts {
            return Err(LayerError::Config(format!(
                "expert parallelism over {world} ranks needs at least {world} experts; the model has {num_experts}"
            )));
        }
        Ok(ExpertPlacement { num_experts, world: world.max(1), expert_parallel })
    }

    /// The experts rank `rank` holds whole under expert parallelism (all of them, split, else).
    pub fn experts_of(&self, rank: usize) -> std::ops::Range<usize> {
        if !self.expert_parallel {
            return 0..self.num_experts;
        }
        let (base, extra) = (self.num_experts / self.world, self.num_experts % self.world);
        let start = rank * base + rank.min(extra);
        start..start + base + usize::from(rank < extra)
    }

    /// Whether experts live whole on ranks.
    pub fn is_expert_parallel(&self) -> bool {
        self.expert_parallel
    }

    /// One line for the logs: `expert parallelism: rank 0 experts 0-2, rank 1 experts 3-5`, or
    /// `expert tensor parallelism: each of 8 experts split over 3 ranks`.
    pub fn describe(&self) -> String {
        self.describe_over("rank")
    }

    /// [`describe`](Self::describe) naming the places `unit` (`rank`, `replica`).
    pub fn describe_over(&self, unit: &str) -> String {
        if !self.expert_parallel {
            return format!(
                "expert tensor parallelism: each of {} experts split over {} rank(s)",
                self.num_experts, self.world
            );
        }
        let ranks: Vec<String> = (0..self.world)
            .map(|r| {
                let e = self.experts_of(r);
                match e.len() {
                    1 => format!("{unit} {r} expert {}", e.start),
                    _ => format!("{unit} {r} experts {}-{}", e.start, e.end - 1),
                }
            })
            .collect();
        format!("expert parallelism: {}", ranks.join(", "))
    }
}

/// The checkpoint names of an MoE block, relative to its prefix (`model.layers.N.mlp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeNames {
    /// The router's linear layer (`gate`: `gate.weight` `[E, H]`).
    pub router: &'static str,
    /// The experts' prefix (`experts`): one gated MLP per expert under `experts.{e}` named by
    /// `expert`, or transformers 5's fused `experts.gate_up_proj: [E, 2I, H]` and
    /// `experts.down_proj: [E, H, I]`.
    pub experts: &'static str,
    /// One expert's projections (Mixtral: `w1`, `w3`, `w2`).
    pub expert: MlpNames,
    /// The shared expert and its gate (Qwen2-MoE: `shared_expert`, `shared_expert_gate`).
    pub shared: Option<(&'static str, &'static str)>,
    /// How the fused expert tensors are laid out, where a checkpoint has them.
    pub fused: FusedExperts,
}

/// The layouts of fused expert tensors (`experts.gate_up_proj`, `experts.down_proj`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FusedExperts {
    /// transformers 5's: `gate_up_proj: [E, 2I, H]` (gate rows, then up rows),
    /// `down_proj: [E, H, I]`, no biases.
    Stacked,
    /// gpt-oss's: `gate_up_proj: [E, H, 2I]` (input-major, gate and up columns interleaved:
    /// column `2i` is gate feature `i`, `2i + 1` up feature `i`) with `gate_up_proj_bias:
    /// [E, 2I]` interleaved alike, `down_proj: [E, I, H]` with `down_proj_bias: [E, H]`.
    Interleaved,
}

impl MoeNames {
    /// Qwen2/3-MoE's and OLMoE's names: `gate`, `experts.{e}.{gate,up,down}_proj`.
    pub const QWEN: MoeNames = MoeNames {
        router: "gate",
        experts: "experts",
        expert: MlpNames { gate_up: Projections::Separate(["gate_proj", "up_proj"]), down: "down_proj" },
        shared: None,
        fused: FusedExperts::Stacked,
    };

    /// gpt-oss's names: `router` (with a bias) and the interleaved fused experts.
    pub const GPT_OSS: MoeNames = MoeNames { router: "router", fused: FusedExperts::Interleaved, ..MoeNames::QWEN };
}

/// Rank `r`'s part of an MoE block.
#[derive(Debug, Clone)]
pub struct ParallelMoe {
    router: Linear,
    /// Each expert's part on this rank: its shard, the whole expert, or none (another rank
    /// holds it whole).
    experts: Vec<Option<ParallelMlp>>,
    /// For each expert another rank holds whole (expert parallelism), empty stand-ins of its
    /// parameters: every rank lists the same parameters, in the same order, for the
    /// collectives over them (gathering, the gradient norm, checkpoints).
    absent: Vec<Option<AbsentExpert>>,
    placement: ExpertPlacement,
    /// An expert-parallel mesh's group and the experts' placement over it (each rank's experts
    /// split over `group`); `None` when every rank of `group` sees the same tokens.
    ep: Option<(DeviceGroup, ExpertPlacement)>,
    /// The shared expert's shard and its replicated gate `[1, H]`.
    shared: Option<(ParallelMlp, Linear)>,
    config: MoeConfig,
    group: DeviceGroup,
}

impl ParallelMoe {
    /// Loads the block under the loader's prefix, each rank reading its shard of every expert,
    /// from either expert layout. Checks the router's shape against `config`.
    pub fn load(ld: &Loader<'_>, config: MoeConfig, names: MoeNames) -> Result<ParallelMoe> {
        let router_name = format!("{}.weight", names.router);
        let (e, hidden) = ld.dims2(&router_name)?;
        if e != config.num_experts || config.top_k == 0 || config.top_k > e {
            return Err(LayerError::Config(format!(
                "{}: the router has {e} experts; the config says {} experts, {} per token",
                ld.name(&router_name),
                config.num_experts,
                config.top_k
            )));
        }
        let placement = ExpertPlacement::new(e, ld.world_size(), config.expert_parallel)?;
        // An expert-parallel mesh places whole experts over replicas (each split over the
        // tensor-parallel group); tokens reach them by all-to-all (`moe_dispatch.rs`).
        let ep = match ld.expert_group().filter(|g| g.world_size() > 1) {
            None => None,
            Some(_) if config.expert_parallel => {
                return Err(LayerError::Config(
                    "experts are placed either over the tensor-parallel ranks (--enable-expert-parallel) or over \
                     replicas (an expert-parallel mesh, -ep), not both"
                        .into(),
                ));
            }
            Some(g) => Some((g.clone(), ExpertPlacement::new(e, g.world_size(), true)?)),
        };
        let mine = match &ep {
            Some((g, pl)) => pl.experts_of(g.rank()),
            None => placement.experts_of(ld.rank()),
        };
        let bias_name = format!("{}.bias", names.router);
        let router_bias = if ld.contains(&bias_name) {
            ld.expect(&bias_name, &[e])?;
            Some(ld.full(&bias_name)?)
        } else {
            None
        };
        let router = Linear::new(ld.full(&router_name)?, router_bias)?;
        let experts_ld = ld.pp(names.experts);
        let gpt_oss_fused = experts_ld.contains("gate_up_proj") || experts_ld.contains("gate_up_proj_blocks");
        let experts = if names.fused == FusedExperts::Interleaved && gpt_oss_fused {
            interleaved_experts(&experts_ld, config, hidden, &placement, mine.clone())?
        } else if experts_ld.contains("gate_up_proj") {
            fused_experts(&experts_ld, config, hidden, &placement, mine.clone())?
        } else {
            (0..e)
                .map(|i| {
                    let x = experts_ld.pp(i);
                    match (mine.contains(&i), placement.is_expert_parallel()) {
                        (false, _) => Ok(None),
                        (true, true) => ParallelMlp::load_whole(&x, names.expert, config.activation).map(Some),
                        (true, false) => ParallelMlp::load(&x, names.expert, config.activation).map(Some),
                    }
                })
                .collect::<Result<Vec<_>>>()?
        };
        for (i, x) in experts.iter().enumerate().filter_map(|(i, x)| x.as_ref().map(|x| (i, x))) {
            if x.gate_up().local().in_features() != hidden {
                return Err(LayerError::Config(format!(
                    "{}: expert {i} takes {} features; the router takes {hidden}",
                    ld.name(names.experts),
                    x.gate_up().local().in_features()
                )));
            }
        }
        let shared = match names.shared {
            None => None,
            Some((mlp, gate)) => {
                let expert = ParallelMlp::load(&ld.pp(mlp), MlpNames::default(), config.activation)?;
                let gate_name = format!("{gate}.weight");
                ld.expect(&gate_name, &[1, hidden])?;
                Some((expert, Linear::new(ld.full(&gate_name)?, None)?))
            }
        };
        let absent = absent_experts(&experts, hidden, ld.group())?;
        Ok(ParallelMoe { router, experts, absent, placement, ep, shared, config, group: ld.group().clone() })
    }

    /// Which rank computes which part of which expert.
    pub fn placement(&self) -> &ExpertPlacement {
        &self.placement
    }

    /// Packs every expert's host weights once.
    pub fn pack_host(&mut self) -> Result<()> {
        for x in self.experts.iter_mut().flatten() {
            x.pack_host()?;
        }
        if let Some((x, _)) = &mut self.shared {
            x.pack_host()?;
        }
        Ok(())
    }

    /// The block's configuration.
    pub fn config(&self) -> &MoeConfig {
        &self.config
    }

    /// The routing of `x: [T, H]` (every rank the same).
    pub fn route(&self, x: &Tensor) -> Result<Routing> {
        self.route_logits(&self.router.forward(x)?, x.dtype())
    }

    /// The routing of router logits `[T, E]`, the weights rounded to `dtype` where the family
    /// casts them.
    fn route_logits(&self, logits: &Tensor, dtype: DType) -> Result<Routing> {
        let mut r = route(logits, self.config.top_k, self.config.router)?;
        if self.config.weights_in_dtype && dtype != DType::F32 {
            let w = Tensor::from_vec(std::mem::take(&mut r.weights), &[r.experts.len()], &Device::Cpu)?;
            r.weights = w.to_dtype(dtype)?.to_dtype(DType::F32)?.to_vec::<f32>()?;
        }
        Ok(r)
    }

    /// An expert's partial output with its down projection's bias added where this rank
    /// adds it: once per expert over the ranks whose partial sums the all-reduce joins (rank
    /// 0 under expert tensor parallelism, the expert's own rank under expert parallelism).
    fn with_down_bias(&self, expert: &ParallelMlp, partial: Tensor) -> Result<Tensor> {
        match expert.down().bias() {
            Some(b) if self.placement.is_expert_parallel() || self.group.rank() == 0 => Ok(partial.add_row(b)?),
            _ => Ok(partial),
        }
    }

    /// `y: [T, H]` for `x: [T, H]` (every rank the full input and output), with one
    /// all-reduce.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.forward_routed(x)?.0)
    }

    /// [`forward`](Self::forward), also returning the routing (for the histogram).
    pub fn forward_routed(&self, x: &Tensor) -> Result<(Tensor, Routing)> {
        let &[t, h] = x.dims() else {
            return Err(LayerError::Config(format!("an MoE block takes [tokens, hidden], got {:?}", x.dims())));
        };
        if self.ep.is_some() {
            return Err(LayerError::Config(
                "an MoE block of an expert-parallel mesh (-ep) runs in training only; load it without one to generate"
                    .into(),
            ));
        }
        let routing = self.route(x)?;
        // The experts with tokens here: (expert, rows ascending, weights).
        let work: Vec<(&ParallelMlp, Vec<usize>, Vec<f32>)> = self
            .experts
            .iter()
            .zip(routing.by_expert())
            .filter_map(|(expert, routed)| {
                let expert = expert.as_ref().filter(|_| !routed.is_empty())?;
                Some((expert, routed.iter().map(|&(t, _)| t).collect(), routed.iter().map(|&(_, w)| w).collect()))
            })
            .collect();
        let run = |(expert, rows, _): &(&ParallelMlp, Vec<usize>, Vec<f32>)| -> Result<Tensor> {
            let ye = expert.down().forward_partial(&expert.activation(&gather_rows(x, rows)?)?)?;
            self.with_down_bias(expert, ye)
        };
        if x.device() != Device::Cpu {
            // The experts' outputs side by side, in expert order: one grouped launch per
            // projection where it can, else a product per expert.
            let outputs = match self.grouped_outputs(x, &work)? {
                Some(ys) => ys,
                None if work.is_empty() => Tensor::zeros(&[0, h], x.dtype(), &x.device())?,
                None => Tensor::cat(&work.iter().map(run).collect::<Result<Vec<_>>>()?, 0)?,
            };
            let partial = self.combine_on_device(x, &work, outputs)?;
            let y =
                if self.group.world_size() == 1 { partial } else { self.group.all_reduce(&partial, ReduceOp::Sum)? };
            return Ok((y.to_dtype(x.dtype())?, routing));
        }
        let mut partial = Tensor::zeros(&[t, h], DType::F32, &Device::Cpu)?;
        // Few rows per expert (decode): the experts' small products side by side on the host's
        // threads, one dispatch for all (each expert's products on one thread); many rows
        // (prefill): one expert after another, each product over every thread. Either way the
        // outputs are added in expert order, so the bits are the same.
        let outputs: Vec<Result<Tensor>> =
            if x.device() == Device::Cpu && work.len() > 1 && work.iter().all(|(_, rows, _)| rows.len() <= FEW_ROWS) {
                let slots: Vec<std::sync::Mutex<Option<Result<Tensor>>>> =
                    work.iter().map(|_| std::sync::Mutex::new(None)).collect();
                tp_core::cpu::par_tasks(work.len(), &|i| {
                    let out = run(&work[i]);
                    if let Ok(mut s) = slots[i].lock() {
                        *s = Some(out);
                    }
                });
                slots
                    .into_iter()
                    .map(|s| {
                        s.into_inner()
                            .ok()
                            .flatten()
                            .unwrap_or_else(|| Err(LayerError::Config("an expert's task did not finish".into())))
                    })
                    .collect()
            } else {
                work.iter().map(run).collect()
            };
        for ((_, rows, weights), ye) in work.iter().zip(outputs) {
            partial.add_rows_scaled(rows, &ye?, weights)?;
        }
        if let Some((expert, gate)) = &self.shared {
            let ys = expert.down().forward_partial(&expert.activation(x)?)?;
            let g = sigmoid_in_dtype(&gate.forward(x)?)?;
            let rows: Vec<usize> = (0..t).collect();
            partial.add_rows_scaled(&rows, &ys.to_device(&Device::Cpu)?, &g)?;
        }
        let y = if self.group.world_size() == 1 { partial } else { self.group.all_reduce(&partial, ReduceOp::Sum)? };
        Ok((y.to_dtype(x.dtype())?, routing))
    }

    /// The host's combine (`add_rows_scaled` expert after expert, then the gated shared
    /// expert) on the device, where the experts' outputs stay (`tp_moe_combine`): each token's
    /// slots in expert order over the outputs side by side, then the shared expert's `g · y`
    /// added. `[T, H]` f32, this rank's partial sum.
    fn combine_on_device(
        &self,
        x: &Tensor,
        work: &[(&ParallelMlp, Vec<usize>, Vec<f32>)],
        outputs: Tensor,
    ) -> Result<Tensor> {
        let t = x.dims()[0];
        let mut slots: Vec<Vec<(i64, f32)>> = vec![Vec::new(); t];
        let mut at = 0i64;
        for (_, rows, weights) in work {
            for (i, (&r, &w)) in rows.iter().zip(weights).enumerate() {
                slots[r].push((at + i as i64, w));
            }
            at += rows.len() as i64;
        }
        let k = slots.iter().map(Vec::len).max().unwrap_or(0);
        let (mut pos, mut w) = (Vec::with_capacity(t * k), Vec::with_capacity(t * k));
        for row in &slots {
            for j in 0..k {
                let (p, v) = row.get(j).copied().unwrap_or((-1, 0.0));
                pos.push(p);
                w.push(v);
            }
        }
        let h = x.dims()[1];
        let mut partial = if work.is_empty() || k == 0 {
            Tensor::zeros(&[t, h], DType::F32, &x.device())?
        } else {
            tp_core::moe::moe_combine(&outputs, &pos, &w, t)?
        };
        if let Some((expert, gate)) = &self.shared {
            let ys = expert.down().forward_partial(&expert.activation(x)?)?;
            let g = sigmoid_in_dtype(&gate.forward(x)?)?;
            let rows: Vec<i64> = (0..t as i64).collect();
            partial = partial.add(&tp_core::moe::moe_combine(&ys, &rows, &g, t)?)?;
        }
        Ok(partial)
    }

    /// The experts' partial outputs for `work`'s rows, side by side in expert order, from one
    /// grouped launch per projection (`tp_core::moe::grouped_linear`): all their rows gathered
    /// once, `[G|U]` for every expert, the activation over all of them, then down (its bias
    /// where [`with_down_bias`](Self::with_down_bias) adds it). `None` where that launch does
    /// not apply: f32, or an expert held as quantized blocks.
    fn grouped_outputs(&self, x: &Tensor, work: &[(&ParallelMlp, Vec<usize>, Vec<f32>)]) -> Result<Option<Tensor>> {
        let Some((first, _, _)) = work.first() else { return Ok(None) };
        if !matches!(x.dtype(), DType::F16 | DType::BF16)
            || work
                .iter()
                .any(|(e, _, _)| e.gate_up().local().weights().dense().is_err() || e.down().weights().dense().is_err())
        {
            return Ok(None);
        }
        let rows: Vec<usize> = work.iter().flat_map(|(_, r, _)| r.iter().copied()).collect();
        let mut offsets = vec![0usize];
        for (_, r, _) in work {
            offsets.push(offsets[offsets.len() - 1] + r.len());
        }
        let gate_up: Vec<(&Tensor, Option<&Tensor>)> = work
            .iter()
            .map(|(e, _, _)| Ok((e.gate_up().local().weights().dense()?, e.gate_up().local().bias())))
            .collect::<Result<_>>()?;
        let gu = tp_core::moe::grouped_linear(&gather_rows(x, &rows)?, &gate_up, &offsets)?;
        let act = gu.glu(first.act())?;
        let adds_bias = self.placement.is_expert_parallel() || self.group.rank() == 0;
        let down: Vec<(&Tensor, Option<&Tensor>)> = work
            .iter()
            .map(|(e, _, _)| Ok((e.down().weights().dense()?, e.down().bias().filter(|_| adds_bias))))
            .collect::<Result<_>>()?;
        Ok(Some(tp_core::moe::grouped_linear(&act, &down, &offsets)?))
    }
}

/// What a router did in a training forward: per token, every expert's probability and the
/// experts chosen (the load-balancing loss is computed from these over all of a row's MoE
/// layers; see [`ParallelMoe::backward`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RouterStats {
    /// The `k` experts each token chose and their weights (`[T · k]` each, `E` experts).
    pub routing: Routing,
    /// `[T · E]` softmax probabilities (f32), every token of the batch.
    pub probs: Vec<f32>,
}

/// One expert's part of a training forward: the rows routed to it, their slots in the
/// routing (`t · k + j`), its input rows, `G|U`, the activation and its partial output.
#[derive(Debug)]
struct ExpertSaved {
    rows: Vec<usize>,
    slots: Vec<usize>,
    x: Tensor,
    gate_up: Tensor,
    act: Tensor,
    out: Tensor,
}

/// What [`ParallelMoe::backward`] needs of a training forward.
#[derive(Debug)]
pub struct MoeSaved {
    x: Tensor,
    batch: crate::SeqBatch,
    stats: RouterStats,
    experts: Vec<Option<ExpertSaved>>,
    /// The shared expert's `G|U`, activation and partial output, and its gate's values.
    shared: Option<(Tensor, Tensor, Tensor, Vec<f32>)>,
    /// `d loss / d p` of the load-balancing loss, `[T · E]`, set before the backward.
    prob_grad: Option<std::sync::Arc<Vec<f32>>>,
    /// Under an expert-parallel mesh: the exchange plan and the experts' (partial) outputs that
    /// came back, f32, one row per sent slot.
    dispatch: Option<(Dispatch, Tensor)>,
}

impl MoeSaved {
    /// The router's probabilities and choices.
    pub fn router_stats(&self) -> &RouterStats {
        &self.stats
    }
    /// Sets the load-balancing loss's gradient on the router probabilities (`[T · E]`).
    pub fn set_prob_grad(&mut self, g: std::sync::Arc<Vec<f32>>) {
        self.prob_grad = Some(g);
    }
}

/// Training.
///
/// With `l = x R^T`, `p = softmax(l)`, the top `k` set `S`, weights `w_e = p_e` (or
/// `p_e / Σ_S p` renormalised) and `y = Σ_{e∈S} w_e E_e(x) + σ(x a^T) S(x)`:
///
/// * `dw_e = dy · E_e(x)`: each rank dots `dy` with its partial output, and the `T·k` scalars
///   are summed over the group (with the shared expert's `dy · S(x)`), one small all-reduce;
/// * each expert's backward from `w_e dy` on its rows and the shared expert's from `σ dy`, all
///   locally, their partial `dx` summed into one buffer for the block's one all-reduce (or
///   reduce-scatter under sequence parallelism);
/// * `dp` from `dw` (through the renormalisation: `dp_i = dw_i / s - Σ_j dw_j p_j / s²`), plus
///   the load-balancing loss's `dp` where the model set one, then the softmax's
///   `dl = p ⊙ (dp - p·dp)`, `dR += dl^T x` and `dx += dl R`; the gate's `dz = dg σ (1 - σ)`,
///   `da += dz^T x`, `dx += dz a`. Router and gate are replicated and see every token, so their
///   gradients and `dx` terms are the same on every rank and added after the reduction.
///
/// Weights rounded to the model's dtype in the forward pass their gradient straight through.
/// Under expert parallelism an expert's gradients live on its rank alone; the other ranks list
/// empty stand-ins of its parameters, so that every rank lists the same parameters.
impl ParallelMoe {
    /// The forward of this rank's rows `x` of `batch` (all of them, or its sequence shard,
    /// all-gathered first), keeping what the backward needs; the output in the same rows.
    pub fn forward_train(&self, x: &Tensor, batch: &crate::SeqBatch) -> Result<(Tensor, MoeSaved)> {
        let group = &self.group;
        let x_full = batch.gather(x, group)?;
        let &[t, h] = x_full.dims() else {
            return Err(LayerError::Config(format!("an MoE block takes [tokens, hidden], got {:?}", x_full.dims())));
        };
        let logits = self.router.forward(&x_full)?;
        let routing = self.route_logits(&logits, x.dtype())?;
        let e = self.config.num_experts;
        let probs: Vec<f32> = logits
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?
            .to_vec::<f32>()?
            .chunks_exact(e.max(1))
            .flat_map(tp_core::moe::softmax)
            .collect();
        let mut partial = Tensor::zeros(&[t, h], DType::F32, &Device::Cpu)?;
        let mut experts = Vec::with_capacity(e);
        let mut slots_of: Vec<Vec<usize>> = vec![Vec::new(); e];
        for (slot, &ex) in routing.experts.iter().enumerate() {
            if let Some(v) = slots_of.get_mut(ex as usize) {
                v.push(slot);
            }
        }
        let dispatch = match &self.ep {
            Some((ep, ep_placement)) => {
                experts.resize_with(e, || None);
                Some(self.dispatch_forward(&x_full, &routing, ep, ep_placement, &mut partial, &mut experts)?)
            }
            None => {
                for (expert, slots) in self.experts.iter().zip(slots_of) {
                    let Some(expert) = expert else {
                        experts.push(None);
                        continue;
                    };
                    if slots.is_empty() {
                        experts.push(None);
                        continue;
                    }
                    let k = routing.top_k;
                    let rows: Vec<usize> = slots.iter().map(|s| s / k).collect();
                    let weights: Vec<f32> = slots.iter().map(|&s| routing.weights[s]).collect();
                    let xe = gather_rows(&x_full, &rows)?;
                    let (gate_up, act, out) = expert.forward_partial_saved(&xe)?;
                    let out = self.with_down_bias(expert, out)?;
                    partial.add_rows_scaled(&rows, &out.to_device(&Device::Cpu)?, &weights)?;
                    experts.push(Some(ExpertSaved { rows, slots, x: xe, gate_up, act, out }));
                }
                None
            }
        };
        let shared = match &self.shared {
            None => None,
            Some((expert, gate)) => {
                let (gate_up, act, out) = expert.forward_partial_saved(&x_full)?;
                let g = sigmoid_in_dtype(&gate.forward(&x_full)?)?;
                let rows: Vec<usize> = (0..t).collect();
                partial.add_rows_scaled(&rows, &out.to_device(&Device::Cpu)?, &g)?;
                Some((gate_up, act, out, g))
            }
        };
        let partial = partial.to_device(&x.device())?;
        let y = batch.reduce(&partial, group)?.to_dtype(x.dtype())?;
        let stats = RouterStats { routing, probs };
        let saved = MoeSaved { x: x.clone(), batch: batch.clone(), stats, experts, shared, prob_grad: None, dispatch };
        Ok((y, saved))
    }

    /// `dx` (f32, the forward's input rows) from `dy` (the output's rows), accumulating every
    /// parameter's gradient.
    pub fn backward(&mut self, saved: MoeSaved, dy: &Tensor) -> Result<Tensor> {
        let group = self.group.clone();
        let batch = &saved.batch;
        let dy_full = batch.gather(&dy.to_dtype(DType::F32)?, &group)?.to_device(&Device::Cpu)?;
        let x_full = batch.gather(&saved.x, &group)?;
        let &[t, h] = dy_full.dims() else {
            return Err(LayerError::Config(format!(
                "an MoE block's gradient is [tokens, hidden], got {:?}",
                dy.dims()
            )));
        };
        let (k, e) = (saved.stats.routing.top_k, self.config.num_experts);
        let dyv = dy_full.to_vec::<f32>()?;
        // Partial dot products (dw per slot, dg per token), summed over the group below.
        let mut dots = vec![0f32; t * k + t];
        let mut dx_partial = Tensor::zeros(&[t, h], DType::F32, &Device::Cpu)?;
        if let (Some((plan, back)), Some((ep, _))) = (&saved.dispatch, &self.ep) {
            let ep = ep.clone();
            self.dispatch_backward(plan, back, &saved, &dyv, &ep, &mut dots, &mut dx_partial)?;
        } else {
            for (expert, s) in self.experts.iter_mut().zip(&saved.experts) {
                let (Some(expert), Some(s)) = (expert.as_mut(), s.as_ref()) else { continue };
                let out = s.out.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.to_vec::<f32>()?;
                let mut d_out = Vec::with_capacity(s.rows.len() * h);
                for (i, (&row, &slot)) in s.rows.iter().zip(&s.slots).enumerate() {
                    let dy_row = &dyv[row * h..(row + 1) * h];
                    dots[slot] = dot(dy_row, &out[i * h..(i + 1) * h]);
                    let w = saved.stats.routing.weights[slot];
                    d_out.extend(dy_row.iter().map(|&g| w * g));
                }
                let d_out = Tensor::from_vec(d_out, &[s.rows.len(), h], &Device::Cpu)?.to_device(&s.x.device())?;
                let dxe = expert.backward_partial(&s.x, &s.gate_up, &s.act, &d_out)?;
                dx_partial.add_rows_scaled(&s.rows, &dxe.to_device(&Device::Cpu)?, &vec![1.0; s.rows.len()])?;
            }
        }
        if let (Some((expert, _)), Some((gate_up, act, out, g))) = (self.shared.as_mut(), saved.shared.as_ref()) {
            let out = out.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.to_vec::<f32>()?;
            let mut d_out = Vec::with_capacity(t * h);
            for row in 0..t {
                let dy_row = &dyv[row * h..(row + 1) * h];
                dots[t * k + row] = dot(dy_row, &out[row * h..(row + 1) * h]);
                d_out.extend(dy_row.iter().map(|&v| g[row] * v));
            }
            let d_out = Tensor::from_vec(d_out, &[t, h], &Device::Cpu)?.to_device(&x_full.device())?;
            let dxs = expert.backward_partial(&x_full, gate_up, act, &d_out)?;
            dx_partial.add_rows_scaled(&(0..t).collect::<Vec<_>>(), &dxs.to_device(&Device::Cpu)?, &vec![1.0; t])?;
        }
        let dots = Tensor::from_vec(dots, &[t * k + t], &Device::Cpu)?.to_device(&group.device())?;
        let dots = if group.world_size() == 1 { dots } else { group.all_reduce(&dots, ReduceOp::Sum)? };
        let dots = dots.to_device(&Device::Cpu)?.to_vec::<f32>()?;
        // The router: dw -> dp -> dl.
        let renormalize = matches!(self.config.router, RouterKind::SoftmaxTopK { renormalize: true });
        let mut dl = vec![0f32; t * e];
        for row in 0..t {
            let p = &saved.stats.probs[row * e..(row + 1) * e];
            let mut dp = match &saved.prob_grad {
                Some(g) => g[row * e..(row + 1) * e].to_vec(),
                None => vec![0f32; e],
            };
            let chosen = &saved.stats.routing.experts[row * k..(row + 1) * k];
            let dw = &dots[row * k..(row + 1) * k];
            if renormalize {
                let s: f32 = chosen.iter().map(|&c| p[c as usize]).sum();
                let sum_dw_p: f32 = chosen.iter().zip(dw).map(|(&c, &d)| d * p[c as usize]).sum();
                for (&c, &d) in chosen.iter().zip(dw) {
                    dp[c as usize] += d / s - sum_dw_p / (s * s);
                }
            } else {
                for (&c, &d) in chosen.iter().zip(dw) {
                    dp[c as usize] += d;
                }
            }
            let pdp: f32 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
            for j in 0..e {
                dl[row * e + j] = p[j] * (dp[j] - pdp);
            }
        }
        let dl = Tensor::from_vec(dl, &[t, e], &Device::Cpu)?.to_device(&x_full.device())?;
        let mut dx_replicated = self.router.backward(&x_full, &dl)?.to_device(&Device::Cpu)?;
        if let (Some((_, gate)), Some((_, _, _, g))) = (self.shared.as_mut(), saved.shared.as_ref()) {
            let dz: Vec<f32> = (0..t).map(|row| dots[t * k + row] * g[row] * (1.0 - g[row])).collect();
            let dz = Tensor::from_vec(dz, &[t, 1], &Device::Cpu)?.to_device(&x_full.device())?;
            dx_replicated.add_assign(&gate.backward(&x_full, &dz)?.to_device(&Device::Cpu)?)?;
        }
        // An expert no token chose gets a zero gradient: transformers 5 holds the experts as one
        // fused tensor whose gradient covers them all, so AdamW still steps every expert (on
        // its momentum and weight decay); a missing gradient would skip it.
        for (expert, s) in self.experts.iter_mut().zip(&saved.experts) {
            if let (Some(expert), None) = (expert.as_mut(), s) {
                zero_missing_grads(expert)?;
            }
        }
        let dx = batch.reduce(&dx_partial.to_device(&group.device())?, &group)?.to_device(&Device::Cpu)?;
        let mut dx = dx;
        dx.add_assign(&batch.local(&dx_replicated, &group)?)?;
        Ok(dx.to_device(&saved.x.device())?)
    }

    /// The block's parameters under `prefix` (`model.layers.N.mlp`): the router and the shared
    /// expert's gate replicated (every rank computes their whole gradient), every expert's and
    /// the shared expert's projections as their MLPs place them (checkpoint names per expert).
    pub fn params<'a>(&'a mut self, prefix: &str, names: MoeNames, f: &mut dyn FnMut(crate::Param<'a>)) -> Result<()> {
        use crate::parts::join;
        let rank = self.group.rank();
        let replicated = |name: String, dims: &[usize]| vec![crate::Placement::replicated(name, dims, rank, false)];
        let (e, h) = (self.router.out_features(), self.router.in_features());
        let w = replicated(join(prefix, &format!("{}.weight", names.router)), &[e, h]);
        // gpt-oss's router has a bias (replicated too); Linear lists it only where it exists.
        let b = replicated(join(prefix, &format!("{}.bias", names.router)), &[e]);
        self.router.params(w, b, f)?;
        for (i, (x, absent)) in self.experts.iter_mut().zip(&mut self.absent).enumerate() {
            let expert = join(prefix, &format!("{}.{i}", names.experts));
            match (x, absent) {
                (Some(x), _) => x.params(&expert, names.expert, f)?,
                (None, Some(a)) => a.params(&expert, names.expert, h, f)?,
                (None, None) => return Err(LayerError::Config(format!("{expert}: held nowhere on this rank"))),
            }
        }
        if let (Some((x, gate)), Some((shared, gate_name))) = (self.shared.as_mut(), names.shared) {
            x.params(&join(prefix, shared), MlpNames::default(), f)?;
            let g = replicated(join(prefix, &format!("{gate_name}.weight")), &[1, h]);
            gate.params(g, Vec::new(), f)?;
        }
        Ok(())
    }
}

/// Under an expert-parallel mesh (see `moe_dispatch.rs`).
impl ParallelMoe {
    /// The routed experts' forward through the exchange: every slot's row goes to the rank
    /// holding its expert, each held expert runs once over the rows it got (from every rank),
    /// and the (tensor-parallel partial) outputs come back to be added, weighted, into
    /// `partial`. Fills `saved[e]` for each held expert that got rows (`rows`: its positions
    /// among the received rows).
    fn dispatch_forward(
        &self,
        x_full: &Tensor,
        routing: &Routing,
        ep: &DeviceGroup,
        ep_placement: &ExpertPlacement,
        partial: &mut Tensor,
        saved: &mut [Option<ExpertSaved>],
    ) -> Result<(Dispatch, Tensor)> {
        let (k, h) = (routing.top_k, x_full.dims()[1]);
        let plan = Dispatch::plan(routing, ep_placement, ep)?;
        let rows: Vec<usize> = plan.slots.iter().map(|s| s / k).collect();
        let received = plan.dispatch(&rows_of(x_full, &rows, h)?, ep)?;
        let mut out_recv = Tensor::zeros(&[plan.received, h], DType::F32, &Device::Cpu)?;
        for (j, e) in ep_placement.experts_of(ep.rank()).enumerate() {
            let (Some(expert), positions) = (&self.experts[e], &plan.local_rows[j]) else { continue };
            if positions.is_empty() {
                continue;
            }
            let xe = gather_rows(&received, positions)?;
            let (gate_up, act, out) = expert.forward_partial_saved(&xe)?;
            let out = self.with_down_bias(expert, out)?;
            out_recv.add_rows_scaled(positions, &out.to_device(&Device::Cpu)?, &vec![1.0; positions.len()])?;
            saved[e] = Some(ExpertSaved { rows: positions.clone(), slots: Vec::new(), x: xe, gate_up, act, out });
        }
        let back = plan.combine(&out_recv.to_device(&ep.device())?, ep)?.to_device(&Device::Cpu)?;
        let weights: Vec<f32> = plan.slots.iter().map(|&s| routing.weights[s]).collect();
        if !rows.is_empty() {
            partial.add_rows_scaled(&rows, &back, &weights)?;
        }
        Ok((plan, back))
    }

    /// The backward of [`dispatch_forward`](Self::dispatch_forward): each slot's `dw = dy · out`
    /// into `dots`, the outputs' gradients `w dy` out to the experts' ranks, each held expert's
    /// backward there (accumulating its weights' gradients), and the inputs' gradients back,
    /// added into `dx_partial`.
    #[allow(clippy::too_many_arguments)]
    fn dispatch_backward(
        &mut self,
        plan: &Dispatch,
        back: &Tensor,
        saved: &MoeSaved,
        dyv: &[f32],
        ep: &DeviceGroup,
        dots: &mut [f32],
        dx_partial: &mut Tensor,
    ) -> Result<()> {
        let routing = &saved.stats.routing;
        let k = routing.top_k;
        let h = dx_partial.dims()[1];
        let backv = back.to_dtype(DType::F32)?.to_vec::<f32>()?;
        let mut d_sent = Vec::with_capacity(plan.slots.len() * h);
        for (i, &slot) in plan.slots.iter().enumerate() {
            let row = slot / k;
            let dy_row = &dyv[row * h..(row + 1) * h];
            dots[slot] = dot(dy_row, &backv[i * h..(i + 1) * h]);
            let w = routing.weights[slot];
            d_sent.extend(dy_row.iter().map(|&g| w * g));
        }
        let d_sent = Tensor::from_vec(d_sent, &[plan.slots.len(), h], &Device::Cpu)?.to_device(&ep.device())?;
        let d_recv = plan.dispatch(&d_sent, ep)?.to_device(&Device::Cpu)?;
        let mut dx_recv = Tensor::zeros(&[plan.received, h], DType::F32, &Device::Cpu)?;
        for (expert, s) in self.experts.iter_mut().zip(&saved.experts) {
            let (Some(expert), Some(s)) = (expert.as_mut(), s.as_ref()) else { continue };
            let d_out = gather_rows(&d_recv, &s.rows)?.to_device(&s.x.device())?;
            let dxe = expert.backward_partial(&s.x, &s.gate_up, &s.act, &d_out)?;
            dx_recv.add_rows_scaled(&s.rows, &dxe.to_device(&Device::Cpu)?, &vec![1.0; s.rows.len()])?;
        }
        let dx_sent = plan.combine(&dx_recv.to_device(&ep.device())?, ep)?.to_device(&Device::Cpu)?;
        let rows: Vec<usize> = plan.slots.iter().map(|s| s / k).collect();
        if !rows.is_empty() {
            dx_partial.add_rows_scaled(&rows, &dx_sent, &vec![1.0; rows.len()])?;
        }
        Ok(())
    }
}

/// Rows `rows` of `x: [T, H]` (`[0, H]` for none).
fn rows_of(x: &Tensor, rows: &[usize], h: usize) -> Result<Tensor> {
    if rows.is_empty() {
        return Ok(Tensor::zeros(&[0, h], x.dtype(), &x.device())?);
    }
    gather_rows(x, rows)
}

/// Sets every gradient of `mlp` that no backward has touched to zeros.
fn zero_missing_grads(mlp: &mut ParallelMlp) -> Result<()> {
    let mut failed = None;
    mlp.params("", MlpNames::default(), &mut |p| {
        if p.grad.get().is_none() && p.grad.deferred() == 0 {
            match Tensor::zeros(p.value.dims(), DType::F32, &p.value.device()) {
                Ok(z) => p.grad.set(Some(z)),
                Err(e) => failed = Some(e),
            }
        }
    })?;
    match failed {
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}

/// The empty stand-ins of an expert another rank holds whole: its stacked gate/up `[0, H]`
/// and down `[H, 0]`, and where the experts have biases (gpt-oss) its stacked gate/up bias
/// `[0]` and down bias `[0]`, each a parameter with blocks of length 0 this rank does not own.
#[derive(Debug, Clone)]
struct AbsentExpert {
    /// The expert's intermediate features (its full tensors' rows and columns).
    inter: usize,
    gate_up: Tensor,
    gate_up_grad: crate::Grad,
    down: Tensor,
    down_grad: crate::Grad,
    biases: Option<[(Tensor, crate::Grad); 2]>,
}

impl AbsentExpert {
    /// The stand-ins as parameters named as the held expert's are (`names` under `prefix`).
    fn params<'a>(
        &'a mut self,
        prefix: &str,
        names: MlpNames,
        hidden: usize,
        f: &mut dyn FnMut(crate::Param<'a>),
    ) -> Result<()> {
        use crate::parts::join;
        let none = |name: String, dims: Vec<usize>, dim: usize| crate::Placement {
            name,
            full_dims: dims,
            dim,
            local_start: 0,
            full_start: 0,
            len: 0,
            owned: false,
            partial: false,
        };
        let Projections::Separate([g, u]) = names.gate_up else {
            return Err(LayerError::Config(format!("{prefix}: experts with fused gate/up names")));
        };
        let gate_up = [g, u].map(|n| none(join(prefix, &format!("{n}.weight")), vec![self.inter, hidden], 0));
        f(crate::Param { value: &mut self.gate_up, grad: &mut self.gate_up_grad, placements: gate_up.to_vec() });
        let gate_up_bias = self
            .biases
            .as_ref()
            .map(|_| [g, u].map(|n| none(join(prefix, &format!("{n}.bias")), vec![self.inter], 0)).to_vec());
        let down = none(join(prefix, &format!("{}.weight", names.down)), vec![hidden, self.inter], 1);
        let down_bias = none(join(prefix, &format!("{}.bias", names.down)), vec![hidden], 0);
        match (&mut self.biases, gate_up_bias) {
            (Some([(gub, gub_grad), (db, db_grad)]), Some(gate_up_bias)) => {
                // In the order a held expert lists them: gate/up weight, its bias, down, its bias.
                f(crate::Param { value: gub, grad: gub_grad, placements: gate_up_bias });
                f(crate::Param { value: &mut self.down, grad: &mut self.down_grad, placements: vec![down] });
                f(crate::Param { value: db, grad: db_grad, placements: vec![down_bias] });
            }
            _ => f(crate::Param { value: &mut self.down, grad: &mut self.down_grad, placements: vec![down] }),
        }
        Ok(())
    }
}

/// The stand-ins for the experts this rank does not hold (`None` for the ones it holds).
fn absent_experts(
    experts: &[Option<ParallelMlp>],
    hidden: usize,
    group: &DeviceGroup,
) -> Result<Vec<Option<AbsentExpert>>> {
    let Some(held) = experts.iter().flatten().next() else {
        return Ok(experts.iter().map(|_| None).collect());
    };
    let (inter, dtype) = (held.gate_up().shards()[0].global_len(), held.gate_up().local().dtype());
    let biased = held.gate_up().local().bias().is_some() || held.down().bias().is_some();
    let empty = || -> Result<(Tensor, crate::Grad)> {
        Ok((Tensor::zeros(&[0], dtype, &group.device())?, crate::Grad::default()))
    };
    experts
        .iter()
        .map(|x| match x {
            Some(_) => Ok(None),
            None => Ok(Some(AbsentExpert {
                inter,
                gate_up: Tensor::zeros(&[0, hidden], dtype, &group.device())?,
                gate_up_grad: crate::Grad::default(),
                down: Tensor::zeros(&[hidden, 0], dtype, &group.device())?,
                down_grad: crate::Grad::default(),
                biases: if biased { Some([empty()?, empty()?]) } else { None },
            })),
        })
        .collect()
}

/// Rows `rows` of `x: [T, H]`, in order.
pub(crate) fn gather_rows(x: &Tensor, rows: &[usize]) -> Result<Tensor> {
    let ids: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
    let ids = Tensor::from_vec(ids, &[rows.len()], &Device::Cpu)?.to_device(&x.device())?;
    Ok(x.embedding(&ids, 0)?)
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// This rank's part of every expert from transformers 5's fused tensors under `ld`'s prefix:
/// `gate_up_proj: [E, 2I, H]` (gate rows, then up rows) and `down_proj: [E, H, I]` (each held
/// expert read whole, then split or kept whole as `placement` says).
fn fused_experts(
    ld: &Loader<'_>,
    config: MoeConfig,
    hidden: usize,
    placement: &ExpertPlacement,
    mine: std::ops::Range<usize>,
) -> Result<Vec<Option<ParallelMlp>>> {
    let dims = ld.dims("gate_up_proj")?;
    let &[e, two_i, h] = &dims[..] else {
        return Err(LayerError::Config(format!("{} has shape {dims:?}; [E, 2I, H] expected", ld.name("gate_up_proj"))));
    };
    if e != config.num_experts || h != hidden || two_i % 2 != 0 {
        return Err(LayerError::Config(format!(
            "{} has shape {dims:?}; [{}, 2I, {hidden}] expected",
            ld.name("gate_up_proj"),
            config.num_experts
        )));
    }
    let inter = two_i / 2;
    ld.expect("down_proj", &[e, hidden, inter])?;
    (0..e)
        .map(|i| {
            if !mine.contains(&i) {
                return Ok(None);
            }
            let gate_up = ld.expert("gate_up_proj", i)?;
            let gate = Linear::new(gate_up.narrow(0, 0, inter)?, None)?;
            let up = Linear::new(gate_up.narrow(0, inter, inter)?, None)?;
            let down = Linear::new(ld.expert("down_proj", i)?, None)?;
            place_expert([&gate, &up, &down], config, placement, ld.group()).map(Some)
        })
        .collect()
}

/// This rank's part of every expert from gpt-oss's fused tensors under `ld`'s prefix
/// ([`FusedExperts::Interleaved`]): each held expert's `[H, 2I]` block transposed and split
/// into gate (even columns) and up (odd columns), `[I, H]` each, its down `[I, H]` transposed to
/// `[H, I]`, the biases split alike; then split or kept whole as `placement` says. The Hub's
/// MXFP4 tensors (`gate_up_proj_blocks`/`_scales: [E, 2I, ..]`, `down_proj_blocks`/`_scales:
/// [E, H, ..]`, already output-major) are dequantized to the biases' dtype as they load, as
/// transformers does without its MXFP4 kernels ([`crate::mxfp4`]).
fn interleaved_experts(
    ld: &Loader<'_>,
    config: MoeConfig,
    hidden: usize,
    placement: &ExpertPlacement,
    mine: std::ops::Range<usize>,
) -> Result<Vec<Option<ParallelMlp>>> {
    // The caller found `gate_up_proj` or its MXFP4 blocks.
    let mxfp4 = !ld.contains("gate_up_proj");
    let e = config.num_experts;
    let two_i = if mxfp4 {
        // `[E, 2I, H / 32, 16]` codes and `[E, 2I, H / 32]` scales.
        let dims = ld.u8_dims("gate_up_proj_blocks")?;
        match dims[..] {
            [n, two_i, g, 16] if n == e && g * 32 == hidden => two_i,
            _ => {
                return Err(LayerError::Config(format!(
                    "{} has shape {dims:?}; [{e}, 2I, {}, 16] expected",
                    ld.name("gate_up_proj_blocks"),
                    hidden / 32
                )));
            }
        }
    } else {
        let dims = ld.dims("gate_up_proj")?;
        match dims[..] {
            [n, h, two_i] if n == e && h == hidden => two_i,
            _ => {
                return Err(LayerError::Config(format!(
                    "{} has shape {dims:?}; [{e}, {hidden}, 2I] expected",
                    ld.name("gate_up_proj")
                )));
            }
        }
    };
    if two_i % 2 != 0 {
        return Err(LayerError::Config(format!("{}: 2I = {two_i} is odd", ld.name("gate_up_proj"))));
    }
    let inter = two_i / 2;
    ld.expect("gate_up_proj_bias", &[e, two_i])?;
    ld.expect("down_proj_bias", &[e, hidden])?;
    if mxfp4 {
        let want = |name: &str, dims: Vec<usize>| -> Result<()> {
            let found = ld.u8_dims(name)?;
            if found != dims {
                return Err(LayerError::Config(format!("{} has shape {found:?}; {dims:?} expected", ld.name(name))));
            }
            Ok(())
        };
        want("gate_up_proj_scales", vec![e, two_i, hidden / 32])?;
        if inter % 32 != 0 {
            return Err(LayerError::Config(format!(
                "{}: MXFP4 experts need I ({inter}) to be a multiple of 32",
                ld.name("down_proj_blocks")
            )));
        }
        want("down_proj_blocks", vec![e, hidden, inter / 32, 16])?;
        want("down_proj_scales", vec![e, hidden, inter / 32])?;
    } else {
        ld.expect("down_proj", &[e, inter, hidden])?;
    }
    (0..e)
        .map(|i| {
            if !mine.contains(&i) {
                return Ok(None);
            }
            if mxfp4 && ld.options().quantized {
                let whole = placement.is_expert_parallel();
                return crate::mxfp4::quantized_expert(ld, i, (hidden, inter), whole, config.activation).map(Some);
            }
            let bias = ld.rows("gate_up_proj_bias", i, 1)?.reshape(&[inter, 2])?;
            let dtype = bias.dtype();
            // `[2I, H]` with rows 2j (gate j) and 2j + 1 (up j), and down `[H, I]`, in f32.
            let (gate_up, down_w) = if mxfp4 {
                let cpu = Device::Cpu;
                let w = |name: &str, rows: usize, cols: usize| -> Result<Tensor> {
                    let codes = ld.u8_entry(&format!("{name}_blocks"), i)?;
                    let scales = ld.u8_entry(&format!("{name}_scales"), i)?;
                    let v = crate::mxfp4::dequantize(&codes, &scales, rows, cols)?;
                    Ok(Tensor::from_vec(v, &[rows, cols], &cpu)?)
                };
                (w("gate_up_proj", two_i, hidden)?, w("down_proj", hidden, inter)?)
            } else {
                (ld.expert("gate_up_proj", i)?.transpose2d()?, ld.expert("down_proj", i)?.transpose2d()?)
            };
            let gate_up = gate_up.reshape(&[inter, 2, hidden])?;
            let part = |j: usize| -> Result<Linear> {
                let w = gate_up.narrow(1, j, 1)?.reshape(&[inter, hidden])?.to_dtype(dtype)?.to_device(&ld.device())?;
                let b = bias.narrow(1, j, 1)?.reshape(&[inter])?;
                Linear::new(w, Some(b))
            };
            let (gate, up) = (part(0)?, part(1)?);
            let down_w = down_w.to_dtype(dtype)?.to_device(&ld.device())?;
            let down = Linear::new(down_w, Some(ld.rows("down_proj_bias", i, 1)?.reshape(&[hidden])?))?;
            place_expert([&gate, &up, &down], config, placement, ld.group()).map(Some)
        })
        .collect()
}

/// This rank's part of one whole expert (`gate`, `up`: `[I, H]`, `down`: `[H, I]`): all of it
/// under expert parallelism, else its balanced shard of the intermediate features.
fn place_expert(
    [gate, up, down]: [&Linear; 3],
    config: MoeConfig,
    placement: &ExpertPlacement,
    group: &DeviceGroup,
) -> Result<ParallelMlp> {
    if placement.is_expert_parallel() {
        ParallelMlp::from_whole(gate, up, down, config.activation, group)
    } else {
        ParallelMlp::from_full(gate, up, down, config.activation, group)
    }
}

/// `sigmoid(g)` of a gate's output `g: [T, 1]`, one value per token, rounded to `g`'s dtype as
/// transformers' `F.sigmoid` on a tensor of that dtype rounds it.
fn sigmoid_in_dtype(g: &Tensor) -> Result<Vec<f32>> {
    let values: Vec<f32> = g.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.to_vec::<f32>()?;
    let s: Vec<f32> = values.iter().map(|&v| 1.0 / (1.0 + (-v).exp())).collect();
    let n = s.len();
    Ok(Tensor::from_vec(s, &[n], &Device::Cpu)?.to_dtype(g.dtype())?.to_dtype(DType::F32)?.to_vec::<f32>()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placements_cover_every_expert_once() {
        for (e, world) in [(8, 1), (8, 3), (8, 5), (8, 8), (60, 7), (3, 3)] {
            let p = ExpertPlacement::new(e, world, true).unwrap();
            let mut seen = vec![0; e];
            for r in 0..world {
                let mine = p.experts_of(r);
                assert!(!mine.is_empty(), "{e} over {world}: rank {r} holds none");
                mine.for_each(|i| seen[i] += 1);
            }
            assert!(seen.iter().all(|&n| n == 1), "{e} over {world}: {seen:?}");
        }
        let p = ExpertPlacement::new(8, 3, true).unwrap();
        assert_eq!(p.describe(), "expert parallelism: rank 0 experts 0-2, rank 1 experts 3-5, rank 2 experts 6-7");
        let tp = ExpertPlacement::new(8, 3, false).unwrap();
        assert_eq!((tp.experts_of(2), tp.is_expert_parallel()), (0..8, false));
        let e = ExpertPlacement::new(4, 6, true).unwrap_err().to_string();
        assert!(e.contains("6 ranks") && e.contains("has 4"), "{e}");
        assert!(ExpertPlacement::new(4, 6, false).is_ok());
    }
}
