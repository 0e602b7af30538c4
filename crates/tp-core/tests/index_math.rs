//! The kernels' index arithmetic (kernels/index_math.cuh, compiled as host C++ by build.rs)
//! against tp-core's TensorShard and narrow/interleave, which are written independently in Rust.
//! These are the exact source lines the shard-copy kernels run on the GPU.

use proptest::prelude::*;
use tp_core::{DType, Device, Tensor, TensorShard};
use tp_kernels::host_index;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn split_matches_tensor_shard(len in 0usize..5000, world in 1usize..=8) {
        for s in TensorShard::for_all_ranks(0, len, world).unwrap() {
            let r = s.rank() as i64;
            prop_assert_eq!(host_index::split_start(len as i64, world as i64, r), s.start() as i64);
            prop_assert_eq!(host_index::split_len(len as i64, world as i64, r), s.len() as i64);
            for i in s.start()..s.end() {
                prop_assert_eq!(host_index::split_owner(len as i64, world as i64, i as i64), r);
            }
        }
    }

    #[test]
    fn gather_index_matches_host_interleave(rows in 1usize..6, cols in 1usize..40, world in 1usize..=8) {
        // Element values are their own flat index in the rank-major buffer.
        let n = rows * cols;
        let buf = Tensor::from_fn_f64(&[n], DType::F32, &Device::Cpu, |i| i as f64).unwrap();
        let out = buf.interleave_rank_major(rows, cols, world).unwrap().to_f64_vec().unwrap();
        for row in 0..rows {
            for col in 0..cols {
                let src = host_index::gather_src(rows as i64, cols as i64, world as i64, row as i64, col as i64);
                prop_assert_eq!(out[row * cols + col], src as f64);
            }
        }
    }

    #[test]
    fn row_copy_index_matches_narrow(outer in 1usize..5, size in 1usize..30, inner in 1usize..5,
                                     a in 0usize..30, b in 0usize..30) {
        let (x, y) = (a % (size + 1), b % (size + 1));
        let (start, end) = (x.min(y), x.max(y));
        let len = end - start;
        prop_assume!(len > 0);
        let t = Tensor::from_fn_f64(&[outer, size, inner], DType::F32, &Device::Cpu, |i| i as f64).unwrap();
        let narrowed = t.narrow(1, start, len).unwrap().to_f64_vec().unwrap();
        // The launcher's mapping for narrow (tp-kernels RowCopy, in elements).
        let (rows, units) = (outer as i64, (len * inner) as i64);
        for u in 0..rows * units {
            let (src, dst) = host_index::row_copy(rows, units, (size * inner) as i64, (start * inner) as i64, units, 0, u);
            prop_assert_eq!(narrowed[dst as usize], src as f64);
        }
    }
}

#[test]
fn persistent_gemm_tile_order_visits_every_tile_once() {
    for tiles_m in 1..40 {
        for tiles_n in 1..12 {
            let mut seen = vec![false; (tiles_m * tiles_n) as usize];
            for t in 0..tiles_m * tiles_n {
                let (tm, tn) = host_index::grouped_tile(t, tiles_m, tiles_n, 8);
                assert!((0..tiles_m).contains(&tm) && (0..tiles_n).contains(&tn), "t {t}: ({tm}, {tn})");
                let i = (tm * tiles_n + tn) as usize;
                assert!(!seen[i], "tile ({tm}, {tn}) visited twice");
                seen[i] = true;
                // Consecutive tiles stay within a group of 8 tile-rows.
                assert_eq!(tm / 8, (t / (8 * tiles_n)), "t {t}");
            }
            assert!(seen.iter().all(|&s| s));
        }
    }
}
