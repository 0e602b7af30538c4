//! [`DeviceGroup`]: the group a user holds: a communicator plus the device this rank computes on.

use crate::communicator::{Communicator, ReduceOp};
use crate::error::{CommError, Result, tensor_err};
use crate::local::LocalGroup;
use std::sync::Arc;
use std::time::Duration;
use tp_core::{Device, Tensor};

/// This rank's view of a tensor-parallel group: who it is, where its tensors live, and the
/// collectives that join the shards. Tensors passed in must be on [`DeviceGroup::device`].
#[derive(Clone)]
pub struct DeviceGroup {
    comm: Arc<dyn Communicator>,
    device: Device,
    /// Keeps rank 0's rendezvous store alive for the group's life (from_env).
    _rendezvous: Option<Arc<std::sync::Mutex<crate::Rendezvous>>>,
}

impl std::fmt::Debug for DeviceGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceGroup(rank {} of {} on {})", self.rank(), self.world_size(), self.device)
    }
}

impl DeviceGroup {
    /// Wraps any communicator; this rank computes on `device`.
    pub fn new(comm: Arc<dyn Communicator>, device: Device) -> Self {
        DeviceGroup { comm, device, _rendezvous: None }
    }

    /// `world_size` ranks as threads of this process ([`LocalGroup`]); rank `r` computes on
    /// `device(r)` (several ranks may share one GPU). Move each handle into its own thread.
    ///
    /// Errors: as [`LocalGroup::with_timeout`]: at most [`MAX_WORLD_SIZE`](crate::MAX_WORLD_SIZE)
    /// ranks, a timeout of at most [`MAX_TIMEOUT`](crate::MAX_TIMEOUT).
    pub fn local(world_size: usize, timeout: Duration, device: impl Fn(usize) -> Device) -> Result<Vec<DeviceGroup>> {
        Ok(LocalGroup::with_timeout(world_size, timeout)?
            .into_iter()
            .enumerate()
            .map(|(r, g)| DeviceGroup::new(Arc::new(g), device(r)))
            .collect())
    }

    /// The torchrun way: reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
    /// `MASTER_PORT` (and `TP_TIMEOUT_SECS`), joins the rendezvous, takes GPU `LOCAL_RANK`,
    /// checks that no two ranks share a GPU (NCCL refuses that, NVIDIA/nccl#1241), passes rank
    /// 0's NCCL unique id to everyone and creates the NCCL communicator, all within the deadline.
    pub fn from_env() -> Result<DeviceGroup> {
        Self::from_launch_env(&crate::LaunchEnv::from_env()?)
    }

    /// [`from_env`](Self::from_env) with the launch settings given explicitly.
    pub fn from_launch_env(env: &crate::LaunchEnv) -> Result<DeviceGroup> {
        let mut rdv = crate::Rendezvous::join(env)?;
        match Self::nccl_over(&mut rdv, env) {
            Ok((comm, device)) => Ok(DeviceGroup {
                comm: Arc::new(comm),
                device,
                _rendezvous: Some(Arc::new(std::sync::Mutex::new(rdv))),
            }),
            Err(e) => {
                // Rank 0 tells the others why, and nobody waits for the rest of the job.
                rdv.abort(&e.to_string());
                Err(e)
            }
        }
    }

    /// After the rendezvous: this rank's GPU, the duplicate-GPU check, and the NCCL communicator.
    pub(crate) fn nccl_over(
        rdv: &mut crate::Rendezvous,
        env: &crate::LaunchEnv,
    ) -> Result<(crate::nccl::NcclComm, Device)> {
        let gpu =
            tp_kernels::Gpu::get(env.local_rank).map_err(|e| CommError::Tensor { op: "from_env", source: e.into() })?;
        // The GPU's UUID: the same physical device gives the same id in every process.
        let uuid = gpu.uuid().map_err(|e| CommError::Tensor { op: "from_env", source: e.into() })?;
        let me = format!("GPU {uuid} ({}, cuda:{} of rank {})", gpu.name(), gpu.ordinal(), env.rank);
        let all = rdv.all_gather_bytes("gpu", me.as_bytes())?;
        let same_gpu = |r: usize| all[r].split(|&b| b == b' ').nth(1) == Some(uuid.as_bytes());
        if let Some(other) = (0..env.world_size).find(|&r| r != env.rank && same_gpu(r)) {
            return Err(CommError::Nccl {
                op: "from_env",
                message: format!(
                    "ranks {} and {other} are both on {me}; NCCL needs one GPU per rank (check LOCAL_RANK, or use \
                     LocalGroup to share a GPU)",
                    env.rank
                ),
            });
        }
        let nccl = crate::nccl::Nccl::get()?;
        let id = if env.rank == 0 { Some(nccl.unique_id()?) } else { None };
        let id = rdv.broadcast_bytes("nccl-id", 0, id.as_ref().map(|i| &i[..]))?;
        let id: [u8; 128] = id
            .try_into()
            .map_err(|v: Vec<u8>| CommError::Rendezvous(format!("NCCL id of {} bytes, expected 128", v.len())))?;
        let comm = crate::nccl::NcclComm::init(id, env.rank, env.world_size, gpu.clone(), env.timeout)?;
        rdv.barrier("nccl-ready")?;
        Ok((comm, Device::Cuda(gpu.ordinal())))
    }

    /// One process driving several GPUs: an NCCL group with one rank per entry of `ordinals`
    /// (rank `r` on GPU `ordinals[r]`), each communicator created on its own thread within
    /// `timeout`. Move each returned group into the thread that drives its GPU.
    ///
    /// Errors: an empty or repeated ordinal list (NCCL needs one GPU per rank), more than
    /// [`MAX_WORLD_SIZE`](crate::MAX_WORLD_SIZE) ordinals, a thread that cannot be started
    /// ([`CommError::Limit`]), CUDA and NCCL errors.
    pub fn nccl_local(ordinals: &[usize], timeout: Duration) -> Result<Vec<DeviceGroup>> {
        if ordinals.is_empty() {
            return Err(CommError::ZeroWorldSize { op: "DeviceGroup::nccl_local" });
        }
        if ordinals.len() > crate::MAX_WORLD_SIZE {
            let why = format!("{} ranks exceed the maximum of {}", ordinals.len(), crate::MAX_WORLD_SIZE);
            return Err(CommError::Limit { op: "DeviceGroup::nccl_local", why });
        }
        if let Some(dup) = ordinals.iter().enumerate().find(|(i, o)| ordinals[..*i].contains(o)) {
            return Err(CommError::Nccl {
                op: "DeviceGroup::nccl_local",
                message: format!("GPU {} is listed twice; NCCL needs one GPU per rank", dup.1),
            });
        }
        let gpus = ordinals
            .iter()
            .map(|&o| tp_kernels::Gpu::get(o).map_err(|e| CommError::Tensor { op: "nccl_local", source: e.into() }))
            .collect::<Result<Vec<_>>>()?;
        let id = crate::nccl::Nccl::get()?.unique_id()?;
        let world = ordinals.len();
        let comms: Vec<Result<crate::nccl::NcclComm>> = std::thread::scope(|s| {
            let handles: Vec<_> = gpus
                .iter()
                .enumerate()
                .map(|(rank, gpu)| {
                    std::thread::Builder::new()
                        .name(format!("tp-nccl-init-{rank}"))
                        .spawn_scoped(s, move || crate::nccl::NcclComm::init(id, rank, world, gpu.clone(), timeout))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| match h {
                    Ok(h) => h.join().unwrap_or_else(|_| {
                        Err(CommError::Nccl { op: "nccl_local", message: "an init thread panicked".into() })
                    }),
                    Err(e) => {
                        Err(CommError::Limit { op: "nccl_local", why: format!("cannot start an init thread: {e}") })
                    }
                })
                .collect()
        });
        comms.into_iter().zip(ordinals).map(|(c, &o)| Ok(DeviceGroup::new(Arc::new(c?), Device::Cuda(o)))).collect()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }
    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }
    /// Where this rank's tensors live.
    pub fn device(&self) -> Device {
        self.device
    }
    /// The underlying communicator.
    pub fn communicator(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    fn check(&self, op: &'static str, x: &Tensor) -> Result<()> {
        if x.device() != self.device {
            return Err(CommError::Tensor {
                op,
                source: tp_core::Error::DeviceMismatch { op, lhs: self.device, rhs: x.device() },
            });
        }
        Ok(())
    }

    /// Gathers every rank's `x` along `dim` in rank order (uneven lengths exact). In a
    /// column-parallel layer this joins the output shards: `Y = [Y_0, .., Y_{p-1}]`.
    pub fn all_gather(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        self.check("all_gather", x)?;
        self.comm.all_gather(x, dim)
    }

    /// [`all_gather`](Self::all_gather) of shards split by the balanced policy of
    /// `tp_core::TensorShard`: `x` is this rank's shard of a dim of length `global_len`. Every
    /// rank's length is known, so no backend needs to exchange them (no host synchronisation on
    /// NCCL). How column-parallel outputs are joined.
    pub fn all_gather_balanced(&self, x: &Tensor, dim: usize, global_len: usize) -> Result<Tensor> {
        self.check("all_gather", x)?;
        let shards = tp_core::TensorShard::for_all_ranks(dim, global_len, self.world_size())
            .map_err(tensor_err("all_gather"))?;
        let lengths: Vec<usize> = shards.iter().map(|s| s.len()).collect();
        self.comm.all_gather_sized(x, dim, &lengths)
    }

    /// All-to-all with variable counts: this rank's rows of `x` go out in consecutive chunks of
    /// `send_counts[j]` rows to rank `j`; the rows received (in rank order) and their counts per
    /// rank come back ([`Communicator::all_to_all`]). How tokens reach the ranks that hold
    /// their experts when tokens are split over ranks.
    pub fn all_to_all(&self, x: &Tensor, send_counts: &[usize]) -> Result<(Tensor, Vec<usize>)> {
        self.check("all_to_all", x)?;
        self.comm.all_to_all(x, send_counts)
    }

    /// [`all_gather`](Self::all_gather) with every rank's length along `dim` given.
    pub fn all_gather_sized(&self, x: &Tensor, dim: usize, lengths: &[usize]) -> Result<Tensor> {
        self.check("all_gather", x)?;
        self.comm.all_gather_sized(x, dim, lengths)
    }

    /// [`all_gather`](Self::all_gather) without waiting: the result arrives through
    /// [`Work::wait`](crate::Work::wait).
    pub fn all_gather_async(&self, x: &Tensor, dim: usize) -> Result<crate::Work> {
        self.check("all_gather", x)?;
        self.comm.all_gather_async(x, dim)
    }

    /// [`all_reduce`](Self::all_reduce) without waiting: overlap it with other work, then
    /// [`Work::wait`](crate::Work::wait) for the sum.
    pub fn all_reduce_async(&self, x: &Tensor, op: ReduceOp) -> Result<crate::Work> {
        self.check("all_reduce", x)?;
        self.comm.all_reduce_async(x, op)
    }

    /// Element-wise reduction over ranks; in a row-parallel layer, `Y = Σ_r X_r A_r`.
    pub fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.check("all_reduce", x)?;
        self.comm.all_reduce(x, op)
    }

    /// The reduction over ranks, of which this rank keeps its balanced shard along `dim`.
    pub fn reduce_scatter(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        self.check("reduce_scatter", x)?;
        self.comm.reduce_scatter(x, dim, op)
    }

    /// Rank `root`'s `x` on every rank.
    pub fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        self.check("broadcast", x)?;
        self.comm.broadcast(x, root)
    }

    /// Waits for every rank.
    pub fn barrier(&self) -> Result<()> {
        self.comm.barrier()
    }

    /// Fails the group for every rank (see [`Communicator::abort`]).
    pub fn abort(&self, reason: &str) {
        self.comm.abort(reason)
    }

    /// `all_reduce` into `x` itself.
    pub fn all_reduce_into(&self, x: &mut Tensor, op: ReduceOp) -> Result<()> {
        self.check("all_reduce_into", x)?;
        self.comm.all_reduce_into(x, op)
    }

    /// `all_gather` into `out`, which must have the gathered shape.
    pub fn all_gather_into(&self, x: &Tensor, dim: usize, out: &mut Tensor) -> Result<()> {
        self.check("all_gather_into", x)?;
        self.check("all_gather_into", out)?;
        self.comm.all_gather_into(x, dim, out)
    }

    /// Point-to-point (pipeline stages): posts `x` (on this rank's device) for rank `dst` of
    /// this group without waiting for it to be received. [`Work::wait`](crate::Work::wait)
    /// returns `x` itself (a clone sharing its storage) once `dst` has received it, or the error
    /// that ended the send: a [`CommError::Mismatch`] when `dst` expected other dims or another
    /// dtype, [`CommError::Timeout`] naming `dst` when it did not receive within the group's
    /// deadline, [`CommError::Poisoned`] when the group failed meanwhile. The `k`-th send from
    /// this rank to `dst` is the `k`-th receive at `dst` from this rank. `dst` equal to this
    /// rank is a [`CommError::Mismatch`], past the group a [`CommError::RankOutOfRange`], both
    /// at the call. See [`Communicator::send_async`] for what each backend does.
    pub fn send_async(&self, x: &Tensor, dst: usize) -> Result<crate::Work> {
        self.check("send", x)?;
        self.comm.send_async(x, dst)
    }

    /// [`send_async`](Self::send_async), waited for: returns once `dst` has received `x`.
    pub fn send(&self, x: &Tensor, dst: usize) -> Result<()> {
        self.send_async(x, dst)?.wait().map(drop)
    }

    /// Point-to-point: posts the receive of the next tensor from rank `src`, which must be a
    /// `dims` tensor of `dtype`; [`Work::wait`](crate::Work::wait) returns it on this rank's
    /// device. A message of other dims or another dtype is a [`CommError::Mismatch`] naming
    /// both shapes, here and at the sender; a sender that does not send within the group's
    /// deadline, a [`CommError::Timeout`] naming `src`. Dropping the work unwaited still takes
    /// (and discards) its message, as a posted NCCL receive does. `src` is checked as in
    /// [`send_async`](Self::send_async).
    pub fn recv_async(&self, dims: &[usize], dtype: tp_core::DType, src: usize) -> Result<crate::Work> {
        let device = self.device;
        let work = self.comm.recv_async(dims, dtype, src)?;
        Ok(work.map(move |t| t.to_device(&device).map_err(tensor_err("recv"))))
    }

    /// [`recv_async`](Self::recv_async), waited for: the next tensor from rank `src`, on this
    /// rank's device.
    pub fn recv(&self, dims: &[usize], dtype: tp_core::DType, src: usize) -> Result<Tensor> {
        self.recv_async(dims, dtype, src)?.wait()
    }

    /// Sends and receives posted together, one work per operation in the order given (see
    /// [`Communicator::send_recv_async`]): the form for neighbours that both send to each other
    /// before receiving, as 1F1B's stages do. Each send is checked as in
    /// [`send_async`](Self::send_async); each received tensor arrives on this rank's device.
    pub fn send_recv_async(&self, ops: &[crate::P2p<'_>]) -> Result<Vec<crate::Work>> {
        for op in ops {
            if let crate::P2p::Send { x, .. } = op {
                self.check("send", x)?;
            }
        }
        let works = self.comm.send_recv_async(ops)?;
        let device = self.device;
        Ok(works
            .into_iter()
            .zip(ops)
            .map(|(w, op)| match op {
                crate::P2p::Send { .. } => w,
                crate::P2p::Recv { .. } => w.map(move |t| t.to_device(&device).map_err(tensor_err("recv"))),
            })
            .collect())
    }

    /// Moves `x` to this rank's device (a cheap clone when already there).
    pub fn to_local(&self, x: &Tensor) -> Result<Tensor> {
        x.to_device(&self.device).map_err(tensor_err("to_local"))
    }
}
