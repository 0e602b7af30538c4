//! Checks of the paged-cache ops ([`Tensor::paged_attention`], [`Tensor::write_slots`])
//! against independent float64 references, written once for every device (the GPU suite calls
//! them with `Device::Cuda(0)`).
//!
//! Each check builds caches whose every row outside the sequences' valid positions holds junk
//! (1e4): a read of a wrong block, of a position past `kv_len` or of another sequence's rows
//! shows in the output.

use super::f64s;
use tp_core::rng::SplitMix64;
use tp_core::{AttentionSpec, DType, Device, KvGroups, PagedAttentionSpec, PagedSeq, Tensor};
use tp_testing::reference::ops::{Attn, attention_f64, ulp};

/// Junk held by every cache row no sequence owns.
const JUNK: f64 = 1e4;

fn on(t: &Tensor, device: Device) -> Tensor {
    t.to_device(&device).expect("to device")
}

/// `n` distinct block ids of `0..num_blocks`, shuffled (Fisher-Yates on SplitMix64).
pub fn shuffled_blocks(num_blocks: usize, n: usize, seed: u64) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    let mut rng = SplitMix64::new(seed);
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.int_in(0, i as i64) as usize);
    }
    ids.truncate(n);
    ids
}

/// One sequence of a test batch: `q_len` query rows at the end of `kv_len` positions.
#[derive(Debug, Clone, Copy)]
pub struct SeqCase {
    pub q_len: usize,
    pub kv_len: usize,
}

/// A batch laid out in caches: each sequence's keys/values (`[kv_len, hkv, d]`, f64 of `dtype`
/// values), its block table and its first query row.
pub struct PagedBatch {
    pub k_cache: Tensor,
    pub v_cache: Tensor,
    pub q: Tensor,
    pub tables: Vec<Vec<u32>>,
    pub q_starts: Vec<usize>,
    pub keys: Vec<(Vec<f64>, Vec<f64>)>,
}

impl PagedBatch {
    /// Random data for `cases` in caches of `block_size`, each sequence's blocks drawn from a
    /// shuffled pool (one spare block per table past what `kv_len` needs, left as junk). Query
    /// rows are laid out in reverse sequence order, so `q_start` and the sequence index differ.
    pub fn random(
        cases: &[SeqCase],
        block_size: usize,
        (hq, hkv, d): (usize, usize, usize),
        dtype: DType,
        seed: u64,
    ) -> Self {
        let cpu = Device::Cpu;
        let need: Vec<usize> = cases.iter().map(|c| c.kv_len.div_ceil(block_size) + 1).collect();
        let num_blocks = need.iter().sum::<usize>() + 3;
        let pool = shuffled_blocks(num_blocks, num_blocks, seed);
        let row = hkv * d;
        let (mut kc, mut vc) = (vec![JUNK; num_blocks * block_size * row], vec![JUNK; num_blocks * block_size * row]);
        let (mut tables, mut keys) = (Vec::new(), Vec::new());
        let mut used = 0;
        for (i, c) in cases.iter().enumerate() {
            let table = pool[used..used + need[i]].to_vec();
            used += need[i];
            let s = seed + 100 * i as u64;
            let k = f64s(&Tensor::randn(&[c.kv_len, hkv, d], dtype, s + 1, &cpu).unwrap());
            let v = f64s(&Tensor::randn(&[c.kv_len, hkv, d], dtype, s + 2, &cpu).unwrap());
            for p in 0..c.kv_len {
                let slot = table[p / block_size] as usize * block_size + p % block_size;
                kc[slot * row..][..row].copy_from_slice(&k[p * row..][..row]);
                vc[slot * row..][..row].copy_from_slice(&v[p * row..][..row]);
            }
            tables.push(table);
            keys.push((k, v));
        }
        let dims = [num_blocks, block_size, hkv, d];
        let k_cache = Tensor::from_fn_f64(&dims, dtype, &cpu, |i| kc[i]).unwrap();
        let v_cache = Tensor::from_fn_f64(&dims, dtype, &cpu, |i| vc[i]).unwrap();
        let mut q_starts = vec![0; cases.len()];
        let mut next = 0;
        for i in (0..cases.len()).rev() {
            q_starts[i] = next;
            next += cases[i].q_len;
        }
        let q = Tensor::randn(&[next, hq, d], dtype, seed + 7, &cpu).unwrap();
        PagedBatch { k_cache, v_cache, q, tables, q_starts, keys }
    }

    /// The batch's [`PagedSeq`]s.
    pub fn seqs(&self, cases: &[SeqCase]) -> Vec<PagedSeq<'_>> {
        cases
            .iter()
            .enumerate()
            .map(|(i, c)| PagedSeq {
                q_start: self.q_starts[i],
                q_len: c.q_len,
                kv_len: c.kv_len,
                blocks: &self.tables[i],
            })
            .collect()
    }
}

/// Paged attention of a mixed batch (decodes, whole prefills, chunked-prefill continuations)
/// on `device` against the f64 reference of each sequence alone on its contiguous keys; then
/// each sequence run alone must give bitwise the rows it gave in the batch (batch invariance).
/// With `sinks`, every query head has an attention-sink logit (gpt-oss).
#[allow(clippy::too_many_arguments)]
pub fn check_paged_attention(
    device: Device,
    cases: &[SeqCase],
    block_size: usize,
    (hq, hkv, d): (usize, usize, usize),
    (window, sinks): (Option<usize>, bool),
    kv_groups: Option<KvGroups>,
    dtype: DType,
    seed: u64,
) {
    let b = PagedBatch::random(cases, block_size, (hq, hkv, d), dtype, seed);
    let sinks: Option<Vec<f32>> = sinks.then(|| (0..hq).map(|h| [2.5, -0.7, 0.0, -30.0, 6.0][h % 5]).collect());
    let spec = PagedAttentionSpec {
        scale: 1.0 / (d as f32).sqrt(),
        sliding_window: window,
        kv_groups,
        sinks: sinks.as_deref().map(Into::into),
    };
    let (kc, vc) = (on(&b.k_cache, device), on(&b.v_cache, device));
    let seqs = b.seqs(cases);
    let y = on(&b.q, device).paged_attention(&kc, &vc, &seqs, &spec).unwrap();
    assert_eq!((y.dims(), y.dtype()), (b.q.dims(), dtype));
    let (got, q) = (f64s(&y), f64s(&b.q));
    let what = format!(
        "paged attention {device} bs{block_size} hq{hq} hkv{hkv} d{d} w{window:?} sinks {} {kv_groups:?} {dtype}",
        sinks.is_some()
    );
    let width = hq * d;
    for (i, c) in cases.iter().enumerate() {
        let rows = b.q_starts[i] * width..(b.q_starts[i] + c.q_len) * width;
        let attn = Attn {
            t: c.q_len,
            hq,
            hkv,
            d,
            kv_len: c.kv_len,
            scale: f64::from(spec.scale),
            window,
            kv_groups,
            sinks: sinks.as_ref().map(|s| s.iter().map(|&x| f64::from(x)).collect()),
        };
        let want = attention_f64(&q[rows.clone()], &b.keys[i].0, &b.keys[i].1, &attn);
        // f32 scores of D products, softmax and a weighted sum: a few e-6, plus the output
        // rounding (as the contiguous attention's check).
        let tol = |j: usize| 2e-5 * (1.0 + (d as f64).sqrt()) + 2.0 * ulp(dtype, want[j]);
        super::assert_close(&format!("{what} seq {i} {c:?}"), &got[rows.clone()], &want, tol);
        // Alone, as a batch of one: bitwise the batch's rows.
        let alone_q = b.q.narrow(0, b.q_starts[i], c.q_len).unwrap();
        let alone = [PagedSeq { q_start: 0, ..seqs[i] }];
        let y1 = on(&alone_q, device).paged_attention(&kc, &vc, &alone, &spec).unwrap();
        assert_eq!(f64s(&y1), got[rows].to_vec(), "{what}: seq {i} alone differs from the batch");
    }
}

/// The paged kernel on an identity-like table equals the contiguous attention bit for bit:
/// both run the same per-row arithmetic.
pub fn check_paged_equals_contiguous(
    device: Device,
    block_size: usize,
    (hq, hkv, d): (usize, usize, usize),
    dtype: DType,
) {
    let case = [SeqCase { q_len: 5, kv_len: 3 * block_size + 2 }];
    let b = PagedBatch::random(&case, block_size, (hq, hkv, d), dtype, 91 + d as u64);
    let (k, v) = &b.keys[0];
    let dims = [case[0].kv_len, hkv, d];
    let kt = Tensor::from_fn_f64(&dims, dtype, &Device::Cpu, |i| k[i]).unwrap();
    let vt = Tensor::from_fn_f64(&dims, dtype, &Device::Cpu, |i| v[i]).unwrap();
    let spec = AttentionSpec::causal(case[0].kv_len, d);
    let want = on(&b.q, device).attention(&on(&kt, device), &on(&vt, device), &spec).unwrap();
    let pspec = PagedAttentionSpec { scale: spec.scale, sliding_window: None, kv_groups: None, sinks: None };
    let got = on(&b.q, device)
        .paged_attention(&on(&b.k_cache, device), &on(&b.v_cache, device), &b.seqs(&case), &pspec)
        .unwrap();
    assert_eq!(f64s(&got), f64s(&want), "paged vs contiguous attention, bs{block_size} d{d} {dtype}");
}

/// Bad batches are typed errors, never a launch that reads outside the caches.
pub fn check_paged_attention_refuses_bad_batches(device: Device) {
    let case = [SeqCase { q_len: 2, kv_len: 5 }];
    let b = PagedBatch::random(&case, 4, (2, 1, 8), DType::F32, 5);
    let (q, kc, vc) = (on(&b.q, device), on(&b.k_cache, device), on(&b.v_cache, device));
    let spec = PagedAttentionSpec { scale: 0.5, sliding_window: None, kv_groups: None, sinks: None };
    let table = &b.tables[0];
    let bad_block = [table[0], 10_000];
    let attempts: [(&str, Vec<PagedSeq<'_>>); 4] = [
        ("uncovered row", vec![PagedSeq { q_start: 0, q_len: 1, kv_len: 5, blocks: table }]),
        ("short table", vec![PagedSeq { q_start: 0, q_len: 2, kv_len: 5, blocks: &table[..1] }]),
        ("block past the cache", vec![PagedSeq { q_start: 0, q_len: 2, kv_len: 5, blocks: &bad_block }]),
        ("more rows than positions", vec![PagedSeq { q_start: 0, q_len: 2, kv_len: 1, blocks: table }]),
    ];
    for (what, seqs) in attempts {
        assert!(q.paged_attention(&kc, &vc, &seqs, &spec).is_err(), "{what} was accepted");
    }
    let wrong = on(&Tensor::zeros(&[3, 4, 1, 8], DType::F32, &Device::Cpu).unwrap(), device);
    assert!(q.paged_attention(&kc, &wrong, &b.seqs(&case), &spec).is_err(), "caches of two shapes");
}

/// `write_slots` of `t` rows into random distinct slots against the host copy with those rows
/// replaced (bitwise); a clone taken before the write keeps the old contents; duplicate or
/// out-of-range slots are errors that leave the cache as it was.
pub fn check_write_slots(
    device: Device,
    (num_blocks, block_size, h, d): (usize, usize, usize, usize),
    t: usize,
    dtype: DType,
) {
    let cpu = Device::Cpu;
    let seed = (num_blocks * 31 + block_size * 7 + d) as u64;
    let cache = Tensor::randn(&[num_blocks, block_size, h, d], dtype, seed, &cpu).unwrap();
    let src = Tensor::randn(&[t, h, d], dtype, seed + 1, &cpu).unwrap();
    let free: Vec<usize> =
        shuffled_blocks(num_blocks * block_size, t, seed + 2).into_iter().map(|s| s as usize).collect();
    let (mut want, row) = (f64s(&cache), h * d);
    let s = f64s(&src);
    for (i, &slot) in free.iter().enumerate() {
        want[slot * row..][..row].copy_from_slice(&s[i * row..][..row]);
    }
    let before = on(&cache, device);
    let mut dev = before.clone();
    let src_dev = on(&src, device);
    dev.write_slots(&src_dev, &free).unwrap();
    let what = format!("write_slots {device} {num_blocks}x{block_size}x{h}x{d} t{t} {dtype}");
    assert_eq!(f64s(&dev), want, "{what}");
    assert_eq!(f64s(&before), f64s(&cache), "{what}: the clone taken before the write changed");
    if t >= 2 {
        let mut dup = free.clone();
        dup[1] = dup[0];
        assert!(dev.write_slots(&src_dev, &dup).is_err(), "{what}: duplicate slots accepted");
        let mut past = free.clone();
        past[t - 1] = num_blocks * block_size;
        assert!(dev.write_slots(&src_dev, &past).is_err(), "{what}: a slot past the cache accepted");
        assert!(dev.write_slots(&src_dev, &free[1..]).is_err(), "{what}: fewer slots than rows accepted");
        assert_eq!(f64s(&dev), want, "{what}: a refused write changed the cache");
    }
}
