//! What opening a checkpoint costs and what it accepts: each file's header is parsed once, at
//! open (a lookup that parsed it again would make loading quadratic in the tensor count); an
//! index or a header past its limit is refused at once; names and file names from the files
//! reach error messages escaped, on one line, and cut.

mod common;
use common::*;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use tp_core::{DType, Tensor, TensorShard};
use tp_layers::{Checkpoint, LayerError, quote_text, save};

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tp-layers-bounds-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Tensor `i`: `[2, 3]` f32 holding `i, i + 1, ..`.
fn tensor(i: usize) -> Tensor {
    let v: Vec<f32> = (0..6).map(|k| (i + k) as f32).collect();
    Tensor::from_vec(v, &[2, 3], &CPU).unwrap()
}

fn name(i: usize) -> String {
    format!("model.layers.{i}.weight")
}

fn write(path: &Path, ids: impl Iterator<Item = usize>) {
    let tensors: Vec<(String, Tensor)> = ids.map(|i| (name(i), tensor(i))).collect();
    let refs: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    save(path, &refs).unwrap();
}

/// Overwrites the first byte of `path`'s JSON header (its `{`) in place, without truncating the
/// file: any later parse of the header fails, while the mapped bytes stay in bounds.
fn spoil_header(path: &Path) {
    let mut f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.seek(SeekFrom::Start(8)).unwrap();
    f.write_all(b"X").unwrap();
    f.sync_all().unwrap();
}

/// Loads every tensor of `ckpt` through each entry point and checks it against its reference.
fn load_all(what: &str, ckpt: &Checkpoint, n: usize) {
    assert_eq!(ckpt.names().len(), n, "{what}");
    for i in 0..n {
        let (name, want) = (name(i), tensor(i));
        assert_eq!(ckpt.info(&name).unwrap(), (DType::F32, vec![2, 3]), "{what}: {name}");
        ckpt.expect(&name, &[2, 3], Some(DType::F32)).unwrap();
        assert_eq!(ckpt.load(&name, None, &CPU).unwrap(), want, "{what}: {name}");
        let shard = TensorShard::new(1, 3, 1, 2).unwrap();
        let (part, read) = ckpt.load_shard(&name, &shard, None, &CPU).unwrap();
        assert_eq!(part, shard.shard(&want).unwrap(), "{what}: {name}");
        assert_eq!(read, part.size_in_bytes(), "{what}: {name}");
    }
}

/// The open checkpoint keeps working after its files' headers are spoiled on disk: no lookup or
/// load parses a header again (the file is mapped shared, so a re-parse would see the spoiled
/// byte; opening the same path again shows that it does).
#[test]
fn headers_are_parsed_only_at_open() {
    let dir = tmpdir("parse-once");
    let n = 600;
    let single = dir.join("model.safetensors");
    write(&single, 0..n);
    let sharded = dir.join("sharded");
    std::fs::create_dir_all(&sharded).unwrap();
    let files: Vec<String> = (0..3).map(|f| format!("part-{f}.safetensors")).collect();
    for (f, file) in files.iter().enumerate() {
        write(&sharded.join(file), (0..n).filter(|i| i % 3 == f));
    }
    let map: serde_json::Map<String, serde_json::Value> =
        (0..n).map(|i| (name(i), files[i % 3].clone().into())).collect();
    let index = sharded.join("model.safetensors.index.json");
    std::fs::write(&index, serde_json::json!({ "weight_map": map }).to_string()).unwrap();

    let opened = [Checkpoint::open(&single).unwrap(), Checkpoint::open(&index).unwrap()];
    spoil_header(&single);
    for file in &files {
        spoil_header(&sharded.join(file));
    }
    for path in [&single, &index] {
        let r = Checkpoint::open(path);
        assert!(
            matches!(&r, Err(LayerError::Checkpoint { why, .. }) if why.contains("not a valid safetensors file")),
            "{}: the spoiled header still parses: {r:?}",
            path.display()
        );
    }
    load_all("single file", &opened[0], n);
    load_all("index", &opened[1], n);
}

fn checkpoint_err(r: tp_layers::Result<Checkpoint>) -> String {
    match r {
        Err(e @ LayerError::Checkpoint { .. }) => e.to_string(),
        other => panic!("expected a checkpoint error, got {other:?}"),
    }
}

#[test]
fn a_header_past_the_limit_is_refused_before_it_is_read() {
    let dir = tmpdir("header");
    let file = dir.join("model.safetensors");
    // Claims a header one byte over the limit; the file holds nothing else.
    let claimed = Checkpoint::MAX_HEADER_BYTES as u64 + 1;
    std::fs::write(&file, claimed.to_le_bytes()).unwrap();
    let e = checkpoint_err(Checkpoint::open(&file));
    assert!(e.contains(&format!("header of {claimed} bytes is larger than the 100000000 accepted")), "{e}");
    assert_eq!(Checkpoint::MAX_HEADER_BYTES, 100_000_000);
}

#[test]
fn an_index_naming_too_many_files_is_refused_before_any_is_opened() {
    let dir = tmpdir("files");
    let map: serde_json::Map<String, serde_json::Value> =
        (0..=Checkpoint::MAX_FILES).map(|i| (format!("t{i}"), format!("f{i}.safetensors").into())).collect();
    let index = dir.join("model.safetensors.index.json");
    std::fs::write(&index, serde_json::json!({ "weight_map": map }).to_string()).unwrap();
    let t = std::time::Instant::now();
    let e = checkpoint_err(Checkpoint::open(&index));
    assert!(e.contains("weight_map names more than 65536 files"), "{e}");
    // None of the files exists: had any been opened first, the error would name it.
    assert!(!e.contains("cannot open"), "{e}");
    eprintln!("refused in {:?}", t.elapsed());
}

#[test]
fn an_index_listing_too_many_tensors_is_refused() {
    let dir = tmpdir("tensors");
    let entries: Vec<String> = (0..=Checkpoint::MAX_TENSORS).map(|i| format!("\"{i}\":\"a\"")).collect();
    let index = dir.join("model.safetensors.index.json");
    std::fs::write(&index, format!("{{\"weight_map\":{{{}}}}}", entries.join(","))).unwrap();
    let e = checkpoint_err(Checkpoint::open(&index));
    assert!(e.contains("weight_map lists 1000001 tensors, more than 1000000"), "{e}");
}

/// One line, under 1 KiB, no raw control character, and holding `needle`.
fn assert_bounded(what: &str, message: &str, needle: &str) {
    assert!(message.len() < 1024, "{what}: {} bytes: {}", message.len(), &message[..1024.min(message.len())]);
    assert!(!message.chars().any(char::is_control), "{what}: {message:?}");
    assert!(message.contains(needle), "{what}: {message:?} lacks {needle:?}");
}

#[test]
fn names_from_files_are_escaped_and_cut_in_errors() {
    let dir = tmpdir("escape");
    write(&dir.join("model.safetensors"), 0..2);
    let long = "a".repeat(1 << 20);
    let hostile = format!("\u{1b}[31m\0{long}");
    let index = dir.join("model.safetensors.index.json");
    let open_with = |map: serde_json::Value| {
        std::fs::write(&index, serde_json::json!({ "weight_map": map }).to_string()).unwrap();
        checkpoint_err(Checkpoint::open(&index))
    };

    // A shard file name with an escape sequence, a NUL and 1 MB of 'a'.
    let e = open_with(serde_json::json!({ name(0): hostile }));
    assert_bounded("hostile file name", &e, "\\u{1b}[31m\\0aaa");
    // The same as a tensor name beside a file name that is not plain.
    let e = open_with(serde_json::json!({ hostile.clone(): "../model.safetensors" }));
    assert_bounded("hostile tensor name", &e, "\"\\u{1b}[31m\\0aaa");
    assert!(e.contains(&format!("({} bytes in all)", hostile.len())), "{e}");
    // A tensor the index promises that its file lacks.
    let e = open_with(serde_json::json!({ format!("x\n{long}"): "model.safetensors" }));
    assert_bounded("missing tensor of the index", &e, "\"x\\naaa");
    // A tensor name that is not a string value.
    let e = open_with(serde_json::json!({ hostile.clone(): 3 }));
    assert_bounded("entry not a string", &e, "is not a file name");

    // A caller's tensor name echoed by a missing-tensor error.
    let ckpt = Checkpoint::open(dir.join("model.safetensors")).unwrap();
    let e = ckpt.load(&hostile, None, &CPU).unwrap_err();
    assert!(matches!(e, LayerError::MissingTensor { .. }), "{e:?}");
    assert_bounded("missing tensor", &e.to_string(), "\\u{1b}[31m\\0aaa");

    // A safetensors header whose complaint names a hostile tensor: its data offsets skip bytes.
    let header = serde_json::json!({ hostile.clone(): { "dtype": "F32", "shape": [1], "data_offsets": [4, 8] } });
    let header = header.to_string();
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&[0; 8]);
    let file = dir.join("bad-offsets.safetensors");
    std::fs::write(&file, bytes).unwrap();
    let e = checkpoint_err(Checkpoint::open(&file));
    assert_bounded("parser's complaint", &e, "not a valid safetensors file");
    assert_eq!(quote_text("\u{1b}"), "\"\\u{1b}\"");
}
