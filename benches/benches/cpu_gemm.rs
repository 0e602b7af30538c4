//! Host GEMM throughput: `y = x W^T` (weight `[N, K]`, the checkpoint layout) and `y = x W`.
//!
//! Throughput is `Elements(2·M·N·K)`: criterion's `Gelem/s` column is GFLOP/s. The kernel family
//! is the machine's best (`TP_CPU_KERNEL` caps it). `cargo xtask bench` measures numpy (f32) and
//! torch (f16/bf16) beside us in the same run; README.md's "Measured" section has the figures.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;
use tp_core::{DType, Device, Tensor};

fn gemm(c: &mut Criterion) {
    let cpu = Device::Cpu;
    let mut group = c.benchmark_group("cpu_gemm");
    group.sample_size(20);
    // (label, M, N, K, dtype): a square, and Llama-3-8B-like projections sharded by TP 2.
    let cases = [
        ("square", 1024, 1024, 1024, DType::F32),
        ("square", 1024, 1024, 1024, DType::BF16),
        ("square", 1024, 1024, 1024, DType::F16),
        ("prefill_qkv_tp2", 128, 3072, 4096, DType::F32),
        ("prefill_qkv_tp2", 128, 3072, 4096, DType::BF16),
        ("decode_down_tp2", 16, 4096, 7168, DType::F32),
        ("decode_qkv_tp2", 1, 3072, 4096, DType::BF16),
    ];
    for (label, m, n, k, dtype) in cases {
        let x = Tensor::rand(&[m, k], dtype, 1, &cpu).expect("x");
        let w = Tensor::rand(&[n, k], dtype, 2, &cpu).expect("w");
        group.throughput(Throughput::Elements(2 * (m * n * k) as u64));
        let id = BenchmarkId::new(format!("x_wT/{label}/{dtype}"), format!("{m}x{n}x{k}"));
        group.bench_with_input(id, &(x, w), |b, (x, w)| b.iter(|| black_box(x.matmul_t(w).expect("matmul"))));
    }
    let x = Tensor::rand(&[1024, 1024], DType::F32, 3, &cpu).expect("x");
    let w = Tensor::rand(&[1024, 1024], DType::F32, 4, &cpu).expect("w");
    group.throughput(Throughput::Elements(2 * 1024u64.pow(3)));
    group.bench_function(BenchmarkId::new("x_w/square/f32", "1024x1024x1024"), |b| {
        b.iter(|| black_box(x.matmul(&w).expect("matmul")))
    });
    group.finish();
}

criterion_group!(benches, gemm);
criterion_main!(benches);
