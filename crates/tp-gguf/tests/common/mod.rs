//! Shared by the tests: temporary directories, writing bytes to a file and opening it, the
//! Python writer, and an independent GGUF builder ([`builder`]) for crafting files byte by byte.
#![allow(dead_code)]

pub mod builder;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tp_gguf::{GgufError, GgufFile};

/// A directory under cargo's temporary directory for tests, removed when dropped.
pub struct TempDir(PathBuf);

static NEXT: AtomicUsize = AtomicUsize::new(0);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("tp-gguf-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Writes `bytes` to a new file in the directory and returns its path.
    pub fn write(&self, bytes: &[u8]) -> PathBuf {
        let path = self.0.join(format!("f{}.gguf", NEXT.fetch_add(1, Ordering::Relaxed)));
        std::fs::write(&path, bytes).unwrap();
        path
    }

    /// Writes `bytes` to a file and opens it; the file is removed again.
    pub fn open(&self, bytes: &[u8]) -> Result<GgufFile, GgufError> {
        let path = self.write(bytes);
        let out = GgufFile::open(&path);
        std::fs::remove_file(&path).unwrap();
        out
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Opening `bytes` fails; returns the error and its message.
pub fn open_err(dir: &TempDir, bytes: &[u8]) -> (GgufError, String) {
    match dir.open(bytes) {
        Ok(f) => panic!("opened a malformed file: {f:?}"),
        Err(e) => {
            let msg = e.to_string();
            (e, msg)
        }
    }
}

/// Runs `tests/write_gguf.py` once per test binary and returns the directory it wrote (kept
/// under cargo's temporary directory). Fails, never skips, without Python 3 and `gguf`.
pub fn python_files() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = Path::new(env!("CARGO_TARGET_TMPDIR"));
        remove_stale_python_dirs(root);
        let dir = root.join(format!("tp-gguf-python-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/write_gguf.py");
        let log = dir.join("python.log");
        let log_file = std::fs::File::create(&log).unwrap();
        let mut child = Command::new("python3")
            .arg(&script)
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run python3 ({e}): these tests need Python 3 and the gguf package: pip install gguf==0.19.0"
                )
            });
        let deadline = Instant::now() + Duration::from_secs(120);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{} took more than 120 s", script.display());
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(
            status.success(),
            "{} failed ({status}); it needs `pip install gguf==0.19.0`:\n{text}",
            script.display()
        );
        dir
    })
}

/// Removes the directories earlier runs of [`python_files`] left, those whose process is gone
/// (Linux: no `/proc/PID`; elsewhere they stay).
fn remove_stale_python_dirs(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix("tp-gguf-python-")) else { continue };
        if Path::new("/proc/self").exists() && !Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}
