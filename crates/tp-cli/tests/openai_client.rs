//! The official `openai` Python package against `tp serve` (tests/openai_client.py). Fails, never
//! skips, when python3 or the package is missing: CI installs it (`pip install openai`).

mod common;

use common::{Server, model_dir};
use std::process::Command;

#[test]
fn the_openai_python_client_works_against_tp_serve() {
    let probe = Command::new("python3").args(["-c", "import openai"]).output();
    match probe {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "python3 cannot import the `openai` package (install it: `pip install openai`): {}",
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => panic!("python3 is not installed or cannot run ({e}); this test needs python3 with `openai`"),
    }
    let s = Server::start_in(&model_dir(), &["--served-model-name", "tiny", "--api-key", "k3y"], &[]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let base = format!("http://{}/v1", s.addr);
    let out = Command::new("python3").args([script, &base, "tiny", "k3y"]).output().expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the openai client checks failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("all checks passed"), "{stdout}");
}
