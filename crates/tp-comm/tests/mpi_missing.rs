//! Without Open MPI, the MPI backend is a typed error naming what it tried and how to install
//! it, never a panic; a library that is not Open MPI is refused before any call.

use tp_comm::CommError;
use tp_comm::mpi::Mpi;

#[test]
fn a_missing_library_is_a_typed_error_with_install_advice() {
    let e = Mpi::open(&["/nonexistent/libmpi.so.40".into(), "libmpi-not-a-real-name.so".into()]).unwrap_err();
    let CommError::MpiUnavailable(msg) = &e else { panic!("expected MpiUnavailable, got {e:?}") };
    assert!(msg.contains("/nonexistent/libmpi.so.40") && msg.contains("libmpi-not-a-real-name.so"), "{msg}");
    assert!(msg.contains("apt-get install openmpi-bin") && msg.contains("TP_MPI_LIB"), "{msg}");
    assert_eq!(e.to_string().lines().count(), 1, "{e}");
}

#[test]
fn a_library_that_is_not_open_mpi_is_refused() {
    let e = Mpi::open(&["libm.so.6".into()]).unwrap_err();
    assert!(
        matches!(e, CommError::MpiUnavailable(ref m) if m.contains("libm.so.6") && m.contains("not an Open MPI")),
        "{e:?}"
    );
}
