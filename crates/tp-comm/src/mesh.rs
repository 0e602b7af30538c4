//! The device mesh: a world of `dp × pp × tp` ranks and, for every rank, one group per axis.
//!
//! Ranks are laid out as Megatron-LM lays them: tensor-parallel fastest, then pipeline, then
//! data-parallel, so a tensor-parallel group is consecutive ranks (on one node, where the
//! all-reduces of every layer go):
//!
//! ```text
//! rank = (dp · pp_size + pp) · tp_size + tp
//! ```
//!
//! For `dp = 2, pp = 2, tp = 2`:
//!
//! | rank | dp | pp | tp | tp group | pp group | dp group |
//! |------|----|----|----|----------|----------|----------|
//! | 0    | 0  | 0  | 0  | 0, 1     | 0, 2     | 0, 4     |
//! | 1    | 0  | 0  | 1  | 0, 1     | 1, 3     | 1, 5     |
//! | 2    | 0  | 1  | 0  | 2, 3     | 0, 2     | 2, 6     |
//! | 3    | 0  | 1  | 1  | 2, 3     | 1, 3     | 3, 7     |
//! | 4    | 1  | 0  | 0  | 4, 5     | 4, 6     | 0, 4     |
//! | ...  |    |    |    |          |          |          |
//!
//! Rank `i` of a rank's pipeline group is stage `i` (likewise for the other axes).
//!
//! Expert parallelism (Megatron's `--expert-model-parallel-size`, `ep` dividing `dp`) splits
//! the data-parallel axis in two: `dp = edp_index · ep + ep_index`. The expert-parallel group
//! is `ep` consecutive replicas (the same stage and tensor-parallel rank), over which a
//! mixture's experts are placed and its tokens dispatched; the expert-data-parallel group is
//! the replicas holding the same experts (`dp / ep` of them), over which the experts'
//! gradients are summed. Without it (`ep = 1`) the first is one rank and the second is the
//! data-parallel group.

use crate::error::{CommError, Result};
use crate::group::DeviceGroup;
use crate::{LaunchEnv, MAX_WORLD_SIZE};
use std::sync::Arc;
use std::time::Duration;
use tp_core::Device;

/// Every axis, in the order their groups are made.
const AXES: [Axis; 5] = [Axis::Tp, Axis::Pp, Axis::Dp, Axis::Ep, Axis::Edp];

/// An axis of the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Axis {
    /// Tensor parallelism (fastest).
    Tp,
    /// Pipeline stages.
    Pp,
    /// Data-parallel replicas (slowest).
    Dp,
    /// Expert parallelism: consecutive data-parallel replicas sharing out the experts.
    Ep,
    /// Expert data parallelism: the replicas holding the same experts.
    Edp,
}

/// The sizes of the axes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MeshShape {
    /// Data-parallel replicas.
    pub dp: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// Tensor-parallel ranks per stage.
    pub tp: usize,
    /// Expert-parallel replicas (dividing `dp`; 1: none).
    pub ep: usize,
}

/// A rank's place on each axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coords {
    /// Its data-parallel replica.
    pub dp: usize,
    /// Its pipeline stage.
    pub pp: usize,
    /// Its tensor-parallel rank.
    pub tp: usize,
}

impl MeshShape {
    /// `dp × pp × tp` ranks.
    ///
    /// Errors: an axis of size 0; more than [`MAX_WORLD_SIZE`] ranks.
    pub fn new(dp: usize, pp: usize, tp: usize) -> Result<MeshShape> {
        const OP: &str = "MeshShape::new";
        if dp == 0 || pp == 0 || tp == 0 {
            return Err(CommError::Limit {
                op: OP,
                why: format!(
                    "every axis needs at least 1 rank (data-parallel {dp}, pipeline {pp}, tensor-parallel {tp})"
                ),
            });
        }
        match dp.checked_mul(pp).and_then(|x| x.checked_mul(tp)) {
            Some(w) if w <= MAX_WORLD_SIZE => Ok(MeshShape { dp, pp, tp, ep: 1 }),
            _ => Err(CommError::Limit {
                op: OP,
                why: format!("{dp} x {pp} x {tp} ranks exceed the maximum of {MAX_WORLD_SIZE}"),
            }),
        }
    }
    /// The same mesh with `ep` expert-parallel replicas out of its `dp`.
    ///
    /// Errors: `ep` 0 or not dividing `dp`, naming both.
    pub fn with_expert_parallel(self, ep: usize) -> Result<MeshShape> {
        if ep == 0 || self.dp % ep != 0 {
            return Err(CommError::Limit {
                op: "MeshShape::with_expert_parallel",
                why: format!(
                    "expert parallelism of {ep} must divide the {} data-parallel replicas (experts are placed over \
                     replicas, as Megatron's --expert-model-parallel-size)",
                    self.dp
                ),
            });
        }
        Ok(MeshShape { ep, ..self })
    }
    /// `dp · pp · tp`.
    pub fn world_size(&self) -> usize {
        self.dp * self.pp * self.tp
    }
    /// The coordinates of global `rank`.
    pub fn coords(&self, rank: usize) -> Coords {
        Coords { tp: rank % self.tp, pp: rank / self.tp % self.pp, dp: rank / (self.tp * self.pp) }
    }
    /// The global rank at `c`.
    pub fn rank(&self, c: Coords) -> usize {
        (c.dp * self.pp + c.pp) * self.tp + c.tp
    }
    /// The size of `axis`.
    pub fn size(&self, axis: Axis) -> usize {
        match axis {
            Axis::Tp => self.tp,
            Axis::Pp => self.pp,
            Axis::Dp => self.dp,
            Axis::Ep => self.ep,
            Axis::Edp => self.dp / self.ep,
        }
    }
    /// The global ranks of `rank`'s group along `axis`, in that axis's order.
    pub fn group_ranks(&self, rank: usize, axis: Axis) -> Vec<usize> {
        let c = self.coords(rank);
        (0..self.size(axis))
            .map(|i| {
                let mut d = c;
                match axis {
                    Axis::Tp => d.tp = i,
                    Axis::Pp => d.pp = i,
                    Axis::Dp => d.dp = i,
                    Axis::Ep => d.dp = c.dp / self.ep * self.ep + i,
                    Axis::Edp => d.dp = i * self.ep + c.dp % self.ep,
                }
                self.rank(d)
            })
            .collect()
    }
    /// `rank`'s place along `axis`: its rank within its group of that axis.
    fn axis_index(&self, rank: usize, axis: Axis) -> usize {
        let c = self.coords(rank);
        match axis {
            Axis::Tp => c.tp,
            Axis::Pp => c.pp,
            Axis::Dp => c.dp,
            Axis::Ep => c.dp % self.ep,
            Axis::Edp => c.dp / self.ep,
        }
    }
    /// Which group of `axis` global `rank` belongs to, numbered `0..world / size(axis)`.
    fn group_index(&self, rank: usize, axis: Axis) -> usize {
        let c = self.coords(rank);
        match axis {
            Axis::Tp => c.dp * self.pp + c.pp,
            Axis::Pp => c.dp * self.tp + c.tp,
            Axis::Dp => c.pp * self.tp + c.tp,
            Axis::Ep => (c.dp / self.ep * self.pp + c.pp) * self.tp + c.tp,
            Axis::Edp => (c.dp % self.ep * self.pp + c.pp) * self.tp + c.tp,
        }
    }
}

/// One rank's view of the mesh: its coordinates, and a group per axis plus the world.
#[derive(Clone)]
pub struct Mesh {
    shape: MeshShape,
    rank: usize,
    world: DeviceGroup,
    tp: DeviceGroup,
    pp: DeviceGroup,
    dp: DeviceGroup,
    ep: DeviceGroup,
    edp: DeviceGroup,
    /// Keeps rank 0's rendezvous store alive for the mesh's life (from_launch_env).
    _rendezvous: Option<Arc<std::sync::Mutex<crate::Rendezvous>>>,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mesh(rank {} at {:?} of {:?})", self.rank, self.coords(), self.shape)
    }
}

impl Mesh {
    /// Every rank of the mesh as threads of this process (a [`LocalGroup`](crate::LocalGroup)
    /// for the world and for every axis group), rank `r` computing on `device(r)`: the mesh of
    /// every global rank, in rank order; move each into its own thread.
    ///
    /// Errors: as [`DeviceGroup::local`].
    pub fn local(shape: MeshShape, timeout: Duration, device: impl Fn(usize) -> Device) -> Result<Vec<Mesh>> {
        let n = shape.world_size();
        let world = DeviceGroup::local(n, timeout, &device)?;
        let mut axes: Vec<Vec<Option<DeviceGroup>>> = Vec::new();
        for axis in AXES {
            let mut mine: Vec<Option<DeviceGroup>> = vec![None; n];
            let size = shape.size(axis);
            // Each group once, from its first rank.
            for first in (0..n).filter(|&r| shape.axis_index(r, axis) == 0) {
                let members = shape.group_ranks(first, axis);
                let groups = DeviceGroup::local(size, timeout, |i| device(members[i]))?;
                for (m, grp) in members.into_iter().zip(groups) {
                    mine[m] = Some(grp);
                }
            }
            axes.push(mine);
        }
        let mut axes: Vec<std::vec::IntoIter<Option<DeviceGroup>>> = axes.into_iter().map(Vec::into_iter).collect();
        world
            .into_iter()
            .enumerate()
            .map(|(rank, world)| {
                let missing =
                    || CommError::Limit { op: "Mesh::local", why: format!("internal: rank {rank} has no group") };
                let mut next =
                    || axes.iter_mut().map(|a| a.next().flatten().ok_or_else(missing)).collect::<Result<Vec<_>>>();
                let [tp, pp, dp, ep, edp] = <[DeviceGroup; 5]>::try_from(next()?).map_err(|_| missing())?;
                Ok(Mesh { shape, rank, world, tp, pp, dp, ep, edp, _rendezvous: None })
            })
            .collect()
    }

    /// Processes launched by torchrun, srun or mpirun ([`LaunchEnv`]), one per GPU (its
    /// `local_rank`): one rendezvous, an NCCL communicator for the world and one per axis group,
    /// all within the deadline. Each group's first rank creates its NCCL id and publishes it
    /// through the rendezvous store under the group's own key (one write and one read per rank
    /// and axis, whatever the world size). An axis of size 1 gets a communicator of one rank
    /// (its id made locally, nothing through the store); an axis spanning the whole world
    /// shares the world's communicator. A failure on one rank aborts the rendezvous, so that
    /// rank 0 tells the others at once and nobody waits on it (a rank other than 0 that fails
    /// leaves the others to fail at the deadline).
    ///
    /// Errors: a world size other than the shape's (a [`CommError::Env`] naming the launcher's
    /// variable); CUDA, NCCL and rendezvous errors.
    pub fn from_launch_env(env: &LaunchEnv, shape: MeshShape) -> Result<Mesh> {
        if env.world_size != shape.world_size() {
            let size_var = match env.launcher {
                crate::Launcher::Torchrun => "WORLD_SIZE",
                crate::Launcher::Slurm => "SLURM_NTASKS",
                crate::Launcher::OpenMpi => "OMPI_COMM_WORLD_SIZE",
            };
            return Err(CommError::Env(format!(
                "{size_var}={} but the mesh needs {} x {} x {} = {} ranks (data x pipeline x tensor parallel)",
                env.world_size,
                shape.dp,
                shape.pp,
                shape.tp,
                shape.world_size()
            )));
        }
        let mut rdv = crate::Rendezvous::join(env)?;
        match Self::nccl_mesh(&mut rdv, env, shape) {
            Ok((world, [tp, pp, dp, ep, edp])) => Ok(Mesh {
                shape,
                rank: env.rank,
                world,
                tp,
                pp,
                dp,
                ep,
                edp,
                _rendezvous: Some(Arc::new(std::sync::Mutex::new(rdv))),
            }),
            Err(e) => {
                rdv.abort(&e.to_string());
                Err(e)
            }
        }
    }

    /// This process's rank of a mesh whose ranks are the processes of an MPI job (`mpirun`,
    /// or `srun` with PMIx): the world is `MPI_COMM_WORLD`, and each axis group is a split of
    /// it (`MPI_Comm_split` with the group's number as color and the rank's place on the axis
    /// as key), made in the same order on every rank. Every rank computes on the host.
    ///
    /// Errors: [`CommError::MpiUnavailable`]; a job whose number of processes is not the
    /// shape's ([`CommError::Env`], naming both); MPI errors.
    pub fn from_mpi(shape: MeshShape, timeout: Duration) -> Result<Mesh> {
        let world = crate::mpi::MpiComm::world(timeout)?;
        use crate::Communicator;
        if world.world_size() != shape.world_size() {
            return Err(CommError::Env(format!(
                "the MPI job has {} processes but the mesh needs {} x {} x {} = {} ranks (data x pipeline x tensor \
                 parallel); launch it with -np {}",
                world.world_size(),
                shape.dp,
                shape.pp,
                shape.tp,
                shape.world_size(),
                shape.world_size()
            )));
        }
        let rank = world.rank();
        let mut groups = Vec::with_capacity(AXES.len());
        for axis in AXES {
            let comm = if shape.size(axis) == shape.world_size() {
                world.clone()
            } else {
                world.split(shape.group_index(rank, axis), shape.axis_index(rank, axis))?
            };
            groups.push(DeviceGroup::new(Arc::new(comm), Device::Cpu));
        }
        let world = DeviceGroup::new(Arc::new(world), Device::Cpu);
        let [tp, pp, dp, ep, edp] =
            <[DeviceGroup; 5]>::try_from(groups).map_err(|_| CommError::Env("internal: five axes".into()))?;
        Ok(Mesh { shape, rank, world, tp, pp, dp, ep, edp, _rendezvous: None })
    }

    /// The world communicator, then one per axis (tp, pp, dp, ep, edp, the same order on every
    /// rank, as NCCL's blocking-until-all initialisation of each needs).
    fn nccl_mesh(
        rdv: &mut crate::Rendezvous,
        env: &LaunchEnv,
        shape: MeshShape,
    ) -> Result<(DeviceGroup, [DeviceGroup; 5])> {
        let (world, device) = DeviceGroup::nccl_over(rdv, env)?;
        let world = DeviceGroup::new(Arc::new(world), device);
        let gpu = tp_kernels::Gpu::get(env.local_rank)
            .map_err(|e| CommError::Tensor { op: "Mesh::from_launch_env", source: e.into() })?;
        let nccl = crate::nccl::Nccl::get()?;
        let mut out = Vec::with_capacity(5);
        for (name, axis) in [("tp", Axis::Tp), ("pp", Axis::Pp), ("dp", Axis::Dp), ("ep", Axis::Ep), ("edp", Axis::Edp)]
        {
            let members = shape.group_ranks(env.rank, axis);
            if members.len() == env.world_size {
                out.push(world.clone());
                continue;
            }
            let me = shape.axis_index(env.rank, axis);
            let id = if members.len() == 1 {
                nccl.unique_id()?.to_vec()
            } else {
                let root = members[0];
                let key = format!("mesh-{name}-{}", shape.group_index(env.rank, axis));
                let mine = if env.rank == root { Some(nccl.unique_id()?.to_vec()) } else { None };
                rdv.broadcast_bytes(&key, root, mine.as_deref())?
            };
            let id: [u8; 128] = id.try_into().map_err(|v: Vec<u8>| {
                CommError::Rendezvous(format!("NCCL id of {} bytes for the {name} group, expected 128", v.len()))
            })?;
            let comm = crate::nccl::NcclComm::init(id, me, members.len(), gpu.clone(), env.timeout)?;
            out.push(DeviceGroup::new(Arc::new(comm), device));
        }
        rdv.barrier("mesh-ready")?;
        let groups =
            <[DeviceGroup; 5]>::try_from(out).map_err(|_| CommError::Rendezvous("internal: five axes".into()))?;
        Ok((world, groups))
    }

    /// The axes' sizes.
    pub fn shape(&self) -> MeshShape {
        self.shape
    }
    /// This rank's coordinates.
    pub fn coords(&self) -> Coords {
        self.shape.coords(self.rank)
    }
    /// The global rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// The group along `axis`.
    pub fn group(&self, axis: Axis) -> &DeviceGroup {
        match axis {
            Axis::Tp => &self.tp,
            Axis::Pp => &self.pp,
            Axis::Dp => &self.dp,
            Axis::Ep => &self.ep,
            Axis::Edp => &self.edp,
        }
    }
    /// The tensor-parallel group (this stage's ranks of this replica).
    pub fn tp(&self) -> &DeviceGroup {
        &self.tp
    }
    /// The pipeline group (rank `i` = stage `i`).
    pub fn pp(&self) -> &DeviceGroup {
        &self.pp
    }
    /// The data-parallel group (the same stage and tensor-parallel rank of every replica).
    pub fn dp(&self) -> &DeviceGroup {
        &self.dp
    }
    /// The expert-parallel group: the replicas over which a mixture's experts are placed (one
    /// rank without expert parallelism).
    pub fn ep(&self) -> &DeviceGroup {
        &self.ep
    }
    /// The expert-data-parallel group: the replicas holding the same experts (the
    /// data-parallel group without expert parallelism).
    pub fn edp(&self) -> &DeviceGroup {
        &self.edp
    }
    /// Every rank.
    pub fn world(&self) -> &DeviceGroup {
        &self.world
    }
    /// Where this rank computes.
    pub fn device(&self) -> Device {
        self.world.device()
    }
    /// Fails every group of this rank, so that a failure anywhere ends every rank's waits.
    pub fn abort(&self, reason: &str) {
        for g in [&self.world, &self.tp, &self.pp, &self.dp, &self.ep, &self.edp] {
            g.abort(reason);
        }
    }
}
