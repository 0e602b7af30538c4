//! Quantized decode GEMVs on the host: `y = x W^T` for a TinyLlama-sized `[5632, 2048]` weight
//! (its gate projection) of each common GGUF type, one activation row (decode) and four (a small
//! batch), the weight streamed from memory: each type cycles through copies totalling 128 MiB or
//! more (several times the L3), so no product finds its weight in cache.
//!
//! Throughput is `Bytes` of weight read per product: criterion's `GiB/s` column is the
//! streaming rate, to set beside a plain read of memory (about 35 GB/s on 2 threads on the CI
//! machine kind) and llama.cpp's whole-model decode (`cargo xtask bench --only gguf`). Q4_0 and
//! Q4_K run in both row layouts: ggml's, and the eight-row interleaving tp loads GGUF files into
//! (`RowLayout::Q4_0x8`, `RowLayout::Q4Kx8`, `RowLayout::Q6Kx8`).

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;
use tp_core::quant::{QuantPart, QuantType, RowLayout, quant_matmul_parts, to_layout};

/// Bytes of the f16 scales in a block of `t` (offsets), set to normal values: random bytes
/// would give denormal or non-finite scales, which no real file holds.
fn scale_offsets(t: QuantType) -> &'static [usize] {
    match t {
        QuantType::Q4K | QuantType::Q5K | QuantType::Q4_1 | QuantType::Q5_1 => &[0, 2],
        QuantType::Q6K => &[208],
        QuantType::Q2K => &[80, 82],
        QuantType::Q3K => &[108],
        _ => &[0],
    }
}

fn quant(c: &mut Criterion) {
    let (n, k) = (5632, 2048);
    let mut group = c.benchmark_group("cpu_quant_gemv");
    group.sample_size(20);
    let cases = [
        (QuantType::Q4_0, RowLayout::Ggml),
        (QuantType::Q4_0, RowLayout::Q4_0x8),
        (QuantType::Q8_0, RowLayout::Ggml),
        (QuantType::Q4K, RowLayout::Ggml),
        (QuantType::Q4K, RowLayout::Q4Kx8),
        (QuantType::Q6K, RowLayout::Ggml),
        (QuantType::Q6K, RowLayout::Q6Kx8),
    ];
    for (t, layout) in cases {
        let row_bytes = t.row_bytes(k).expect("whole blocks");
        let bytes = n * row_bytes;
        let copies = ((128usize << 20) / bytes).max(2);
        let weights: Vec<Vec<u8>> = (0..copies)
            .map(|c| {
                let mut w: Vec<u8> = (0..bytes).map(|i| (i.wrapping_mul(31).wrapping_add(c * 7) % 251) as u8).collect();
                for block in w.chunks_exact_mut(t.block_bytes()) {
                    for &at in scale_offsets(t) {
                        block[at..at + 2].copy_from_slice(&0x2012u16.to_le_bytes()); // 2^-7 * 1.0176
                    }
                }
                to_layout(t, layout, &mut w, row_bytes).expect("whole rows");
                w
            })
            .collect();
        for m in [1, 4] {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 7 % 13) as f32 - 6.0) / 6.0).collect();
            let mut y = vec![0f32; m * n];
            let mut next = 0;
            group.throughput(Throughput::Bytes(bytes as u64));
            let id = BenchmarkId::new(format!("{t}/{layout:?}"), format!("m{m}/{n}x{k}"));
            group.bench_function(id, |b| {
                b.iter(|| {
                    let w = &weights[next % copies];
                    next += 1;
                    let part = [QuantPart { t, w, rows: n, layout }];
                    quant_matmul_parts(&part, k, &x, m, &mut y).expect("product");
                    black_box(&y);
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, quant);
criterion_main!(benches);
