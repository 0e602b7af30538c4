//! The `mlp` example, run as the user runs it (the compiled example binary, which `cargo test`
//! builds), at world sizes 1..=4, against a float64 reference computed here; and its errors.

mod common;
use common::*;
use std::path::PathBuf;
use std::process::Command;
use tp_core::{DType, Tensor};
use tp_layers::{Checkpoint, save};

/// target/<profile>/examples/mlp, next to this test's own binary in target/<profile>/deps.
fn example_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(|d| d.parent()).unwrap();
    let bin = profile_dir.join("examples").join("mlp");
    assert!(
        bin.exists(),
        "{} missing: cargo test builds examples; build it with cargo build --examples",
        bin.display()
    );
    bin
}

fn setup(name: &str) -> (PathBuf, MlpRef, usize) {
    let dir = std::env::temp_dir().join(format!("tp-example-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (hidden, inter, tokens) = (24, 43, 7);
    let gate = linear(inter, hidden, false, DType::F32, 1);
    let up = linear(inter, hidden, false, DType::F32, 3);
    let down = linear(hidden, inter, true, DType::F32, 5);
    let p = "model.layers.3.mlp";
    save(
        dir.join("model.safetensors"),
        &[
            (&format!("{p}.gate_proj.weight"), gate.weight()),
            (&format!("{p}.up_proj.weight"), up.weight()),
            (&format!("{p}.down_proj.weight"), down.weight()),
            (&format!("{p}.down_proj.bias"), down.bias().unwrap()),
        ],
    )
    .unwrap();
    let x = Tensor::rand(&[tokens, hidden], DType::F32, 7, &CPU).unwrap();
    save(dir.join("x.safetensors"), &[("x", &x)]).unwrap();
    let r = mlp_f64(&x, &gate, &up, &down);
    (dir, r, tokens * hidden)
}

fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(example_binary()).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).to_string())
}

#[test]
fn example_matches_the_f64_reference_at_world_sizes_1_to_4() {
    let (dir, r, n) = setup("ok");
    let d = dir.to_string_lossy().to_string();
    for dtype in ["f32", "bf16"] {
        for world in 1..=4 {
            let out = format!("{d}/y-{dtype}-{world}.safetensors");
            let (ok, err) = run(&[
                "--checkpoint",
                &d,
                "--prefix",
                "model.layers.3.mlp",
                "--input",
                &format!("{d}/x.safetensors"),
                "--world-size",
                &world.to_string(),
                "--dtype",
                dtype,
                "--output",
                &out,
            ]);
            assert!(ok, "world {world} {dtype}: {err}");
            let y = Checkpoint::open(&out).unwrap().load("y", None, &CPU).unwrap();
            assert_eq!(y.dims(), &[7, 24]);
            assert_eq!(y.dtype().as_str(), dtype);
            let got = f64s(&y);
            assert_eq!(got.len(), n);
            let u = y.dtype().unit_roundoff();
            let c = if dtype == "f32" { 16.0 } else { 4.0 };
            assert_close(&format!("world {world} {dtype}"), &got, &r.y, |i| {
                c * u * r.scale[i] + 2.0 * u * r.y[i].abs() + 1e-6
            });
        }
    }
}

#[test]
fn example_errors_are_one_line_and_non_zero() {
    let (dir, _, _) = setup("err");
    let d = dir.to_string_lossy().to_string();
    let x = format!("{d}/x.safetensors");
    let base =
        ["--checkpoint", &d, "--prefix", "model.layers.3.mlp", "--input", &x, "--output", "/tmp/unused-y.safetensors"];
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--world-size", "0"], "at least 1"),
        (vec!["--world-size", "two"], "not a number"),
        (vec!["--world-size", "2", "--dtype", "f64"], "unknown dtype"),
        (vec!["--world-size", "2", "--backend", "mpi"], "expected local or nccl"),
        (vec!["--world-size", "2", "--device", "tpu"], "expected cpu or cuda"),
        (vec!["--world-size", "2", "--bogus"], "unknown argument"),
        (vec!["--world-size", "2", "--backend", "nccl"], "needs --device cuda"),
        (vec!["--world-size", "2", "--device", "cuda"], "--device cuda"),
        (vec![], "--world-size is required"),
    ];
    for (extra, needle) in cases {
        let args: Vec<&str> = base.iter().copied().chain(extra.iter().copied()).collect();
        let (ok, err) = run(&args);
        assert!(!ok, "{extra:?} should fail");
        assert!(err.contains(needle), "{extra:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // Wrong prefix, missing input file.
    let (ok, err) =
        run(&["--checkpoint", &d, "--prefix", "nope", "--input", &x, "--world-size", "1", "--output", "/tmp/y.st"]);
    assert!(!ok && err.contains("no tensor named"), "{err}");
    let (ok, err) = run(&[
        "--checkpoint",
        &d,
        "--prefix",
        "p",
        "--input",
        "/nonexistent.safetensors",
        "--world-size",
        "1",
        "--output",
        "/tmp/y.st",
    ]);
    assert!(!ok && err.contains("cannot open"), "{err}");
}
