//! Loading from real safetensors files written by the test: single file and index-sharded; each
//! rank reads only its bytes; every malformed input is a typed error.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use tp_core::{Activation, DType, Tensor, TensorShard};
use tp_layers::{
    Checkpoint, ColumnParallel, LayerError, LoadOptions, Loader, MlpNames, ParallelMlp, RowParallel, save,
};

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tp-layers-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

struct Mlp {
    gate: tp_layers::Linear,
    up: tp_layers::Linear,
    down: tp_layers::Linear,
}

fn mlp(dtype: DType, bias: bool) -> Mlp {
    Mlp {
        gate: linear(43, 24, bias, dtype, 1),
        up: linear(43, 24, bias, dtype, 3),
        down: linear(24, 43, bias, dtype, 5),
    }
}

/// The MLP's tensors under Hugging Face names.
fn named<'a>(m: &'a Mlp, prefix: &str) -> Vec<(String, &'a Tensor)> {
    let mut v = Vec::new();
    for (n, l) in [("gate_proj", &m.gate), ("up_proj", &m.up), ("down_proj", &m.down)] {
        v.push((format!("{prefix}.{n}.weight"), l.weight().unwrap()));
        if let Some(b) = l.bias() {
            v.push((format!("{prefix}.{n}.bias"), b));
        }
    }
    v
}

fn write(path: &Path, tensors: &[(String, &Tensor)]) {
    let refs: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), *t)).collect();
    save(path, &refs).unwrap();
}

const P: &str = "model.layers.0.mlp";

#[test]
fn shards_read_only_their_bytes_and_equal_narrow() {
    let dir = tmpdir("bytes");
    let m = mlp(DType::BF16, true);
    let file = dir.join("model.safetensors");
    write(&file, &named(&m, P));
    let ckpt = Checkpoint::open(&file).unwrap();
    let name = format!("{P}.down_proj.weight");
    for world in 1..=8 {
        for dim in 0..2 {
            for rank in 0..world {
                let shard = TensorShard::new(dim, m.down.weight().unwrap().dims()[dim], rank, world).unwrap();
                let (t, read) = ckpt.load_shard(&name, &shard, None, &CPU).unwrap();
                assert_eq!(t, shard.shard(m.down.weight().unwrap()).unwrap());
                assert_eq!(read, t.size_in_bytes(), "read exactly the shard's bytes");
            }
        }
    }
    assert_eq!(ckpt.load(&name, None, &CPU).unwrap(), *m.down.weight().unwrap());
    assert_eq!(
        ckpt.load(&name, Some(DType::F32), &CPU).unwrap(),
        m.down.weight().unwrap().to_dtype(DType::F32).unwrap()
    );
}

#[test]
fn layers_load_from_a_single_file_and_from_an_index() {
    for bias in [false, true] {
        let dir = tmpdir(&format!("index-{bias}"));
        let m = mlp(DType::F32, bias);
        let all = named(&m, P);
        // Single file.
        write(&dir.join("model.safetensors"), &all);
        // The same tensors over two files with an index, in another folder.
        let sharded = dir.join("sharded");
        std::fs::create_dir_all(&sharded).unwrap();
        let (first, second): (Vec<_>, Vec<_>) = all.iter().cloned().enumerate().partition(|(i, _)| i % 2 == 0);
        let first: Vec<_> = first.into_iter().map(|(_, t)| t).collect();
        let second: Vec<_> = second.into_iter().map(|(_, t)| t).collect();
        write(&sharded.join("model-00001-of-00002.safetensors"), &first);
        write(&sharded.join("model-00002-of-00002.safetensors"), &second);
        let map: serde_json::Map<String, serde_json::Value> = first
            .iter()
            .map(|(n, _)| (n.clone(), "model-00001-of-00002.safetensors".into()))
            .chain(second.iter().map(|(n, _)| (n.clone(), "model-00002-of-00002.safetensors".into())))
            .collect();
        let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
        std::fs::write(sharded.join("model.safetensors.index.json"), index.to_string()).unwrap();

        let x = Tensor::rand(&[5, 24], DType::F32, 9, &CPU).unwrap();
        for source in
            [dir.clone(), dir.join("model.safetensors"), sharded.clone(), sharded.join("model.safetensors.index.json")]
        {
            let ckpt = Checkpoint::open(&source).unwrap();
            for world in 1..=4 {
                let got = on_ranks(world, CPU, |g| {
                    let ld = Loader::new(&ckpt, &g, LoadOptions::new()).pp(P);
                    let loaded = ParallelMlp::load(&ld, MlpNames::default(), Activation::Silu).unwrap();
                    let built = ParallelMlp::from_full(&m.gate, &m.up, &m.down, Activation::Silu, &g).unwrap();
                    (loaded.forward(&x).unwrap(), built.forward(&x).unwrap())
                });
                for (a, b) in got {
                    assert_eq!(a, b, "{} world {world}", source.display());
                }
                let got = on_ranks(world, CPU, |g| {
                    let ld = Loader::new(&ckpt, &g, LoadOptions::new()).pp(P);
                    let col = ColumnParallel::load(&ld.pp("gate_proj")).unwrap();
                    let full = ColumnParallel::from_full(&m.gate, &g).unwrap();
                    let row = RowParallel::load(&ld.pp("down_proj")).unwrap();
                    let full_row = RowParallel::from_full(m.down.weight().unwrap(), m.down.bias(), &g).unwrap();
                    (
                        col.forward(&x).unwrap() == full.forward(&x).unwrap(),
                        row.weight().unwrap() == full_row.weight().unwrap(),
                    )
                });
                assert!(got.iter().all(|&(c, r)| c && r), "{} world {world}", source.display());
            }
        }
    }
}

fn expect_err(r: Result<impl std::fmt::Debug, LayerError>, what: &str, check: impl Fn(&LayerError) -> bool) {
    match r {
        Err(e) => assert!(check(&e), "{what}: unexpected error {e}"),
        Ok(v) => panic!("{what}: expected an error, got {v:?}"),
    }
}

#[test]
fn malformed_checkpoints_are_typed_errors() {
    let dir = tmpdir("bad");
    let m = mlp(DType::F32, false);
    let file = dir.join("model.safetensors");
    write(&file, &named(&m, P));
    let ckpt = Checkpoint::open(&file).unwrap();

    expect_err(
        on_ranks(1, CPU, |g| load_mlp(&ckpt, "model.layers.7.mlp", &g)).remove(0),
        "missing tensor",
        |e| matches!(e, LayerError::MissingTensor { name, .. } if name.contains("layers.7")),
    );
    expect_err(Checkpoint::open(dir.join("nope.safetensors")), "missing file", |e| {
        matches!(e, LayerError::Checkpoint { .. })
    });

    // Wrong shape: down is [24, 43]; a checkpoint whose down is [24, 42] does not fit gate/up.
    let bad = linear(24, 42, false, DType::F32, 7);
    let mut tensors = named(&m, P);
    tensors.retain(|(n, _)| !n.contains("down_proj"));
    tensors.push((format!("{P}.down_proj.weight"), bad.weight().unwrap()));
    let wrong_shape = dir.join("shape.safetensors");
    write(&wrong_shape, &tensors);
    expect_err(
        on_ranks(2, CPU, |g| load_mlp(&Checkpoint::open(&wrong_shape).unwrap(), P, &g)).remove(0),
        "wrong shape",
        |e| matches!(e, LayerError::WrongShape { found, expected, .. } if found == &vec![24, 42] && expected == &vec![24, 43]),
    );

    // Wrong dtype: a dtype tp has no use for (f64), and an integer tensor where a weight should
    // be (integers load, as token ids, but are no layer's parameters).
    let f64s_bytes: Vec<u8> = (0..24 * 43).flat_map(|i| f64::from(i).to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F64, vec![24, 43], &f64s_bytes).unwrap();
    let f64_file = dir.join("f64.safetensors");
    safetensors::serialize_to_file(vec![("w".to_string(), view)], None, &f64_file).unwrap();
    expect_err(
        Checkpoint::open(&f64_file).unwrap().load("w", None, &CPU),
        "unsupported dtype",
        |e| matches!(e, LayerError::WrongDtype { found, .. } if found == "F64"),
    );
    let ints: Vec<u8> = (0..43 * 24).flat_map(|i: i32| i.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::I32, vec![43, 24], &ints).unwrap();
    let int_file = dir.join("ints.safetensors");
    safetensors::serialize_to_file(vec![("p.weight".to_string(), view)], None, &int_file).unwrap();
    let ints_ckpt = Checkpoint::open(&int_file).unwrap();
    assert_eq!(ints_ckpt.load("p.weight", None, &CPU).unwrap().to_i64_vec().unwrap()[..3], [0, 1, 2]);
    expect_err(
        on_ranks(2, CPU, |g| ColumnParallel::load(&Loader::new(&ints_ckpt, &g, LoadOptions::new()).pp("p"))).remove(0),
        "integer weight",
        |e| matches!(e, LayerError::WrongDtype { found, .. } if found == "i32"),
    );
    expect_err(ckpt.expect(&format!("{P}.gate_proj.weight"), &[43, 24], Some(DType::BF16)), "expected dtype", |e| {
        matches!(e, LayerError::WrongDtype { .. })
    });

    // Truncated file: a download cut short.
    let bytes = std::fs::read(&file).unwrap();
    let cut = dir.join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() - 100]).unwrap();
    expect_err(
        Checkpoint::open(&cut),
        "truncated",
        |e| matches!(e, LayerError::Checkpoint { why, .. } if why.contains("not a valid safetensors file")),
    );
    std::fs::write(&cut, &bytes[..5]).unwrap();
    expect_err(Checkpoint::open(&cut), "truncated header", |e| matches!(e, LayerError::Checkpoint { .. }));

    // Bad index files.
    let cases: [(&str, &str); 5] = [
        ("not json", "{weight_map"),
        ("no weight_map", r#"{"metadata": {}}"#),
        ("missing shard file", r#"{"weight_map": {"a": "gone.safetensors"}}"#),
        ("tensor not in its file", r#"{"weight_map": {"nothere": "model.safetensors"}}"#),
        ("path outside the folder", r#"{"weight_map": {"a": "../model.safetensors"}}"#),
    ];
    for (what, text) in cases {
        let idx = dir.join("model.safetensors.index.json");
        std::fs::write(&idx, text).unwrap();
        expect_err(Checkpoint::open(&idx), what, |e| matches!(e, LayerError::Checkpoint { .. }));
        std::fs::remove_file(&idx).unwrap();
    }
    expect_err(Checkpoint::open(tmpdir("empty")), "empty folder", |e| matches!(e, LayerError::Checkpoint { .. }));
}

#[test]
fn ranges_of_every_dim_of_a_3d_tensor_equal_narrowing_the_whole() {
    let dir = std::env::temp_dir().join(format!("tp-ckpt-3d-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.safetensors");
    for dtype in [DType::F32, DType::BF16] {
        let t = Tensor::randn(&[3, 5, 4], dtype, 7, &CPU).unwrap();
        save(&path, &[("t", &t)]).unwrap();
        let ckpt = Checkpoint::open(&path).unwrap();
        for (dim, size) in [(0, 3), (1, 5), (2, 4)] {
            for start in 0..size {
                for len in 0..=size - start {
                    let (got, read) = ckpt.load_range("t", dim, start, len, None, &CPU).unwrap();
                    assert_eq!(got, t.narrow(dim, start, len).unwrap(), "{dtype} dim {dim} {start}+{len}");
                    assert_eq!(read, got.size_in_bytes());
                }
            }
        }
        assert!(ckpt.load_range("t", 1, 4, 2, None, &CPU).is_err(), "past the end");
        assert!(ckpt.load_range("t", 3, 0, 1, None, &CPU).is_err(), "no such dim");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
