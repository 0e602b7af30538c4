//! GPU criterion benches (feature `gpu`; needs a CUDA GPU): our GEMM kernels and the
//! column-parallel layer on the device. Every iteration synchronises the stream, so the time
//! is the kernel's, not the launch's; throughput is `Elements(2·M·N·K)`, i.e. FLOP/s.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use tp_core::{DType, Device, Tensor};
use tp_kernels::Gpu;

fn gpu_gemm(c: &mut Criterion) {
    let gpu = Gpu::get(0).expect("the GPU benches need a CUDA device");
    let dev = Device::Cuda(0);
    let mut g = c.benchmark_group("gpu_gemm");
    g.sample_size(20);
    for (dtype, s) in [(DType::F32, 4096), (DType::BF16, 8192), (DType::F16, 8192), (DType::BF16, 4096)] {
        let x = Tensor::rand(&[s, s], dtype, 1, &Device::Cpu).unwrap().to_device(&dev).unwrap();
        let w = Tensor::rand(&[s, s], dtype, 2, &Device::Cpu).unwrap().to_device(&dev).unwrap();
        g.throughput(Throughput::Elements(2 * (s as u64).pow(3)));
        g.bench_function(BenchmarkId::new(format!("x_wT/{dtype}"), s), |b| {
            b.iter(|| {
                let y = x.matmul_t(&w).unwrap();
                gpu.synchronize().unwrap();
                y
            })
        });
    }
    g.finish();
}

criterion_group!(benches, gpu_gemm);
criterion_main!(benches);
