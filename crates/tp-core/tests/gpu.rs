//! GPU test suite: every CUDA kernel against the host backend and a float64 reference, on random
//! data, at shapes off every tile multiple, with output buffers poisoned (NaN) before each
//! kernel writes them, and every element checked.
//!
//! Built only with `--features gpu-tests` (`cargo xtask bundle` does). It FAILS, never skips,
//! when no GPU, driver or compiled kernels are present.

mod common;
use common::*;
use tp_core::{DType, Device, Tensor, TensorShard, WeightLayout};

const GPU: Device = Device::Cuda(0);
const CPU: Device = Device::Cpu;

fn setup() {
    gpu_setup();
}

fn gpu(t: &Tensor) -> Tensor {
    t.to_device(&GPU).expect("host -> device")
}

fn host(t: &Tensor) -> Tensor {
    t.to_device(&CPU).expect("device -> host")
}

#[test]
fn device_reports_itself_and_round_trips_bytes() {
    setup();
    let g = tp_kernels::Gpu::get(0).unwrap();
    eprintln!(
        "device: {} sm_{}{} with {} SMs",
        g.name(),
        g.compute_capability().0,
        g.compute_capability().1,
        g.sm_count()
    );
    for dtype in DType::FLOATS {
        let t = Tensor::randn(&[3, 1031], dtype, 1, &CPU).unwrap();
        let d = gpu(&t);
        assert_eq!(d.device(), GPU);
        assert_eq!(host(&d), t);
    }
    let missing = tp_kernels::device_count().unwrap();
    assert!(matches!(
        Tensor::zeros(&[1], DType::F32, &Device::Cuda(missing)),
        Err(tp_core::Error::CudaUnavailable { .. })
    ));
}

#[test]
fn narrow_matches_host_bit_for_bit() {
    setup();
    for dtype in DType::FLOATS {
        for dims in [vec![3usize, 17, 5], vec![129, 64], vec![7, 1, 33, 3]] {
            let t = Tensor::randn(&dims, dtype, 2, &CPU).unwrap();
            let d = gpu(&t);
            for dim in 0..dims.len() {
                let size = dims[dim];
                for (start, len) in [(0, size), (0, 1), (size / 3, size - size / 3), (size - 1, 1), (size / 2, 0)] {
                    let want = t.narrow(dim, start, len).unwrap();
                    let got = host(&d.narrow(dim, start, len).unwrap());
                    assert_eq!(got, want, "{dtype} {dims:?} dim {dim} {start}+{len}");
                }
            }
        }
    }
}

#[test]
fn shard_and_unshard_on_gpu_are_exact_for_every_world_size() {
    setup();
    for dtype in DType::FLOATS {
        let t = Tensor::randn(&[5, 131, 3], dtype, 3, &CPU).unwrap();
        let d = gpu(&t);
        for dim in 0..3 {
            for world in 1..=8 {
                let parts = TensorShard::shard_all(&d, dim, world).unwrap();
                let host_parts = TensorShard::shard_all(&t, dim, world).unwrap();
                for (p, h) in parts.iter().zip(&host_parts) {
                    assert_eq!(&host(p), h);
                }
                assert_eq!(host(&TensorShard::unshard(&parts, dim).unwrap()), t, "{dtype} dim {dim} world {world}");
            }
        }
    }
}

#[test]
fn gather_interleave_matches_host_even_and_uneven() {
    setup();
    for dtype in DType::FLOATS {
        // Even splits with 16-byte units, even with narrow units, and uneven splits.
        for (rows, cols, world) in [(33, 4096, 8), (7, 24, 3), (65, 1000, 7), (3, 5, 8), (1, 129, 2), (257, 17, 4)] {
            let buf = Tensor::randn(&[rows * cols], dtype, 4, &CPU).unwrap();
            let want = buf.interleave_rank_major(rows, cols, world).unwrap();
            let got = host(&gpu(&buf).interleave_rank_major(rows, cols, world).unwrap());
            assert_eq!(got, want, "{dtype} rows {rows} cols {cols} world {world}");
        }
    }
}

#[test]
fn casts_match_host_rounding() {
    setup();
    let mut values: Vec<f32> =
        (0..u32::MAX / 65521).map(|i| f32::from_bits(i * 65521)).filter(|v| !v.is_nan()).collect();
    values.extend([f32::MAX, -f32::MAX, 65504.0, 65520.0, 1.0 + 2f32.powi(-11), 1.0 + 2f32.powi(-8), 0.0, -0.0]);
    let t = Tensor::from_slice(&values, &[values.len()], &CPU).unwrap();
    let d = gpu(&t);
    for to in [DType::F16, DType::BF16] {
        let want = t.to_dtype(to).unwrap();
        let got = host(&d.to_dtype(to).unwrap());
        assert_eq!(got, want, "f32 -> {to}");
        // And back, and across.
        assert_eq!(host(&gpu(&want).to_dtype(DType::F32).unwrap()), want.to_dtype(DType::F32).unwrap());
        let other = if to == DType::F16 { DType::BF16 } else { DType::F16 };
        assert_eq!(host(&gpu(&want).to_dtype(other).unwrap()), want.to_dtype(other).unwrap(), "{to} -> {other}");
    }
}

#[test]
fn matmul_matches_f64_reference_at_small_sizes() {
    setup();
    let sizes = [1, 3, 17, 64, 129];
    let mut seed = 1000;
    for dtype in DType::FLOATS {
        for m in sizes {
            for k in sizes {
                for n in sizes {
                    for layout in [WeightLayout::Nk, WeightLayout::Kn] {
                        seed += 3;
                        check_matmul(GPU, m, k, n, dtype, layout, seed % 2 == 0, seed);
                    }
                }
            }
        }
    }
}

#[test]
fn matmul_matches_f64_reference_at_large_edge_shapes() {
    setup();
    // Several tiles with ragged edges in every dim; K both a multiple of 8 (cp.async path) and
    // not (element path), and K = 0 (bias only).
    for (m, k, n) in [(257, 1000, 383), (300, 1027, 129), (128, 512, 256), (1, 4096, 1031), (513, 8, 77), (5, 0, 9)] {
        for dtype in DType::FLOATS {
            check_matmul(GPU, m, k, n, dtype, WeightLayout::Nk, true, 7);
            check_matmul(GPU, m, k, n, dtype, WeightLayout::Nk, false, 8);
        }
        check_matmul(GPU, m, k, n, DType::F32, WeightLayout::Kn, true, 9);
    }
}

#[test]
fn small_integer_products_are_exact_on_tensor_cores() {
    setup();
    // Integers in [-4, 4] with K = 104: every partial sum (|y| <= 1664) is exact in the f32
    // accumulator, so the output must be exactly one rounding of the exact sum: exact in f16,
    // rounded to nearest even in bf16 (8 significant bits), bit for bit.
    let (m, k, n) = (200, 104, 136);
    for dtype in [DType::F16, DType::BF16] {
        let x = Tensor::rand_int(&[m, k], dtype, -4, 4, 1, &CPU).unwrap();
        let w = Tensor::rand_int(&[n, k], dtype, -4, 4, 2, &CPU).unwrap();
        let y = host(&gpu(&x).matmul_t(&gpu(&w)).unwrap());
        let (want, _) = matmul_f64(&f64s(&x), &f64s(&w), m, k, n, true);
        let want = Tensor::from_fn_f64(&[m, n], dtype, &CPU, |i| want[i]).unwrap();
        assert_eq!(y, want, "{dtype}: one rounding of the exact sum");
    }
}

#[test]
fn bad_inputs_on_gpu_are_typed_errors() {
    setup();
    let x = gpu(&Tensor::randn(&[4, 8], DType::F32, 1, &CPU).unwrap());
    let w_cpu = Tensor::randn(&[5, 8], DType::F32, 2, &CPU).unwrap();
    assert!(matches!(x.matmul_t(&w_cpu), Err(tp_core::Error::DeviceMismatch { .. })));
    assert!(matches!(
        x.matmul_t(&gpu(&w_cpu.to_dtype(DType::BF16).unwrap())),
        Err(tp_core::Error::DTypeMismatch { .. })
    ));
    assert!(matches!(x.narrow(1, 7, 2), Err(tp_core::Error::NarrowOutOfBounds { .. })));
    assert!(matches!(Tensor::cat(&[&x, &w_cpu], 0), Err(tp_core::Error::DeviceMismatch { .. })));
    assert!(x.as_slice::<f32>().is_err());
}

#[test]
fn hopper_wgmma_kernel_matches_f64_or_refuses_other_devices() {
    setup();
    let g = tp_kernels::Gpu::get(0).unwrap();
    for dtype in [DType::BF16, DType::F16] {
        let ty = if dtype == DType::BF16 { tp_kernels::ElemType::BF16 } else { tp_kernels::ElemType::F16 };
        // Ragged in every dim (TMA zero-fills), several persistent tiles per CTA, K % 8 == 0.
        for (m, n, k, with_bias) in
            [(300, 520, 1000, true), (129, 257, 72, false), (1, 1031, 4096, true), (4096, 4096, 8192, false)]
        {
            let x = Tensor::randn(&[m, k], dtype, 3, &CPU).unwrap();
            let w = Tensor::randn(&[n, k], dtype, 4, &CPU).unwrap();
            let b = Tensor::randn(&[n], dtype, 5, &CPU).unwrap();
            let (xd, wd, bd) = (gpu(&x), gpu(&w), gpu(&b));
            let mut out = g.alloc(m * n * 2).unwrap();
            let r = g.gemm_wgmma(tp_kernels::GemmArgs {
                c: &mut out,
                a: xd.cuda_buffer().unwrap().1,
                b: wd.cuda_buffer().unwrap().1,
                bias: with_bias.then(|| bd.cuda_buffer().unwrap().1),
                shape: tp_kernels::GemmShape { m, n, k },
                ty,
            });
            if g.compute_capability() != (9, 0) {
                assert!(matches!(r, Err(tp_kernels::KernelError::InvalidLaunch { .. })), "{r:?}");
                return;
            }
            r.unwrap();
            let y = host(&Tensor::from_cuda_buffer(out, &[m, n], dtype, g.clone()).unwrap());
            if m * n * k > 1 << 30 {
                // The big case: compare with the mma.sync kernel instead of a slow f64 loop,
                // launched directly (matmul_t itself takes wgmma under TP_GEMM_KERNEL=wgmma).
                let mut reference = g.alloc(m * n * 2).unwrap();
                g.gemm_mma(tp_kernels::GemmArgs {
                    c: &mut reference,
                    a: xd.cuda_buffer().unwrap().1,
                    b: wd.cuda_buffer().unwrap().1,
                    bias: with_bias.then(|| bd.cuda_buffer().unwrap().1),
                    shape: tp_kernels::GemmShape { m, n, k },
                    ty,
                })
                .unwrap();
                let want = host(&Tensor::from_cuda_buffer(reference, &[m, n], dtype, g.clone()).unwrap());
                let (a, b) = (f64s(&y), f64s(&want));
                let rms = (b.iter().map(|v| v * v).sum::<f64>() / b.len() as f64).sqrt();
                assert_close("wgmma vs mma 4096x4096x8192", &a, &b, |_| rms * 2f64.powi(-5));
                continue;
            }
            let (mut want, abs) = matmul_f64(&f64s(&x), &f64s(&w), m, k, n, true);
            if with_bias {
                let bv = f64s(&b);
                want.iter_mut().enumerate().for_each(|(i, v)| *v += bv[i % n]);
            }
            assert_close(&format!("wgmma {m}x{k}x{n} {dtype}"), &f64s(&y), &want, |i| {
                matmul_tol(dtype, k + 1, want[i], abs[i] + want[i].abs())
            });
        }
    }
}

#[test]
fn decode_shapes_match_reference_on_both_sides_of_the_small_m_cutoff() {
    setup();
    // M <= 8 takes the decode kernel, M = 9 the tiled ones; K 4096 takes 16-byte loads, K 4100
    // (not a multiple of 8) the scalar variant for half types and the vector one for f32.
    for dtype in DType::FLOATS {
        for m in [1, 2, 5, 8, 9] {
            for k in [4096, 4100] {
                check_matmul(GPU, m, k, 777, dtype, WeightLayout::Nk, m % 2 == 1, 40 + m as u64);
            }
        }
    }
}

fn llama3() -> tp_core::RopeScaling {
    tp_core::RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192.0,
    }
}

fn linear() -> tp_core::RopeScaling {
    tp_core::RopeScaling::Linear { factor: 4.0 }
}

fn dynamic() -> tp_core::RopeScaling {
    tp_core::RopeScaling::Dynamic { factor: 4.0, max_position_embeddings: 64.0 }
}

fn yarn() -> tp_core::RopeScaling {
    tp_testing::reference::ops::yarn_defaults(16.0, 64.0)
}

/// GPU result within `ulps` ulps of the host's, element by element.
fn assert_near_host(what: &str, g: &Tensor, h: &Tensor, ulps: f64) {
    let (gv, hv) = (f64s(&host(g)), f64s(h));
    assert_close(what, &gv, &hv, |i| ulps * common::decoder::ulp(h.dtype(), hv[i]));
}

#[test]
fn decoder_kernels_match_f64_references() {
    use common::decoder::*;
    setup();
    for dtype in DType::FLOATS {
        for (rows, h) in [(1, 1), (3, 17), (5, 129), (2, 4099)] {
            check_rms_norm(GPU, rows, h, dtype, 3 + h as u64);
        }
        for scaling in [tp_core::RopeScaling::Default, llama3()] {
            for d in [2, 10, 64, 128, 256] {
                check_rope(GPU, &[0, 1, 2, 7, 100, 4097], 3, d, scaling.clone(), dtype, d as u64);
            }
        }
        // linear, YaRN (cos/sin times its attention factor in the kernel) and dynamic NTK
        // (frequencies recomputed per call, past max_position_embeddings = 64 here).
        for scaling in [linear(), yarn(), dynamic()] {
            for d in [4, 10, 64, 128, 256] {
                check_rope(GPU, &[0, 1, 2, 7, 100, 4097], 3, d, scaling.clone(), dtype, d as u64);
                check_rope(GPU, &[0, 5, 63], 2, d, scaling.clone(), dtype, 1 + d as u64);
            }
        }
        // LongRoPE: short factors within the original length, long past it.
        for d in [4, 10, 64, 128, 256] {
            check_rope(GPU, &[0, 5, 63], 2, d, longrope(d), dtype, d as u64);
            check_rope(GPU, &[0, 1, 2, 7, 100, 4097], 3, d, longrope(d), dtype, 1 + d as u64);
        }
        // Partial rotary: the first r features turn, the rest pass through.
        for (d, r) in [(128, 96), (10, 6), (8, 2)] {
            check_partial_rope(
                GPU,
                &[0, 1, 2, 7, 100, 4097],
                3,
                (d, r),
                tp_core::RopeScaling::Default,
                dtype,
                d as u64,
            );
            check_partial_rope(GPU, &[0, 5, 70], 2, (d, r), longrope(r), dtype, 1 + d as u64);
        }
        for (hq, hkv) in [(4, 4), (6, 2), (5, 1)] {
            for d in [10, 64, 128, 256] {
                check_attention(GPU, 7, 7, hq, hkv, d, None, dtype, d as u64);
                check_attention(GPU, 1, 300, hq, hkv, d, None, dtype, 1 + d as u64);
                check_attention(GPU, 3, 11, hq, hkv, d, None, dtype, 2 + d as u64);
            }
        }
        for world in [1, 3, 8] {
            check_embedding(GPU, 1001, 13, dtype, world);
        }
        check_argmax(GPU, 3, 1001, dtype);
        check_argmax(GPU, 2, 70_000, dtype);
        check_add(GPU, dtype);
        // The kernels of the newer families: norm styles (with an outside statistic), sums of
        // squares, GeGLU, scale, soft-capping.
        common::block_ops::check_block_ops(GPU);
    }
    for w in [1, 3, 64] {
        check_attention(GPU, 9, 20, 4, 2, 16, Some(w), DType::F32, w as u64);
    }
    // Query heads that start inside a KV group (a tensor-parallel rank's uneven share).
    for (hq, hkv, size, offset) in [(2, 2, 3, 2), (4, 2, 3, 1), (5, 3, 2, 1)] {
        let groups = Some(tp_core::KvGroups { size, offset });
        for (t, kv_len) in [(1, 19), (9, 20)] {
            let spec =
                tp_core::AttentionSpec { kv_len, scale: 0.3, sliding_window: None, kv_groups: groups, sinks: None };
            check_attention_spec(GPU, t, (hq, hkv, 24), &spec, DType::BF16, (hq * 100 + t) as u64);
            // With gpt-oss's attention sinks, one logit per query head.
            let sinks: Vec<f32> = (0..hq).map(|h| [2.5, -0.7, 0.0, -30.0, 6.0][h % 5]).collect();
            let spec = tp_core::AttentionSpec { sinks: Some(sinks.into()), sliding_window: Some(5), ..spec };
            check_attention_spec(GPU, t, (hq, hkv, 24), &spec, DType::F32, (hq * 100 + t) as u64);
        }
    }
    for (hq, hkv, d) in [(4, 4, 10), (6, 2, 64), (3, 1, 128)] {
        check_prefill_equals_decode(GPU, 9, hq, hkv, d);
    }
}

#[test]
fn paged_attention_matches_f64_and_is_batch_invariant() {
    use common::paged_gpu::*;
    setup();
    // Decodes, a whole prefill, chunked-prefill continuations, a one-position sequence.
    let cases = [
        SeqCase { q_len: 1, kv_len: 37 },
        SeqCase { q_len: 9, kv_len: 9 },
        SeqCase { q_len: 5, kv_len: 23 },
        SeqCase { q_len: 1, kv_len: 1 },
        SeqCase { q_len: 3, kv_len: 40 },
    ];
    let gqa = |size, offset| Some(tp_core::KvGroups { size, offset });
    for dtype in DType::FLOATS {
        for block_size in [1, 16, 17] {
            for d in [64, 80, 128] {
                let seed = (block_size * 1000 + d) as u64;
                check_paged_attention(GPU, &cases, block_size, (4, 2, d), (None, false), None, dtype, seed);
                check_paged_attention(GPU, &cases, block_size, (6, 2, d), (Some(7), true), None, dtype, seed + 3);
                // Query heads starting inside a KV group (a rank's uneven share), with windows.
                check_paged_attention(GPU, &cases, block_size, (3, 2, d), (Some(5), false), gqa(2, 1), dtype, seed + 1);
                check_paged_attention(
                    GPU,
                    &cases,
                    block_size,
                    (5, 3, d),
                    (Some(17), false),
                    gqa(2, 1),
                    dtype,
                    seed + 2,
                );
            }
            check_paged_equals_contiguous(GPU, block_size, (6, 2, 80), dtype);
        }
    }
    check_paged_attention(GPU, &cases, 16, (8, 1, 256), (Some(1), false), None, DType::F32, 3);
    check_paged_attention_refuses_bad_batches(GPU);
}

#[test]
fn write_slots_writes_exactly_its_slots() {
    setup();
    for dtype in DType::FLOATS {
        // Rows of 1, 10, 160 and 256 elements: copy units from 2 to 16 bytes.
        for (dims, t) in [((5, 1, 1, 1), 3), ((7, 16, 2, 5), 40), ((4, 17, 2, 80), 17), ((3, 16, 2, 128), 1)] {
            common::paged_gpu::check_write_slots(GPU, dims, t, dtype);
        }
    }
}

#[test]
fn sampling_kernels_match_host_references() {
    use common::sampling::*;
    setup();
    for dtype in DType::FLOATS {
        for (rows, n) in [(1, 1), (3, 7), (3, 1000), (2, 32_001)] {
            check_penalize(GPU, rows, n, dtype);
            check_row_max_sum_exp(GPU, rows, n, dtype);
            for k in [1, 5, 64] {
                check_top_k(GPU, rows, n, k, dtype);
            }
        }
    }
}

#[test]
fn decoder_kernels_agree_with_the_host() {
    setup();
    for dtype in DType::FLOATS {
        let x = Tensor::randn(&[37, 4099], dtype, 1, &CPU).unwrap();
        let w = Tensor::rand(&[4099], dtype, 2, &CPU).unwrap();
        assert_near_host(
            &format!("rms_norm {dtype}"),
            &gpu(&x).rms_norm(&gpu(&w), 1e-6).unwrap(),
            &x.rms_norm(&w, 1e-6).unwrap(),
            1.0,
        );
        let q = Tensor::randn(&[33, 5, 128], dtype, 3, &CPU).unwrap();
        let pos: Vec<usize> = (1000..1033).collect();
        for scaling in [llama3(), linear(), yarn(), dynamic()] {
            let rope = tp_core::RotaryEmbedding::new(128, 500_000.0, scaling.clone()).unwrap();
            assert_near_host(
                &format!("rope {scaling:?} {dtype}"),
                &gpu(&q).rope(&pos, &rope).unwrap(),
                &q.rope(&pos, &rope).unwrap(),
                1.0,
            );
        }
        // Bit-exact ones: lookups, argmax, adds, in-place writes.
        let ids = Tensor::from_vec((0..77i64).map(|i| (i * 13) % 1001).collect::<Vec<_>>(), &[7, 11], &CPU).unwrap();
        let table = Tensor::randn(&[500, 31], dtype, 4, &CPU).unwrap();
        assert_eq!(host(&gpu(&table).embedding(&gpu(&ids), 400).unwrap()), table.embedding(&ids, 400).unwrap());
        let logits = Tensor::randn(&[9, 32_003], dtype, 5, &CPU).unwrap();
        assert_eq!(host(&gpu(&logits).argmax().unwrap()), logits.argmax().unwrap());
        let mut a = gpu(&x);
        a.add_assign(&gpu(&x.rms_norm(&w, 1e-6).unwrap())).unwrap();
        let mut b = x.clone();
        b.add_assign(&x.rms_norm(&w, 1e-6).unwrap()).unwrap();
        assert_near_host(&format!("add {dtype}"), &a, &b, 1.0);
        let mut cache = gpu(&Tensor::zeros(&[64, 4, 32], dtype, &CPU).unwrap());
        let rows = Tensor::randn(&[5, 4, 32], dtype, 6, &CPU).unwrap();
        cache.slice_set(&gpu(&rows), 0, 40).unwrap();
        assert_eq!(host(&cache.narrow(0, 40, 5).unwrap()), rows);
        assert_eq!(host(&cache.narrow(0, 0, 40).unwrap()), Tensor::zeros(&[40, 4, 32], dtype, &CPU).unwrap());
    }
    // Integer tensors move and slice on the device too.
    let ids = Tensor::from_vec(vec![1i32, 2, 3, 4, 5, 6], &[2, 3], &CPU).unwrap();
    assert_eq!(host(&gpu(&ids).narrow(1, 1, 2).unwrap()).to_vec::<i32>().unwrap(), vec![2, 3, 5, 6]);
    let joined = Tensor::cat(&[gpu(&ids), gpu(&ids)], 0).unwrap();
    assert_eq!(host(&joined).to_vec::<i32>().unwrap(), [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6]);
}

/// A bias-only product (K = 0) through one GEMM launcher: every element of the poisoned output
/// must be the bias (or zero). `launch` gets the arguments; its error is returned.
fn check_bias_only(
    name: &str,
    m: usize,
    bias: &Tensor,
    with_bias: bool,
    launch: impl FnOnce(&tp_kernels::Gpu, tp_kernels::GemmArgs<'_>) -> tp_kernels::Result<()>,
) -> tp_kernels::Result<()> {
    let g = tp_kernels::Gpu::get(0).unwrap();
    let (n, dtype) = (bias.dims()[0], bias.dtype());
    let ty = match dtype {
        DType::F32 => tp_kernels::ElemType::F32,
        DType::F16 => tp_kernels::ElemType::F16,
        _ => tp_kernels::ElemType::BF16,
    };
    let bd = gpu(bias);
    let (a, w) = (g.alloc(0)?, g.alloc(0)?);
    let mut out = g.alloc(m * n * dtype.size_in_bytes())?;
    let shape = tp_kernels::GemmShape { m, n, k: 0 };
    let b = with_bias.then(|| bd.cuda_buffer().unwrap().1);
    launch(&g, tp_kernels::GemmArgs { c: &mut out, a: &a, b: &w, bias: b, shape, ty })?;
    let y = f64s(&host(&Tensor::from_cuda_buffer(out, &[m, n], dtype, g.clone()).unwrap()));
    let bv = f64s(bias);
    for (i, v) in y.iter().enumerate() {
        let want = if with_bias { bv[i % n] } else { 0.0 };
        assert_eq!(*v, want, "{name} {dtype} m {m} bias {with_bias}: element {i}");
    }
    Ok(())
}

/// A GEMM launcher under test.
type Launch = fn(&tp_kernels::Gpu, tp_kernels::GemmArgs<'_>) -> tp_kernels::Result<()>;

#[test]
fn bias_only_products_on_every_gemm_launcher() {
    setup();
    let hopper = tp_kernels::Gpu::get(0).unwrap().compute_capability() == (9, 0);
    let every: [(&str, usize, Launch); 3] = [
        ("gemm_nt (decode)", 3, |g, a| g.gemm_nt(a)),
        ("gemm_nt", 20, |g, a| g.gemm_nt(a)),
        ("gemm_small_m", 8, |g, a| g.gemm_small_m(a)),
    ];
    let f32_only: [(&str, usize, Launch); 2] = [
        ("gemm_simt_f32 nk", 20, |g, a| g.gemm_simt_f32(a, true)),
        ("gemm_simt_f32 kn", 20, |g, a| g.gemm_simt_f32(a, false)),
    ];
    let halves: [(&str, usize, Launch); 2] =
        [("gemm_mma", 20, |g, a| g.gemm_mma(a)), ("gemm_tensor_core", 20, |g, a| g.gemm_tensor_core(a))];
    for dtype in DType::FLOATS {
        let bias = Tensor::randn(&[33], dtype, 11, &CPU).unwrap();
        for with_bias in [true, false] {
            let own = if dtype == DType::F32 { &f32_only } else { &halves };
            for &(name, m, launch) in every.iter().chain(own) {
                check_bias_only(name, m, &bias, with_bias, launch).unwrap();
            }
            if dtype == DType::F32 {
                continue;
            }
            // The Hopper launcher hands K = 0 to mma.sync (no TMA map has a zero dimension).
            let r = check_bias_only("gemm_wgmma", 20, &bias, with_bias, |g, a| g.gemm_wgmma(a));
            if hopper {
                r.unwrap();
            } else {
                assert!(matches!(r, Err(tp_kernels::KernelError::InvalidLaunch { .. })), "{r:?}");
            }
        }
    }
}

/// LoRA's batched product (`tp_lora_shrink`, `tp_lora_expand`) against the host's: mixed slots
/// (empty, negative and out-of-table ids skipped), rows and widths off every warp and block
/// multiple, ranks 1 to 128, f32/f16/bf16 inputs and outputs, the output poisoned where no
/// adapter writes it (those rows must come back bit for bit).
#[test]
fn the_batched_lora_product_matches_the_host() {
    use tp_core::lora::{LoraFactors, lora_product};
    setup();
    for (t, width, out, r) in [(1, 8, 8, 1), (13, 257, 300, 8), (70, 576, 1536, 16), (5, 100, 33, 128)] {
        let slots: Vec<i32> = (0..t).map(|i| [0, 2, -1, 1, 5][i % 5]).collect();
        let (a1, b1) = (
            Tensor::randn(&[r, width], DType::F32, 2, &CPU).unwrap(),
            Tensor::randn(&[out, r], DType::F32, 3, &CPU).unwrap(),
        );
        let (a2, b2) = (
            Tensor::randn(&[r, width], DType::F32, 4, &CPU).unwrap(),
            Tensor::randn(&[out, r], DType::F32, 5, &CPU).unwrap(),
        );
        let (ga1, gb1, ga2, gb2) = (gpu(&a1), gpu(&b1), gpu(&a2), gpu(&b2));
        let host_f =
            [Some(LoraFactors { a: &a1, b: &b1, scale: 0.25 }), None, Some(LoraFactors { a: &a2, b: &b2, scale: 3.0 })];
        let dev_f = [
            Some(LoraFactors { a: &ga1, b: &gb1, scale: 0.25 }),
            None,
            Some(LoraFactors { a: &ga2, b: &gb2, scale: 3.0 }),
        ];
        for dtype in DType::FLOATS {
            let x = Tensor::randn(&[t, width], DType::F32, 1, &CPU).unwrap().to_dtype(dtype).unwrap();
            let y = Tensor::randn(&[t, out], DType::F32, 6, &CPU).unwrap().to_dtype(dtype).unwrap();
            let want = lora_product(&x, &y, &host_f, &slots).unwrap().to_f64_vec().unwrap();
            let got = host(&lora_product(&gpu(&x), &gpu(&y), &dev_f, &slots).unwrap()).to_f64_vec().unwrap();
            let base = y.to_f64_vec().unwrap();
            let tol = if dtype == DType::F32 { 1e-4 } else { 2e-2 };
            for row in 0..t {
                for c in 0..out {
                    let (g, w) = (got[row * out + c], want[row * out + c]);
                    if ![0, 2].contains(&slots[row]) {
                        assert_eq!(
                            g,
                            base[row * out + c],
                            "{dtype:?} [{t}, {width}] -> {out} r {r}: row {row} untouched"
                        );
                    } else {
                        assert!(
                            (g - w).abs() <= tol * w.abs().max(1.0),
                            "{dtype:?} [{t}, {width}] -> {out} r {r}: ({row}, {c}) {g} vs {w}"
                        );
                    }
                }
            }
        }
    }
}
