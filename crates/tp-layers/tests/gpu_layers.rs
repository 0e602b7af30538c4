//! GPU suite of the layers: the same layers through LocalGroup ranks sharing GPU 0, against the
//! host backend; and the element-wise kernels (SwiGLU, row bias) against the host. Built with
//! `--features gpu-tests`; fails, never skips, without a GPU.

mod common;
use common::*;
use tp_core::{Activation, DType, Device, NormStyle, RopeScaling, RotaryEmbedding, Tensor};
use tp_layers::{
    AttentionConfig, AttentionHeads, Block, Checkpoint, ColumnParallel, DecoderConfig, DecoderLayer, DecoderNames,
    LoadOptions, Loader, ParallelLmHead, ParallelMlp, RowParallel, VocabParallelEmbedding, save,
};
use tp_testing::reference::block::*;

const GPU: Device = Device::Cuda(0);

fn setup() {
    tp_kernels::note_sticky_errors_on_panic();
    assert!(tp_kernels::device_count().expect("the GPU suite needs a CUDA device") > 0);
}

#[test]
fn elementwise_kernels_match_the_host() {
    setup();
    for dtype in DType::FLOATS {
        let x = Tensor::randn(&[37, 2 * 129], dtype, 1, &CPU).unwrap();
        let want = f64s(&x.swiglu().unwrap());
        let got = f64s(&x.to_device(&GPU).unwrap().swiglu().unwrap());
        let u = dtype.unit_roundoff();
        assert_close(&format!("swiglu {dtype}"), &got, &want, |i| 2.0 * u * want[i].abs() + 1e-6);
        let b = Tensor::randn(&[2 * 129], dtype, 2, &CPU).unwrap();
        let want = x.add_row(&b).unwrap();
        let got = x.to_device(&GPU).unwrap().add_row(&b.to_device(&GPU).unwrap()).unwrap().to_device(&CPU).unwrap();
        assert_eq!(got, want, "add_row {dtype}: one f32 add and one rounding on both");
    }
}

#[test]
fn layers_on_ranks_sharing_one_gpu_match_the_host() {
    setup();
    for dtype in DType::FLOATS {
        let (hidden, inter) = (64, 200);
        let gate = linear(inter, hidden, false, dtype, 1);
        let up = linear(inter, hidden, false, dtype, 3);
        let down = linear(hidden, inter, true, dtype, 5);
        let x = Tensor::rand(&[9, hidden], dtype, 7, &CPU).unwrap();
        let r = mlp_f64(&x, &gate, &up, &down);
        let u = dtype.unit_roundoff();
        for world in [1, 2, 3, 4, 8] {
            let got = on_ranks(world, GPU, |g| {
                let to_gpu = |l: &tp_layers::Linear| l.to(dtype, &GPU).unwrap();
                let (gg, ug, dg) = (to_gpu(&gate), to_gpu(&up), to_gpu(&down));
                let xg = x.to_device(&GPU).unwrap();
                let mlp = ParallelMlp::from_full(&gg, &ug, &dg, Activation::Silu, &g).unwrap();
                let col = ColumnParallel::from_full(&gg, &g).unwrap().forward_gathered(&xg).unwrap();
                let row = RowParallel::from_full(dg.weight().unwrap(), dg.bias(), &g).unwrap();
                let act = Tensor::rand(&[9, inter], dtype, 11, &CPU).unwrap().to_device(&GPU).unwrap();
                let row_y = row.forward_split(&act).unwrap();
                (
                    mlp.forward(&xg).unwrap().to_device(&CPU).unwrap(),
                    col.to_device(&CPU).unwrap(),
                    row_y.to_device(&CPU).unwrap(),
                )
            });
            let c = if dtype == DType::F32 { 16.0 } else { 4.0 };
            for (y, col, _) in &got {
                assert_close(&format!("gpu mlp {dtype} world {world}"), &f64s(y), &r.y, |i| {
                    c * u * r.scale[i] + 2.0 * u * r.y[i].abs() + 1e-5
                });
                let (want, abs) = linear_f64(&x, &gate);
                assert_close(&format!("gpu column {dtype} world {world}"), &f64s(col), &want, |i| {
                    tol(dtype, hidden, want[i], abs[i])
                });
            }
            assert!(got.iter().all(|g| g.0 == got[0].0 && g.2 == got[0].2), "ranks disagree");
        }
    }
}

#[test]
fn decoder_layers_on_ranks_sharing_one_gpu_match_f64() {
    setup();
    let (hidden, inter, nq, nkv, d) = (48, 77, 12, 4, 16);
    let dir = std::env::temp_dir().join(format!("tp-gpu-decoder-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bw = BlockWeights::random(hidden, inter, nq, nkv, d, true, DType::F32, 31);
    let named = bw.named("model.layers.0");
    let refs: Vec<(&str, &Tensor)> = named.iter().map(|(n, t)| (n.as_str(), t)).collect();
    save(dir.join("model.safetensors"), &refs).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let x = Tensor::randn(&[9, hidden], DType::F32, 32, &CPU).unwrap();
    let want = block(&f64s(&x), &bw, (nq, nkv, d), 10_000.0, 1e-6);
    let scale = want.iter().map(|v| v.abs()).fold(0.0, f64::max);
    let cfg = DecoderConfig {
        attention: AttentionConfig {
            heads: AttentionHeads { num_heads: nq, num_kv_heads: nkv, head_dim: d },
            rope: RotaryEmbedding::new(d, 10_000.0, RopeScaling::Default).unwrap(),
            sliding_window: None,
            scale: None,
            qk_norm: None,
            sinks: false,
        },
        rms_norm_eps: 1e-6,
        norm_style: NormStyle::Weight,
        activation: Activation::Silu,
        moe: None,
    };
    for dtype in DType::FLOATS {
        for world in [1, 2, 4] {
            let got = on_ranks(world, GPU, |g| {
                let opts = LoadOptions::new().with_dtype(dtype);
                let ld = Loader::new(&ckpt, &g, opts).pp("model.layers.0");
                let layer = DecoderLayer::load(&ld, &cfg, &DecoderNames::default()).unwrap();
                let mut cache = layer.new_cache(12).unwrap();
                let xg = x.to_dtype(dtype).unwrap().to_device(&GPU).unwrap();
                let a = layer.forward(&xg.narrow(0, 0, 6).unwrap(), &mut cache).unwrap();
                let b = layer.forward(&xg.narrow(0, 6, 1).unwrap(), &mut cache).unwrap();
                let c = layer.forward(&xg.narrow(0, 7, 2).unwrap(), &mut cache).unwrap();
                Tensor::cat(&[a, b, c], 0).unwrap().to_device(&CPU).unwrap()
            });
            let bound = if dtype == DType::F32 { 1e-4 } else { 0.05 };
            for y in &got {
                assert_close(&format!("gpu block {dtype} world {world}"), &f64s(y), &want, |_| bound * scale);
            }
            assert!(got.iter().all(|y| y == &got[0]), "ranks disagree");
        }
    }
    // Embedding and greedy head on the GPU equal the host's.
    let table = Tensor::randn(&[1001, hidden], DType::BF16, 33, &CPU).unwrap();
    let ids = Tensor::from_vec((0..17i64).map(|i| (i * 97) % 1001).collect::<Vec<_>>(), &[17], &CPU).unwrap();
    let host_emb = table.embedding(&ids, 0).unwrap();
    let host_top = x.to_dtype(DType::BF16).unwrap().matmul_t(&table).unwrap().argmax().unwrap();
    for world in [1, 3, 8] {
        let got = on_ranks(world, GPU, |g| {
            let emb = VocabParallelEmbedding::from_full(&table.to_device(&GPU).unwrap(), &g).unwrap();
            let head = ParallelLmHead::tied(&emb);
            let xg = x.to_dtype(DType::BF16).unwrap().to_device(&GPU).unwrap();
            (emb.forward(&ids).unwrap().to_device(&CPU).unwrap(), head.argmax(&xg).unwrap())
        });
        for (e, top) in got {
            assert_eq!(e, host_emb, "embedding world {world}");
            // The GPU GEMM may round a logit differently from the host's: the chosen token's
            // logit must be the maximum within bf16 rounding.
            let logits = f64s(&x.to_dtype(DType::BF16).unwrap().matmul_t(&table).unwrap());
            for (r, (&t, &h)) in top.to_i64_vec().unwrap().iter().zip(&host_top.to_i64_vec().unwrap()).enumerate() {
                let row = &logits[r * 1001..(r + 1) * 1001];
                assert!(row[t as usize] >= row[h as usize] - 0.02 * row[h as usize].abs(), "row {r}: {t} vs {h}");
            }
        }
    }
}

#[test]
fn forwards_over_nccl_issue_no_host_synchronisation() {
    setup();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let vars = [("RANK", "0".to_string()), ("WORLD_SIZE", "1".into()), ("MASTER_PORT", port.to_string())];
    let env = tp_comm::LaunchEnv::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())).unwrap();
    let g = tp_comm::DeviceGroup::from_launch_env(&env).expect("NCCL group of one");
    let dtype = DType::BF16;
    let to_gpu = |l: &tp_layers::Linear| l.to(dtype, &GPU).unwrap();
    let (gate, up, down) = (
        to_gpu(&linear(200, 64, false, dtype, 1)),
        to_gpu(&linear(200, 64, false, dtype, 2)),
        to_gpu(&linear(64, 200, true, dtype, 3)),
    );
    let mlp = ParallelMlp::from_full(&gate, &up, &down, Activation::Silu, &g).unwrap();
    let col = ColumnParallel::from_full(&gate, &g).unwrap();
    let row = RowParallel::from_full(down.weight().unwrap(), down.bias(), &g).unwrap();
    let x = Tensor::rand(&[9, 64], dtype, 4, &CPU).unwrap().to_device(&GPU).unwrap();
    let act = Tensor::rand(&[9, 200], dtype, 5, &CPU).unwrap().to_device(&GPU).unwrap();
    // Warm up (modules load on first use), then count.
    let _ = (mlp.forward(&x).unwrap(), col.forward_gathered(&x).unwrap(), row.forward(&act).unwrap());
    let before = tp_kernels::host_syncs();
    let outs = (mlp.forward(&x).unwrap(), col.forward_gathered(&x).unwrap(), row.forward(&act).unwrap());
    assert_eq!(tp_kernels::host_syncs(), before, "a forward must not make the host wait for the GPU");
    // The results are right (reading them back is the first synchronisation).
    let r = mlp_f64(&x.to_device(&CPU).unwrap(), &gate, &up, &down);
    let got = f64s(&outs.0.to_device(&CPU).unwrap());
    assert_close("mlp over nccl", &got, &r.y, |i| {
        4.0 * dtype.unit_roundoff() * r.scale[i] + 2.0 * dtype.unit_roundoff() * r.y[i].abs() + 1e-5
    });
    assert!(tp_kernels::host_syncs() > before);
}

/// LoRA adapters on a column- and a row-parallel layer on the GPU against the same layers on
/// the host: two served slots and the base mixed per token (the batched kernels), and the
/// trained slot's forward and backward (input gradient, adapter gradients), at world sizes 1-3.
#[test]
fn lora_layers_on_the_gpu_match_the_host() {
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use tp_layers::lora::{
        LoraInit, LoraSettings, LoraSpec, LoraTargets, attaching, attaching_as, frozen_base, with_token_adapters,
    };
    setup();
    let (t, h, out, r) = (9, 40, 72, 4);
    let spec = |seed: u64| {
        let mut full = BTreeMap::new();
        full.insert("c.lora_A.weight".to_string(), Tensor::randn(&[r, h], DType::F32, seed, &CPU).unwrap());
        full.insert("c.lora_B.weight".to_string(), Tensor::randn(&[out, r], DType::F32, seed + 1, &CPU).unwrap());
        full.insert("r.lora_A.weight".to_string(), Tensor::randn(&[r, out], DType::F32, seed + 2, &CPU).unwrap());
        full.insert("r.lora_B.weight".to_string(), Tensor::randn(&[h, r], DType::F32, seed + 3, &CPU).unwrap());
        Arc::new(LoraSpec {
            settings: LoraSettings { r, alpha: 8.0, use_rslora: false },
            targets: LoraTargets::Names(vec!["c".into(), "r".into()]),
            init: LoraInit::Tensors(Arc::new(full)),
        })
    };
    let w_c = Tensor::randn(&[out, h], DType::F32, 11, &CPU).unwrap();
    let w_r = Tensor::randn(&[h, out], DType::F32, 12, &CPU).unwrap();
    let x = Tensor::randn(&[t, h], DType::F32, 13, &CPU).unwrap();
    let dy = Tensor::randn(&[t, h], DType::F32, 14, &CPU).unwrap();
    let ids: Arc<[u32]> = vec![1, 0, 2, 2, 1, 0, 1, 2, 0].into();
    let run = |device: Device, world: usize| {
        on_ranks(world, device, |g| {
            let mut c = ColumnParallel::from_full(&tp_layers::Linear::new(w_c.clone(), None).unwrap(), &g).unwrap();
            let mut rp = RowParallel::from_full(&w_r, None, &g).unwrap();
            for (k, s) in [(1, spec(1)), (2, spec(5))] {
                attaching_as(k, s, || {
                    c.params("c", &mut |_| {}).unwrap();
                    rp.params("r", &mut |_| {}).unwrap();
                });
            }
            attaching(spec(9), || {
                c.params("c", &mut |_| {}).unwrap();
                rp.params("r", &mut |_| {}).unwrap();
            });
            let xd = x.to_device(&device).unwrap();
            let forward = |c: &ColumnParallel, rp: &RowParallel| {
                let y = c.forward(&xd).unwrap();
                let yf = g.all_gather_balanced(&y, 1, out).unwrap();
                rp.forward_split(&yf).unwrap()
            };
            let mixed = with_token_adapters(ids.clone(), || forward(&c, &rp));
            let trained = forward(&c, &rp);
            // The trained slot's backward through the row layer.
            let y = g.all_gather_balanced(&c.forward(&xd).unwrap(), 1, out).unwrap();
            let s = *rp.shard();
            let y_local = y.narrow(1, s.start(), s.len()).unwrap();
            let dx = frozen_base(|| rp.backward(&y_local, &dy.to_device(&device).unwrap()).unwrap());
            let grads = frozen_base(|| {
                let mut ps = Vec::new();
                rp.params("r", &mut |p| ps.push(p)).unwrap();
                tp_layers::sync_partial_grads(&mut ps, &g).unwrap();
                tp_layers::gather_full(&ps, tp_layers::Gather::Grads, &g).unwrap()
            });
            (f64s(&mixed), f64s(&trained), f64s(&dx), f64s(&grads["r.lora_A.weight"]), f64s(&grads["r.lora_B.weight"]))
        })
    };
    for world in [1, 2, 3] {
        let (want, got) = (run(CPU, world), run(GPU, world));
        for (rank, (w, g)) in want.iter().zip(&got).enumerate() {
            let at = format!("LoRA rank {rank} of {world}");
            for (name, gv, wv) in [
                ("mixed", &g.0, &w.0),
                ("trained", &g.1, &w.1),
                ("dX", &g.2, &w.2),
                ("dA", &g.3, &w.3),
                ("dB", &g.4, &w.4),
            ] {
                let scale = wv.iter().fold(1f64, |m, v| m.max(v.abs()));
                assert_close(&format!("{at} {name}"), gv, wv, |_| 1e-4 * scale);
            }
        }
    }
}
