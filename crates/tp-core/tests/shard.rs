//! `TensorShard`: the balanced policy tiles each dimension exactly, and `unshard` inverts `shard`.

mod common;
use common::*;
use proptest::prelude::*;
use tp_core::{DType, Device, Error, Tensor, TensorShard};

const CPU: Device = Device::Cpu;

#[test]
fn policy_matches_the_documented_closed_form() {
    // 10 over 4: 3, 3, 2, 2 starting at 0, 3, 6, 8.
    let s = TensorShard::for_all_ranks(0, 10, 4).unwrap();
    assert_eq!(s.iter().map(|s| (s.start(), s.len())).collect::<Vec<_>>(), [(0, 3), (3, 3), (6, 2), (8, 2)]);
    // Fewer elements than ranks: trailing ranks hold nothing.
    let s = TensorShard::for_all_ranks(1, 2, 3).unwrap();
    assert_eq!(s.iter().map(|s| (s.start(), s.len())).collect::<Vec<_>>(), [(0, 1), (1, 1), (2, 0)]);
    assert!(s[2].is_empty());
    // Even splits are Megatron's.
    let s = TensorShard::for_all_ranks(0, 4096, 8).unwrap();
    assert!(s.iter().enumerate().all(|(r, s)| s.start() == r * 512 && s.len() == 512));
}

fn dims_strategy() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(0usize..=9, 1..=4)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn shards_tile_the_dimension(len in 0usize..10_000, world in 1usize..=8) {
        let shards = TensorShard::for_all_ranks(0, len, world).unwrap();
        let mut next = 0;
        for (r, s) in shards.iter().enumerate() {
            prop_assert_eq!(s.rank(), r);
            prop_assert_eq!(s.world_size(), world);
            prop_assert_eq!(s.global_len(), len);
            prop_assert_eq!(s.start(), next, "gap or overlap before rank {}", r);
            prop_assert!(s.len() == len / world || s.len() == len / world + 1);
            next = s.end();
        }
        prop_assert_eq!(next, len);
        // Larger shards come first.
        prop_assert!(shards.windows(2).all(|w| w[0].len() >= w[1].len()));
    }

    #[test]
    fn unshard_inverts_shard(dims in dims_strategy(), dim_pick in 0usize..4, world in 1usize..=8,
                             dtype_pick in 0usize..3, seed in any::<u64>()) {
        let dim = dim_pick % dims.len();
        let dtype = DType::FLOATS[dtype_pick];
        let t = Tensor::randn(&dims, dtype, seed, &CPU).unwrap();
        let parts = TensorShard::shard_all(&t, dim, world).unwrap();
        prop_assert_eq!(parts.len(), world);
        for (r, p) in parts.iter().enumerate() {
            let s = TensorShard::new(dim, dims[dim], r, world).unwrap();
            prop_assert_eq!(p.dims()[dim], s.len());
            prop_assert_eq!(p, &t.narrow(dim, s.start(), s.len()).unwrap());
        }
        let back = TensorShard::unshard(&parts, dim).unwrap();
        prop_assert_eq!(back.dims(), t.dims());
        // Exact: compare the bits.
        prop_assert_eq!(back.as_bytes().unwrap(), t.as_bytes().unwrap());
    }
}

#[test]
fn uneven_column_parallel_matmul_gathers_exactly() {
    // The column-parallel identity the layers rely on: shard W's rows, multiply, gather columns.
    let x = Tensor::randn(&[5, 33], DType::F32, 1, &CPU).unwrap();
    let w = Tensor::randn(&[67, 33], DType::F32, 2, &CPU).unwrap();
    assert_nonzero(&x);
    let full = x.matmul_t(&w).unwrap();
    for world in 1..=8 {
        let parts: Vec<Tensor> =
            TensorShard::shard_all(&w, 0, world).unwrap().iter().map(|ws| x.matmul_t(ws).unwrap()).collect();
        let y = TensorShard::unshard(&parts, 1).unwrap();
        assert_eq!(y.dims(), full.dims());
        let (a, b) = (f64s(&y), f64s(&full));
        // Each output column is the same dot product in both; only GEMM blocking may differ.
        assert_close(&format!("world {world}"), &a, &b, |i| 1e-5 * (1.0 + b[i].abs()));
    }
}

#[test]
fn unshard_rejects_parts_out_of_policy() {
    let t = Tensor::randn(&[10, 3], DType::F32, 1, &CPU).unwrap();
    let mut parts = TensorShard::shard_all(&t, 0, 4).unwrap(); // lengths 3, 3, 2, 2
    assert_eq!(TensorShard::unshard(&parts, 0).unwrap(), t);
    parts.swap(0, 3); // 2, 3, 2, 3: not the policy's order
    assert!(matches!(TensorShard::unshard(&parts, 0), Err(Error::ShardMismatch { .. })));
    let uneven = [t.narrow(0, 0, 1).unwrap(), t.narrow(0, 1, 3).unwrap()]; // 1, 3; the policy says 2, 2
    assert!(matches!(TensorShard::unshard(&uneven, 0), Err(Error::ShardMismatch { .. })));
    assert!(matches!(TensorShard::unshard(&[], 0), Err(Error::ZeroWorldSize { .. })));
    assert!(matches!(TensorShard::unshard(&parts, 2), Err(Error::DimOutOfRange { dim: 2, .. })));
    let other_dtype = [t.narrow(0, 0, 5).unwrap(), t.narrow(0, 5, 5).unwrap().to_dtype(DType::BF16).unwrap()];
    assert!(matches!(TensorShard::unshard(&other_dtype, 0), Err(Error::DTypeMismatch { .. })));
}
