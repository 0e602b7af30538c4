//! Checks of the decoder ops (RMSNorm, RoPE, attention, embedding, argmax, add, slice_set)
//! against independent float64 references, written once and run on every device: the host
//! suite calls them with `Device::Cpu`, the GPU suite with `Device::Cuda(0)`.

use super::{assert_close, f64s};
use tp_core::{AttentionSpec, DType, Device, RopeScaling, RotaryEmbedding, Tensor};
#[allow(unused_imports)] // each test binary uses some
pub use tp_testing::reference::ops::{
    Attn, attention_f64, attention_factor_f64, inv_freq_f64, inv_freq_f64_at, norm_row, rotate, round_to, rstd, ulp,
};

fn on(t: &Tensor, device: Device) -> Tensor {
    t.to_device(&device).expect("to device")
}

/// RMSNorm against the f64 computation rounded at Hugging Face's two points: within one ulp in
/// f16/bf16, a few f32 ulps in f32 (where the normalisation itself is f32).
pub fn check_rms_norm(device: Device, rows: usize, h: usize, dtype: DType, seed: u64) {
    let x = Tensor::randn(&[rows, h], dtype, seed, &Device::Cpu).unwrap();
    let w = Tensor::rand(&[h], dtype, seed + 1, &Device::Cpu).unwrap();
    let eps = 1e-5;
    let y = on(&x, device).rms_norm(&on(&w, device), eps).unwrap();
    assert_eq!((y.dims(), y.dtype()), (x.dims(), dtype));
    let (xv, wv) = (f64s(&x), f64s(&w));
    let mut want = Vec::with_capacity(rows * h);
    for row in xv.chunks(h) {
        let r = rstd(row.iter().map(|v| v * v).sum(), h, eps);
        want.extend(norm_row(row, &wv, r, tp_core::NormStyle::Weight, Some(dtype)));
    }
    let ulps = if dtype == DType::F32 { 8.0 } else { 1.0 };
    assert_close(&format!("rms_norm {device} {rows}x{h} {dtype}"), &f64s(&y), &want, |i| ulps * ulp(dtype, want[i]));
}

/// LongRoPE for heads of `d`: per-pair factors growing from 1, the long ones twice the short,
/// original length 64 (positions past 63 take the long factors), attention factor 1.2.
pub fn longrope(d: usize) -> RopeScaling {
    let pairs = d / 2;
    let short: Vec<f64> = (0..pairs).map(|i| 1.0 + i as f64 / pairs as f64).collect();
    RopeScaling::LongRope {
        long_factor: short.iter().map(|f| 2.0 * f).collect(),
        short_factor: short,
        original_max_position_embeddings: 64.0,
        attention_factor: 1.2,
    }
}

/// RoPE on `[tokens, heads, d]` at `positions` against the f64 rotation (times YaRN's attention
/// factor, with dynamic scaling's frequencies for `max(positions) + 1` tokens). The bound covers
/// the four roundings to the dtype (cos/sin, both products, the sum), the f32 angle and the f32
/// frequencies (dynamic scaling's f32 base loses up to `~factor` ulps to cancellation), and the
/// f32 product with the attention factor.
pub fn check_rope(
    device: Device,
    positions: &[usize],
    heads: usize,
    d: usize,
    scaling: RopeScaling,
    dtype: DType,
    seed: u64,
) {
    check_partial_rope(device, positions, heads, (d, d), scaling, dtype, seed);
}

/// [`check_rope`] on heads of `d` features of which the first `r` rotate (partial rotary); the
/// other `d - r` must come out bit for bit as they went in.
#[allow(clippy::too_many_arguments)]
pub fn check_partial_rope(
    device: Device,
    positions: &[usize],
    heads: usize,
    (d, r): (usize, usize),
    scaling: RopeScaling,
    dtype: DType,
    seed: u64,
) {
    let theta = 500_000.0;
    let rope = RotaryEmbedding::new(r, theta, scaling.clone()).unwrap();
    let t = positions.len();
    let x = Tensor::randn(&[t, heads, d], dtype, seed, &Device::Cpu).unwrap();
    let y = on(&x, device).rope(positions, &rope).unwrap();
    assert_eq!((y.dims(), y.dtype()), (x.dims(), dtype));
    let seq_len = positions.iter().max().map_or(0, |p| p + 1);
    let (xv, freq) = (f64s(&x), inv_freq_f64_at(r, theta, &scaling, seq_len));
    let m = attention_factor_f64(&scaling);
    let freq_ulps = match scaling {
        RopeScaling::Dynamic { factor, .. } => 8.0 + 4.0 * factor,
        _ => 8.0,
    };
    let mut want = xv.clone();
    rotate(&mut want, positions, (heads, d), &freq, m);
    let (half, u, u32) = (r / 2, dtype.unit_roundoff(), 2f64.powi(-24));
    let mut tol = vec![0.0; xv.len()];
    for (tok, &p) in positions.iter().enumerate() {
        for h in 0..heads {
            let base = (tok * heads + h) * d;
            for i in 0..half {
                let angle = p as f64 * freq[i];
                let (x1, x2) = (xv[base + i], xv[base + half + i]);
                let bound =
                    m * (x1.abs() + x2.abs()) * (5.0 * u + 2.0 * u32 + freq_ulps * u32 * (1.0 + angle.abs())) + 1e-30;
                tol[base + i] = bound + ulp(dtype, want[base + i]);
                tol[base + half + i] = bound + ulp(dtype, want[base + half + i]);
            }
        }
    }
    assert_close(
        &format!("rope {device} {positions:?} h{heads} d{d} r{r} {scaling:?} {dtype}"),
        &f64s(&y),
        &want,
        |i| tol[i],
    );
}

/// Attention of `t` queries over a cache of `cap >= kv_len` rows (rows past `kv_len` hold
/// garbage that must not be read) against the f64 reference.
#[allow(clippy::too_many_arguments)]
pub fn check_attention(
    device: Device,
    t: usize,
    kv_len: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    window: Option<usize>,
    dtype: DType,
    seed: u64,
) {
    let spec =
        AttentionSpec { kv_len, scale: 1.0 / (d as f32).sqrt(), sliding_window: window, kv_groups: None, sinks: None };
    check_attention_spec(device, t, (hq, hkv, d), &spec, dtype, seed);
}

/// [`check_attention`] with any spec, e.g. query heads that start inside a KV group.
pub fn check_attention_spec(
    device: Device,
    t: usize,
    (hq, hkv, d): (usize, usize, usize),
    spec: &AttentionSpec,
    dtype: DType,
    seed: u64,
) {
    let (kv_len, window) = (spec.kv_len, spec.sliding_window);
    let cap = kv_len + 3;
    let cpu = Device::Cpu;
    let q = Tensor::randn(&[t, hq, d], dtype, seed, &cpu).unwrap();
    let mut k = Tensor::randn(&[cap, hkv, d], dtype, seed + 1, &cpu).unwrap();
    let mut v = Tensor::randn(&[cap, hkv, d], dtype, seed + 2, &cpu).unwrap();
    // Garbage (huge values) past kv_len: any read of it shows in the output.
    let junk = Tensor::from_fn_f64(&[3, hkv, d], dtype, &cpu, |_| 1e4).unwrap();
    k.slice_set(&junk, 0, kv_len).unwrap();
    v.slice_set(&junk, 0, kv_len).unwrap();
    let y = on(&q, device).attention(&on(&k, device), &on(&v, device), spec).unwrap();
    assert_eq!((y.dims(), y.dtype()), (q.dims(), dtype));
    let want = attention_f64(&f64s(&q), &f64s(&k), &f64s(&v), &Attn::of_spec(t, (hq, hkv, d), spec));
    // f32 scores of D products, softmax and a weighted sum of |v| <= ~5: a few e-6 in f32,
    // plus the output rounding and the inputs' own dtype.
    let tol = |i: usize| 2e-5 * (1.0 + (d as f64).sqrt()) + 2.0 * ulp(dtype, want[i]);
    assert_close(
        &format!("attention {device} t{t} L{kv_len} hq{hq} hkv{hkv} d{d} w{window:?} {:?} {dtype}", spec.kv_groups),
        &f64s(&y),
        &want,
        tol,
    );
}

/// A prefill of `t` tokens through a cache equals `t` single-token decode steps, each appending
/// its key and value to the cache first (f32, so only summation order differs).
pub fn check_prefill_equals_decode(device: Device, t: usize, hq: usize, hkv: usize, d: usize) {
    let cpu = Device::Cpu;
    let q = Tensor::randn(&[t, hq, d], DType::F32, 11, &cpu).unwrap();
    let k = Tensor::randn(&[t, hkv, d], DType::F32, 12, &cpu).unwrap();
    let v = Tensor::randn(&[t, hkv, d], DType::F32, 13, &cpu).unwrap();
    let (q, k, v) = (on(&q, device), on(&k, device), on(&v, device));
    let prefill = q.attention(&k, &v, &AttentionSpec::causal(t, d)).unwrap();
    let mut kc = Tensor::zeros(&[t, hkv, d], DType::F32, &device).unwrap();
    let mut vc = kc.clone();
    let mut steps = Vec::new();
    for i in 0..t {
        kc.slice_set(&k.narrow(0, i, 1).unwrap(), 0, i).unwrap();
        vc.slice_set(&v.narrow(0, i, 1).unwrap(), 0, i).unwrap();
        steps.push(q.narrow(0, i, 1).unwrap().attention(&kc, &vc, &AttentionSpec::causal(i + 1, d)).unwrap());
    }
    let decoded = Tensor::cat(&steps, 0).unwrap();
    let want = f64s(&prefill);
    assert_close(&format!("prefill vs decode {device} t{t} hq{hq} hkv{hkv} d{d}"), &f64s(&decoded), &want, |i| {
        1e-5 * (1.0 + want[i].abs())
    });
}

/// Vocab-parallel lookups: each shard's rows where the id is local, zeros elsewhere; the sum
/// over shards equals the full table's rows, bit for bit. Ids in both integer dtypes.
pub fn check_embedding(device: Device, vocab: usize, h: usize, dtype: DType, world: usize) {
    let cpu = Device::Cpu;
    let table = Tensor::randn(&[vocab, h], dtype, 5, &cpu).unwrap();
    let ids: Vec<i64> = (0..23).map(|i| ((i * 7919 + 3) % vocab) as i64).collect();
    let tv = f64s(&table);
    for id_dtype in DType::INTS {
        let ids_t = Tensor::from_vec(ids.clone(), &[23], &cpu).unwrap();
        let ids_t = match id_dtype {
            DType::I32 => Tensor::from_vec(ids.iter().map(|&i| i as i32).collect::<Vec<_>>(), &[23], &cpu).unwrap(),
            _ => ids_t,
        };
        let mut sum = vec![0.0; 23 * h];
        for shard in tp_core::TensorShard::for_all_ranks(0, vocab, world).unwrap() {
            let local = on(&shard.shard(&table).unwrap(), device);
            let y = local.embedding(&on(&ids_t, device), shard.start()).unwrap();
            assert_eq!((y.dims(), y.dtype()), (&[23, h][..], dtype));
            let yv = f64s(&y);
            for (r, &id) in ids.iter().enumerate() {
                let mine = (shard.start()..shard.end()).contains(&(id as usize));
                for j in 0..h {
                    let want = if mine { tv[id as usize * h + j] } else { 0.0 };
                    assert_eq!(
                        yv[r * h + j].to_bits(),
                        want.to_bits(),
                        "embedding {device} {id_dtype} shard {shard:?} id {id}"
                    );
                    sum[r * h + j] += yv[r * h + j];
                }
            }
        }
        let full: Vec<f64> = ids.iter().flat_map(|&id| tv[id as usize * h..(id as usize + 1) * h].to_vec()).collect();
        assert_eq!(sum, full, "embedding {device}: the shards' sum is the full lookup");
    }
}

/// Argmax against a plain scan, with planted ties (the lowest index wins) and a NaN row.
pub fn check_argmax(device: Device, rows: usize, n: usize, dtype: DType) {
    let cpu = Device::Cpu;
    let mut x = Tensor::rand_int(&[rows, n], dtype, -50, 50, 9, &cpu).unwrap();
    // Row 0: a tie between two maxima far apart; row 1 (if any): a NaN late in the row.
    let mut v = f64s(&x);
    v[n / 3] = 99.0;
    v[n - 1] = 99.0;
    if rows > 1 {
        v[n + n / 2] = f64::NAN;
    }
    x = Tensor::from_fn_f64(&[rows, n], dtype, &cpu, |i| v[i]).unwrap();
    let (vals, idx) = on(&x, device).max_with_index().unwrap();
    assert_eq!((idx.dims(), idx.dtype(), vals.dtype()), (&[rows][..], DType::I64, DType::F32));
    let got = idx.to_i64_vec().unwrap();
    let got_v = f64s(&vals);
    for r in 0..rows {
        let row = &v[r * n..(r + 1) * n];
        let want = row.iter().position(|x| x.is_nan()).unwrap_or_else(|| {
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            row.iter().position(|&x| x == m).unwrap()
        });
        assert_eq!(got[r], want as i64, "argmax {device} {dtype} row {r}");
        assert!(got_v[r].to_bits() == row[want].to_bits() || (got_v[r].is_nan() && row[want].is_nan()));
    }
    assert_eq!(on(&x, device).argmax().unwrap().to_i64_vec().unwrap(), got);
}

/// `add` and `add_assign` against f64 sums rounded once; the in-place form leaves a clone that
/// shared the elements untouched.
pub fn check_add(device: Device, dtype: DType) {
    let cpu = Device::Cpu;
    let a = Tensor::randn(&[7, 33], dtype, 1, &cpu).unwrap();
    let b = Tensor::randn(&[7, 33], dtype, 2, &cpu).unwrap();
    let want: Vec<f64> = f64s(&a).iter().zip(f64s(&b)).map(|(x, y)| round_to(dtype, x + y)).collect();
    let (ad, bd) = (on(&a, device), on(&b, device));
    assert_eq!(f64s(&ad.add(&bd).unwrap()), want, "add {device} {dtype}");
    let mut inplace = ad.clone();
    inplace.add_assign(&bd).unwrap();
    assert_eq!(f64s(&inplace), want, "add_assign {device} {dtype}");
    assert_eq!(f64s(&ad), f64s(&a), "the shared original must not change");
    // x += x: the operand aliases the target.
    let mut twice = ad.clone();
    twice.add_assign(&ad).unwrap();
    let want2: Vec<f64> = f64s(&a).iter().map(|x| round_to(dtype, 2.0 * x)).collect();
    assert_eq!(f64s(&twice), want2);
}
