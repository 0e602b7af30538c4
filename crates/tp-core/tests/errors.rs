//! Every bad input a user can give returns a typed error (and never panics).

use tp_core::{DType, Device, Error, Shape, Tensor, TensorShard, WeightLayout};

const CPU: Device = Device::Cpu;

fn t(dims: &[usize], dtype: DType) -> Tensor {
    Tensor::randn(dims, dtype, 1, &CPU).unwrap()
}

#[test]
fn matmul_with_mismatched_inner_dims() {
    let x = t(&[4, 8], DType::F32);
    let e = x.matmul_t(&t(&[5, 9], DType::F32)).unwrap_err();
    assert!(
        matches!(&e, Error::ShapeMismatch { op: "matmul", lhs, rhs, .. } if lhs == &[4, 8] && rhs == &[5, 9]),
        "{e}"
    );
    assert!(e.to_string().contains("[4, 8]") && e.to_string().contains("[5, 9]"), "{e}");
    assert!(matches!(x.matmul(&t(&[5, 8], DType::F32)), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(
        x.matmul_layout(&t(&[8, 5], DType::F32), WeightLayout::Nk, None),
        Err(Error::ShapeMismatch { .. })
    ));
}

#[test]
fn matmul_with_bad_ranks_and_bias() {
    let x = t(&[4, 8], DType::F32);
    assert!(matches!(x.matmul_t(&t(&[2, 5, 8], DType::F32)), Err(Error::RankMismatch { .. })));
    assert!(matches!(x.matmul_t(&t(&[8], DType::F32)), Err(Error::RankMismatch { .. })));
    let scalar = Tensor::from_vec(vec![1.0f32], &[], &CPU).unwrap();
    assert!(matches!(scalar.matmul_t(&t(&[2, 1], DType::F32)), Err(Error::RankMismatch { .. })));
    let w = t(&[5, 8], DType::F32);
    assert!(matches!(x.linear(&w, Some(&t(&[4], DType::F32))), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(x.linear(&w, Some(&t(&[1, 5], DType::F32))), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(x.linear(&w, Some(&t(&[5], DType::F16))), Err(Error::DTypeMismatch { .. })));
}

#[test]
fn matmul_with_dtype_mismatch() {
    let e = t(&[4, 8], DType::F32).matmul_t(&t(&[5, 8], DType::BF16)).unwrap_err();
    assert_eq!(e, Error::DTypeMismatch { op: "matmul", lhs: DType::F32, rhs: DType::BF16 });
}

#[test]
fn dim_out_of_range() {
    let x = t(&[4, 8], DType::F16);
    assert_eq!(x.narrow(2, 0, 1).unwrap_err(), Error::DimOutOfRange { op: "narrow", dim: 2, ndim: 2 });
    assert!(matches!(Tensor::cat(&[&x, &x], 5), Err(Error::DimOutOfRange { dim: 5, .. })));
    assert!(matches!(TensorShard::new(3, 4, 0, 2).unwrap().shard(&x), Err(Error::DimOutOfRange { dim: 3, .. })));
    assert!(matches!(TensorShard::shard_all(&x, 2, 2), Err(Error::DimOutOfRange { .. })));
}

#[test]
fn rank_and_world_size_checks() {
    assert_eq!(
        TensorShard::new(0, 10, 4, 4).unwrap_err(),
        Error::RankOutOfRange { op: "TensorShard::new", rank: 4, world_size: 4 }
    );
    assert!(matches!(TensorShard::new(0, 10, 0, 0), Err(Error::ZeroWorldSize { .. })));
    assert!(matches!(TensorShard::for_all_ranks(0, 10, 0), Err(Error::ZeroWorldSize { .. })));
    assert!(matches!(TensorShard::shard_all(&t(&[4], DType::F32), 0, 0), Err(Error::ZeroWorldSize { .. })));
    // A shard built for another length does not apply.
    let s = TensorShard::new(0, 9, 0, 2).unwrap();
    assert!(matches!(s.shard(&t(&[10, 2], DType::F32)), Err(Error::ShardMismatch { .. })));
}

#[test]
fn narrow_past_the_end() {
    let x = t(&[4, 8], DType::BF16);
    assert_eq!(x.narrow(1, 5, 4).unwrap_err(), Error::NarrowOutOfBounds { dim: 1, start: 5, len: 4, size: 8 });
    assert!(matches!(x.narrow(0, 5, 0), Err(Error::NarrowOutOfBounds { .. })));
    assert!(matches!(x.narrow(0, usize::MAX, 2), Err(Error::NarrowOutOfBounds { .. })));
}

#[test]
fn cat_of_mismatched_inputs() {
    let a = t(&[2, 3], DType::F32);
    assert!(matches!(Tensor::cat(&[&a, &t(&[2, 4], DType::F32)], 0), Err(Error::ShapeMismatch { op: "cat", .. })));
    assert!(matches!(Tensor::cat(&[&a, &t(&[2, 3, 1], DType::F32)], 0), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(Tensor::cat(&[&a, &t(&[2, 3], DType::F16)], 0), Err(Error::DTypeMismatch { .. })));
    assert_eq!(Tensor::cat::<Tensor>(&[], 0).unwrap_err(), Error::CatEmpty);
    // Along the cat dim sizes may differ.
    assert_eq!(Tensor::cat(&[&a, &t(&[2, 4], DType::F32)], 1).unwrap().dims(), &[2, 7]);
}

#[test]
fn vec_length_must_match_shape() {
    let e = Tensor::from_vec(vec![1.0f32; 5], &[2, 3], &CPU).unwrap_err();
    assert_eq!(e, Error::ElementCountMismatch { op: "from_vec", dims: vec![2, 3], expected: 6, got: 5 });
    assert!(matches!(t(&[2, 3], DType::F32).reshape(&[4, 2]), Err(Error::ElementCountMismatch { .. })));
}

#[test]
fn overflowing_shapes_are_rejected() {
    let huge = [usize::MAX / 2, 3];
    assert_eq!(Shape::new(&huge).unwrap_err(), Error::ShapeOverflow { dims: huge.to_vec() });
    // The element count fits in usize but its bytes do not fit in isize.
    assert!(matches!(Shape::new(&[1 << 62]), Err(Error::ShapeOverflow { .. })));
    assert!(matches!(Tensor::zeros(&[1 << 40, 1 << 40], DType::F32, &CPU), Err(Error::ShapeOverflow { .. })));
    assert!(matches!(Tensor::from_vec(Vec::<f32>::new(), &[usize::MAX, 2], &CPU), Err(Error::ShapeOverflow { .. })));
    // A zero-length dim does not hide an overflow in the others (sub-products must stay valid).
    assert!(matches!(Shape::new(&[0, usize::MAX, 3]), Err(Error::ShapeOverflow { .. })));
    // A cat of empty tensors whose summed length overflows.
    let empty = Tensor::zeros(&[1 << 60, 0], DType::F32, &CPU).unwrap();
    assert!(matches!(Tensor::cat(&[&empty, &empty, &empty, &empty], 0), Err(Error::ShapeOverflow { .. })));
}

#[test]
fn tensors_past_the_size_limit_are_rejected() {
    // 2^38 elements (1 TiB at 4 bytes) is the most a tensor with elements may hold.
    assert_eq!(tp_core::MAX_TENSOR_BYTES, 1 << 40);
    assert_eq!(Shape::new(&[1 << 38]).unwrap().numel(), 1 << 38);
    assert!(matches!(Shape::new(&[(1 << 38) + 1]), Err(Error::ShapeOverflow { .. })));
    assert!(matches!(Shape::new(&[1 << 19, 1 << 19, 2]), Err(Error::ShapeOverflow { .. })));
    let e = Tensor::zeros(&[1 << 20, 1 << 20, 1 << 20], DType::BF16, &CPU).unwrap_err();
    assert!(e.to_string().contains("1 TiB"), "{e}");
    // Empty tensors may still have dims up to the isize bound.
    assert_eq!(Shape::new(&[1 << 60, 0]).unwrap().numel(), 0);
}

/// Zero-byte operands with huge dims pass validation; their product does not, before anything
/// is allocated: a `[2^40, 0]` weight, or a `[2^36, 0]` input (K = 0, so the output is all bias).
#[test]
fn zero_byte_operands_with_huge_dims_cannot_allocate_their_product() {
    let empty = |dims: &[usize], dtype| Tensor::zeros(dims, dtype, &CPU).unwrap();
    for dtype in DType::FLOATS {
        let (huge_w, x) = (empty(&[1 << 40, 0], dtype), empty(&[1, 0], dtype));
        assert!(matches!(x.matmul_t(&huge_w), Err(Error::ShapeOverflow { dims }) if dims == [1, 1 << 40]));
        assert!(matches!(x.matmul(&empty(&[0, 1 << 40], dtype)), Err(Error::ShapeOverflow { .. })));
        let (w, huge_x) = (empty(&[8, 0], dtype), empty(&[1 << 36, 0], dtype));
        assert!(matches!(huge_x.matmul_t(&w), Err(Error::ShapeOverflow { dims }) if dims == [1 << 36, 8]));
        let bias = Tensor::rand(&[8], dtype, 1, &CPU).unwrap();
        assert!(matches!(huge_x.linear(&w, Some(&bias)), Err(Error::ShapeOverflow { .. })));
        // Leading dims multiply too.
        assert!(matches!(empty(&[1 << 20, 1 << 20, 0], dtype).matmul_t(&w), Err(Error::ShapeOverflow { .. })));
        // The same shapes at a size that fits give the exact K = 0 product: the bias on every row.
        let y = empty(&[3, 0], dtype).linear(&w, Some(&bias)).unwrap();
        assert_eq!(y.dims(), &[3, 8]);
        let (got, b) = (y.to_f64_vec().unwrap(), bias.to_f64_vec().unwrap());
        assert!(got.chunks(8).all(|row| row == b), "{got:?}");
    }
}

#[test]
fn wrong_element_type_on_access() {
    let x = t(&[2, 2], DType::BF16);
    assert_eq!(
        x.to_vec::<f32>().unwrap_err(),
        Error::DTypeMismatch { op: "as_slice", lhs: DType::BF16, rhs: DType::F32 }
    );
    assert!(x.to_vec::<tp_core::bf16>().is_ok());
}

/// Without a usable GPU every CUDA request is `CudaUnavailable`; with one, the same requests
/// work, and only a device past the last one is refused. (So this passes, and checks something,
/// on CPU machines and GPU machines alike.)
#[test]
fn cuda_requests_are_typed_errors_without_a_gpu_and_work_with_one() {
    let count = tp_kernels::device_count().ok().filter(|_| tp_kernels::NOT_COMPILED.is_none()).unwrap_or(0);
    if count == 0 {
        let e = Tensor::zeros(&[2], DType::F32, &Device::Cuda(0)).unwrap_err();
        assert!(matches!(e, Error::CudaUnavailable { .. }), "{e}");
        // The chain says it once (tp-kernels' own message is not repeated inside tp-core's).
        assert_eq!(e.to_string().matches("CUDA unavailable").count(), 1, "{e}");
        assert!(matches!(t(&[2], DType::F32).to_device(&Device::Cuda(1)), Err(Error::CudaUnavailable { .. })));
    } else {
        let x = t(&[2], DType::F32);
        assert_eq!(x.to_device(&Device::Cuda(0)).unwrap().to_device(&Device::Cpu).unwrap(), x);
        let e = x.to_device(&Device::Cuda(count)).unwrap_err();
        assert!(matches!(e, Error::CudaUnavailable { .. }), "device {count} of {count}: {e}");
    }
}
