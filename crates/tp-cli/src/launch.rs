//! How this process was launched: as one rank of several (torchrun, srun, mpirun), and the
//! MPI world for `--backend mpi`.

use crate::error::CliError;

/// `Some("rank 1 of 4 launched by mpirun")` when a launcher started this process as one rank of
/// several (a `--backend local` run there would repeat the whole job in every process).
pub fn launched_as_rank() -> Option<String> {
    let env = tp_comm::LaunchEnv::from_lookup(|k| match k {
        // A torchrun-style set needs an address; this check only needs the sizes.
        "MASTER_ADDR" => Some("127.0.0.1".into()),
        "MASTER_PORT" => Some("1".into()),
        k => std::env::var(k).ok(),
    })
    .ok()?;
    let by = match env.launcher {
        tp_comm::Launcher::Torchrun => "torchrun",
        tp_comm::Launcher::Slurm => "srun",
        tp_comm::Launcher::OpenMpi => "mpirun",
    };
    (env.world_size > 1).then(|| format!("rank {} of {} launched by {by}", env.rank, env.world_size))
}

/// Refuses `--backend local` in a process that is one rank of several.
pub fn refuse_local_under_launcher() -> Result<(), CliError> {
    match launched_as_rank() {
        Some(launch) => Err(CliError::Engine(format!(
            "this process is {launch}, but --backend local runs every rank as a thread of one process: pass \
             --backend mpi to make each process a rank"
        ))),
        None => Ok(()),
    }
}

/// The MPI job's world (every process), every wait bounded by `TP_TIMEOUT_SECS`.
pub fn mpi_world() -> Result<tp_comm::mpi::MpiComm, CliError> {
    let timeout = tp_comm::LaunchEnv::timeout_from_lookup(|k| std::env::var(k).ok())
        .map_err(|e| CliError::Engine(e.to_string()))?;
    tp_comm::mpi::MpiComm::world(timeout).map_err(|e| CliError::Engine(format!("--backend mpi: {e}")))
}

/// Ends MPI in this process after a job's normal end.
pub fn mpi_finalize() -> Result<(), CliError> {
    tp_comm::mpi::finalize().map_err(|e| CliError::Engine(e.to_string()))
}
