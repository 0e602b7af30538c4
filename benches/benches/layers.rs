//! Layer overhead on the host: `ColumnParallel::forward` and `RowParallel::forward_partial` (the
//! collective excluded) beside the bare GEMM on the very same shard. Target: at most 1.03x.
//!
//! Shapes: a Llama-3-8B-like MLP at TP 2 — column: gate shard `[7168, 4096]`; row: down shard
//! `[4096, 7168]`; 64 tokens, f32. Throughput `Elements(2·M·N·K)` reads as FLOP/s.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;
use tp_comm::DeviceGroup;
use tp_core::{DType, Device, Tensor};
use tp_layers::{ColumnParallel, Linear, RowParallel};

fn layers(c: &mut Criterion) {
    let cpu = Device::Cpu;
    let (tokens, hidden, inter, world) = (64, 4096, 14336, 2);
    let mut g = c.benchmark_group("layer_overhead");
    g.sample_size(20);
    // Rank 0 of a 2-rank group: the benchmarked calls do not communicate.
    let groups = DeviceGroup::local(world, std::time::Duration::from_secs(60), |_| cpu).unwrap();
    let rank0 = &groups[0];

    let gate = Linear::new(Tensor::rand(&[inter, hidden], DType::F32, 1, &cpu).unwrap(), None).unwrap();
    let col = ColumnParallel::from_full(&gate, rank0).unwrap();
    let x = Tensor::rand(&[tokens, hidden], DType::F32, 2, &cpu).unwrap();
    let w_col = col.local().weight().unwrap().clone();
    g.throughput(Throughput::Elements(2 * (tokens * w_col.dims()[0] * hidden) as u64));
    g.bench_function("column/bare_gemm", |b| b.iter(|| black_box(x.matmul_t(&w_col).unwrap())));
    g.bench_function("column/forward", |b| b.iter(|| black_box(col.forward(&x).unwrap())));

    let down = Tensor::rand(&[hidden, inter], DType::F32, 3, &cpu).unwrap();
    let row = RowParallel::from_full(&down, None, rank0).unwrap();
    let xr = Tensor::rand(&[tokens, row.shard().len()], DType::F32, 4, &cpu).unwrap();
    let w_row = row.weight().unwrap().clone();
    g.throughput(Throughput::Elements(2 * (tokens * hidden * row.shard().len()) as u64));
    g.bench_function("row/bare_gemm", |b| b.iter(|| black_box(xr.matmul_t(&w_row).unwrap())));
    g.bench_function("row/forward_partial", |b| b.iter(|| black_box(row.forward_partial(&xr).unwrap())));
    g.finish();
}

criterion_group!(benches, layers);
criterion_main!(benches);
