//! The launchers people already run give the same coordinates: torchrun's variables, srun's
//! and Open MPI's mpirun's; partial sets and conflicting sets are refused naming the
//! variables; a torchrun nested in an allocation wins; SLURM's node list gives the master.

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
    let e = env_of(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "4"),
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
    ])
    .unwrap_err()
    .to_string();
    assert!(e.contains("SLURM_NTASKS=4") && e.contains("OMPI_COMM_WORLD_SIZE=2"), "{e}");
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
}

#[test]
fn the_first_host_of_a_slurm_node_list() {
    for (list, first) in [
        ("node[01-04,07],login5", "node01"),
        ("gpu-a[1-2]-b[3-4]", "gpu-a1-b3"),
        ("host1,host2", "host1"),
        ("single", "single"),
        ("n[007]", "n007"),
        ("rack[2,5]n[10-11],x", "rack2n10"),
        (" c[3-9] ", "c3"),
    ] {
        assert_eq!(first_host(list).unwrap(), first, "{list}");
    }
    for (list, why) in [
        ("", "no host"),
        ("node[01-04", "without its ']'"),
        ("node01-04]", "without its '['"),
        ("node[]", "not a list of numbers"),
        ("node[a-b]", "not a list of numbers"),
        ("node[9-3]", "runs backwards"),
        ("node[[1]]", "nested"),
        (",node1", "no host"),
    ] {
        let e = first_host(list).unwrap_err().to_string();
        assert!(e.contains("SLURM_JOB_NODELIST") && e.contains(why), "{list:?}: {e}");
    }
    // Through the environment: a malformed list is refused when it is needed.
    let e = env_of(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_JOB_NODELIST", "n[1-")]).unwrap_err();
    assert!(e.to_string().contains("SLURM_JOB_NODELIST"));
}
