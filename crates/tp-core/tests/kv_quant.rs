//! 8-bit paged KV caches (`QuantKvBuffer`): FP8 E4M3 rounding against a brute-force search of
//! every representable value (computed here in f64 from the format's definition), Q8_0 against
//! its block definition, paged attention over them bitwise equal to attention over the decoded
//! cache in f32 (whose own accuracy the paged tests check against float64) and close to the
//! unquantized float64 attention, and typed errors for bad writes and mixed caches.

mod common;
use common::f64s;
use common::paged::{PagedCase, build, reference};
use tp_core::rng::SplitMix64;
use tp_core::{DType, Device, Error, KvBuffer, KvQuant, QuantKvBuffer, Tensor};

const CPU: Device = Device::Cpu;

fn f32s(t: &Tensor) -> Vec<f32> {
    f64s(t).into_iter().map(|v| v as f32).collect()
}

fn ones(dims: &[usize]) -> Tensor {
    Tensor::from_fn_f64(dims, DType::F32, &CPU, |_| 1.0).unwrap()
}

/// Every finite FP8 E4M3 (`e4m3fn`) value with its code, from the definition: bias 7, exponent
/// field 0 subnormal (`m/8 · 2^-6`), `S.1111.111` NaN (left out).
fn e4m3_values() -> Vec<(u8, f64)> {
    (0u8..=255)
        .filter(|c| c & 0x7F != 0x7F)
        .map(|c| {
            let (e, m) = (i32::from((c >> 3) & 15), f64::from(c & 7));
            let mag = if e == 0 { m / 8.0 * 2f64.powi(-6) } else { (1.0 + m / 8.0) * 2f64.powi(e - 7) };
            (c, if c & 0x80 != 0 { -mag } else { mag })
        })
        .collect()
}

/// The value FP8 E4M3 should store for `x`: the nearest finite value (ties to the even code),
/// ±448 beyond it.
fn e4m3_nearest(x: f64, table: &[(u8, f64)]) -> f64 {
    if x.abs() >= 448.0 {
        return 448f64.copysign(x);
    }
    let mut best = (f64::INFINITY, 0u8, 0.0);
    for &(c, v) in table {
        let err = (v - x).abs();
        if err < best.0 || (err == best.0 && c & 1 == 0 && best.1 & 1 == 1) {
            best = (err, c, v);
        }
    }
    best.2
}

/// `values` written as one (slot, head) row per `d` elements and decoded back.
fn round_trip(quant: KvQuant, values: &[f32], d: usize) -> Vec<f32> {
    let rows = values.len() / d;
    let mut buf = QuantKvBuffer::zeros(quant, [rows, 1, 1, d]).unwrap();
    let src = Tensor::from_vec(values.to_vec(), &[rows, 1, d], &CPU).unwrap();
    buf.write_slots(&src, &(0..rows).collect::<Vec<_>>()).unwrap();
    f32s(&buf.to_f32_tensor().unwrap())
}

#[test]
fn fp8_rounds_to_the_nearest_value_ties_to_even_and_saturates() {
    let table = e4m3_values();
    let mut rng = SplitMix64::new(5);
    let mut xs: Vec<f32> = Vec::new();
    // Every value, every midpoint between neighbours (ties), and just either side of them.
    let mut sorted: Vec<f64> = table.iter().map(|t| t.1).collect();
    sorted.sort_by(f64::total_cmp);
    sorted.dedup();
    for w in sorted.windows(2) {
        let mid = (w[0] + w[1]) / 2.0;
        xs.extend([w[0] as f32, mid as f32, (mid as f32).next_up(), (mid as f32).next_down()]);
    }
    // Random magnitudes over the whole range, subnormals to past saturation, both signs.
    for _ in 0..20_000 {
        let mag = 2f64.powf(rng.uniform(-14.0, 10.0));
        xs.push(if rng.uniform(0.0, 1.0) < 0.5 { -mag } else { mag } as f32);
    }
    xs.extend([0.0, -0.0, 448.0, 449.0, 464.0, 465.0, 1e30, -1e30, f32::INFINITY, f32::NEG_INFINITY]);
    let d = 16;
    xs.resize(xs.len().next_multiple_of(d), 1.0);
    let got = round_trip(KvQuant::Fp8E4M3, &xs, d);
    for (x, g) in xs.iter().zip(&got) {
        let want = e4m3_nearest(f64::from(*x), &table);
        assert_eq!(f64::from(*g), want, "fp8 of {x:e}: got {g:e}, want {want:e}");
    }
    assert!(round_trip(KvQuant::Fp8E4M3, &[f32::NAN; 16], d).iter().all(|v| v.is_nan()));
}

#[test]
fn q8_0_blocks_hold_each_value_within_half_a_step_of_its_f16_scale() {
    let mut rng = SplitMix64::new(9);
    for (d, scale) in [(32, 1.0), (64, 1e-3), (96, 250.0), (128, 1e-6)] {
        let mut xs: Vec<f32> = (0..d * 7).map(|_| (rng.normal() * scale) as f32).collect();
        xs[..32].fill(0.0); // an all-zero block decodes to zeros
        xs[40] = (100.0 * scale) as f32; // a block whose largest element dominates
        let got = round_trip(KvQuant::Q8_0, &xs, d);
        for (b, (x, g)) in xs.chunks(32).zip(got.chunks(32)).enumerate() {
            let amax = x.iter().fold(0f64, |m, v| m.max(f64::from(v.abs())));
            // ggml: d = amax / 127 in f32, stored as f16.
            let step = f64::from(tp_core::f16::from_f32((amax / 127.0) as f32).to_f32());
            for (xi, gi) in x.iter().zip(g) {
                let (xi, gi) = (f64::from(*xi), f64::from(*gi));
                if step == 0.0 {
                    assert_eq!(gi, 0.0, "block {b}");
                    continue;
                }
                let q = gi / step;
                assert!(q == q.round() && q.abs() <= 127.0, "block {b}: {gi} is not a code times {step}");
                // The code is x / d rounded, with d the f32 scale before its f16 rounding.
                let exact = xi / (amax / 127.0);
                assert!((q - exact).abs() <= 0.5 + 1e-5, "block {b}: {xi} -> code {q}, exact {exact}");
            }
        }
    }
}

/// Attention over an 8-bit cache is attention over its decoded values (bitwise, whatever the
/// queries' dtype), and stays near the unquantized float64 result.
#[test]
fn paged_attention_over_8_bit_caches_is_attention_over_their_decoded_values() {
    let seqs = vec![(9, 1), (0, 7), (20, 5), (0, 260), (120, 230), (33, 1)];
    for quant in [KvQuant::Fp8E4M3, KvQuant::Q8_0] {
        for (bs, heads, seed) in [(1, (4, 4, 32), 1), (3, (6, 2, 64), 2), (16, (4, 1, 32), 3)] {
            let c = PagedCase {
                seqs: seqs.clone(),
                block_size: bs,
                heads,
                window: if seed == 2 { Some(17) } else { None },
                groups: None,
                spare_blocks: 2,
                dtype: DType::F32,
                seed,
                sinks: None,
            };
            let b = build(&c);
            let quantized = |t: &Tensor| {
                let dims: [usize; 4] = t.dims().try_into().unwrap();
                let mut buf = QuantKvBuffer::zeros(quant, dims).unwrap();
                let slots: Vec<usize> = (0..dims[0] * dims[1]).collect();
                buf.write_slots(&t.reshape(&[slots.len(), dims[2], dims[3]]).unwrap(), &slots).unwrap();
                buf
            };
            let (kq, vq) = (quantized(&b.k), quantized(&b.v));
            let (kd, vd) = (kq.to_f32_tensor().unwrap(), vq.to_f32_tensor().unwrap());
            let order: Vec<usize> = (0..b.seqs.len()).rev().collect();
            let seqs = b.paged(&order);
            for q in [b.q.clone(), b.q.to_dtype(DType::BF16).unwrap()] {
                let y = q.paged_attention_kv(kq.as_kv(), vq.as_kv(), &seqs, &b.spec).unwrap();
                let dense = q.to_dtype(DType::F32).unwrap().paged_attention(&kd, &vd, &seqs, &b.spec).unwrap();
                let dense = dense.to_dtype(q.dtype()).unwrap();
                assert_eq!(y.dtype(), q.dtype());
                assert!(y.as_bytes().unwrap() == dense.as_bytes().unwrap(), "{quant} {c:?} {}", q.dtype());
            }
            // Unit-variance keys and values: the loss is the format's step, not more (measured:
            // fp8 worst 0.10-0.18, mean 0.005-0.009; q8_0 worst 0.014-0.018, mean 0.001-0.002).
            let y = f64s(&b.q.paged_attention_kv(kq.as_kv(), vq.as_kv(), &seqs, &b.spec).unwrap());
            let want = reference(&b, c.heads);
            let errs: Vec<f64> = y.iter().zip(&want).map(|(a, w)| (a - w).abs()).collect();
            let worst = errs.iter().copied().fold(0.0, f64::max);
            let mean = errs.iter().sum::<f64>() / errs.len() as f64;
            let (worst_max, mean_max) = if quant == KvQuant::Fp8E4M3 { (0.3, 0.02) } else { (0.04, 0.005) };
            assert!(
                worst < worst_max && mean < mean_max,
                "{quant} {c:?}: off the f64 attention by {worst}, {mean} on average"
            );
        }
    }
}

#[test]
fn bad_8_bit_caches_and_writes_are_typed_errors() {
    let bad = |r: Result<QuantKvBuffer, Error>| matches!(r, Err(Error::InvalidArgument { .. }));
    assert!(bad(QuantKvBuffer::zeros(KvQuant::Q8_0, [2, 4, 1, 48])), "q8_0 needs whole blocks of 32");
    assert!(bad(QuantKvBuffer::zeros(KvQuant::Fp8E4M3, [0, 4, 1, 8])));
    assert!(matches!(
        QuantKvBuffer::zeros(KvQuant::Fp8E4M3, [1 << 40, 1 << 20, 8, 128]),
        Err(Error::ShapeOverflow { .. })
    ));
    let mut buf = QuantKvBuffer::zeros(KvQuant::Fp8E4M3, [2, 4, 2, 8]).unwrap();
    let before = f32s(&buf.to_f32_tensor().unwrap());
    let src = ones(&[2, 2, 8]);
    for slots in [vec![0, 8], vec![3, 3], vec![1]] {
        let e = buf.write_slots(&src, &slots).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{slots:?}: {e}");
    }
    let e = buf.write_slots(&ones(&[2, 1, 8]), &[0, 1]).unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
    let e = buf.write_slots(&Tensor::from_vec(vec![1i64; 32], &[2, 2, 8], &CPU).unwrap(), &[0, 1]).unwrap_err();
    assert!(matches!(e, Error::NotFloat { .. }), "{e}");
    assert_eq!(f32s(&buf.to_f32_tensor().unwrap()), before, "a refused write changed the cache");
    // Keys stored one way and values another, or in two 8-bit formats.
    let q = ones(&[1, 2, 8]);
    let dense = Tensor::zeros(&[2, 4, 2, 8], DType::F32, &CPU).unwrap();
    let other = QuantKvBuffer::zeros(KvQuant::Q8_0, [2, 4, 2, 32]).unwrap();
    let seqs = [tp_core::PagedSeq { q_start: 0, q_len: 1, kv_len: 1, blocks: &[0] }];
    let spec = tp_core::PagedAttentionSpec { scale: 1.0, sliding_window: None, kv_groups: None, sinks: None };
    let e = q.paged_attention_kv(KvBuffer::Dense(&dense), buf.as_kv(), &seqs, &spec).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    let e = q.paged_attention_kv(buf.as_kv(), other.as_kv(), &seqs, &spec).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. } | Error::ShapeMismatch { .. }), "{e}");
    buf.write_slots(&src, &[0, 1]).unwrap();
    let y = q.paged_attention_kv(buf.as_kv(), buf.as_kv(), &seqs, &spec).unwrap();
    assert_eq!(f64s(&y), vec![1.0; 16]);
}
