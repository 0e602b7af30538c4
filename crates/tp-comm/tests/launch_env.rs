//! The launchers people already run give the same coordinates: torchrun's variables, srun's
//! and Open MPI's mpirun's; partial sets and conflicting sets are refused naming the
//! variables; a torchrun nested in an allocation wins, and so does an mpirun inside a SLURM
//! allocation; SLURM's node list gives the master.

use std::collections::HashMap;
use tp_comm::{LaunchEnv, Launcher, first_host};

fn env_of(pairs: &[(&str, &str)]) -> tp_comm::Result<LaunchEnv> {
    let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    LaunchEnv::from_lookup(|k| m.get(k).cloned())
}

fn coords(e: &LaunchEnv) -> (usize, usize, usize, &str) {
    (e.rank, e.world_size, e.local_rank, e.master_addr.as_str())
}

#[test]
fn torchrun_srun_and_mpirun_give_the_same_coordinates() {
    let t = env_of(&[("RANK", "5"), ("WORLD_SIZE", "16"), ("LOCAL_RANK", "5"), ("MASTER_ADDR", "gpu01")]).unwrap();
    let s = env_of(&[
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "16"),
        ("SLURM_LOCALID", "5"),
        ("SLURM_JOB_NODELIST", "gpu[01-02]"),
    ])
    .unwrap();
    let o = env_of(&[
        ("OMPI_COMM_WORLD_RANK", "5"),
        ("OMPI_COMM_WORLD_SIZE", "16"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "5"),
        ("MASTER_ADDR", "gpu01"),
    ])
    .unwrap();
    assert_eq!(coords(&t), (5, 16, 5, "gpu01"));
    assert_eq!(coords(&s), coords(&t));
    assert_eq!(coords(&o), coords(&t));
    assert_eq!((t.launcher, s.launcher, o.launcher), (Launcher::Torchrun, Launcher::Slurm, Launcher::OpenMpi));
    assert_eq!((s.master_port, o.master_port), (29500, 29500));
    // Local rank defaults to the rank; MASTER_ADDR wins over the node list.
    let s = env_of(&[
        ("SLURM_PROCID", "3"),
        ("SLURM_NTASKS", "4"),
        ("MASTER_ADDR", "head"),
        ("SLURM_JOB_NODELIST", "n[1-2]"),
    ])
    .unwrap();
    assert_eq!(coords(&s), (3, 4, 3, "head"));
    // mpirun without MASTER_ADDR: one machine.
    let o = env_of(&[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2")]).unwrap();
    assert_eq!(coords(&o), (1, 2, 1, "127.0.0.1"));
}

#[test]
fn partial_sets_are_refused_naming_the_missing_variable() {
    let msg = |pairs: &[(&str, &str)]| env_of(pairs).unwrap_err().to_string();
    assert!(msg(&[("SLURM_PROCID", "0")]).contains("SLURM_NTASKS is not set"));
    assert!(msg(&[("SLURM_NTASKS", "2")]).contains("SLURM_PROCID is not set"));
    assert!(msg(&[("OMPI_COMM_WORLD_RANK", "0")]).contains("OMPI_COMM_WORLD_SIZE is not set"));
    assert!(msg(&[("OMPI_COMM_WORLD_SIZE", "2")]).contains("OMPI_COMM_WORLD_RANK is not set"));
    let none = msg(&[]);
    assert!(none.contains("RANK is not set") && none.contains("srun") && none.contains("mpirun"), "{none}");
    assert!(
        msg(&[("SLURM_PROCID", "2"), ("SLURM_NTASKS", "2")]).contains("SLURM_PROCID=2 is not below SLURM_NTASKS=2")
    );
    assert!(
        msg(&[("OMPI_COMM_WORLD_RANK", "x"), ("OMPI_COMM_WORLD_SIZE", "2")]).contains("OMPI_COMM_WORLD_RANK=\"x\"")
    );
}

#[test]
fn conflicting_sets_are_refused_naming_both_and_agreeing_ones_accepted() {
    let e = env_of(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")])
        .unwrap_err()
        .to_string();
    assert!(e.contains("torchrun's RANK=1 WORLD_SIZE=2") && e.contains("SLURM's SLURM_PROCID=0 SLURM_NTASKS=2"), "{e}");
    let e = env_of(&[("RANK", "0"), ("WORLD_SIZE", "4"), ("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")])
        .unwrap_err();
    assert!(matches!(e, tp_comm::CommError::Env(_)));
    let e = e.to_string();
    assert!(
        e.contains("torchrun's RANK=0 WORLD_SIZE=4")
            && e.contains("Open MPI's OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=2"),
        "{e}"
    );
    let e = env_of(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "1"),
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
    ])
    .unwrap_err()
    .to_string();
    assert!(e.contains("LOCAL_RANK=1") && e.contains("OMPI_COMM_WORLD_LOCAL_RANK=0"), "{e}");
    // Agreeing sets (a wrapper that exports torchrun's names beside SLURM's) are fine.
    let ok = env_of(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2")]).unwrap();
    assert_eq!((ok.rank, ok.world_size, ok.launcher), (1, 2, Launcher::Torchrun));
    let ok = env_of(&[
        ("RANK", "3"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("OMPI_COMM_WORLD_RANK", "3"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
    ])
    .unwrap();
    assert_eq!(coords(&ok), (3, 4, 1, "127.0.0.1"));
    // A local rank given by one set only is not a disagreement.
    let ok = env_of(&[
        ("RANK", "3"),
        ("WORLD_SIZE", "4"),
        ("SLURM_PROCID", "3"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_LOCALID", "1"),
    ])
    .unwrap();
    assert_eq!(coords(&ok), (3, 4, 3, "127.0.0.1"));
    // Without TORCHELASTIC_RUN_ID a RANK exported into every task of an srun is caught.
    for procid in ["1", "2", "3"] {
        let e = env_of(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("SLURM_PROCID", procid), ("SLURM_NTASKS", "4")]);
        assert!(e.unwrap_err().to_string().contains(&format!("SLURM_PROCID={procid}")));
    }
}

#[test]
fn an_mpirun_inside_a_slurm_allocation_takes_open_mpis_coordinates() {
    // `sbatch -N2 --ntasks-per-node 8` then `mpirun -np 16 ...`: every MPI process inherits the
    // batch step's SLURM_PROCID=0 and SLURM_NTASKS=16 (or its daemon's), Open MPI's are its own.
    for r in [0usize, 1, 9, 15] {
        let rank = r.to_string();
        let local = (r % 8).to_string();
        let e = env_of(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_JOB_NODELIST", "node[01-02]"),
            ("OMPI_COMM_WORLD_RANK", &rank),
            ("OMPI_COMM_WORLD_SIZE", "16"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", &local),
            ("MASTER_ADDR", "node01"),
        ])
        .unwrap();
        assert_eq!(coords(&e), (r, 16, r % 8, "node01"));
        assert_eq!(e.launcher, Launcher::OpenMpi);
    }
    // SLURM's are not read at all then: a batch step without --ntasks has SLURM_PROCID alone.
    let e = env_of(&[("SLURM_PROCID", "0"), ("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2")]).unwrap();
    assert_eq!((e.rank, e.world_size, e.launcher), (1, 2, Launcher::OpenMpi));
    // Without MASTER_ADDR the master is not taken from SLURM's node list (mpirun's default).
    let e = env_of(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_JOB_NODELIST", "node[01-02]"),
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
    ])
    .unwrap();
    assert_eq!(e.master_addr, "127.0.0.1");
}

#[test]
fn a_torchrun_nested_in_an_allocation_takes_its_own_coordinates() {
    // `srun --ntasks-per-node 1 torchrun --nnodes 2 --nproc-per-node 8 ...`: SLURM's variables
    // count the two agents, torchrun's the sixteen workers.
    let e = env_of(&[
        ("RANK", "11"),
        ("WORLD_SIZE", "16"),
        ("LOCAL_RANK", "3"),
        ("TORCHELASTIC_RUN_ID", "job"),
        ("MASTER_ADDR", "node01"),
        ("SLURM_PROCID", "1"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_JOB_NODELIST", "node[01-02]"),
    ])
    .unwrap();
    assert_eq!(coords(&e), (11, 16, 3, "node01"));
    assert_eq!(e.launcher, Launcher::Torchrun);
    // The others are not read at all: partial or garbled sets beside it do not matter.
    let e = env_of(&[
        ("RANK", "5"),
        ("WORLD_SIZE", "8"),
        ("TORCHELASTIC_RUN_ID", "none"),
        ("SLURM_PROCID", "0"),
        ("OMPI_COMM_WORLD_RANK", "x"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
    ])
    .unwrap();
    assert_eq!((e.rank, e.world_size, e.launcher), (5, 8, Launcher::Torchrun));
    // TORCHELASTIC_RUN_ID without torchrun's set changes nothing.
    let e = env_of(&[("TORCHELASTIC_RUN_ID", "job"), ("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2")]).unwrap();
    assert_eq!((e.rank, e.launcher), (1, Launcher::Slurm));
    // And torchrun's own set must still be whole and valid.
    let e = env_of(&[("RANK", "1"), ("TORCHELASTIC_RUN_ID", "job"), ("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2")]);
    assert!(e.unwrap_err().to_string().contains("WORLD_SIZE is not set"));
}

#[test]
fn the_first_host_of_a_slurm_node_list() {
    for (list, first) in [
        ("node[01-04,07],login5", "node01"),
        ("gpu-a[1-2]-b[3-4]", "gpu-a1-b3"),
        ("host1,host2", "host1"),
        ("single", "single"),
        ("n[007]", "n007"),
        ("n[007-012]", "n007"),
        ("n[8-10]", "n8"),
        ("rack[2,5]n[10-11],x", "rack2n10"),
        ("a[1-2],b[3-4],c", "a1"),
        ("[3-4]x", "3x"),
        ("node1.cluster.example,node2.cluster.example", "node1.cluster.example"),
        (" c[3-9] ", "c3"),
    ] {
        assert_eq!(first_host(list).unwrap(), first, "{list}");
    }
    for (list, why) in [
        ("", "no host"),
        ("   ", "no host"),
        (",node1", "no host"),
        ("node1,,node2", "no host"),
        ("node1,", "no host"),
        ("node[01-04", "without its ']'"),
        ("node01-04]", "without its '['"),
        ("node[1]]", "without its '['"),
        ("node[]", "not a list of numbers"),
        ("node[a-b]", "not a list of numbers"),
        ("node[1-]", "not a list of numbers"),
        ("node[-3]", "not a list of numbers"),
        ("node[1-2-3]", "not a list of numbers"),
        ("node[1,,2]", "not a list of numbers"),
        ("node[1, 2]", "not a list of numbers"),
        ("node[1-2,x]", "not a list of numbers"),
        ("node[99999999999999999999]", "too large"),
        ("node[9-3]", "runs backwards"),
        ("node[01-02,7-5]", "runs backwards"),
        ("node1,m[3-1]", "runs backwards"),
        ("node[[1]]", "nested"),
        ("node[1[2]]", "nested"),
        ("node 1", "space"),
        ("node\t1,node2", "space"),
    ] {
        let e = first_host(list).unwrap_err();
        assert!(matches!(e, tp_comm::CommError::Env(_)), "{list:?}: {e:?}");
        let e = e.to_string();
        assert!(e.contains("SLURM_JOB_NODELIST") && e.contains(why), "{list:?}: {e}");
    }
}

#[test]
fn the_master_under_slurm_is_the_first_host_of_the_steps_node_list() {
    let srun = |extra: &[(&'static str, &'static str)]| {
        let mut v = vec![("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")];
        v.extend_from_slice(extra);
        env_of(&v)
    };
    assert_eq!(srun(&[("SLURM_JOB_NODELIST", "gpu[07-08]")]).unwrap().master_addr, "gpu07");
    // A step on part of the allocation: its own list (task 0 runs on its first node).
    let e = srun(&[("SLURM_JOB_NODELIST", "gpu[01-04]"), ("SLURM_STEP_NODELIST", "gpu[03-04]")]).unwrap();
    assert_eq!(e.master_addr, "gpu03");
    assert_eq!(srun(&[("SLURM_NODELIST", "old[5-6]")]).unwrap().master_addr, "old5");
    // MASTER_ADDR overrides the node list, which is then not even parsed.
    let e = srun(&[("MASTER_ADDR", "head"), ("SLURM_JOB_NODELIST", "gpu[01-04"), ("SLURM_STEP_NODELIST", "[")]);
    assert_eq!(e.unwrap().master_addr, "head");
    // No node list at all: this machine.
    assert_eq!(srun(&[]).unwrap().master_addr, "127.0.0.1");
    // A malformed list is refused when it is needed, naming the variable it came from.
    let e = srun(&[("SLURM_JOB_NODELIST", "n[1-")]).unwrap_err();
    assert!(matches!(e, tp_comm::CommError::Env(_)) && e.to_string().contains("SLURM_JOB_NODELIST=\"n[1-\""), "{e}");
    let e = srun(&[("SLURM_JOB_NODELIST", "n[1-2]"), ("SLURM_STEP_NODELIST", "n[2-1]")]).unwrap_err().to_string();
    assert!(e.contains("SLURM_STEP_NODELIST") && e.contains("runs backwards"), "{e}");
    // A wrapper script under srun that exports torchrun's names beside SLURM's (agreeing).
    let e = env_of(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("SLURM_PROCID", "1"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_JOB_NODELIST", "gpu[07-08]"),
    ])
    .unwrap();
    assert_eq!((e.master_addr.as_str(), e.launcher), ("gpu07", Launcher::Torchrun));
    // The node list is SLURM's: torchrun's or Open MPI's coordinates alone do not use it.
    let e = env_of(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("SLURM_JOB_NODELIST", "gpu[07-08]")]).unwrap();
    assert_eq!(e.master_addr, "127.0.0.1");
}

#[test]
fn every_launchers_values_are_checked_by_name() {
    let msg = |pairs: &[(&str, &str)]| env_of(pairs).unwrap_err().to_string();
    assert!(msg(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "0")]).contains("SLURM_NTASKS must be at least 1"));
    assert!(
        msg(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "5000")]).contains("OMPI_COMM_WORLD_SIZE=5000")
    );
    assert!(
        msg(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_LOCALID", "-1")]).contains("SLURM_LOCALID=\"-1\"")
    );
    assert!(
        msg(&[("OMPI_COMM_WORLD_RANK", "3"), ("OMPI_COMM_WORLD_SIZE", "2")])
            .contains("OMPI_COMM_WORLD_RANK=3 is not below OMPI_COMM_WORLD_SIZE=2")
    );
    // The partial-set message names both the missing and the present variable.
    let e = msg(&[("OMPI_COMM_WORLD_RANK", "0")]);
    assert!(e.contains("OMPI_COMM_WORLD_SIZE is not set but OMPI_COMM_WORLD_RANK is"), "{e}");
    // The other variables keep their rules under every launcher.
    let e = msg(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("MASTER_PORT", "0")]);
    assert!(e.contains("MASTER_PORT=0"), "{e}");
    let e = msg(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2"), ("TP_TIMEOUT_SECS", "0")]);
    assert!(e.contains("TP_TIMEOUT_SECS=0"), "{e}");
}

/// torchrun (since torch 2.4) serves its agent's store on MASTER_PORT and sets
/// TORCHELASTIC_USE_AGENT_STORE=True for its workers: tp's store takes the next port, on every
/// rank alike; TP_MASTER_PORT overrides both; outside torchrun the variable changes nothing.
#[test]
fn under_torchrun_s_agent_store_tp_takes_the_next_port() {
    let torchrun = [("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "29400"), ("TORCHELASTIC_RUN_ID", "x")];
    let with = |extra: &[(&str, &str)]| {
        let mut v = torchrun.to_vec();
        v.extend_from_slice(extra);
        env_of(&v)
    };
    assert_eq!(with(&[]).unwrap().master_port, 29400);
    assert_eq!(with(&[("TORCHELASTIC_USE_AGENT_STORE", "True")]).unwrap().master_port, 29401);
    assert_eq!(with(&[("TORCHELASTIC_USE_AGENT_STORE", "False")]).unwrap().master_port, 29400);
    assert_eq!(
        with(&[("TORCHELASTIC_USE_AGENT_STORE", "True"), ("TP_MASTER_PORT", "31000")]).unwrap().master_port,
        31000
    );
    let e = env_of(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_PORT", "65535"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
    ])
    .unwrap_err();
    assert!(e.to_string().contains("TP_MASTER_PORT"), "{e}");
    let e = with(&[("TP_MASTER_PORT", "0")]).unwrap_err();
    assert!(e.to_string().contains("TP_MASTER_PORT=0 is not a port"), "{e}");
    // srun's variables with a stray agent-store flag: MASTER_PORT as given.
    let e = env_of(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("MASTER_PORT", "29400"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
    ])
    .unwrap();
    assert_eq!(e.master_port, 29400);
}

/// The whole case on real processes: a listener holds MASTER_PORT (as torchrun's agent does),
/// and two tp-probe workers with torchrun's variables still find each other.
#[test]
fn tp_probe_workers_join_beside_a_busy_agent_port() {
    let agent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = agent.local_addr().unwrap().port();
    if std::net::TcpListener::bind(("127.0.0.1", port + 1)).is_err() {
        // The next port is taken by something else on this machine: pick again.
        return tp_probe_workers_join_beside_a_busy_agent_port();
    }
    let children: Vec<_> = (0..2)
        .map(|r| {
            std::process::Command::new(env!("CARGO_BIN_EXE_tp-probe"))
                .env_clear()
                .env("RANK", r.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("TORCHELASTIC_RUN_ID", "test")
                .env("TORCHELASTIC_USE_AGENT_STORE", "True")
                .env("TP_TIMEOUT_SECS", "20")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let children: Vec<_> = children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    drop(agent);
    for (r, out) in children.iter().enumerate() {
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && text.contains(&format!("rank {r}: ok")), "rank {r}: {text}");
        assert!(text.contains(&format!(":{}", port + 1)) || r != 0, "rank {r} joined another port: {text}");
    }
}
