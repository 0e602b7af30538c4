//! What is opened: only regular files (symlinks followed), never blocking on a pipe, bounded in
//! size; and every cut or single-byte corruption of a small valid file is an error or a file whose
//! tensors all lie in it, never a panic.

mod common;

use common::TempDir;
use common::builder::{Builder, V, s};
use std::sync::mpsc;
use std::time::Duration;
use tp_gguf::{GgufError, GgufFile};

/// A small valid file with metadata of several kinds (nested arrays too) and two tensors.
fn small() -> common::builder::Built {
    Builder::new()
        .kv("general.architecture", s("tp"))
        .kv("a.u32", V::U32(7))
        .kv("a.strs", V::Arr(8, vec![s("x"), s("")]))
        .kv("a.n", V::Arr(9, vec![V::Arr(7, vec![V::Bool(true)]), V::Arr(6, vec![V::F32(1.5)])]))
        .kv("a.f64", V::F64(-2.0))
        .tensor("t.f32", &[2, 2], 0, vec![1; 16])
        .tensor("t.q8_0", &[32], 8, vec![2; 34])
        .build()
}

/// Opens `path` on another thread and waits at most 10 s for the answer, so a blocking `open`
/// fails the test instead of hanging it.
fn open_with_deadline(path: std::path::PathBuf) -> Result<GgufFile, GgufError> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(GgufFile::open(&path));
    });
    rx.recv_timeout(Duration::from_secs(10)).expect("GgufFile::open blocked for 10 s")
}

fn not_regular(e: &GgufError) -> &'static str {
    match e {
        GgufError::NotRegularFile { kind, .. } => kind,
        _ => panic!("{e:?}"),
    }
}

#[test]
fn a_fifo_is_refused_without_blocking() {
    let dir = TempDir::new("files");
    let fifo = dir.path().join("pipe.gguf");
    let status = std::process::Command::new("mkfifo").arg(&fifo).status().expect("run mkfifo");
    assert!(status.success());
    let e = open_with_deadline(fifo).unwrap_err();
    assert_eq!(not_regular(&e), "a named pipe (FIFO)");
    assert!(e.to_string().ends_with("pipe.gguf: is a named pipe (FIFO), not a regular file"), "{e}");
}

#[test]
fn a_directory_and_a_device_are_refused() {
    let dir = TempDir::new("files");
    let e = open_with_deadline(dir.path().to_path_buf()).unwrap_err();
    assert_eq!(not_regular(&e), "a directory");
    let e = open_with_deadline("/dev/null".into()).unwrap_err();
    assert_eq!(not_regular(&e), "a character device");
    assert_eq!(e.to_string(), "/dev/null: is a character device, not a regular file");
}

#[test]
fn a_missing_file_is_an_io_error_naming_it() {
    let dir = TempDir::new("files");
    let e = GgufFile::open(dir.path().join("missing\n.gguf")).unwrap_err();
    assert!(
        matches!(&e, GgufError::Io { action: "open", source, .. } if source.kind() == std::io::ErrorKind::NotFound),
        "{e:?}"
    );
    assert!(e.to_string().contains("missing\\n.gguf: cannot open: "), "{e}");
}

#[test]
fn a_symlink_is_followed() {
    let dir = TempDir::new("files");
    let target = dir.write(&small().bytes);
    let link = dir.path().join("link.gguf");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let f = GgufFile::open(&link).unwrap();
    assert_eq!((f.path(), f.tensors().len()), (link.as_path(), 2));
}

#[test]
fn a_file_past_the_size_bound_is_refused_before_mapping() {
    let dir = TempDir::new("files");
    let path = dir.write(&small().bytes);
    // Sparse: no disk blocks are used.
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len(GgufFile::MAX_FILE_BYTES + 1).unwrap();
    let e = GgufFile::open(&path).unwrap_err();
    assert!(
        matches!(e, GgufError::FileTooLarge { bytes, max, .. } if bytes == max + 1 && max == GgufFile::MAX_FILE_BYTES),
        "{e:?}"
    );
    assert!(e.to_string().contains(&format!("is {} bytes, more than the", GgufFile::MAX_FILE_BYTES + 1)), "{e}");
    // At the bound it opens (the tensors are at the start).
    file.set_len(GgufFile::MAX_FILE_BYTES).unwrap();
    assert_eq!(GgufFile::open(&path).unwrap().tensors().len(), 2);
}

/// Every cut of the file before its last tensor's last byte is an error; after it (only the
/// last tensor's padding is cut) the file is whole and reads the same.
#[test]
fn every_cut_of_a_small_file_is_an_error_until_its_data_ends() {
    let dir = TempDir::new("files");
    let built = small();
    let whole = dir.open(&built.bytes).unwrap();
    assert!(built.data_end < built.bytes.len(), "the file ends in padding");
    for len in 0..built.bytes.len() {
        match dir.open(&built.bytes[..len]) {
            Err(e) => {
                assert!(len < built.data_end, "a cut to {len} bytes of a valid file failed: {e}");
                assert!(!e.to_string().is_empty());
            }
            Ok(f) => {
                assert!(len >= built.data_end, "a cut to {len} bytes opened");
                assert_eq!(f.tensors(), whole.tensors());
                for t in f.tensors() {
                    assert_eq!(f.tensor_data(t), whole.tensor_data(t));
                }
            }
        }
    }
}

/// Every byte replaced by several others: an error, or a file whose tensors' bytes are exactly
/// their size and lie in the file.
#[test]
fn single_byte_corruptions_never_panic() {
    let dir = TempDir::new("files");
    let built = small();
    let (mut errors, mut opened) = (0, 0);
    for at in 0..built.data_start {
        let was = built.bytes[at];
        for now in [0x00, 0x01, 0x02, 0x07, 0x09, 0x0d, 0x7f, 0x80, 0xff, was ^ 0x20] {
            if now == was {
                continue;
            }
            let mut bytes = built.bytes.clone();
            bytes[at] = now;
            match dir.open(&bytes) {
                Err(e) => {
                    errors += 1;
                    assert!(e.to_string().len() < 1000, "{e}");
                }
                Ok(f) => {
                    opened += 1;
                    for t in f.tensors() {
                        assert_eq!(f.tensor_data(t).len(), t.n_bytes, "byte {at} = {now:#x}: {t:?}");
                        assert!(f.data_offset() + t.offset as usize + t.n_bytes <= bytes.len());
                    }
                }
            }
        }
    }
    // Most corruptions are caught; some (a value's bytes, a name's letters) are valid files.
    assert!(errors > opened && opened > 0, "{errors} errors, {opened} opened");
}
