//! Every layer at world sizes 1..=8 with uneven shards, against the unsharded float64
//! computation, on random data; all ranks agree.

mod common;
use common::*;
use tp_core::{Activation, DType, Tensor, TensorShard};
use tp_layers::{ColumnParallel, Linear, MergedColumnParallel, ParallelMlp, QkvLayout, QkvParallel, RowParallel};

const OUT: usize = 37; // odd: uneven over every world size but 1
const IN: usize = 29;
const TOKENS: usize = 5;

#[test]
fn column_parallel_blocks_and_gather_match_the_full_layer() {
    for dtype in DType::FLOATS {
        let full = linear(OUT, IN, true, dtype, 1);
        let x = Tensor::rand(&[TOKENS, IN], dtype, 2, &CPU).unwrap();
        let (want, abs) = linear_f64(&x, &full);
        for world in 1..=8 {
            let got = on_ranks(world, CPU, |g| {
                let layer = ColumnParallel::from_full(&full, &g).unwrap();
                (*layer.shard(), layer.forward(&x).unwrap(), layer.forward_gathered(&x).unwrap())
            });
            for (shard, local, gathered) in &got {
                // The local block is columns start..end of the full output.
                let lv = f64s(local);
                for t in 0..TOKENS {
                    for j in 0..shard.len() {
                        let (i, k) = (t * shard.len() + j, t * OUT + shard.start() + j);
                        assert!(
                            (lv[i] - want[k]).abs() <= tol(dtype, IN, want[k], abs[k]),
                            "{dtype} world {world} local"
                        );
                    }
                }
                assert_close(&format!("{dtype} world {world} gathered"), &f64s(gathered), &want, |i| {
                    tol(dtype, IN, want[i], abs[i])
                });
            }
            assert!(got.iter().all(|(_, _, y)| y == &got[0].2), "ranks disagree");
        }
    }
}

#[test]
fn row_parallel_sums_partials_and_adds_the_bias_once() {
    for dtype in DType::FLOATS {
        let full = linear(OUT, IN, true, dtype, 3);
        let x = Tensor::rand(&[2, TOKENS, IN], dtype, 4, &CPU).unwrap();
        let (want, abs) = linear_f64(&x, &full);
        for world in 1..=8 {
            let got = on_ranks(world, CPU, |g| {
                let layer = RowParallel::from_full(full.weight().unwrap(), full.bias(), &g).unwrap();
                let split = layer.forward_split(&x).unwrap();
                // The same through an explicitly split input.
                let xr = TensorShard::new(2, IN, g.rank(), world).unwrap().shard(&x).unwrap();
                (split, layer.forward(&xr).unwrap())
            });
            for (a, b) in &got {
                assert_eq!(a, b);
                assert_eq!(a.dims(), &[2, TOKENS, OUT]);
                assert_close(&format!("{dtype} world {world}"), &f64s(a), &want, |i| tol(dtype, IN, want[i], abs[i]));
            }
            assert!(got.iter().all(|(y, _)| y == &got[0].0), "ranks disagree");
        }
    }
}

#[test]
fn merged_column_parallel_splits_into_each_projection() {
    let (a, b) = (linear(OUT, IN, false, DType::F32, 5), linear(OUT + 2, IN, false, DType::F32, 6));
    let x = Tensor::rand(&[TOKENS, IN], DType::F32, 7, &CPU).unwrap();
    let (wa, aa) = linear_f64(&x, &a);
    let (wb, ab) = linear_f64(&x, &b);
    for world in 1..=8 {
        let got = on_ranks(world, CPU, |g| {
            let m = MergedColumnParallel::from_full(&[&a, &b], &g).unwrap();
            assert_eq!(m.local().out_features(), m.shards()[0].len() + m.shards()[1].len());
            m.forward_gathered(&x).unwrap()
        });
        for parts in got {
            assert_close("a", &f64s(&parts[0]), &wa, |i| tol(DType::F32, IN, wa[i], aa[i]));
            assert_close("b", &f64s(&parts[1]), &wb, |i| tol(DType::F32, IN, wb[i], ab[i]));
        }
    }
}

#[test]
fn qkv_splits_whole_heads_and_replicates_kv_heads() {
    let (hd, hidden) = (3, 16);
    // (query heads, KV heads, world sizes that must work): every world size up to the query
    // heads, including those where a rank's heads straddle KV groups (8/2 at 3, 12/4 at 8).
    for (nq, nkv, worlds) in [
        (8, 8, (1..=8).collect::<Vec<_>>()),
        (8, 2, (1..=8).collect()),
        (16, 8, vec![1, 2, 3, 4, 7, 8]),
        (12, 4, (1..=12).collect()),
        (6, 3, vec![4, 5]),
        (6, 1, vec![1, 4, 6]),
    ] {
        let q = linear(nq * hd, hidden, true, DType::F32, 8);
        let k = linear(nkv * hd, hidden, true, DType::F32, 9);
        let v = linear(nkv * hd, hidden, true, DType::F32, 10);
        let x = Tensor::rand(&[TOKENS, hidden], DType::F32, 11, &CPU).unwrap();
        let (qf, kf, vf) = (linear_f64(&x, &q).0, linear_f64(&x, &k).0, linear_f64(&x, &v).0);
        for world in worlds {
            let mut q_heads = vec![0; nq];
            for rank in 0..world {
                let layout = QkvLayout::new(nq, nkv, hd, rank, world).unwrap();
                let layer = QkvParallel::from_full(&q, &k, &v, layout).unwrap();
                let (ql, kl, vl) = layer.forward(&x).unwrap();
                let check = |got: &Tensor, full: &[f64], width: usize, start: usize, len: usize| {
                    let gv = f64s(got);
                    for t in 0..TOKENS {
                        for c in 0..len * hd {
                            let want = full[t * width + start * hd + c];
                            assert!((gv[t * len * hd + c] - want).abs() < 1e-4, "{nq}/{nkv} world {world} rank {rank}");
                        }
                    }
                };
                check(&ql, &qf, nq * hd, layout.q_start, layout.q_len);
                check(&kl, &kf, nkv * hd, layout.kv_start, layout.kv_len);
                check(&vl, &vf, nkv * hd, layout.kv_start, layout.kv_len);
                (layout.q_start..layout.q_start + layout.q_len).for_each(|h| q_heads[h] += 1);
                // Exactly the KV heads its query heads use, and the grouping that maps them.
                let group = nq / nkv;
                let used: Vec<usize> = (layout.q_start..layout.q_start + layout.q_len).map(|h| h / group).collect();
                assert_eq!(layout.kv_start, used[0], "{nq}/{nkv} world {world} rank {rank}");
                assert_eq!(layout.kv_start + layout.kv_len - 1, *used.last().unwrap());
                let g = layout.kv_groups();
                for (i, &kv) in used.iter().enumerate() {
                    assert_eq!((i + g.offset) / g.size, kv - layout.kv_start, "local head {i}");
                }
                if nkv < world && world % nkv == 0 && nq % world == 0 {
                    assert_eq!((layout.kv_start, layout.kv_len), (rank / (world / nkv), 1), "replica placement");
                }
            }
            assert!(q_heads.iter().all(|&c| c == 1), "every query head on exactly one rank");
        }
    }
    // Layouts that cannot work are errors, not wrong answers.
    assert!(QkvLayout::new(8, 3, 4, 0, 2).is_err(), "heads not a multiple of KV heads");
    assert!(QkvLayout::new(8, 2, 4, 0, 9).is_err(), "8 query heads over 9 ranks");
    assert!(QkvLayout::new(8, 8, 4, 5, 5).is_err(), "rank >= world");
    let q = linear(8 * 3, 16, false, DType::F32, 1);
    let k = linear(2 * 3, 16, false, DType::F32, 2);
    assert!(QkvParallel::from_full(&q, &k, &q, QkvLayout::new(8, 2, 3, 0, 2).unwrap()).is_err(), "v of the wrong size");
}

#[test]
fn parallel_mlp_matches_the_unsharded_block_at_every_world_size() {
    let (hidden, inter) = (24, 43);
    for dtype in DType::FLOATS {
        for bias in [false, true] {
            let gate = linear(inter, hidden, bias, dtype, 20);
            let up = linear(inter, hidden, bias, dtype, 22);
            let down = linear(hidden, inter, bias, dtype, 24);
            let x = Tensor::rand(&[TOKENS, hidden], dtype, 26, &CPU).unwrap();
            let r = mlp_f64(&x, &gate, &up, &down);
            let u = dtype.unit_roundoff();
            let run = |world: usize| {
                on_ranks(world, CPU, |g| {
                    ParallelMlp::from_full(&gate, &up, &down, Activation::Silu, &g).unwrap().forward(&x).unwrap()
                })
            };
            // The unsharded block against f64: f32 tightly; for f16/bf16 a bound covering the
            // rounding of every intermediate (g, u, silu(g)*u, y).
            let single = f64s(&run(1)[0]);
            let c = if dtype == DType::F32 { 16.0 } else { 2.0 };
            assert_close(&format!("{dtype} bias {bias} world 1"), &single, &r.y, |i| {
                c * u * r.scale[i] + 2.0 * u * r.y[i].abs() + 1e-6
            });
            // Sharded against unsharded, in the same dtype: they differ by each rank's partial sum
            // being rounded before the all-reduce, and by f32 accumulation order in the GEMMs
            // (the 2^-20 scale term). A misplaced shard would be off by O(|y|).
            for world in 2..=8 {
                let got = run(world);
                for y in &got {
                    assert_close(&format!("{dtype} bias {bias} world {world}"), &f64s(y), &single, |i| {
                        2.0 * u * r.partial_abs[i] + u * single[i].abs() + 2f64.powi(-20) * r.scale[i]
                    });
                }
                assert!(got.iter().all(|y| y == &got[0]), "ranks disagree");
            }
        }
    }
}

/// Many rows in passes (`forward_in_passes`, as the host forward takes a prefill step) give, at
/// every world size, the rows the one-pass forward gives, within the f32 GEMMs' accumulation
/// order (each pass is its own product), and every rank the same; passes of 16 rows and a short
/// last one, an odd row count, the bias once.
#[test]
fn the_mlp_in_passes_matches_one_pass() {
    let (hidden, inter, tokens) = (24, 43, 53);
    for bias in [false, true] {
        let gate = linear(inter, hidden, bias, DType::F32, 30);
        let up = linear(inter, hidden, bias, DType::F32, 32);
        let down = linear(hidden, inter, bias, DType::F32, 34);
        let x = Tensor::rand(&[tokens, hidden], DType::F32, 36, &CPU).unwrap();
        let r = mlp_f64(&x, &gate, &up, &down);
        for world in 1..=4 {
            let got = on_ranks(world, CPU, |g| {
                let mlp = ParallelMlp::from_full(&gate, &up, &down, Activation::Silu, &g).unwrap();
                // 16 rows of [G_r | U_r] per pass at most: 4 passes.
                let pass = 16 * 2 * mlp.down().shard().len() * 4;
                (mlp.forward_in_passes(&x, usize::MAX).unwrap(), mlp.forward_in_passes(&x, pass).unwrap())
            });
            for (one, passes) in &got {
                assert_eq!(passes.dims(), one.dims());
                assert_close(&format!("bias {bias} world {world}"), &f64s(passes), &f64s(one), |i| {
                    2f64.powi(-20) * r.scale[i]
                });
            }
            assert!(got.iter().all(|(_, y)| y == &got[0].1), "ranks disagree");
        }
    }
}

#[test]
fn bad_layer_arguments_are_typed_errors() {
    let l = linear(OUT, IN, true, DType::F32, 1);
    assert!(Linear::new(Tensor::zeros(&[3], DType::F32, &CPU).unwrap(), None).is_err());
    assert!(
        Linear::new(l.weight().unwrap().clone(), Some(Tensor::zeros(&[OUT + 1], DType::F32, &CPU).unwrap())).is_err()
    );
    assert!(Linear::new(l.weight().unwrap().clone(), Some(Tensor::zeros(&[OUT], DType::BF16, &CPU).unwrap())).is_err());
    assert!(TensorShard::new(0, OUT, 3, 3).is_err(), "rank >= world");
    assert!(TensorShard::new(0, OUT, 0, 0).is_err(), "world 0");
    let x_wrong = Tensor::zeros(&[TOKENS, IN + 1], DType::F32, &CPU).unwrap();
    let got = on_ranks(2, CPU, |g| {
        let shard_mismatch =
            ColumnParallel::new(l.clone(), TensorShard::new(0, OUT, g.rank(), 2).unwrap(), &g).is_err();
        let layer = ColumnParallel::from_full(&l, &g).unwrap();
        (shard_mismatch, layer.forward(&x_wrong).is_err(), layer.forward_gathered(&x_wrong).is_err())
    });
    assert!(got.iter().all(|&e| e == (true, true, true)), "{got:?}");
}
