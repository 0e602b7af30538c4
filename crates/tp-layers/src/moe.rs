//! [`ParallelMoe`]: a mixture-of-experts block in place of a decoder layer's MLP,
//! tensor-parallel over each expert's intermediate features.
//!
//! For a token `x` (every rank holds all `T` tokens, as after attention's all-reduce):
//!
//! * the router `l = x R^T` (`R: [E, H]`, replicated) gives the expert weights
//!   ([`tp_core::moe::route`]: softmax, the top `k`, renormalised where the family says so);
//! * each chosen expert `e` is a gated MLP `E_e(x) = down_e(act(gate_e x) ⊙ up_e x)`, and
//!   `y = Σ_{e chosen} w_e · E_e(x)`;
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
use crate::parts::Projections;
use tp_comm::{DeviceGroup, ReduceOp};
use tp_core::moe::route;
use tp_core::{Activation, DType, Device, RouterKind, Routing, Tensor};

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
                    1 => format!("rank {r} expert {}", e.start),
                    _ => format!("rank {r} experts {}-{}", e.start, e.end - 1),
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
}

impl MoeNames {
    /// Qwen2/3-MoE's and OLMoE's names: `gate`, `experts.{e}.{gate,up,down}_proj`.
    pub const QWEN: MoeNames = MoeNames {
        router: "gate",
        experts: "experts",
        expert: MlpNames { gate_up: Projections::Separate(["gate_proj", "up_proj"]), down: "down_proj" },
        shared: None,
    };
}

/// Rank `r`'s part of an MoE block.
#[derive(Debug, Clone)]
pub struct ParallelMoe {
    router: Linear,
    /// Each expert's part on this rank: its shard, the whole expert, or none (another rank
    /// holds it whole).
    experts: Vec<Option<ParallelMlp>>,
    placement: ExpertPlacement,
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
        let mine = placement.experts_of(ld.rank());
        let router = Linear::new(ld.full(&router_name)?, None)?;
        let experts_ld = ld.pp(names.experts);
        let experts = if experts_ld.contains("gate_up_proj") {
            fused_experts(&experts_ld, config, hidden, &placement)?
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
        Ok(ParallelMoe { router, experts, placement, shared, config, group: ld.group().clone() })
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
        let logits = self.router.forward(x)?;
        let mut r = route(&logits, self.config.top_k, self.config.router)?;
        if self.config.weights_in_dtype && x.dtype() != DType::F32 {
            let w = Tensor::from_vec(std::mem::take(&mut r.weights), &[r.experts.len()], &Device::Cpu)?;
            r.weights = w.to_dtype(x.dtype())?.to_dtype(DType::F32)?.to_vec::<f32>()?;
        }
        Ok(r)
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
        let routing = self.route(x)?;
        let mut partial = Tensor::zeros(&[t, h], DType::F32, &Device::Cpu)?;
        for (expert, routed) in self.experts.iter().zip(routing.by_expert()) {
            let Some(expert) = expert else { continue };
            if routed.is_empty() {
                continue;
            }
            let rows: Vec<usize> = routed.iter().map(|&(t, _)| t).collect();
            let weights: Vec<f32> = routed.iter().map(|&(_, w)| w).collect();
            let ids: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
            let ids = Tensor::from_vec(ids, &[rows.len()], &Device::Cpu)?.to_device(&x.device())?;
            let xe = x.embedding(&ids, 0)?;
            let ye = expert.down().forward_partial(&expert.activation(&xe)?)?;
            partial.add_rows_scaled(&rows, &ye.to_device(&Device::Cpu)?, &weights)?;
        }
        if let Some((expert, gate)) = &self.shared {
            let ys = expert.down().forward_partial(&expert.activation(x)?)?;
            let g = sigmoid_in_dtype(&gate.forward(x)?)?;
            let rows: Vec<usize> = (0..t).collect();
            partial.add_rows_scaled(&rows, &ys.to_device(&Device::Cpu)?, &g)?;
        }
        let partial = partial.to_device(&x.device())?;
        let y = if self.group.world_size() == 1 { partial } else { self.group.all_reduce(&partial, ReduceOp::Sum)? };
        Ok((y.to_dtype(x.dtype())?, routing))
    }
}

/// This rank's part of every expert from transformers 5's fused tensors under `ld`'s prefix:
/// `gate_up_proj: [E, 2I, H]` (gate rows, then up rows) and `down_proj: [E, H, I]` (each held
/// expert read whole, then split or kept whole as `placement` says).
fn fused_experts(
    ld: &Loader<'_>,
    config: MoeConfig,
    hidden: usize,
    placement: &ExpertPlacement,
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
    let mine = placement.experts_of(ld.rank());
    (0..e)
        .map(|i| {
            if !mine.contains(&i) {
                return Ok(None);
            }
            let gate_up = ld.expert("gate_up_proj", i)?;
            let gate = Linear::new(gate_up.narrow(0, 0, inter)?, None)?;
            let up = Linear::new(gate_up.narrow(0, inter, inter)?, None)?;
            let down = Linear::new(ld.expert("down_proj", i)?, None)?;
            let act = config.activation;
            if placement.is_expert_parallel() {
                ParallelMlp::from_whole(&gate, &up, &down, act, ld.group()).map(Some)
            } else {
                ParallelMlp::from_full(&gate, &up, &down, act, ld.group()).map(Some)
            }
        })
        .collect()
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
