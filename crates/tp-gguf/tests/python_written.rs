//! Files written by the `gguf` Python package (llama.cpp's writer, tests/write_gguf.py): every
//! metadata value, tensor dimension, type and byte must read back as the script wrote them, the
//! data section and tensors must lie where the package's own reader finds them, and the ggml type
//! table must equal the package's.

mod common;

use common::builder::{Builder, V, s};
use common::{TempDir, python_files};
use serde_json::Value as Json;
use std::path::Path;
use tp_gguf::{Array, GgmlType, GgufError, GgufFile, Value};

fn manifest_entry(file: &str) -> Json {
    let text = std::fs::read_to_string(python_files().join("manifest.json")).unwrap();
    let manifest: Json = serde_json::from_str(&text).unwrap();
    manifest["files"].as_array().unwrap().iter().find(|f| f["file"] == file).unwrap().clone()
}

/// An array's elements as values, to compare one by one.
fn elements(a: &Array) -> Vec<Value> {
    match a {
        Array::U8(v) => v.iter().map(|&x| Value::U8(x)).collect(),
        Array::I8(v) => v.iter().map(|&x| Value::I8(x)).collect(),
        Array::U16(v) => v.iter().map(|&x| Value::U16(x)).collect(),
        Array::I16(v) => v.iter().map(|&x| Value::I16(x)).collect(),
        Array::U32(v) => v.iter().map(|&x| Value::U32(x)).collect(),
        Array::I32(v) => v.iter().map(|&x| Value::I32(x)).collect(),
        Array::F32(v) => v.iter().map(|&x| Value::F32(x)).collect(),
        Array::Bool(v) => v.iter().map(|&x| Value::Bool(x)).collect(),
        Array::String(v) => v.iter().map(|x| Value::String(x.clone())).collect(),
        Array::Array(v) => v.iter().map(|x| Value::Array(x.clone())).collect(),
        Array::U64(v) => v.iter().map(|&x| Value::U64(x)).collect(),
        Array::I64(v) => v.iter().map(|&x| Value::I64(x)).collect(),
        Array::F64(v) => v.iter().map(|&x| Value::F64(x)).collect(),
    }
}

/// Checks `v` against the script's description of what it wrote (floats as bit patterns).
fn check_value(v: &Value, want: &Json, at: &str) {
    let t = want["t"].as_str().unwrap();
    let n = &want["v"];
    let ok = match (t, v) {
        ("u8", Value::U8(x)) => n.as_u64() == Some((*x).into()),
        ("i8", Value::I8(x)) => n.as_i64() == Some((*x).into()),
        ("u16", Value::U16(x)) => n.as_u64() == Some((*x).into()),
        ("i16", Value::I16(x)) => n.as_i64() == Some((*x).into()),
        ("u32", Value::U32(x)) => n.as_u64() == Some((*x).into()),
        ("i32", Value::I32(x)) => n.as_i64() == Some((*x).into()),
        ("u64", Value::U64(x)) => n.as_u64() == Some(*x),
        ("i64", Value::I64(x)) => n.as_i64() == Some(*x),
        ("f32", Value::F32(x)) => want["bits"].as_u64() == Some(x.to_bits().into()),
        ("f64", Value::F64(x)) => want["bits"].as_u64() == Some(x.to_bits()),
        ("bool", Value::Bool(x)) => n.as_bool() == Some(*x),
        ("str", Value::String(x)) => n.as_str() == Some(x.as_str()),
        ("arr", Value::Array(a)) => {
            let items = n.as_array().unwrap();
            assert_eq!(a.type_name(), format!("arr[{}]", want["e"].as_str().unwrap()), "{at}");
            assert_eq!(a.len(), items.len(), "{at}");
            for (i, (item, w)) in elements(a).iter().zip(items).enumerate() {
                check_value(item, w, &format!("{at}[{i}]"));
            }
            true
        }
        _ => false,
    };
    assert!(ok, "{at}: read {v:?}, the script wrote {want}");
}

/// Opens the script's `file` and checks everything the manifest says about it.
fn check_file(file: &str) -> GgufFile {
    let want = manifest_entry(file);
    let f = GgufFile::open(python_files().join(file)).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment() as u64, want["alignment"].as_u64().unwrap());
    let kvs = want["metadata"].as_array().unwrap();
    assert_eq!(f.metadata().len(), kvs.len(), "{file}: metadata count");
    for ((key, value), w) in f.metadata().iter().zip(kvs) {
        assert_eq!(key, w[0].as_str().unwrap(), "{file}: metadata order");
        check_value(value, &w[1], &format!("{file} {key}"));
        assert!(f.get(key).is_some_and(|v| std::ptr::eq(v, value)), "{file}: get({key})");
    }
    assert_eq!(f.data_offset() as u64, want["reader_data_offset"].as_u64().unwrap(), "{file}: data section");
    let tensors = want["tensors"].as_array().unwrap();
    assert_eq!(f.tensors().len(), tensors.len(), "{file}: tensor count");
    for (t, w) in f.tensors().iter().zip(tensors) {
        let at = format!("{file} tensor {}", t.name);
        assert_eq!(t.name, w["name"].as_str().unwrap(), "{at}");
        assert_eq!(t.ggml_type, GgmlType(w["type"].as_u64().unwrap() as u32), "{at}");
        let dims: Vec<u64> = w["dims"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).collect();
        assert_eq!(t.dims, dims, "{at}");
        assert_eq!(t.n_elements(), dims.iter().product::<u64>(), "{at}");
        assert_eq!((f.data_offset() as u64 + t.offset), w["reader_offset"].as_u64().unwrap(), "{at}: offset");
        assert_eq!(t.n_bytes as u64, w["reader_n_bytes"].as_u64().unwrap(), "{at}: size");
        assert_eq!(t.offset % f.alignment() as u64, 0, "{at}");
        let bytes = std::fs::read(python_files().join(w["file"].as_str().unwrap())).unwrap();
        assert_eq!(f.tensor_data(t), &bytes[..], "{at}: bytes");
        assert_eq!(f.tensor(&t.name), Some(t));
    }
    f
}

#[test]
fn every_value_type_and_tensor_type_reads_back() {
    let f = check_file("values.gguf");
    assert_eq!(f.tensors().len(), 11);
    // Spot checks in Rust terms, beside the manifest's.
    assert_eq!(f.get("t.u64"), Some(&Value::U64(u64::MAX)));
    assert_eq!(f.get("t.empty_str"), Some(&Value::String(String::new())));
    assert!(matches!(f.get("t.f32_nan"), Some(Value::F32(x)) if x.is_nan()));
    let nested = f.get_array("n.strs3").unwrap().unwrap();
    let Array::Array(outer) = nested else { panic!("{nested:?}") };
    assert_eq!(
        outer[1],
        Array::Array(vec![Array::String(vec!["c".into()]), Array::String(vec!["".into(), "d".into()])])
    );
    let q6k = f.tensor("w.q6_k").unwrap();
    assert_eq!((q6k.ggml_type, q6k.dims.as_slice(), q6k.n_bytes), (GgmlType::Q6_K, &[256, 2][..], 420));
    assert_eq!(f.tensor("w.f32").unwrap().dims, [5, 3], "ggml order: the row length first");
    assert_eq!(f.tensor("w.f32_4d").unwrap().dims, [2, 3, 1, 2]);
    assert!(f.tensor("nope").is_none() && f.get("nope").is_none());
}

#[test]
fn custom_alignment_places_tensors_on_its_multiples() {
    let f = check_file("aligned.gguf");
    assert_eq!((f.alignment(), f.data_offset() % 64), (64, 0));
    assert_eq!(f.get_u32("general.alignment").unwrap(), Some(64));
    let offsets: Vec<u64> = f.tensors().iter().map(|t| t.offset).collect();
    assert_eq!(offsets, [0, 64, 128, 192]);
}

#[test]
fn a_file_without_tensors_opens() {
    let f = check_file("no_tensors.gguf");
    assert!(f.tensors().is_empty());
    assert_eq!(f.get_str("x.str").unwrap(), Some("only metadata"));
}

/// Version 2 has version 3's layout (v3 only added big-endian files; v1 had u32 counts): the
/// Python reader accepts the same bytes as either, and so does this one, reading the same.
#[test]
fn version_2_is_version_3_with_another_number() {
    let v3 = std::fs::read(python_files().join("values.gguf")).unwrap();
    let mut v2 = v3.clone();
    v2[4..8].copy_from_slice(&2u32.to_le_bytes());
    let dir = TempDir::new("v2");
    let a = GgufFile::open(dir.write(&v2)).unwrap();
    let b = GgufFile::open(python_files().join("values.gguf")).unwrap();
    assert_eq!((a.version(), b.version()), (2, 3));
    assert_eq!(a.metadata().len(), b.metadata().len());
    for (x, y) in a.metadata().iter().zip(b.metadata()) {
        // NaN != NaN: compare what was stored, through Debug.
        assert_eq!(format!("{x:?}"), format!("{y:?}"));
    }
    assert_eq!(a.tensors(), b.tensors());
    for (x, y) in a.tensors().iter().zip(b.tensors()) {
        assert_eq!(a.tensor_data(x), b.tensor_data(y));
    }
}

#[test]
fn a_big_endian_file_is_refused_by_name() {
    let path = python_files().join("bigendian.gguf");
    let e = GgufFile::open(&path).unwrap_err();
    assert!(matches!(e, GgufError::BigEndian { raw: 0x0300_0000, .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("big-endian") && msg.contains("version 3") && msg.contains("byte 4"), "{msg}");
}

/// The builder the malformed-file tests patch writes what the Python package writes.
#[test]
fn the_test_builder_writes_what_python_writes() {
    let mut q8 = Vec::new();
    q8.extend(0u8..34);
    let f32: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0].iter().flat_map(|x| x.to_le_bytes()).collect();
    let built = Builder::new()
        .kv("general.architecture", s("tp"))
        .kv("s.u32", V::U32(7))
        .kv("s.i32", V::I32(-3))
        .kv("s.f32", V::F32(0.5))
        .kv("s.bool", V::Bool(true))
        .kv("s.str", s("hi"))
        .kv("s.strs", V::Arr(8, vec![s("a"), s("bc")]))
        .kv("s.ints", V::Arr(5, vec![V::I32(1), V::I32(-2)]))
        .kv("s.nested", V::Arr(9, vec![V::Arr(5, vec![V::I32(1)]), V::Arr(5, vec![V::I32(2), V::I32(3)])]))
        .tensor("s.f32", &[3, 2], 0, f32)
        .tensor("s.q8_0", &[32, 1], 8, q8)
        .build();
    let python = std::fs::read(python_files().join("small.gguf")).unwrap();
    assert_eq!(built.bytes, python);
    check_file("small.gguf");
}

/// The ggml type table equals the `gguf` package's (`GGMLQuantizationType`, `GGML_QUANT_SIZES`):
/// the same numbers known, with the same names and block sizes.
#[test]
fn the_ggml_type_table_is_the_python_packages() {
    let text = std::fs::read_to_string(python_files().join("types.json")).unwrap();
    let table: serde_json::Map<String, Json> = serde_json::from_str(&text).unwrap();
    let mut theirs: Vec<u32> = table.keys().map(|k| k.parse().unwrap()).collect();
    theirs.sort_unstable();
    let ours: Vec<u32> = GgmlType::all().map(|t| t.0).collect();
    assert_eq!(ours, theirs);
    for (id, row) in &table {
        let t = GgmlType(id.parse().unwrap());
        let row = row.as_array().unwrap();
        assert_eq!(t.name(), row[0].as_str(), "{id}");
        assert_eq!(t.block_elems().map(|n| n as u64), row[1].as_u64(), "{id}");
        assert_eq!(t.block_bytes().map(|n| n as u64), row[2].as_u64(), "{id}");
    }
    assert!(Path::new(&python_files().join("values.gguf")).exists());
}
