//! What the loader opens: only regular files, symlinks followed. A named pipe, a device or a
//! directory, given as the checkpoint, inside a folder, or as an index entry, is a typed error
//! at once (each check runs on a helper thread with a time limit, so a blocking open fails the
//! test instead of hanging it); a Hugging Face cache, all symlinks into `blobs/`, loads.

mod common;
use common::*;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use tp_core::{DType, Tensor};
use tp_layers::{Checkpoint, LayerError, save};

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tp-layers-files-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn mkfifo(path: &Path) {
    assert!(Command::new("mkfifo").arg(path).status().unwrap().success(), "mkfifo {}", path.display());
}

/// `f()` on a helper thread; the test fails if it has not returned within 5 s.
fn within<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(5)).unwrap_or_else(|_| panic!("{what}: blocked for 5 s"))
}

fn open_err(what: &str, path: PathBuf, needle: &str) {
    let r = within(what, move || Checkpoint::open(path).map(|c| format!("{c:?}")));
    match r {
        Err(LayerError::Checkpoint { why, .. }) => assert!(why.contains(needle), "{what}: {why}"),
        other => panic!("{what}: expected a checkpoint error naming {needle:?}, got {other:?}"),
    }
}

const P: &str = "model.layers.0.mlp";

/// A small MLP's tensors under Hugging Face names.
fn mlp_tensors() -> Vec<(String, Tensor)> {
    let (gate, up, down) =
        (linear(12, 8, false, DType::F32, 1), linear(12, 8, false, DType::F32, 2), linear(8, 12, true, DType::F32, 3));
    vec![
        (format!("{P}.gate_proj.weight"), gate.weight().unwrap().clone()),
        (format!("{P}.up_proj.weight"), up.weight().unwrap().clone()),
        (format!("{P}.down_proj.weight"), down.weight().unwrap().clone()),
        (format!("{P}.down_proj.bias"), down.bias().unwrap().clone()),
    ]
}

fn write(path: &Path, tensors: &[(String, Tensor)]) {
    let refs: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    save(path, &refs).unwrap();
}

#[test]
fn pipes_devices_and_directories_are_refused_without_blocking() {
    let dir = tmpdir("special");
    let fifo = dir.join("pipe.safetensors");
    mkfifo(&fifo);
    symlink(&fifo, dir.join("link.safetensors")).unwrap();
    std::fs::create_dir(dir.join("sub.safetensors")).unwrap();
    // Folders whose model file or index is a pipe.
    let (single, indexed) = (dir.join("single"), dir.join("indexed"));
    for d in [&single, &indexed] {
        std::fs::create_dir(d).unwrap();
    }
    mkfifo(&single.join("model.safetensors"));
    mkfifo(&indexed.join("model.safetensors.index.json"));
    // Index files whose entry is a pipe, a directory, or a symlink to a device.
    symlink("/dev/zero", dir.join("zero.safetensors")).unwrap();
    for (name, entry) in
        [("to-pipe", "pipe.safetensors"), ("to-dir", "sub.safetensors"), ("to-dev", "zero.safetensors")]
    {
        let text = format!(r#"{{"weight_map": {{"{P}.gate_proj.weight": "{entry}"}}}}"#);
        std::fs::write(dir.join(format!("{name}.index.json")), text).unwrap();
    }
    mkfifo(&dir.join("pipe.index.json"));

    let cases: Vec<(&str, PathBuf, &str)> = vec![
        ("a named pipe", fifo.clone(), "is a named pipe (FIFO), not a regular file"),
        ("a symlink to a pipe", dir.join("link.safetensors"), "named pipe"),
        ("/dev/zero", "/dev/zero".into(), "is a character device, not a regular file"),
        ("/dev/null", "/dev/null".into(), "character device"),
        ("a symlink to /dev/zero", dir.join("zero.safetensors"), "character device"),
        ("a folder's model.safetensors", single, "named pipe"),
        ("a folder's index", indexed, "named pipe"),
        ("an index that is a pipe", dir.join("pipe.index.json"), "named pipe"),
        ("an index entry that is a pipe", dir.join("to-pipe.index.json"), "named pipe"),
        ("an index entry that is a directory", dir.join("to-dir.index.json"), "is a directory"),
        ("an index entry that is a device", dir.join("to-dev.index.json"), "character device"),
    ];
    for (what, path, needle) in cases {
        open_err(what, path, needle);
    }

    // Writing: a pipe, a device or a directory is refused without blocking. The device is
    // reached through a symlink in the test's folder: were it written, the rename safetensors
    // does would replace only that symlink, never the system's /dev/null.
    let x = Tensor::zeros(&[2], DType::F32, &CPU).unwrap();
    symlink("/dev/null", dir.join("null.safetensors")).unwrap();
    let outputs = [
        ("a pipe", fifo.clone()),
        ("a device", dir.join("null.safetensors")),
        ("a directory", dir.join("sub.safetensors")),
    ];
    for (what, path) in outputs {
        let (x, p) = (x.clone(), path.clone());
        let r = within(what, move || save(p, &[("x", &x)]));
        assert!(
            matches!(&r, Err(LayerError::Write { why, .. }) if why.contains("not a regular file")),
            "{what}: {r:?}"
        );
        assert!(!std::fs::metadata(&path).unwrap().is_file(), "{what} was replaced");
    }
    save(dir.join("new.safetensors"), &[("x", &x)]).unwrap();
}

#[test]
fn an_oversized_index_is_refused() {
    let dir = tmpdir("big-index");
    let index = dir.join("model.safetensors.index.json");
    // Sparse: 65 MiB of zeros that take no disk.
    std::fs::File::create(&index).unwrap().set_len(65 << 20).unwrap();
    open_err("a 65 MiB index", dir, "is larger than 67108864 bytes");
}

/// Builds a Hugging Face hub cache entry: files under `blobs/<hash>`, each revision a folder of
/// relative symlinks `snapshots/<rev>/<name> -> ../../blobs/<hash>`, `refs/main` naming a rev.
struct HfCache {
    repo: PathBuf,
}

impl HfCache {
    fn new(root: &Path) -> HfCache {
        let repo = root.join("models--org--tiny-mlp");
        for d in ["blobs", "refs", "snapshots"] {
            std::fs::create_dir_all(repo.join(d)).unwrap();
        }
        HfCache { repo }
    }

    /// Moves `file` into `blobs/` and links it into revision `rev` under `name`.
    fn add(&self, rev: &str, name: &str, file: &Path, hash: &str) {
        std::fs::rename(file, self.repo.join("blobs").join(hash)).unwrap();
        let snap = self.repo.join("snapshots").join(rev);
        std::fs::create_dir_all(&snap).unwrap();
        symlink(format!("../../blobs/{hash}"), snap.join(name)).unwrap();
        std::fs::write(self.repo.join("refs/main"), rev).unwrap();
    }

    fn snapshot(&self, rev: &str) -> PathBuf {
        self.repo.join("snapshots").join(rev)
    }
}

fn assert_loads(what: &str, path: &Path, tensors: &[(String, Tensor)]) {
    let ckpt = Checkpoint::open(path).unwrap_or_else(|e| panic!("{what}: {e}"));
    for (name, t) in tensors {
        assert_eq!(&ckpt.load(name, None, &CPU).unwrap(), t, "{what}: {name}");
    }
    on_ranks(2, CPU, |g| {
        load_mlp(&ckpt, P, &g).unwrap_or_else(|e| panic!("{what}: rank {}: {e}", g.rank()));
    });
}

#[test]
fn a_hugging_face_cache_layout_loads() {
    let root = tmpdir("hf-cache");
    let cache = HfCache::new(&root);
    let tensors = mlp_tensors();

    // Revision 1: one model.safetensors.
    let rev1 = "0123456789abcdef0123456789abcdef01234567";
    let tmp = root.join("single.tmp");
    write(&tmp, &tensors);
    cache.add(rev1, "model.safetensors", &tmp, "5d2c1a9e8f7b6a5d4c3b2a1f0e9d8c7b6a5f4e3d2c1b0a9f8e7d6c5b4a3f2e1d");
    assert_loads("snapshot folder", &cache.snapshot(rev1), &tensors);
    assert_loads("snapshot file", &cache.snapshot(rev1).join("model.safetensors"), &tensors);

    // Revision 2: two shards and their index, every one a symlink into blobs/.
    let rev2 = "89abcdef0123456789abcdef0123456789abcdef";
    let shards =
        [("model-00001-of-00002.safetensors", &tensors[..2]), ("model-00002-of-00002.safetensors", &tensors[2..])];
    let mut weight_map = serde_json::Map::new();
    for (i, (name, part)) in shards.iter().enumerate() {
        let tmp = root.join(format!("shard{i}.tmp"));
        write(&tmp, part);
        cache.add(rev2, name, &tmp, &format!("{i}f{}", "ab".repeat(31)));
        for (t, _) in *part {
            weight_map.insert(t.clone(), serde_json::Value::String(name.to_string()));
        }
    }
    let index = serde_json::json!({ "metadata": { "total_size": 0 }, "weight_map": weight_map });
    let tmp = root.join("index.tmp");
    std::fs::write(&tmp, index.to_string()).unwrap();
    cache.add(
        rev2,
        "model.safetensors.index.json",
        &tmp,
        "9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c8b7a6f5e4d3c2b1a0f9e8d",
    );
    assert_loads("sharded snapshot folder", &cache.snapshot(rev2), &tensors);
    assert_loads("sharded snapshot index", &cache.snapshot(rev2).join("model.safetensors.index.json"), &tensors);
    // What refs/main names, through one more symlink (as tools resolve "latest").
    let main = std::fs::read_to_string(cache.repo.join("refs/main")).unwrap();
    symlink(cache.snapshot(&main), root.join("latest")).unwrap();
    assert_loads("a symlink to the snapshot", &root.join("latest"), &tensors);
}
