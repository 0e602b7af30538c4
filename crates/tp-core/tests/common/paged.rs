//! Checks of paged attention and slot writes against an independent float64 reference (each
//! sequence's keys gathered through its block table into one contiguous cache, then the f64
//! attention of tp-testing), written once and run on every device: the host suite calls them
//! with `Device::Cpu`.

use super::decoder::{Attn, attention_f64, ulp};
use super::{assert_close, f64s};
use tp_core::rng::SplitMix64;
use tp_core::{DType, Device, KvGroups, PagedAttentionSpec, PagedSeq, Tensor};

/// One batch: its sequences (`(context, q_len)` each: positions already cached, rows fed now),
/// the cache geometry, the attention's options.
#[derive(Debug, Clone)]
pub struct PagedCase {
    /// `(context, q_len)` of each sequence, in row order.
    pub seqs: Vec<(usize, usize)>,
    /// Positions per block.
    pub block_size: usize,
    /// Query heads, KV heads, head size.
    pub heads: (usize, usize, usize),
    /// Sliding window, if any.
    pub window: Option<usize>,
    /// A grouping that starts mid-group, if any.
    pub groups: Option<KvGroups>,
    /// Attention-sink logits, one per query head, if any.
    pub sinks: Option<Vec<f32>>,
    /// Blocks beyond those the sequences use (junk the op must never read).
    pub spare_blocks: usize,
    /// Dtype of q and the caches.
    pub dtype: DType,
    /// Seed of the data and of the block shuffle.
    pub seed: u64,
}

/// A built case: tensors on the host, each sequence's rows and block table.
pub struct Built {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    /// `(q_start, q_len, kv_len, blocks)` per sequence.
    pub seqs: Vec<(usize, usize, usize, Vec<u32>)>,
    pub spec: PagedAttentionSpec,
}

impl Built {
    /// The sequences as the op takes them, listed in `order` (any order: rows are found by
    /// `q_start`).
    pub fn paged(&self, order: &[usize]) -> Vec<PagedSeq<'_>> {
        order
            .iter()
            .map(|&i| {
                let (q_start, q_len, kv_len, blocks) = &self.seqs[i];
                PagedSeq { q_start: *q_start, q_len: *q_len, kv_len: *kv_len, blocks }
            })
            .collect()
    }
}

/// Value of every cache slot no sequence owns: any read of it shows in the output.
const JUNK: f64 = 1e4;

/// Builds `c`: block ids drawn from a shuffled pool (non-contiguous, out of order), random keys
/// and values at every owned position, junk everywhere else.
pub fn build(c: &PagedCase) -> Built {
    let (hq, hkv, d) = c.heads;
    let bs = c.block_size;
    let needed: usize = c.seqs.iter().map(|&(ctx, n)| (ctx + n).div_ceil(bs)).sum();
    let num_blocks = needed + c.spare_blocks;
    let mut rng = SplitMix64::new(c.seed);
    let mut pool: Vec<u32> = (0..num_blocks as u32).collect();
    for i in (1..pool.len()).rev() {
        pool.swap(i, rng.int_in(0, i as i64) as usize);
    }
    let mut owned = vec![false; num_blocks * bs];
    let (mut seqs, mut q_start) = (Vec::new(), 0);
    for &(ctx, n) in &c.seqs {
        let kv_len = ctx + n;
        let blocks: Vec<u32> = pool.drain(..kv_len.div_ceil(bs)).collect();
        for p in 0..kv_len {
            owned[blocks[p / bs] as usize * bs + p % bs] = true;
        }
        seqs.push((q_start, n, kv_len, blocks));
        q_start += n;
    }
    let row = hkv * d;
    let cpu = Device::Cpu;
    let owned = &owned;
    let mut fill = |_| {
        let mut r = SplitMix64::new(rng.next_u64());
        move |i: usize| if owned[i / row] { r.normal() } else { JUNK }
    };
    let dims = [num_blocks, bs, hkv, d];
    let k = Tensor::from_fn_f64(&dims, c.dtype, &cpu, fill(0)).unwrap();
    let v = Tensor::from_fn_f64(&dims, c.dtype, &cpu, fill(1)).unwrap();
    let q = Tensor::randn(&[q_start, hq, d], c.dtype, c.seed + 7, &cpu).unwrap();
    let spec = PagedAttentionSpec {
        scale: 1.0 / (d as f32).sqrt(),
        sliding_window: c.window,
        kv_groups: c.groups,
        sinks: c.sinks.as_deref().map(Into::into),
    };
    Built { q, k, v, seqs, spec }
}

/// The f64 reference: each sequence's keys and values gathered in position order, then causal
/// attention of its rows over them.
pub fn reference(b: &Built, heads: (usize, usize, usize)) -> Vec<f64> {
    let (hq, hkv, d) = heads;
    let bs = b.k.dims()[1];
    let (q, k, v) = (f64s(&b.q), f64s(&b.k), f64s(&b.v));
    let mut out = vec![0.0; q.len()];
    for (q_start, q_len, kv_len, blocks) in &b.seqs {
        let gather = |src: &[f64]| -> Vec<f64> {
            (0..*kv_len)
                .flat_map(|p| src[(blocks[p / bs] as usize * bs + p % bs) * hkv * d..][..hkv * d].to_vec())
                .collect()
        };
        let a = Attn {
            t: *q_len,
            hq,
            hkv,
            d,
            kv_len: *kv_len,
            scale: f64::from(b.spec.scale),
            window: b.spec.sliding_window,
            kv_groups: b.spec.kv_groups,
            sinks: b.spec.sinks.as_ref().map(|s| s.iter().map(|&x| f64::from(x)).collect()),
        };
        let rows = &q[q_start * hq * d..(q_start + q_len) * hq * d];
        let y = attention_f64(rows, &gather(&k), &gather(&v), &a);
        out[q_start * hq * d..(q_start + q_len) * hq * d].copy_from_slice(&y);
    }
    out
}

/// Paged attention of case `c` on `device` (sequences listed in reverse) against the f64
/// reference, every element.
pub fn check_paged_attention(device: Device, c: &PagedCase) {
    let b = build(c);
    let on = |t: &Tensor| t.to_device(&device).unwrap();
    let order: Vec<usize> = (0..b.seqs.len()).rev().collect();
    let y = on(&b.q).paged_attention(&on(&b.k), &on(&b.v), &b.paged(&order), &b.spec).unwrap();
    assert_eq!((y.dims(), y.dtype()), (b.q.dims(), c.dtype));
    let want = reference(&b, c.heads);
    let d = c.heads.2;
    let tol = |i: usize| 2e-5 * (1.0 + (d as f64).sqrt()) + 2.0 * ulp(c.dtype, want[i]);
    assert_close(&format!("paged attention {device} {c:?}"), &f64s(&y), &want, tol);
}

/// Each sequence of case `c` run alone (its rows only, at row 0) gives bitwise the rows it gets
/// in the batch, on `device`.
pub fn check_batch_invariance(device: Device, c: &PagedCase) {
    let b = build(c);
    let on = |t: &Tensor| t.to_device(&device).unwrap();
    let (k, v) = (on(&b.k), on(&b.v));
    let all: Vec<usize> = (0..b.seqs.len()).collect();
    let bytes = |t: Tensor| t.to_device(&Device::Cpu).unwrap().as_bytes().unwrap().to_vec();
    let batch = bytes(on(&b.q).paged_attention(&k, &v, &b.paged(&all), &b.spec).unwrap());
    let (hq, _, d) = c.heads;
    let row = hq * d * c.dtype.size_in_bytes();
    for (i, (q_start, q_len, kv_len, blocks)) in b.seqs.iter().enumerate() {
        let q = on(&b.q.narrow(0, *q_start, *q_len).unwrap());
        let alone = [PagedSeq { q_start: 0, q_len: *q_len, kv_len: *kv_len, blocks }];
        let y = bytes(q.paged_attention(&k, &v, &alone, &b.spec).unwrap());
        assert!(
            y == batch[q_start * row..(q_start + q_len) * row],
            "{device} sequence {i} of {c:?}: alone differs from in the batch"
        );
    }
}
