//! Jobs of several processes for tests: a command under `mpirun -np N` or `srun -n N` (a
//! one-node SLURM with PMIx, as `.ci/slurm.sh` brings up), run with a bound on its time.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The launchers a test starts processes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// Open MPI's `mpirun` (as root, more processes than cores allowed).
    Mpirun,
    /// SLURM's `srun` (PMIx; a rank that fails ends the step).
    Srun,
}

impl Launcher {
    /// Both, in that order.
    pub const ALL: [Launcher; 2] = [Launcher::Mpirun, Launcher::Srun];

    /// `program` as `n` processes under this launcher (stdin closed, stdout and stderr piped).
    pub fn command(self, n: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = match self {
            Launcher::Mpirun => {
                let mut c = Command::new("mpirun");
                c.args(["--allow-run-as-root", "--oversubscribe", "-np", &n.to_string()]);
                c
            }
            Launcher::Srun => {
                let mut c = Command::new("srun");
                c.args(["--kill-on-bad-exit=1", "--mpi=pmix", "-n", &n.to_string()]);
                c
            }
        };
        c.arg(program).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        c
    }
}

/// What a bounded run gave.
#[derive(Debug)]
pub struct Finished {
    /// Whether it exited with status 0 (`false` if it had to be killed).
    pub success: bool,
    /// Whether it ran past its limit and was killed.
    pub killed: bool,
    /// Its stdout then its stderr.
    pub output: String,
    /// Wall time from start to exit.
    pub elapsed: Duration,
}

/// Runs `cmd` (its stdout and stderr piped), killing it if it runs past `limit`.
///
/// Panics (a test helper): the program cannot be started, naming it and how to install the
/// launchers.
pub fn run_bounded(mut cmd: Command, limit: Duration) -> Finished {
    let started = Instant::now();
    let mut child = cmd.spawn().unwrap_or_else(|e| {
        panic!("cannot start {:?} ({e}); .ci/slurm.sh installs Open MPI and starts a one-node SLURM", cmd.get_program())
    });
    let read = |r: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut r) = r {
                let _ = r.read_to_string(&mut s);
            }
            s
        })
    };
    let out = read(child.stdout.take().map(|o| Box::new(o) as Box<dyn std::io::Read + Send>));
    let err = read(child.stderr.take().map(|o| Box::new(o) as Box<dyn std::io::Read + Send>));
    let (success, killed) = loop {
        match child.try_wait() {
            Ok(Some(s)) => break (s.success(), false),
            Ok(None) if started.elapsed() > limit => {
                let _ = child.kill();
                let _ = child.wait();
                break (false, true);
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(_) => break (false, false),
        }
    };
    let elapsed = started.elapsed();
    let output = format!("{}{}", out.join().unwrap_or_default(), err.join().unwrap_or_default());
    Finished { success, killed, output, elapsed }
}
