//! Without an NCCL library, the backend is a typed error naming what it tried and how to
//! install NCCL, never a panic.

use tp_comm::CommError;
use tp_comm::nccl::Nccl;

#[test]
fn a_missing_library_is_a_typed_error_with_install_advice() {
    let e = Nccl::open(&["/nonexistent/libnccl.so.2".into(), "libnccl-not-a-real-name.so".into()]).unwrap_err();
    let CommError::NcclUnavailable(msg) = &e else { panic!("expected NcclUnavailable, got {e:?}") };
    assert!(msg.contains("/nonexistent/libnccl.so.2") && msg.contains("libnccl-not-a-real-name.so"), "{msg}");
    assert!(msg.contains("pip install nvidia-nccl-cu13") && msg.contains("TP_NCCL_LIB"), "{msg}");
}

#[test]
fn a_file_that_is_not_nccl_is_rejected() {
    // A real shared library without NCCL's symbols.
    let e = Nccl::open(&["libm.so.6".into()]).unwrap_err();
    assert!(matches!(e, CommError::NcclUnavailable(ref m) if m.contains("libm.so.6")), "{e:?}");
}

#[test]
fn one_process_many_gpus_refuses_bad_device_lists_before_touching_cuda() {
    use std::time::Duration;
    use tp_comm::DeviceGroup;
    let e = DeviceGroup::nccl_local(&[], Duration::from_secs(1)).unwrap_err();
    assert!(matches!(e, CommError::ZeroWorldSize { .. }), "{e:?}");
    let e = DeviceGroup::nccl_local(&[0, 1, 0], Duration::from_secs(1)).unwrap_err();
    assert!(e.to_string().contains("GPU 0 is listed twice"), "{e}");
}
