//! `tp-probe`: checks that a job's processes can find each other, the way tp's ranks will.
//!
//! Launch it exactly as you would launch the real job (`torchrun --no-python --nproc-per-node N
//! tp-probe`, `srun ... tp-probe`, or by hand with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT):
//! every rank joins the rendezvous, receives an id from rank 0 and passes a barrier. It prints one
//! line per step and exits 0, or prints the error (missing rank, duplicate rank, WORLD_SIZE
//! mismatch, port in use, unreachable or stopped rank 0) and exits 1 within `TP_TIMEOUT_SECS`
//! plus one second (`DEADLINE_SLACK`).

use tp_comm::{LaunchEnv, Rendezvous};

fn main() {
    if let Err(e) = run() {
        eprintln!("tp-probe: {e}");
        std::process::exit(1);
    }
}

fn run() -> tp_comm::Result<()> {
    let env = LaunchEnv::from_env()?;
    let mut rdv = Rendezvous::join(&env)?;
    println!("rank {} of {}: joined {}:{}", env.rank, env.world_size, env.master_addr, env.master_port);
    let id = format!("job-id-from-rank-0-pid-{}", std::process::id());
    let got = rdv.broadcast_bytes("probe-id", 0, (env.rank == 0).then_some(id.as_bytes()))?;
    println!("rank {}: received id {}", env.rank, tp_comm::peer_text(&got));
    rdv.barrier("probe-done")?;
    println!("rank {}: ok", env.rank);
    Ok(())
}
