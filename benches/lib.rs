//! Criterion benchmarks of tp live in `benches/benches/`; run them with
//! `cargo bench -p tp-benches`. Throughput is reported in elements per second where one
//! element is one floating-point operation, so `Gelem/s` reads as GFLOP/s.
