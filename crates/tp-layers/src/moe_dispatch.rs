//! Token dispatch over an expert-parallel group (Megatron's all-to-all token dispatcher): the
//! experts of a mixture are placed whole over `P` ranks that hold *different* tokens (data
//! parallel replicas), so each token's rows travel to the ranks holding its experts and their
//! outputs travel back.
//!
//! Rank `r` routes its `T` tokens (`k` slots each). It sends, for every rank `d` in order and
//! every expert `e` that `d` holds in order, the rows of the slots routed to `e` (ascending
//! slot), and first tells `d` how many rows each of its experts gets (one small all-to-all of
//! counts). Rank `d` receives, source by source, its experts' rows in the same order, runs each
//! expert once over all of its rows (from every source), and sends the outputs back in the
//! order they came; rank `r` gets them back in its send order, one per slot. The backward sends
//! the outputs' gradients the same way and the inputs' gradients back. Both exchanges are
//! [`DeviceGroup::all_to_all`] with variable counts.

use crate::error::{LayerError, Result};
use crate::moe::ExpertPlacement;
use tp_comm::DeviceGroup;
use tp_core::{Device, Routing, Tensor};

/// One forward's exchange plan on this rank.
#[derive(Debug, Clone)]
pub(crate) struct Dispatch {
    /// The routing slots (`t · k + j`) this rank sends, grouped by destination rank, then by
    /// the destination's expert, then ascending.
    pub slots: Vec<usize>,
    /// Rows sent to each rank.
    send_counts: Vec<usize>,
    /// Rows received from each rank.
    recv_counts: Vec<usize>,
    /// For each expert this rank holds (in order), the positions of its rows among the rows
    /// received (source by source).
    pub local_rows: Vec<Vec<usize>>,
    /// Rows received.
    pub received: usize,
}

impl Dispatch {
    /// The plan for `routing` with experts placed over `group` by `placement` (whole experts,
    /// one range per rank); exchanges the per-expert counts.
    ///
    /// Errors: a collective's failure; a peer whose counts do not fit this rank's experts.
    pub(crate) fn plan(routing: &Routing, placement: &ExpertPlacement, group: &DeviceGroup) -> Result<Dispatch> {
        let (p, me) = (group.world_size(), group.rank());
        let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); routing.num_experts];
        for (slot, &e) in routing.experts.iter().enumerate() {
            by_expert
                .get_mut(e as usize)
                .ok_or_else(|| {
                    LayerError::Config(format!("slot {slot} routed to expert {e} of {}", routing.num_experts))
                })?
                .push(slot);
        }
        let (mut slots, mut send_counts, mut counts) = (Vec::new(), Vec::with_capacity(p), Vec::new());
        for d in 0..p {
            let before = slots.len();
            for e in placement.experts_of(d) {
                counts.push(by_expert[e].len() as i64);
                slots.extend_from_slice(&by_expert[e]);
            }
            send_counts.push(slots.len() - before);
        }
        let per_rank: Vec<usize> = (0..p).map(|d| placement.experts_of(d).len()).collect();
        let counts = Tensor::from_vec(counts, &[per_rank.iter().sum(), 1], &Device::Cpu)?.to_device(&group.device())?;
        let (got, from) = group.all_to_all(&counts, &per_rank)?;
        let mine = per_rank[me];
        if from.iter().any(|&n| n != mine) {
            return Err(LayerError::Config(format!(
                "expert dispatch: rank {me} holds {mine} experts but received counts for {from:?}"
            )));
        }
        let got = got.to_device(&Device::Cpu)?.to_i64_vec()?;
        let (mut local_rows, mut recv_counts, mut at) = (vec![Vec::new(); mine], Vec::with_capacity(p), 0usize);
        for src in 0..p {
            let mut n_src = 0;
            for (i, rows) in local_rows.iter_mut().enumerate() {
                let n = usize::try_from(got[src * mine + i]).unwrap_or(0);
                rows.extend(at..at + n);
                at += n;
                n_src += n;
            }
            recv_counts.push(n_src);
        }
        Ok(Dispatch { slots, send_counts, recv_counts, local_rows, received: at })
    }

    /// Sends `rows` (`[slots, H]`, in [`slots`](Self::slots) order) to the ranks holding their
    /// experts: the rows this rank received (`[received, H]`).
    pub(crate) fn dispatch(&self, rows: &Tensor, group: &DeviceGroup) -> Result<Tensor> {
        let (out, from) = group.all_to_all(rows, &self.send_counts)?;
        self.check("dispatch", &from, &self.recv_counts)?;
        Ok(out)
    }

    /// Sends `rows` (`[received, H]`, in received order) back to the ranks they came from: the
    /// rows this rank gets back, in [`slots`](Self::slots) order.
    pub(crate) fn combine(&self, rows: &Tensor, group: &DeviceGroup) -> Result<Tensor> {
        let (out, from) = group.all_to_all(rows, &self.recv_counts)?;
        self.check("combine", &from, &self.send_counts)?;
        Ok(out)
    }

    fn check(&self, what: &str, got: &[usize], want: &[usize]) -> Result<()> {
        if got != want {
            return Err(LayerError::Config(format!("expert {what}: received {got:?} rows per rank, planned {want:?}")));
        }
        Ok(())
    }
}
