//! The typed metadata getters: `Ok(None)` when absent, the value when its type fits, and
//! `WrongType` / `OutOfRange` naming the key, what it holds and what was asked for.

mod common;

use common::TempDir;
use common::builder::{Builder, V, s};
use tp_gguf::{Array, GgufError, GgufFile};

fn file(dir: &TempDir) -> GgufFile {
    let built = Builder::new()
        .kv("u8", V::U8(200))
        .kv("u16", V::U16(60000))
        .kv("u32", V::U32(u32::MAX))
        .kv("u64.small", V::U64(5))
        .kv("u64.big", V::U64(1 << 33))
        .kv("u64.max", V::U64(u64::MAX))
        .kv("i8.neg", V::I8(-1))
        .kv("i16", V::I16(300))
        .kv("i32", V::I32(123))
        .kv("i32.neg", V::I32(-5))
        .kv("i64.min", V::I64(i64::MIN))
        .kv("f32", V::F32(1.25))
        .kv("f64", V::F64(0.1))
        .kv("bool", V::Bool(true))
        .kv("str", s("llama"))
        .kv("strs", V::Arr(8, vec![s("a"), s("b")]))
        .kv("f32s", V::Arr(6, vec![V::F32(0.5), V::F32(-1.0)]))
        .kv("i32s", V::Arr(5, vec![V::I32(-1), V::I32(2)]))
        .kv("u32s", V::Arr(4, vec![V::U32(3)]))
        .kv("empty", V::Arr(4, vec![]))
        .build();
    dir.open(&built.bytes).unwrap()
}

fn wrong_type<T: std::fmt::Debug>(r: tp_gguf::Result<T>, key: &str, found: &str, expected: &str) {
    let e = r.unwrap_err();
    assert!(
        matches!(&e, GgufError::WrongType { key: k, found: f, expected: x, .. } if k == key && f == found && *x == expected),
        "{e:?}"
    );
    assert!(e.to_string().ends_with(&format!("metadata key {key:?} is {found}, expected {expected}")), "{e}");
}

fn out_of_range<T: std::fmt::Debug>(r: tp_gguf::Result<T>, key: &str, value: &str, expected: &str) {
    let e = r.unwrap_err();
    assert!(
        matches!(&e, GgufError::OutOfRange { key: k, value: v, expected: x, .. } if k == key && v == value && *x == expected),
        "{e:?}"
    );
    assert!(e.to_string().contains(&format!("metadata key {key:?} is {value} (")), "{e}");
}

#[test]
fn integer_getters_take_any_integer_type_in_range() {
    let dir = TempDir::new("get");
    let f = file(&dir);
    assert_eq!(f.get_u32("u8").unwrap(), Some(200));
    assert_eq!(f.get_u32("u16").unwrap(), Some(60000));
    assert_eq!(f.get_u32("u32").unwrap(), Some(u32::MAX));
    assert_eq!(f.get_u32("u64.small").unwrap(), Some(5));
    assert_eq!(f.get_u32("i16").unwrap(), Some(300));
    assert_eq!(f.get_u32("i32").unwrap(), Some(123));
    assert_eq!(f.get_u32("absent").unwrap(), None);
    out_of_range(f.get_u32("u64.big"), "u64.big", "8589934592", "u32");
    out_of_range(f.get_u32("i32.neg"), "i32.neg", "-5", "u32");
    assert_eq!(f.get_u64("u64.max").unwrap(), Some(u64::MAX));
    assert_eq!(f.get_u64("u32").unwrap(), Some(u32::MAX.into()));
    out_of_range(f.get_u64("i8.neg"), "i8.neg", "-1", "u64");
    assert_eq!(f.get_i64("i64.min").unwrap(), Some(i64::MIN));
    assert_eq!(f.get_i64("i32.neg").unwrap(), Some(-5));
    out_of_range(f.get_i64("u64.max"), "u64.max", "18446744073709551615", "i64");
    wrong_type(f.get_u32("f32"), "f32", "f32", "u32");
    wrong_type(f.get_u64("bool"), "bool", "bool", "u64");
    wrong_type(f.get_i64("str"), "str", "str", "i64");
}

#[test]
fn float_bool_and_string_getters() {
    let dir = TempDir::new("get");
    let f = file(&dir);
    assert_eq!(f.get_f32("f32").unwrap(), Some(1.25));
    assert_eq!(f.get_f32("f64").unwrap(), Some(0.1f64 as f32));
    assert_eq!(f.get_f32("absent").unwrap(), None);
    wrong_type(f.get_f32("i32"), "i32", "i32", "f32");
    assert_eq!(f.get_bool("bool").unwrap(), Some(true));
    wrong_type(f.get_bool("u8"), "u8", "u8", "bool");
    assert_eq!(f.get_str("str").unwrap(), Some("llama"));
    assert_eq!(f.get_str("absent").unwrap(), None);
    wrong_type(f.get_str("u32"), "u32", "u32", "str");
    wrong_type(f.get_str("strs"), "strs", "arr[str]", "str");
}

#[test]
fn array_getters_take_exactly_their_element_type() {
    let dir = TempDir::new("get");
    let f = file(&dir);
    assert_eq!(f.get_str_array("strs").unwrap(), Some(&["a".to_string(), "b".to_string()][..]));
    assert_eq!(f.get_f32_array("f32s").unwrap(), Some(&[0.5, -1.0][..]));
    assert_eq!(f.get_i32_array("i32s").unwrap(), Some(&[-1, 2][..]));
    assert_eq!(f.get_u32_array("u32s").unwrap(), Some(&[3][..]));
    assert_eq!(f.get_u32_array("empty").unwrap(), Some(&[][..]));
    assert_eq!(f.get_array("i32s").unwrap(), Some(&Array::I32(vec![-1, 2])));
    assert_eq!(f.get_str_array("absent").unwrap(), None);
    wrong_type(f.get_u32_array("i32s"), "i32s", "arr[i32]", "arr[u32]");
    wrong_type(f.get_i32_array("f32s"), "f32s", "arr[f32]", "arr[i32]");
    wrong_type(f.get_f32_array("str"), "str", "str", "arr[f32]");
    wrong_type(f.get_str_array("u32s"), "u32s", "arr[u32]", "arr[str]");
    wrong_type(f.get_array("u8"), "u8", "u8", "an array");
}

#[test]
fn metadata_keeps_file_order() {
    let dir = TempDir::new("get");
    let f = file(&dir);
    let keys: Vec<&str> = f.metadata().iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys[..4], ["u8", "u16", "u32", "u64.small"]);
    assert_eq!(keys.len(), 20);
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32);
}
