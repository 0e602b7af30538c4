//! The real NCCL library, loaded at run time on a machine with no GPU: version, error text,
//! unique ids. Built with `--features nccl-tests` (`cargo xtask test` installs the pinned
//! `nvidia-nccl-cu13` wheel and points `TP_NCCL_LIB` at it); fails, never skips, without NCCL.

use tp_comm::nccl::Nccl;

#[test]
fn loads_the_pinned_library_and_reports_its_version() {
    let nccl = Nccl::get().expect("TP_NCCL_LIB or libnccl.so.2 must load for this suite");
    let (major, minor, _) = nccl.version();
    assert_eq!((major, minor), (2, 32), "loaded {}", nccl.path());
}

#[test]
fn errors_carry_ncclgeterrorstring() {
    let nccl = Nccl::get().unwrap();
    let e = nccl.error_for_test(4).to_string(); // ncclInvalidArgument
    assert!(e.contains("invalid argument") && e.contains("code 4"), "{e}");
}

#[test]
fn unique_ids_need_no_gpu_and_differ() {
    // ncclGetUniqueId only sets up the bootstrap socket address: it works on a CPU machine.
    let nccl = Nccl::get().unwrap();
    let (a, b) = (nccl.unique_id().unwrap(), nccl.unique_id().unwrap());
    assert!(a.iter().any(|&x| x != 0));
    assert_ne!(a, b);
}
