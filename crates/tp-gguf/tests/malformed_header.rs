//! Malformed headers and metadata, crafted from a good file (tests/common/builder.rs, which
//! writes what the `gguf` Python package writes) by patching or cutting bytes: each must be its
//! own error variant, at the right byte, with a message naming the field.

mod common;

use common::builder::{Builder, V, gguf_string, s};
use common::{TempDir, open_err};
use tp_gguf::{GgufError, GgufFile};

/// A good file: metadata of several kinds and two tensors.
fn good() -> Builder {
    let q8: Vec<u8> = (0u8..34).collect();
    Builder::new()
        .kv("general.architecture", s("tp"))
        .kv("a.u32", V::U32(7))
        .kv("a.str", s("hello"))
        .kv("a.strs", V::Arr(8, vec![s("x"), s("yz")]))
        .kv("a.u32s", V::Arr(4, vec![V::U32(1), V::U32(2), V::U32(3)]))
        .kv("a.bool", V::Bool(true))
        .tensor("t.f32", &[4, 2], 0, vec![0; 32])
        .tensor("t.q8_0", &[32, 1], 8, q8)
}

#[test]
fn the_base_file_is_good() {
    let dir = TempDir::new("hdr");
    let f = dir.open(&good().build().bytes).unwrap();
    assert_eq!((f.metadata().len(), f.tensors().len(), f.alignment()), (6, 2, 32));
}

#[test]
fn bad_magic_is_named_and_escaped() {
    let dir = TempDir::new("hdr");
    let mut b = good().build();
    let (e, msg) = open_err(&dir, &b.patch(0, b"GGML").bytes);
    assert!(matches!(&e, GgufError::BadMagic { found, .. } if found == "\"GGML\""), "{e:?}");
    assert!(msg.contains("magic at byte 0 is \"GGML\""), "{msg}");
    let (_, msg) = open_err(&dir, &b.patch(0, b"\x1b[2J").bytes);
    assert!(msg.contains("\\u{1b}[2J") && !msg.contains('\u{1b}'), "{msg}");
}

#[test]
fn versions_other_than_2_and_3_are_refused_by_number() {
    let dir = TempDir::new("hdr");
    for version in [0u32, 1, 4, 0xffff_ffff] {
        let mut b = good().build();
        let (e, msg) = open_err(&dir, &b.patch_u32(4, version).bytes);
        assert!(matches!(e, GgufError::UnsupportedVersion { version: v, .. } if v == version), "{e:?}");
        assert!(msg.contains(&format!("GGUF version {version} (the version field at byte 4)")), "{msg}");
    }
    // Version 3 written big-endian: the field reads 0x03000000.
    let mut b = good().build();
    let (e, msg) = open_err(&dir, &b.patch(4, &[0, 0, 0, 3]).bytes);
    assert!(matches!(e, GgufError::BigEndian { raw: 0x0300_0000, .. }), "{e:?}");
    assert!(msg.contains("big-endian") && msg.contains("(version 3)"), "{msg}");
}

#[test]
fn a_cut_header_names_the_field_it_ends_in() {
    let dir = TempDir::new("hdr");
    // No tensors, so that the tensor count fits in what is left of a cut file.
    let bytes = Builder::new().kv("general.architecture", s("tp")).build().bytes;
    for (len, field, offset) in [
        (0, "the magic", 0),
        (3, "the magic", 0),
        (6, "the version", 4),
        (12, "the tensor count", 8),
        (20, "the metadata key-value count", 16),
    ] {
        let (e, msg) = open_err(&dir, &bytes[..len]);
        match &e {
            GgufError::Truncated { what, offset: at, have, .. } => {
                assert_eq!((what.as_str(), *at, *have), (field, offset, (len - offset as usize) as u64), "{len}")
            }
            _ => panic!("{len}: {e:?}"),
        }
        assert!(msg.contains(&format!("ends inside {field} at byte {offset}")), "{msg}");
    }
}

#[test]
fn counts_the_file_cannot_hold_are_refused_before_allocating() {
    let dir = TempDir::new("hdr");
    for (at, field) in [(8, "the tensor count"), (16, "the metadata key-value count")] {
        for count in [1u64 << 40, u64::MAX] {
            let mut b = good().build();
            let (e, msg) = open_err(&dir, &b.patch_u64(at, count).bytes);
            assert!(
                matches!(&e, GgufError::CountTooLarge { what, offset, count: c, .. } if what == field && *offset == at as u64 && *c == count),
                "{e:?}"
            );
            assert!(msg.contains(&format!("{field} at byte {at} is {count}")), "{msg}");
        }
    }
}

#[test]
fn string_lengths_past_the_end_are_refused() {
    let dir = TempDir::new("hdr");
    let built = good().build();
    // The length of key 1 ("a.u32"), then of the string value of key 2 ("a.str").
    let key_len_at = built.kv_at[1];
    let value_len_at = built.type_at[2] + 4;
    for (at, field) in [
        (key_len_at, "the length of the key of metadata entry 1"),
        (value_len_at, "the length of the value of key \"a.str\""),
    ] {
        let mut b = good().build();
        let (e, msg) = open_err(&dir, &b.patch_u64(at, 1 << 50).bytes);
        assert!(
            matches!(&e, GgufError::CountTooLarge { what, offset, .. } if what == field && *offset == at as u64),
            "{e:?}"
        );
        assert!(msg.contains(field), "{msg}");
    }
}

#[test]
fn array_lengths_are_checked_at_their_elements_size() {
    let dir = TempDir::new("hdr");
    let built = good().build();
    // "a.u32s": element type (u32) then length (u64); u32 elements take 4 bytes each.
    let len_at = built.type_at[4] + 4 + 4;
    let remaining = (built.bytes.len() - len_at - 8) as u64;
    let mut b = good().build();
    let (e, msg) = open_err(&dir, &b.patch_u64(len_at, remaining / 4 + 1).bytes);
    match &e {
        GgufError::CountTooLarge { what, offset, max, remaining: r, .. } => {
            assert_eq!(
                (what.as_str(), *offset, *max, *r),
                ("the length of the value of key \"a.u32s\"", len_at as u64, remaining / 4, remaining)
            )
        }
        _ => panic!("{e:?}"),
    }
    assert!(msg.contains(&format!("hold at most {}", remaining / 4)), "{msg}");
    // Just within the bytes left, the length passes its check and the entries after it fail.
    let mut b = good().build();
    assert!(dir.open(&b.patch_u64(len_at, remaining / 4).bytes).is_err());
    // A string array: each element at least its 8-byte length.
    let len_at = built.type_at[3] + 8;
    let mut b = good().build();
    let (e, _) = open_err(&dir, &b.patch_u64(len_at, u64::MAX).bytes);
    assert!(
        matches!(&e, GgufError::CountTooLarge { what, .. } if what == "the length of the value of key \"a.strs\""),
        "{e:?}"
    );
}

#[test]
fn strings_that_are_not_utf8_are_named() {
    let dir = TempDir::new("hdr");
    let cases: [(Builder, &str, u64); 3] = [
        (good().kv_bytes(b"bad\xffkey", V::U8(1)), "the key of metadata entry 6", 3),
        (good().kv("k.str", V::Str(b"ok\xc3".to_vec())), "the value of key \"k.str\"", 2),
        (good().kv("k.strs", V::Arr(8, vec![s("fine"), V::Str(b"\xfe".to_vec())])), "element [1] of key \"k.strs\"", 0),
    ];
    for (builder, field, valid_up_to) in cases {
        let (e, msg) = open_err(&dir, &builder.build().bytes);
        assert!(
            matches!(&e, GgufError::InvalidUtf8 { what, valid_up_to: v, .. } if what == field && *v == valid_up_to),
            "{e:?}"
        );
        assert!(msg.contains(field) && msg.contains("not valid UTF-8"), "{msg}");
    }
}

#[test]
fn bools_other_than_0_and_1_are_refused() {
    let dir = TempDir::new("hdr");
    let built = good().kv("k.b", V::Raw(7, vec![2])).build();
    let (e, msg) = open_err(&dir, &built.bytes);
    let at = (built.type_at[6] + 4) as u64;
    assert!(
        matches!(&e, GgufError::BadBool { what, offset, byte: 2, .. } if what == "the value of key \"k.b\"" && *offset == at),
        "{e:?}"
    );
    assert!(msg.contains(&format!("at byte {at} is a bool stored as 0x02")), "{msg}");
    let built = good().kv("k.bs", V::Arr(7, vec![V::Bool(true), V::Bool(false), V::Raw(7, vec![0xff])])).build();
    let at = (built.type_at[6] + 4 + 4 + 8 + 2) as u64;
    let (e, _) = open_err(&dir, &built.bytes);
    assert!(
        matches!(&e, GgufError::BadBool { what, offset, byte: 0xff, .. } if what == "element [2] of key \"k.bs\"" && *offset == at),
        "{e:?}"
    );
}

#[test]
fn unknown_value_types_are_refused_by_number() {
    let dir = TempDir::new("hdr");
    let built = good().kv("k.x", V::Raw(13, vec![0; 8])).build();
    let (e, msg) = open_err(&dir, &built.bytes);
    let at = built.type_at[6] as u64;
    assert!(
        matches!(&e, GgufError::UnknownValueType { what, offset, type_id: 13, .. } if what == "the value type of key \"k.x\"" && *offset == at),
        "{e:?}"
    );
    assert!(msg.contains("is value type 13"), "{msg}");
    // As an array's element type, and inside a nested array.
    let (e, _) = open_err(&dir, &good().kv("k.a", V::Arr(0xdead, vec![])).build().bytes);
    assert!(
        matches!(&e, GgufError::UnknownValueType { what, type_id: 0xdead, .. } if what == "the element type of the value of key \"k.a\""),
        "{e:?}"
    );
    let nested = V::Arr(9, vec![V::Arr(4, vec![V::U32(1)]), V::Arr(99, vec![])]);
    let (e, _) = open_err(&dir, &good().kv("k.n", nested).build().bytes);
    assert!(
        matches!(&e, GgufError::UnknownValueType { what, type_id: 99, .. } if what == "the element type of element [1] of key \"k.n\""),
        "{e:?}"
    );
}

/// Arrays nested `depth` deep (1: an array of u32).
fn nested(depth: usize) -> V {
    if depth == 1 { V::Arr(4, vec![V::U32(5)]) } else { V::Arr(9, vec![nested(depth - 1)]) }
}

#[test]
fn arrays_nest_at_most_max_array_depth() {
    let dir = TempDir::new("hdr");
    let max = GgufFile::MAX_ARRAY_DEPTH;
    let f = dir.open(&good().kv("k.deep", nested(max)).build().bytes).unwrap();
    assert_eq!(f.get_array("k.deep").unwrap().unwrap().len(), 1);
    let (e, msg) = open_err(&dir, &good().kv("k.deep", nested(max + 1)).build().bytes);
    let path = "[0]".repeat(max);
    assert!(
        matches!(&e, GgufError::ArrayTooDeep { what, max: m, .. } if *what == format!("element {path} of key \"k.deep\"") && *m == max),
        "{e:?}"
    );
    assert!(msg.contains(&format!("nests arrays more than {max} deep")), "{msg}");
}

#[test]
fn keys_are_non_empty_and_unique() {
    let dir = TempDir::new("hdr");
    let built = good().kv("a.str", V::U8(1)).build();
    let (e, msg) = open_err(&dir, &built.bytes);
    let (at, first) = (built.kv_at[6] as u64, built.kv_at[2] as u64);
    assert!(
        matches!(&e, GgufError::DuplicateKey { key, offset, first: f, .. } if key == "a.str" && *offset == at && *f == first),
        "{e:?}"
    );
    assert!(
        msg.contains(&format!("metadata key \"a.str\" at byte {at} appears twice (first at byte {first})")),
        "{msg}"
    );
    let built = good().kv("", V::U8(1)).build();
    let (e, msg) = open_err(&dir, &built.bytes);
    assert!(matches!(e, GgufError::EmptyKey { index: 6, offset, .. } if offset == built.kv_at[6] as u64), "{e:?}");
    assert!(msg.contains("the key of metadata entry 6"), "{msg}");
}

#[test]
fn a_huge_hostile_key_makes_a_short_escaped_message() {
    let dir = TempDir::new("hdr");
    let key = format!("\u{1b}[31m{}\n", "k".repeat(100_000));
    let (e, msg) = open_err(&dir, &good().kv(&key, V::U8(1)).kv(&key, V::U8(2)).build().bytes);
    assert!(matches!(e, GgufError::DuplicateKey { .. }), "{e:?}");
    assert!(msg.len() < 600 && !msg.contains('\u{1b}') && !msg.contains('\n'), "{} bytes: {msg}", msg.len());
    assert!(msg.contains(&format!("({} bytes in all)", key.len())), "{msg}");
}

#[test]
fn general_alignment_must_be_a_u32_power_of_two() {
    let dir = TempDir::new("hdr");
    for alignment in [0u32, 3, 48, 0x8000_0001] {
        let built = good().kv("general.alignment", V::U32(alignment)).build();
        let (e, msg) = open_err(&dir, &built.bytes);
        let at = (built.type_at[6] + 4) as u64;
        assert!(
            matches!(e, GgufError::BadAlignment { alignment: a, offset, .. } if a == alignment && offset == at),
            "{e:?}"
        );
        assert!(msg.contains(&format!("general.alignment at byte {at} is {alignment}, not a power of two")), "{msg}");
    }
    for (v, found) in
        [(V::I32(32), "i32"), (V::U64(32), "u64"), (s("32"), "str"), (V::Arr(4, vec![V::U32(32)]), "arr[u32]")]
    {
        let (e, msg) = open_err(&dir, &good().kv("general.alignment", v).build().bytes);
        assert!(matches!(&e, GgufError::AlignmentType { found: f, .. } if f == found), "{e:?}");
        assert!(msg.contains("general.alignment at byte") && msg.contains("must be a u32"), "{msg}");
    }
    // A good one moves the data section and the tensors onto its multiples.
    let mut builder = good().kv("general.alignment", V::U32(128));
    builder.alignment = 128;
    let f = dir.open(&builder.build().bytes).unwrap();
    assert_eq!((f.alignment(), f.data_offset() % 128, f.tensors()[1].offset), (128, 0, 128));
}

#[test]
fn a_value_cut_short_is_truncated_at_its_field() {
    let dir = TempDir::new("hdr");
    // One pair, so that its count fits in what is left of a cut file.
    let built = Builder::new().kv("a.u32", V::U32(7)).build();
    assert_eq!(&built.bytes[24..24 + 13], &gguf_string(b"a.u32")[..]);
    // End the file inside the u32 value.
    let at = built.type_at[0] + 4;
    let (e, msg) = open_err(&dir, &built.bytes[..at + 2]);
    assert!(
        matches!(&e, GgufError::Truncated { what, offset, need: 4, have: 2, .. } if what == "the value of key \"a.u32\"" && *offset == at as u64),
        "{e:?}"
    );
    assert!(msg.contains("ends inside the value of key \"a.u32\" at byte 41: it needs 4 bytes, 2 remain"), "{msg}");
    // Inside the value type.
    let (e, _) = open_err(&dir, &built.bytes[..at - 1]);
    assert!(
        matches!(&e, GgufError::Truncated { what, need: 4, have: 3, .. } if what == "the value type of key \"a.u32\""),
        "{e:?}"
    );
}
