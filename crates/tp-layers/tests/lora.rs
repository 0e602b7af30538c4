//! LoRA adapters on the tensor-parallel linear layers against a float64 reference: the
//! forward, the input gradient and the adapters' gradients at world sizes 1 through 8, shapes
//! off every multiple (uneven shards), GQA heads replicated past their count, a fused Phi-3
//! projection, rsLoRA's scale, and a quantized base.

use std::collections::BTreeMap;
use std::sync::Arc;
use tp_core::rng::SplitMix64;
use tp_core::{DType, Device, Tensor};
use tp_layers::lora::{LoraInit, LoraSettings, LoraSpec, LoraTargets, attaching, frozen_base};
use tp_layers::tp_comm::DeviceGroup;
use tp_layers::{
    ColumnParallel, Gather, Linear, MergedColumnParallel, Param, Projections, QkvLayout, QkvParallel, RowParallel,
    gather_full, sync_partial_grads,
};
use tp_testing::ranks::on_ranks;

/// A row-major `[rows, cols]` float64 matrix.
#[derive(Clone, Debug)]
struct M {
    rows: usize,
    cols: usize,
    v: Vec<f64>,
}

impl M {
    fn rand(rows: usize, cols: usize, rng: &mut SplitMix64) -> M {
        M { rows, cols, v: (0..rows * cols).map(|_| rng.uniform(-1.0, 1.0)).collect() }
    }
    fn at(&self, i: usize, j: usize) -> f64 {
        self.v[i * self.cols + j]
    }
    /// `self · o^T`.
    fn mul_t(&self, o: &M) -> M {
        assert_eq!(self.cols, o.cols);
        let mut v = vec![0.0; self.rows * o.rows];
        for i in 0..self.rows {
            for j in 0..o.rows {
                v[i * o.rows + j] = (0..self.cols).map(|k| self.at(i, k) * o.at(j, k)).sum();
            }
        }
        M { rows: self.rows, cols: o.rows, v }
    }
    fn t(&self) -> M {
        let mut v = vec![0.0; self.v.len()];
        for i in 0..self.rows {
            for j in 0..self.cols {
                v[j * self.rows + i] = self.at(i, j);
            }
        }
        M { rows: self.cols, cols: self.rows, v }
    }
    /// `self · o`.
    fn mul(&self, o: &M) -> M {
        self.mul_t(&o.t())
    }
    fn add(&self, o: &M) -> M {
        M { rows: self.rows, cols: self.cols, v: self.v.iter().zip(&o.v).map(|(a, b)| a + b).collect() }
    }
    fn scale(&self, s: f64) -> M {
        M { rows: self.rows, cols: self.cols, v: self.v.iter().map(|a| a * s).collect() }
    }
    fn cols(&self, r: std::ops::Range<usize>) -> M {
        let mut v = Vec::new();
        for i in 0..self.rows {
            v.extend_from_slice(&self.v[i * self.cols + r.start..i * self.cols + r.end]);
        }
        M { rows: self.rows, cols: r.len(), v }
    }
    fn row_block(&self, r: std::ops::Range<usize>) -> M {
        M { rows: r.len(), cols: self.cols, v: self.v[r.start * self.cols..r.end * self.cols].to_vec() }
    }
    fn tensor(&self) -> Tensor {
        let v: Vec<f32> = self.v.iter().map(|&x| x as f32).collect();
        Tensor::from_vec(v, &[self.rows, self.cols], &Device::Cpu).unwrap()
    }
}

fn close(what: &str, got: &Tensor, want: &M, tol: f64) {
    assert_eq!(got.dims(), [want.rows, want.cols], "{what}: shape");
    let g = got.to_f64_vec().unwrap();
    let scale = want.v.iter().fold(1f64, |m, x| m.max(x.abs()));
    for (i, (a, b)) in g.iter().zip(&want.v).enumerate() {
        assert!((a - b).abs() <= tol * scale, "{what}[{i}]: {a} vs {b}");
    }
}

/// One adapted module of the reference: `W: [out, in]`, `A: [r, in]`, `B: [out, r]`.
struct Module {
    w: M,
    a: M,
    b: M,
}

impl Module {
    fn new(out: usize, inp: usize, r: usize, rng: &mut SplitMix64) -> Module {
        Module { w: M::rand(out, inp, rng), a: M::rand(r, inp, rng), b: M::rand(out, r, rng) }
    }
    /// `x W^T + s (x A^T) B^T` (`adapted`) or `x W^T`.
    fn forward(&self, x: &M, s: f64, adapted: bool) -> M {
        let y = x.mul_t(&self.w);
        if adapted { y.add(&x.mul_t(&self.a).mul_t(&self.b).scale(s)) } else { y }
    }
    /// `(dx, dA, dB)` for output gradient `g`.
    fn backward(&self, x: &M, g: &M, s: f64, adapted: bool) -> (M, M, M) {
        let dx = g.mul(&self.w);
        if !adapted {
            return (dx, M { rows: 0, cols: 0, v: vec![] }, M { rows: 0, cols: 0, v: vec![] });
        }
        let du = g.mul(&self.b).scale(s);
        let db = g.t().mul(&x.mul_t(&self.a)).scale(s);
        (dx.add(&du.mul(&self.a)), du.t().mul(x), db)
    }
}

fn spec(r: usize, alpha: f64, rslora: bool, targets: &[&str], tensors: BTreeMap<String, Tensor>) -> Arc<LoraSpec> {
    Arc::new(LoraSpec {
        settings: LoraSettings { r, alpha, use_rslora: rslora },
        targets: LoraTargets::Names(targets.iter().map(|s| s.to_string()).collect()),
        init: LoraInit::Tensors(Arc::new(tensors)),
    })
}

/// The adapters' gradients, full and summed over the ranks, by name.
fn adapter_grads(params: &mut Vec<Param<'_>>, g: &DeviceGroup) -> BTreeMap<String, Tensor> {
    sync_partial_grads(params, g).unwrap();
    gather_full(params, Gather::Grads, g).unwrap()
}

#[test]
fn column_and_row_adapters_match_float64_at_every_world_size() {
    let (t, h, out, r) = (7, 13, 22, 3);
    for rslora in [false, true] {
        let mut rng = SplitMix64::new(11 + rslora as u64);
        let (col, row) = (Module::new(out, h, r, &mut rng), Module::new(h, out, r, &mut rng));
        let (x, x2, gc, gr) =
            (M::rand(t, h, &mut rng), M::rand(t, out, &mut rng), M::rand(t, out, &mut rng), M::rand(t, h, &mut rng));
        let alpha = 5.0;
        let s = if rslora { alpha / (r as f64).sqrt() } else { alpha / r as f64 };
        let mut full = BTreeMap::new();
        full.insert("c.lora_A.weight".to_string(), col.a.tensor());
        full.insert("c.lora_B.weight".to_string(), col.b.tensor());
        full.insert("r.lora_A.weight".to_string(), row.a.tensor());
        full.insert("r.lora_B.weight".to_string(), row.b.tensor());
        let spec = spec(r, alpha, rslora, &["c", "r"], full);
        let (yc, yr) = (col.forward(&x, s, true), row.forward(&x2, s, true));
        let (dxc, dac, dbc) = col.backward(&x, &gc, s, true);
        let (dxr, dar, dbr) = row.backward(&x2, &gr, s, true);
        for world in 1..=8 {
            on_ranks(world, Device::Cpu, |g| {
                let rank = g.rank();
                let base = Linear::new(col.w.tensor(), None).unwrap();
                let mut c = ColumnParallel::from_full(&base, &g).unwrap();
                let mut rp = RowParallel::from_full(&row.w.tensor(), None, &g).unwrap();
                let ((), adapted) = attaching(spec.clone(), || {
                    c.params("c", &mut |_| {}).unwrap();
                    rp.params("r", &mut |_| {}).unwrap();
                });
                assert_eq!(adapted, 2);
                let cs = *c.shard();
                let rs = *rp.shard();
                let what = |w: &str| format!("{w} (rank {rank} of {world}, rslora {rslora})");
                close(&what("column forward"), &c.forward(&x.tensor()).unwrap(), &yc.cols(cs.start()..cs.end()), 1e-5);
                close(&what("row forward"), &rp.forward_split(&x2.tensor()).unwrap(), &yr, 1e-5);
                let (dx_c, dx_r) = frozen_base(|| {
                    let dyc = gc.cols(cs.start()..cs.end()).tensor();
                    let x2_local = x2.cols(rs.start()..rs.end()).tensor();
                    (c.backward(&x.tensor(), &dyc).unwrap(), rp.backward(&x2_local, &gr.tensor()).unwrap())
                });
                close(&what("column dX"), &dx_c, &dxc, 1e-5);
                close(&what("row dX"), &dx_r, &dxr.cols(rs.start()..rs.end()), 1e-5);
                let grads = frozen_base(|| {
                    let mut ps = Vec::new();
                    c.params("c", &mut |p| ps.push(p)).unwrap();
                    rp.params("r", &mut |p| ps.push(p)).unwrap();
                    assert_eq!(ps.len(), 4, "only the adapters are parameters with the base frozen");
                    adapter_grads(&mut ps, &g)
                });
                close(&what("column dA"), &grads["c.lora_A.weight"], &dac, 1e-5);
                close(&what("column dB"), &grads["c.lora_B.weight"], &dbc, 1e-5);
                close(&what("row dA"), &grads["r.lora_A.weight"], &dar, 1e-5);
                close(&what("row dB"), &grads["r.lora_B.weight"], &dbr, 1e-5);
                // The frozen base got no gradient.
                let mut base_grads = 0;
                c.params("c", &mut |p| base_grads += p.grad.get().is_some() as usize).unwrap();
                rp.params("r", &mut |p| base_grads += p.grad.get().is_some() as usize).unwrap();
                assert_eq!(base_grads, 0, "{}", what("frozen base"));
            });
        }
    }
}

/// q/k/v with 8 query heads over 2 KV heads (replicated past 2 ranks), PEFT's default targets
/// (q and v; k stays as it is).
#[test]
fn qkv_adapters_on_q_and_v_match_float64_with_replicated_kv_heads() {
    let (t, h, hd, nq, nkv, r) = (5, 10, 3, 8, 2, 4);
    let mut rng = SplitMix64::new(5);
    let (q, k, v) = (
        Module::new(nq * hd, h, r, &mut rng),
        Module::new(nkv * hd, h, r, &mut rng),
        Module::new(nkv * hd, h, r, &mut rng),
    );
    let x = M::rand(t, h, &mut rng);
    let gs = [M::rand(t, nq * hd, &mut rng), M::rand(t, nkv * hd, &mut rng), M::rand(t, nkv * hd, &mut rng)];
    let s = 16.0 / r as f64;
    let mut full = BTreeMap::new();
    for (name, m) in [("q_proj", &q), ("v_proj", &v)] {
        full.insert(format!("attn.{name}.lora_A.weight"), m.a.tensor());
        full.insert(format!("attn.{name}.lora_B.weight"), m.b.tensor());
    }
    let spec = spec(r, 16.0, false, &["q_proj", "v_proj"], full);
    let mods = [(&q, true), (&k, false), (&v, true)];
    let want_y: Vec<M> = mods.iter().map(|(m, a)| m.forward(&x, s, *a)).collect();
    let back: Vec<(M, M, M)> = mods.iter().zip(&gs).map(|((m, a), g)| m.backward(&x, g, s, *a)).collect();
    let want_dx = back[0].0.add(&back[1].0).add(&back[2].0);
    for world in 1..=8 {
        on_ranks(world, Device::Cpu, |g| {
            let layout = QkvLayout::new(nq, nkv, hd, g.rank(), world).unwrap();
            let lin = |m: &Module| Linear::new(m.w.tensor(), None).unwrap();
            let mut qkv = QkvParallel::from_full(&lin(&q), &lin(&k), &lin(&v), layout).unwrap();
            assert_eq!(
                attaching(spec.clone(), || qkv.params("attn", Projections::default(), &mut |_| {}).unwrap()).1,
                2
            );
            let (yq, yk, yv) = qkv.forward(&x.tensor()).unwrap();
            let (qr, kr) = (
                (layout.q_start * hd)..((layout.q_start + layout.q_len) * hd),
                (layout.kv_start * hd)..((layout.kv_start + layout.kv_len) * hd),
            );
            close("q", &yq.reshape(&[t, qr.len()]).unwrap(), &want_y[0].cols(qr.clone()), 1e-5);
            close("k", &yk.reshape(&[t, kr.len()]).unwrap(), &want_y[1].cols(kr.clone()), 1e-5);
            close("v", &yv.reshape(&[t, kr.len()]).unwrap(), &want_y[2].cols(kr.clone()), 1e-5);
            // A KV head held by several ranks gets its gradient once, from its owner: the sum
            // over the ranks' contributions is the whole gradient, as attention's partial
            // gradients are.
            let sharing = layout.kv_sharing();
            let kv_dy = |gm: &M| {
                let mut m = gm.cols(kr.clone());
                for (j, &(owned, _)) in sharing.iter().enumerate() {
                    if !owned {
                        for i in 0..t {
                            m.v[i * m.cols + j * hd..i * m.cols + (j + 1) * hd].fill(0.0);
                        }
                    }
                }
                m
            };
            let dy = Tensor::cat(&[gs[0].cols(qr.clone()).tensor(), kv_dy(&gs[1]).tensor(), kv_dy(&gs[2]).tensor()], 1)
                .unwrap();
            let dx = frozen_base(|| qkv.backward(&x.tensor(), &dy, &g, None).unwrap());
            close(&format!("qkv dX at {world}"), &dx, &want_dx, 1e-5);
            let grads = frozen_base(|| {
                let mut ps = Vec::new();
                qkv.params("attn", Projections::default(), &mut |p| ps.push(p)).unwrap();
                adapter_grads(&mut ps, &g)
            });
            assert_eq!(grads.len(), 4, "q and v adapted, k not: {:?}", grads.keys());
            close(&format!("dA_q at {world}"), &grads["attn.q_proj.lora_A.weight"], &back[0].1, 1e-5);
            close(&format!("dB_q at {world}"), &grads["attn.q_proj.lora_B.weight"], &back[0].2, 1e-5);
            close(&format!("dA_v at {world}"), &grads["attn.v_proj.lora_A.weight"], &back[2].1, 1e-5);
            close(&format!("dB_v at {world}"), &grads["attn.v_proj.lora_B.weight"], &back[2].2, 1e-5);
        });
    }
}

/// Phi-3's fused `gate_up_proj`: one adapter over both parts, whose rows a rank holds in two
/// blocks of the fused tensor.
#[test]
fn a_fused_projection_has_one_adapter_over_its_parts() {
    let (t, h, inter, r) = (6, 9, 11, 2);
    let mut rng = SplitMix64::new(8);
    let m = Module::new(2 * inter, h, r, &mut rng);
    let x = M::rand(t, h, &mut rng);
    let gm = M::rand(t, 2 * inter, &mut rng);
    let s = 8.0 / r as f64;
    let mut full = BTreeMap::new();
    full.insert("mlp.gate_up_proj.lora_A.weight".to_string(), m.a.tensor());
    full.insert("mlp.gate_up_proj.lora_B.weight".to_string(), m.b.tensor());
    let spec = spec(r, 8.0, false, &["gate_up_proj"], full);
    let y = m.forward(&x, s, true);
    let (dx, da, db) = m.backward(&x, &gm, s, true);
    for world in 1..=8 {
        on_ranks(world, Device::Cpu, |g| {
            let gate = Linear::new(m.w.row_block(0..inter).tensor(), None).unwrap();
            let up = Linear::new(m.w.row_block(inter..2 * inter).tensor(), None).unwrap();
            let mut layer = MergedColumnParallel::from_full(&[&gate, &up], &g).unwrap();
            let names = Projections::<2>::Fused("gate_up_proj");
            assert_eq!(attaching(spec.clone(), || layer.params("mlp", names, &mut |_| {}).unwrap()).1, 1);
            let sh = layer.shards().to_vec();
            let (gr, ur) = (sh[0].start()..sh[0].end(), (inter + sh[1].start())..(inter + sh[1].end()));
            let want = Tensor::cat(&[y.cols(gr.clone()).tensor(), y.cols(ur.clone()).tensor()], 1).unwrap();
            let got = layer.forward(&x.tensor()).unwrap();
            close(
                &format!("fused forward at {world}"),
                &got,
                &M { rows: t, cols: gr.len() + ur.len(), v: want.to_f64_vec().unwrap() },
                1e-5,
            );
            let dy = Tensor::cat(&[gm.cols(gr).tensor(), gm.cols(ur).tensor()], 1).unwrap();
            close(
                &format!("fused dX at {world}"),
                &frozen_base(|| layer.backward(&x.tensor(), &dy).unwrap()),
                &dx,
                1e-5,
            );
            let grads = frozen_base(|| {
                let mut ps = Vec::new();
                layer.params("mlp", names, &mut |p| ps.push(p)).unwrap();
                adapter_grads(&mut ps, &g)
            });
            close(&format!("fused dA at {world}"), &grads["mlp.gate_up_proj.lora_A.weight"], &da, 1e-5);
            close(&format!("fused dB at {world}"), &grads["mlp.gate_up_proj.lora_B.weight"], &db, 1e-5);
        });
    }
}

/// A missing adapter tensor and a rank that does not fit are errors naming the tensor.
#[test]
fn adapters_that_do_not_fit_the_base_are_refused_by_name() {
    let mut rng = SplitMix64::new(3);
    let m = Module::new(6, 5, 2, &mut rng);
    on_ranks(2, Device::Cpu, |g| {
        let mut c = ColumnParallel::from_full(&Linear::new(m.w.tensor(), None).unwrap(), &g).unwrap();
        let mut full = BTreeMap::new();
        full.insert("c.lora_A.weight".to_string(), m.a.tensor());
        let err = attaching(spec(2, 4.0, false, &["c"], full.clone()), || c.params("c", &mut |_| {})).0.unwrap_err();
        assert!(err.to_string().contains("c.lora_B.weight"), "{err}");
        full.insert("c.lora_B.weight".to_string(), m.b.tensor());
        let err = attaching(spec(3, 4.0, false, &["c"], full), || c.params("c", &mut |_| {})).0.unwrap_err();
        assert!(err.to_string().contains("c.lora_A.weight"), "{err}");
        assert!(c.local().lora().is_none());
    });
}

/// Fresh adapters start as PEFT's do: `B = 0` (the output is the base's), `A` within
/// `±1/sqrt(in)`, the same on every rank.
#[test]
fn fresh_adapters_start_at_the_base() {
    let mut rng = SplitMix64::new(4);
    let m = Module::new(9, 7, 3, &mut rng);
    let x = M::rand(4, 7, &mut rng);
    let spec = Arc::new(LoraSpec {
        settings: LoraSettings { r: 3, alpha: 6.0, use_rslora: false },
        targets: LoraTargets::AllLinear,
        init: LoraInit::Fresh { seed: 1 },
    });
    let a_by_rank = on_ranks(3, Device::Cpu, |g| {
        let mut c = ColumnParallel::from_full(&Linear::new(m.w.tensor(), None).unwrap(), &g).unwrap();
        let ((), n) = attaching(spec.clone(), || c.params("model.layers.0.self_attn.q_proj", &mut |_| {}).unwrap());
        assert_eq!(n, 1);
        let s = *c.shard();
        close(
            "fresh forward",
            &c.forward(&x.tensor()).unwrap(),
            &m.forward(&x, 0.0, false).cols(s.start()..s.end()),
            1e-6,
        );
        let vals = frozen_base(|| {
            let mut ps = Vec::new();
            c.params("model.layers.0.self_attn.q_proj", &mut |p| ps.push(p)).unwrap();
            gather_full(&ps, Gather::Values, &g).unwrap()
        });
        let a = vals["model.layers.0.self_attn.q_proj.lora_A.weight"].to_f64_vec().unwrap();
        assert!(a.iter().all(|v| v.abs() <= 1.0 / 7f64.sqrt()) && a.iter().any(|v| *v != 0.0));
        assert!(vals["model.layers.0.self_attn.q_proj.lora_B.weight"].to_f64_vec().unwrap().iter().all(|v| *v == 0.0));
        a
    });
    assert!(a_by_rank.windows(2).all(|w| w[0] == w[1]));
    let _ = DType::F32;
}

/// Two adapters served in slots 1 and 2 with the base: each row of a mixed batch gets its own
/// adapter's result (against float64), and under batch invariance exactly the bits it gets in a
/// batch of its adapter alone, at every world size.
#[test]
fn a_mixed_batch_gives_each_row_its_own_adapter() {
    use tp_layers::lora::{attaching_as, detaching, with_token_adapters};
    let (t, h, out, r) = (9, 11, 14, 3);
    let mut rng = SplitMix64::new(21);
    let (col, row) = (Module::new(out, h, r, &mut rng), Module::new(h, out, r, &mut rng));
    let (col2, row2) = (Module::new(out, h, r, &mut rng), Module::new(h, out, r, &mut rng));
    let x = M::rand(t, h, &mut rng);
    let spec_of = |c: &Module, rw: &Module| {
        let mut full = BTreeMap::new();
        full.insert("c.lora_A.weight".to_string(), c.a.tensor());
        full.insert("c.lora_B.weight".to_string(), c.b.tensor());
        full.insert("r.lora_A.weight".to_string(), rw.a.tensor());
        full.insert("r.lora_B.weight".to_string(), rw.b.tensor());
        spec(r, 6.0, false, &["c", "r"], full)
    };
    let s = 6.0 / r as f64;
    let ids: Arc<[u32]> = Arc::from(vec![1, 0, 2, 2, 1, 0, 0, 2, 1]);
    // Float64: each row through its adapter (column then row layer).
    let pick = |k: u32| -> (M, M) {
        let (c, rw) = match k {
            1 => (&col, &row),
            2 => (&col2, &row2),
            _ => (&col, &row),
        };
        let y = Module { w: col.w.clone(), a: c.a.clone(), b: c.b.clone() }.forward(&x, s, k > 0);
        let z = Module { w: row.w.clone(), a: rw.a.clone(), b: rw.b.clone() }.forward(&y, s, k > 0);
        (y, z)
    };
    let want: Vec<(M, M)> = (0..3).map(pick).collect();
    for world in [1, 2, 3, 5] {
        on_ranks(world, Device::Cpu, |g| {
            tp_core::cpu::set_batch_invariant(true);
            let mut c = ColumnParallel::from_full(&Linear::new(col.w.tensor(), None).unwrap(), &g).unwrap();
            let mut rp = RowParallel::from_full(&row.w.tensor(), None, &g).unwrap();
            for (k, sp) in [(1, spec_of(&col, &row)), (2, spec_of(&col2, &row2))] {
                let ((), n) = attaching_as(k, sp, || {
                    c.params("c", &mut |_| {}).unwrap();
                    rp.params("r", &mut |_| {}).unwrap();
                });
                assert_eq!(n, 2);
            }
            let cs = *c.shard();
            let run = |c: &ColumnParallel, rp: &RowParallel, ids: Arc<[u32]>| {
                with_token_adapters(ids, || {
                    let y = c.forward(&x.tensor()).unwrap();
                    let yf = g.all_gather_balanced(&y, 1, out).unwrap();
                    (y, rp.forward_split(&yf).unwrap())
                })
            };
            let (y, z) = run(&c, &rp, ids.clone());
            let (yv, zv) = (y.to_f64_vec().unwrap(), z.to_f64_vec().unwrap());
            for (i, &k) in ids.iter().enumerate() {
                let (wy, wz) = &want[k as usize];
                let wy = wy.cols(cs.start()..cs.end()).row_block(i..i + 1);
                close(&format!("row {i} (adapter {k}) column at {world}"), &y.narrow(0, i, 1).unwrap(), &wy, 1e-5);
                close(
                    &format!("row {i} (adapter {k}) row layer at {world}"),
                    &z.narrow(0, i, 1).unwrap(),
                    &wz.row_block(i..i + 1),
                    1e-5,
                );
            }
            // A batch of one adapter alone gives its rows the same bits.
            for k in 0..3u32 {
                let (ya, za) = run(&c, &rp, Arc::from(vec![k; t]));
                let (ya, za) = (ya.to_f64_vec().unwrap(), za.to_f64_vec().unwrap());
                for i in (0..t).filter(|&i| ids[i] == k) {
                    assert_eq!(ya[i * cs.len()..(i + 1) * cs.len()], yv[i * cs.len()..(i + 1) * cs.len()], "row {i}");
                    assert_eq!(za[i * h..(i + 1) * h], zv[i * h..(i + 1) * h], "row {i}");
                }
            }
            // Detached, slot 2 adds nothing: its rows are the base's.
            detaching(2, || {
                c.params("c", &mut |_| {}).unwrap();
                rp.params("r", &mut |_| {}).unwrap();
            });
            let (y2, _) = run(&c, &rp, Arc::from(vec![2; t]));
            let (y0, _) = run(&c, &rp, Arc::from(vec![0; t]));
            assert_eq!(y2.to_f64_vec().unwrap(), y0.to_f64_vec().unwrap());
            assert_eq!(c.local().lora().unwrap().slots(), vec![1]);
        });
    }
}

/// An MLP that takes its rows in passes (as the host does for long batches) gives each pass's
/// rows their own adapters: the same result as in one pass, at world sizes 1-3.
#[test]
fn an_mlp_in_passes_keeps_each_rows_adapter() {
    use tp_layers::lora::{attaching_as, with_token_adapters};
    use tp_layers::{MlpNames, ParallelMlp};
    let (t, h, inter, r) = (40, 12, 20, 2);
    let mut rng = SplitMix64::new(31);
    let (gate, up, down) =
        (Module::new(inter, h, r, &mut rng), Module::new(inter, h, r, &mut rng), Module::new(h, inter, r, &mut rng));
    let x = M::rand(t, h, &mut rng);
    let mut full = BTreeMap::new();
    for (name, m) in [("gate_proj", &gate), ("up_proj", &up), ("down_proj", &down)] {
        full.insert(format!("mlp.{name}.lora_A.weight"), m.a.tensor());
        full.insert(format!("mlp.{name}.lora_B.weight"), m.b.tensor());
    }
    let spec = spec(r, 4.0, false, &["gate_proj", "up_proj", "down_proj"], full);
    let ids: Arc<[u32]> = (0..t).map(|i| [1, 0, 1, 1, 0][i % 5]).collect::<Vec<u32>>().into();
    for world in 1..=3 {
        on_ranks(world, Device::Cpu, |g| {
            tp_core::cpu::set_batch_invariant(true);
            let lin = |m: &Module| Linear::new(m.w.tensor(), None).unwrap();
            let mut mlp =
                ParallelMlp::from_full(&lin(&gate), &lin(&up), &lin(&down), tp_core::Activation::Silu, &g).unwrap();
            let ((), n) =
                attaching_as(1, spec.clone(), || mlp.params("mlp", MlpNames::default(), &mut |_| {}).unwrap());
            assert_eq!(n, 3);
            let xt = x.tensor();
            let one = with_token_adapters(ids.clone(), || mlp.forward_in_passes(&xt, usize::MAX)).unwrap();
            // Passes of 16 rows.
            let passes = with_token_adapters(ids.clone(), || mlp.forward_in_passes(&xt, 16 * 2 * inter * 4)).unwrap();
            assert_eq!(one.to_f64_vec().unwrap(), passes.to_f64_vec().unwrap(), "world {world}");
            let base = mlp.forward_in_passes(&xt, usize::MAX).unwrap();
            assert_ne!(one.to_f64_vec().unwrap(), base.to_f64_vec().unwrap());
        });
    }
}

/// Dropout on the adapters' input (PEFT's `lora_dropout`): the forward and backward against
/// float64 on the input times `dropout_factor`'s mask, at world sizes 1 and 3 (the masks follow
/// global columns, so every TP degree drops the same elements), and nothing dropped outside
/// `with_dropout`.
#[test]
fn dropout_masks_the_adapters_input_the_same_at_every_world_size() {
    use tp_layers::lora::{dropout_factor, with_dropout};
    let (t, h, out, r, p, seed) = (6, 10, 14, 2, 0.3f32, 77u64);
    let mut rng = SplitMix64::new(41);
    let (col, row) = (Module::new(out, h, r, &mut rng), Module::new(h, out, r, &mut rng));
    let (x, x2, gc, gr) =
        (M::rand(t, h, &mut rng), M::rand(t, out, &mut rng), M::rand(t, out, &mut rng), M::rand(t, h, &mut rng));
    let s = 4.0 / r as f64;
    let mut full = BTreeMap::new();
    full.insert("c.lora_A.weight".to_string(), col.a.tensor());
    full.insert("c.lora_B.weight".to_string(), col.b.tensor());
    full.insert("r.lora_A.weight".to_string(), row.a.tensor());
    full.insert("r.lora_B.weight".to_string(), row.b.tensor());
    let spec = spec(r, 4.0, false, &["c", "r"], full);
    let masked = |m: &M, module: &str| M {
        rows: m.rows,
        cols: m.cols,
        v: (0..m.v.len())
            .map(|i| m.v[i] * f64::from(dropout_factor(seed, module, i / m.cols, i % m.cols, p)))
            .collect(),
    };
    let (xd, x2d) = (masked(&x, "c"), masked(&x2, "r"));
    let dropped = (0..t * h).filter(|&i| dropout_factor(seed, "c", i / h, i % h, p) == 0.0).count();
    assert!(dropped > 0 && dropped < t * h, "{dropped} of {} dropped", t * h);
    // y = x W^T + s (x_d A^T) B^T; dA = du^T x_d, dB = s dY^T (x_d A^T), dx = dY W + (du A) ⊙ mask.
    let want_y = x.mul_t(&col.w).add(&xd.mul_t(&col.a).mul_t(&col.b).scale(s));
    let du = gc.mul(&col.b).scale(s);
    let want_dx = masked(&du.mul(&col.a), "c").add(&gc.mul(&col.w));
    let (want_da, want_db) = (du.t().mul(&xd), gc.t().mul(&xd.mul_t(&col.a)).scale(s));
    let du_r = gr.mul(&row.b).scale(s);
    let want_dx2 = masked(&du_r.mul(&row.a), "r").add(&gr.mul(&row.w));
    let (want_da2, want_db2) = (du_r.t().mul(&x2d), gr.t().mul(&x2d.mul_t(&row.a)).scale(s));
    for world in [1, 3] {
        on_ranks(world, Device::Cpu, |g| {
            let mut c = ColumnParallel::from_full(&Linear::new(col.w.tensor(), None).unwrap(), &g).unwrap();
            let mut rp = RowParallel::from_full(&row.w.tensor(), None, &g).unwrap();
            attaching(spec.clone(), || {
                c.params("c", &mut |_| {}).unwrap();
                rp.params("r", &mut |_| {}).unwrap();
            });
            let (cs, rs) = (*c.shard(), *rp.shard());
            let at = |w: &str| format!("{w} at {world}");
            let y = with_dropout(seed, p, || c.forward(&x.tensor()).unwrap());
            close(&at("forward"), &y, &want_y.cols(cs.start()..cs.end()), 1e-5);
            let (dx, dx2) = frozen_base(|| {
                with_dropout(seed, p, || {
                    let x2_local = x2.cols(rs.start()..rs.end()).tensor();
                    (
                        c.backward(&x.tensor(), &gc.cols(cs.start()..cs.end()).tensor()).unwrap(),
                        rp.backward(&x2_local, &gr.tensor()).unwrap(),
                    )
                })
            });
            close(&at("column dX"), &dx, &want_dx, 1e-5);
            close(&at("row dX"), &dx2, &want_dx2.cols(rs.start()..rs.end()), 1e-5);
            let grads = frozen_base(|| {
                let mut ps = Vec::new();
                c.params("c", &mut |p| ps.push(p)).unwrap();
                rp.params("r", &mut |p| ps.push(p)).unwrap();
                adapter_grads(&mut ps, &g)
            });
            close(&at("column dA"), &grads["c.lora_A.weight"], &want_da, 1e-5);
            close(&at("column dB"), &grads["c.lora_B.weight"], &want_db, 1e-5);
            close(&at("row dA"), &grads["r.lora_A.weight"], &want_da2, 1e-5);
            close(&at("row dB"), &grads["r.lora_B.weight"], &want_db2, 1e-5);
            // Outside with_dropout (serving, evaluation) nothing is dropped.
            let plain = c.forward(&x.tensor()).unwrap();
            close(&at("no dropout"), &plain, &col.forward(&x, s, true).cols(cs.start()..cs.end()), 1e-5);
        });
    }
}
