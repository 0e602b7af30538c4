//! `tp-bench` on the CPU backend: its first line says why there is no GPU, and it writes JSON,
//! CSV and SVG whose schema and figures (positive, finite) are checked here.

use std::process::Command;

#[test]
fn cpu_run_writes_a_well_formed_report() {
    let out = std::env::temp_dir().join(format!("tp-bench-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let run = Command::new(env!("CARGO_BIN_EXE_tp-bench"))
        .args(["--cpu", "--quick", "--shapes", "64x48x32,3x5x7", "--dtype", "f32,bf16", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    assert!(stdout.lines().next().unwrap().starts_with("no GPU: "), "{stdout}");

    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    let rows = json.as_array().expect("a JSON array of rows");
    // 2 shapes x 2 dtypes of GEMM, plus 2 layers x 2 dtypes.
    assert_eq!(rows.len(), 8, "{json}");
    for r in rows {
        for key in ["kind", "name", "shape", "dtype", "unit", "reference_name"] {
            assert!(r[key].is_string(), "{key} in {r}");
        }
        for key in ["reference", "ratio", "matched", "roofline", "bound"] {
            assert!(r.get(key).is_some(), "{key} missing in {r}");
        }
        let ours = r["ours"].as_f64().expect("ours is a number");
        assert!(ours.is_finite() && ours > 0.0, "{r}");
        for key in ["reference", "ratio", "roofline"] {
            if let Some(v) = r[key].as_f64() {
                assert!(v.is_finite() && v > 0.0, "{key} in {r}");
            }
        }
        if r["kind"] == "gemm" {
            assert_eq!(r["unit"], "GFLOP/s");
            assert!(r["roofline"].as_f64().is_some() && r["bound"].is_string(), "{r}");
        }
    }
    let csv = std::fs::read_to_string(out.join("results.csv")).unwrap();
    assert!(csv.starts_with("kind,name,shape,dtype,ours,unit,reference_name,reference,ratio,matched,roofline,bound\n"));
    assert_eq!(csv.lines().count(), 9);
    let svg = std::fs::read_to_string(out.join("results.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("<polyline") && svg.trim_end().ends_with("</svg>"));
}

#[test]
fn bad_flags_fail_with_a_message() {
    for args in [vec!["--dtype", "f64"], vec!["--shapes", "1x2"], vec!["--frobnicate"]] {
        let run = Command::new(env!("CARGO_BIN_EXE_tp-bench")).arg("--cpu").args(&args).output().unwrap();
        assert!(!run.status.success(), "{args:?}");
        assert!(String::from_utf8_lossy(&run.stderr).starts_with("tp-bench: "), "{args:?}");
    }
}
