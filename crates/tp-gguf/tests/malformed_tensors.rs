//! Malformed tensor infos and data layouts, crafted from a good file (tests/common/builder.rs) by
//! patching or cutting bytes: each must be its own error variant, at the right byte, with a
//! message naming the tensor and the field.

mod common;

use common::builder::{Builder, V, s};
use common::{TempDir, open_err};
use tp_gguf::{GgmlType, GgufError, GgufFile};

/// A good file: metadata and three tensors (F32 [4, 2], Q8_0 [32, 1], F16 [3]).
fn good() -> Builder {
    let q8: Vec<u8> = (0u8..34).collect();
    Builder::new()
        .kv("general.architecture", s("tp"))
        .kv("a.u32", V::U32(7))
        .tensor("t.f32", &[4, 2], 0, (0u8..32).collect())
        .tensor("t.q8_0", &[32, 1], 8, q8)
        .tensor("t.f16", &[3], 1, vec![9; 6])
}

#[test]
fn the_base_file_is_good() {
    let dir = TempDir::new("ten");
    let built = good().build();
    let f = dir.open(&built.bytes).unwrap();
    assert_eq!(f.data_offset(), built.data_start);
    let offsets: Vec<(u64, usize)> = f.tensors().iter().map(|t| (t.offset, t.n_bytes)).collect();
    assert_eq!(offsets, [(0, 32), (32, 34), (96, 6)]);
    assert_eq!(f.tensor_data(&f.tensors()[0]), &(0u8..32).collect::<Vec<_>>()[..]);
    assert_eq!(f.tensor_data(&f.tensors()[2]), &[9; 6]);
}

#[test]
fn more_than_four_dimensions_are_refused() {
    let dir = TempDir::new("ten");
    let mut b = good().build();
    let at = b.info_at[1].n_dims;
    let (e, msg) = open_err(&dir, &b.patch_u32(at, 5).bytes);
    assert!(
        matches!(&e, GgufError::TooManyDims { name, n_dims: 5, max: 4, offset, .. } if name == "t.q8_0" && *offset == at as u64),
        "{e:?}"
    );
    assert!(
        msg.contains(&format!("tensor \"t.q8_0\": its number of dimensions at byte {at} is 5, more than 4")),
        "{msg}"
    );
    let mut b = good().build();
    let (e, _) = open_err(&dir, &b.patch_u32(at, u32::MAX).bytes);
    assert!(matches!(e, GgufError::TooManyDims { n_dims: u32::MAX, .. }), "{e:?}");
}

#[test]
fn a_dimension_of_zero_is_refused() {
    let dir = TempDir::new("ten");
    let mut b = good().build();
    let at = b.info_at[0].dims + 8;
    let (e, msg) = open_err(&dir, &b.patch_u64(at, 0).bytes);
    assert!(
        matches!(&e, GgufError::ZeroDim { name, index: 1, offset, .. } if name == "t.f32" && *offset == at as u64),
        "{e:?}"
    );
    assert!(msg.contains(&format!("tensor \"t.f32\": dimension 1 at byte {at} is 0")), "{msg}");
}

#[test]
fn sizes_past_64_bits_are_refused() {
    let dir = TempDir::new("ten");
    // 2^32 · 2^32 · 2 elements.
    let (e, msg) = open_err(&dir, &good().tensor("big", &[1 << 32, 1 << 32, 2], 0, vec![]).build().bytes);
    assert!(
        matches!(&e, GgufError::SizeOverflow { name, unit: "elements", bits: 64, dims, .. } if name == "big" && dims[2] == 2),
        "{e:?}"
    );
    assert!(msg.contains("make more elements than fit in 64 bits"), "{msg}");
    // 2^62 F32 elements fit, their 2^64 bytes do not.
    let (e, msg) = open_err(&dir, &good().tensor("big", &[1 << 62], 0, vec![]).build().bytes);
    assert!(matches!(&e, GgufError::SizeOverflow { unit: "bytes", bits: 64, .. }), "{e:?}");
    assert!(msg.contains("tensor \"big\": dimensions [4611686018427387904]"), "{msg}");
}

#[test]
fn unknown_tensor_types_are_refused_by_number() {
    let dir = TempDir::new("ten");
    // Removed (Q4_2, Q4_0_4_4, IQ4_NL_4_4), past the table, and absurd.
    for type_id in [4u32, 31, 36, 42, 1000, u32::MAX] {
        let mut b = good().build();
        let at = b.info_at[2].type_id;
        let (e, msg) = open_err(&dir, &b.patch_u32(at, type_id).bytes);
        assert!(
            matches!(&e, GgufError::UnknownTensorType { name, type_id: t, offset, .. } if name == "t.f16" && *t == type_id && *offset == at as u64),
            "{e:?}"
        );
        assert!(msg.contains(&format!("tensor \"t.f16\": type {type_id} at byte {at} is not a ggml type")), "{msg}");
    }
}

#[test]
fn a_row_must_be_whole_blocks() {
    let dir = TempDir::new("ten");
    // Q8_0 blocks hold 32 elements; rows of 48 are not whole blocks (the other dimensions may be
    // anything).
    let (e, msg) = open_err(&dir, &good().tensor("q", &[48, 1], 8, vec![0; 51]).build().bytes);
    assert!(
        matches!(&e, GgufError::RowNotBlocks { name, type_name: "Q8_0", row: 48, block: 32, .. } if name == "q"),
        "{e:?}"
    );
    assert!(msg.contains("tensor \"q\" of type Q8_0: its row length (dimension 0, at byte"), "{msg}");
    assert!(msg.contains("is 48, not a multiple of the type's block of 32 elements"), "{msg}");
    let f = dir.open(&good().tensor("q", &[32, 3], 8, vec![0; 102]).build().bytes).unwrap();
    assert_eq!(f.tensor("q").unwrap().n_bytes, 102);
    // Q6_K: 256-element blocks of 210 bytes.
    let (e, _) = open_err(&dir, &good().tensor("k", &[128], GgmlType::Q6_K.0, vec![0; 210]).build().bytes);
    assert!(matches!(e, GgufError::RowNotBlocks { type_name: "Q6_K", row: 128, block: 256, .. }), "{e:?}");
}

#[test]
fn data_offsets_must_be_aligned() {
    let dir = TempDir::new("ten");
    let mut b = good().build();
    let at = b.info_at[2].offset;
    let (e, msg) = open_err(&dir, &b.patch_u64(at, 100).bytes);
    assert!(
        matches!(&e, GgufError::MisalignedTensor { name, data_offset: 100, alignment: 32, offset, .. } if name == "t.f16" && *offset == at as u64),
        "{e:?}"
    );
    assert!(
        msg.contains(&format!("its data offset 100 (the field at byte {at}) is not a multiple of the alignment 32")),
        "{msg}"
    );
}

#[test]
fn tensors_may_not_overlap() {
    let dir = TempDir::new("ten");
    // The F16 tensor placed on the Q8_0 one.
    let mut b = good().build();
    let (e, msg) = open_err(&dir, &b.patch_u64(b.info_at[2].offset, 32).bytes);
    assert!(
        matches!(&e, GgufError::OverlappingTensors { first, second, .. } if first == "t.q8_0" && second == "t.f16"
        || first == "t.f16" && second == "t.q8_0"),
        "{e:?}"
    );
    assert!(msg.contains("overlap"), "{msg}");
    // Partly: the 34 bytes of the Q8_0 tensor at 32..66 and a tensor moved to 64.
    let mut b = good().build();
    let (e, msg) = open_err(&dir, &b.patch_u64(b.info_at[2].offset, 64).bytes);
    assert!(
        matches!(&e, GgufError::OverlappingTensors { first_start: 32, first_end: 66, second_start: 64, .. }),
        "{e:?}"
    );
    assert!(
        msg.contains("tensors \"t.q8_0\" (data offsets 32..66) and \"t.f16\" (from data offset 64) overlap"),
        "{msg}"
    );
    // In another order than the infos' is fine.
    let mut b = good().build();
    let (first, last) = (b.info_at[0].offset, b.info_at[2].offset);
    b.patch_u64(first, 96).patch_u64(last, 0);
    let f = dir.open(&b.bytes).unwrap();
    assert_eq!(f.tensor("t.f16").unwrap().offset, 0);
}

#[test]
fn tensor_bytes_must_lie_in_the_file() {
    let dir = TempDir::new("ten");
    let built = good().build();
    let at = built.info_at[1].offset as u64;
    for offset in [1u64 << 40, u64::MAX - 31] {
        let mut b = good().build();
        let (e, msg) = open_err(&dir, &b.patch_u64(at as usize, offset).bytes);
        assert!(
            matches!(&e, GgufError::TensorPastEnd { name, data_offset, n_bytes: 34, offset: o, .. } if name == "t.q8_0" && *data_offset == offset && *o == at),
            "{e:?}"
        );
        assert!(
            msg.contains(&format!(
                "tensor \"t.q8_0\": its 34 bytes from data offset {offset} (the field at byte {at})"
            )),
            "{msg}"
        );
    }
    // A file cut one byte into the last tensor's bytes, and one cut before its data section.
    let (e, msg) = open_err(&dir, &built.bytes[..built.data_end - 1]);
    let len = built.data_end - 1;
    assert!(
        matches!(&e, GgufError::TensorPastEnd { name, file_len, .. } if name == "t.f16" && *file_len == len as u64),
        "{e:?}"
    );
    assert!(msg.contains(&format!("run past the end of the file ({len} bytes")), "{msg}");
    let (e, _) = open_err(&dir, &built.bytes[..built.data_start - 1]);
    assert!(matches!(&e, GgufError::TensorPastEnd { name, .. } if name == "t.f32"), "{e:?}");
}

#[test]
fn tensor_names_are_unique_and_utf8() {
    let dir = TempDir::new("ten");
    let built = good().tensor("t.q8_0", &[1], 0, vec![0; 4]).build();
    let (e, msg) = open_err(&dir, &built.bytes);
    let (at, first) = (built.info_at[3].start as u64, built.info_at[1].start as u64);
    assert!(
        matches!(&e, GgufError::DuplicateTensor { name, offset, first: f, .. } if name == "t.q8_0" && *offset == at && *f == first),
        "{e:?}"
    );
    assert!(
        msg.contains(&format!("tensor name \"t.q8_0\" at byte {at} appears twice (first at byte {first})")),
        "{msg}"
    );
    let built = good().tensor_bytes(b"t.\xff", &[1], 0, vec![0; 4], None).build();
    let (e, msg) = open_err(&dir, &built.bytes);
    assert!(
        matches!(&e, GgufError::InvalidUtf8 { what, valid_up_to: 2, .. } if what == "the name of tensor 3"),
        "{e:?}"
    );
    assert!(msg.contains("the name of tensor 3 at byte"), "{msg}");
    let mut b = good().build();
    let at = b.info_at[1].start;
    let (e, _) = open_err(&dir, &b.patch_u64(at, 1 << 40).bytes);
    assert!(
        matches!(&e, GgufError::CountTooLarge { what, offset, .. } if what == "the length of the name of tensor 1" && *offset == at as u64),
        "{e:?}"
    );
}

#[test]
fn a_tensor_info_cut_short_names_its_field() {
    let dir = TempDir::new("ten");
    let built = good().build();
    let at = built.info_at[1];
    for (cut, field) in [
        (at.n_dims + 2, "the number of dimensions of tensor \"t.q8_0\""),
        (at.dims + 3, "dimension 0 of tensor \"t.q8_0\""),
        (at.type_id + 1, "the type of tensor \"t.q8_0\""),
        (at.offset + 7, "the data offset of tensor \"t.q8_0\""),
    ] {
        // The counts are patched down to what the cut file can hold, so that the cut field is
        // what fails.
        let mut bytes = built.bytes[..cut].to_vec();
        bytes[8..16].copy_from_slice(&2u64.to_le_bytes());
        let (e, msg) = open_err(&dir, &bytes);
        assert!(matches!(&e, GgufError::Truncated { what, .. } if what == field), "{cut}: {e:?}");
        assert!(msg.contains(field), "{msg}");
    }
}

#[test]
fn a_scalar_tensor_has_no_dimensions_and_one_element() {
    let dir = TempDir::new("ten");
    let f = dir.open(&good().tensor("scalar", &[], 0, 2.5f32.to_le_bytes().to_vec()).build().bytes).unwrap();
    let t = f.tensor("scalar").unwrap();
    assert_eq!((t.dims.len(), t.n_elements(), t.n_bytes), (0, 1, 4));
    assert_eq!(f.tensor_data(t), 2.5f32.to_le_bytes());
    // A quantized scalar is not a whole block.
    let (e, _) = open_err(&dir, &good().tensor("scalar", &[], 8, vec![0; 34]).build().bytes);
    assert!(matches!(e, GgufError::RowNotBlocks { row: 1, .. }), "{e:?}");
}

#[test]
fn tensor_data_answers_only_for_this_files_tensors() {
    let dir = TempDir::new("ten");
    let a = dir.open(&good().build().bytes).unwrap();
    let b = dir.open(&Builder::new().tensor("t.f32", &[4], 0, vec![1; 16]).build().bytes).unwrap();
    let mine = &a.tensors()[0];
    assert_eq!(a.tensor_data(mine).len(), 32);
    // Another file's tensor of the same name but another size, an edited one, an unknown name.
    assert!(a.tensor_data(&b.tensors()[0]).is_empty());
    let mut edited = mine.clone();
    edited.n_bytes = 1 << 40;
    assert!(a.tensor_data(&edited).is_empty());
    edited = mine.clone();
    edited.name = "nope".into();
    assert!(a.tensor_data(&edited).is_empty());
    let _: &GgufFile = &b;
}
