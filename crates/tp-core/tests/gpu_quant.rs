//! GPU tests of the quantized-weight kernels (`kernels/quant_dequant.cu`, `quant_gemv.cu`), for
//! every ggml format they take: `Gpu::dequantize` against tp-cpu's `quant::dequantize` bit for
//! bit (f32; bf16 is that value rounded to nearest even), and `Gpu::quant_gemv` against the f64
//! product of the CPU-dequantized weight, within the bound of an f32-accumulated dot product
//! (plus the bf16 rounding of the output; x is generated in its own dtype, so it carries no
//! rounding of its own). Random blocks with finite binary16 scales; rows, k and m off the warp
//! and block-step multiples, a grid that strides; output buffers poisoned (NaN) before the
//! kernels write them, every element checked.
//!
//! Built only with `--features gpu-tests` (`cargo xtask bundle` does). It FAILS, never skips,
//! when no GPU, driver or compiled kernels are present.

mod common;
use common::quant::random_weight;
use common::{assert_close, matmul_f64, matmul_tol};
use std::sync::Arc;
use tp_core::rng::SplitMix64;
use tp_core::{DType, bf16};
use tp_cpu::quant::{self, QuantType};
use tp_kernels::{ElemType, GemmShape, Gpu, KernelError, QUANT_FORMATS, QUANT_GEMV_MAX_M, QuantFormat};

fn setup() -> Arc<Gpu> {
    common::gpu_setup();
    Gpu::get(0).expect("GPU 0")
}

/// The f32 values `rows x k` of `w`, as tp-cpu dequantizes them (bit-exact with ggml).
fn cpu_dequantize(f: QuantFormat, w: &[u8], rows: usize, k: usize) -> Vec<f32> {
    let t = QuantType::from_ggml_id(f.ggml_id()).expect("tp-cpu has every kernel format");
    let mut out = vec![0f32; rows * k];
    quant::dequantize(t, w, &mut out).unwrap();
    out
}

fn decode(bytes: &[u8], ty: ElemType) -> Vec<f32> {
    match ty {
        ElemType::F32 => bytes.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        ElemType::BF16 => bytes.chunks(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        _ => panic!("f32 or bf16"),
    }
}

fn encode(values: &[f32], ty: ElemType) -> Vec<u8> {
    match ty {
        ElemType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ElemType::BF16 => values.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect(),
        _ => panic!("f32 or bf16"),
    }
}

const TYPES: [ElemType; 2] = [ElemType::F32, ElemType::BF16];

/// (rows, blocks per row) covering one block, ragged block counts (not a multiple of the
/// 8-block warp step of the legacy formats), many rows, and one shape with more 8-element
/// units than the grid has threads (the grid-stride loop runs several times).
fn dequant_shapes(f: QuantFormat, g: &Gpu) -> Vec<(usize, usize)> {
    let units_in_grid = g.sm_count() as usize * 32 * 256;
    let big_rows = (units_in_grid * 8 * 3 / 2).div_ceil(8192);
    let mut v = vec![(1, 1), (3, 5), (37, 13), (129, 4096 / f.block_elems())];
    if matches!(f.ggml_id(), 2 | 12) {
        v.push((big_rows, 8192 / f.block_elems()));
    }
    v
}

#[test]
fn dequantize_matches_tp_cpu_bit_for_bit() {
    let g = setup();
    for (i, f) in QUANT_FORMATS.into_iter().enumerate() {
        for (s, (rows, blocks)) in dequant_shapes(f, &g).into_iter().enumerate() {
            let k = blocks * f.block_elems();
            let w = random_weight(f, rows, k, 0.25, (i * 100 + s) as u64);
            let want = cpu_dequantize(f, &w, rows, k);
            assert!(want.iter().filter(|v| **v != 0.0).count() * 2 > want.len(), "{}: mostly zeros", f.name());
            let wd = g.htod(&w).unwrap();
            for ty in TYPES {
                let bytes = rows * k * ty.size();
                let mut out = g.alloc(bytes).unwrap();
                g.dequantize(f.ggml_id(), &wd, (rows, k), &mut out, ty).unwrap();
                let got = g.dtoh(&out, bytes).unwrap();
                let want_bytes = encode(&want, ty);
                if got != want_bytes {
                    let e = got.iter().zip(&want_bytes).position(|(a, b)| a != b).unwrap_or(0) / ty.size();
                    let (gv, wv) = (decode(&got, ty)[e], decode(&want_bytes, ty)[e]);
                    panic!(
                        "{} {ty:?} {rows}x{k}: element {e} (row {}, col {}): got {gv:e}, want {wv:e}",
                        f.name(),
                        e / k,
                        e % k
                    );
                }
            }
        }
    }
}

/// (rows, k in blocks, m): single row and block, ragged rows and block counts, every m up to
/// the maximum, k = 0 (zeros), and more rows than the grid has warps (warps stride over rows).
fn gemv_shapes(f: QuantFormat, g: &Gpu) -> Vec<(usize, usize, usize)> {
    let warps_in_grid = g.sm_count() as usize * 32 * 8;
    let mut v = vec![(1, 1, 1), (37, 13, 3), (33, 3, QUANT_GEMV_MAX_M), (300, 4096 / f.block_elems(), 8)];
    v.extend([(7, 5, 2), (5, 0, 4), (65, 9, 5), (19, 2, 6), (3, 7, 7)]);
    if matches!(f.ggml_id(), 8 | 14) {
        v.push((warps_in_grid + 37, 1, 2));
    }
    v
}

#[test]
fn quant_gemv_matches_the_f64_product_of_the_dequantized_weight() {
    let g = setup();
    for (i, f) in QUANT_FORMATS.into_iter().enumerate() {
        for (s, (rows, blocks, m)) in gemv_shapes(f, &g).into_iter().enumerate() {
            let k = blocks * f.block_elems();
            let seed = (1000 + i * 100 + s) as u64;
            let w = random_weight(f, rows, k, 0.05, seed);
            let wf: Vec<f64> = cpu_dequantize(f, &w, rows, k).into_iter().map(f64::from).collect();
            let wd = g.htod(&w).unwrap();
            let mut rng = SplitMix64::new(seed ^ 0xABCD);
            let x32: Vec<f32> = (0..m * k).map(|_| rng.normal() as f32).collect();
            for ty in TYPES {
                // x in its own dtype: the reference multiplies exactly the values the GPU reads.
                let xb = encode(&x32, ty);
                let x = decode(&xb, ty);
                let xd = g.htod(&xb).unwrap();
                let mut y = g.alloc(m * rows * ty.size()).unwrap();
                g.quant_gemv(f.ggml_id(), &wd, GemmShape { m, n: rows, k }, &xd, &mut y, ty).unwrap();
                let got: Vec<f64> =
                    decode(&g.dtoh(&y, m * rows * ty.size()).unwrap(), ty).into_iter().map(f64::from).collect();
                let xf: Vec<f64> = x.into_iter().map(f64::from).collect();
                let (want, abs) = matmul_f64(&xf, &wf, m, k, rows, true);
                let dtype = if ty == ElemType::F32 { DType::F32 } else { DType::BF16 };
                let what = format!("{} {ty:?} rows {rows} k {k} m {m}", f.name());
                assert_close(&what, &got, &want, |e| matmul_tol(dtype, k, want[e], abs[e]));
                if k > 0 {
                    assert!(got.iter().filter(|v| **v != 0.0).count() * 2 > got.len(), "{what}: mostly zeros");
                }
            }
        }
    }
}

#[test]
fn bad_quant_launches_are_typed_errors_and_empty_ones_write_nothing() {
    let g = setup();
    let f = QuantFormat::from_ggml_id(12).unwrap(); // Q4_K
    let (rows, k, m) = (4, 512, 2);
    let w = g.htod(&random_weight(f, rows, k, 0.05, 7)).unwrap();
    let x = g.htod(&vec![0u8; m * k * 4]).unwrap();
    let mut y = g.alloc(m * rows * 4).unwrap();
    let mut out = g.alloc(rows * k * 4).unwrap();
    let shape = |m, n, k| GemmShape { m, n, k };
    let unsupported = |r: Result<(), KernelError>, id| {
        assert_eq!(r, Err(KernelError::UnsupportedQuantType { id }));
    };
    for id in [0, 1, 9, 30] {
        unsupported(g.dequantize(id, &w, (rows, k), &mut out, ElemType::F32), id);
        unsupported(g.quant_gemv(id, &w, shape(m, rows, k), &x, &mut y, ElemType::F32), id);
    }
    let invalid = |r: Result<(), KernelError>, what: &str| {
        assert!(matches!(r, Err(KernelError::InvalidLaunch { .. })), "{what}: {r:?}");
    };
    invalid(g.dequantize(12, &w, (rows, k), &mut out, ElemType::F16), "f16 output");
    invalid(g.dequantize(12, &w, (rows, 128), &mut out, ElemType::F32), "k not whole blocks");
    invalid(g.dequantize(12, &w, (rows + 1, k), &mut out, ElemType::F32), "weight too short");
    invalid(g.dequantize(12, &w, (rows, k), &mut y, ElemType::F32), "output too short");
    invalid(g.quant_gemv(12, &w, shape(0, rows, k), &x, &mut y, ElemType::F32), "m = 0");
    invalid(g.quant_gemv(12, &w, shape(QUANT_GEMV_MAX_M + 1, rows, k), &x, &mut y, ElemType::F32), "m too big");
    invalid(g.quant_gemv(12, &w, shape(m, rows, 300), &x, &mut y, ElemType::F32), "k not whole blocks");
    invalid(g.quant_gemv(12, &w, shape(m, rows + 1, k), &x, &mut y, ElemType::F32), "weight too short");
    invalid(g.quant_gemv(12, &w, shape(m + 1, rows, k), &x, &mut y, ElemType::F32), "x too short");
    invalid(g.quant_gemv(12, &w, shape(m, rows, k), &x, &mut out, ElemType::I32), "i32");
    let mut small_y = g.alloc(m * rows * 4 - 1).unwrap();
    invalid(g.quant_gemv(12, &w, shape(m, rows, k), &x, &mut small_y, ElemType::F32), "y too short");
    // No rows: nothing to do, nothing written (the poisoned buffers stay NaN bytes).
    g.dequantize(12, &w, (0, k), &mut out, ElemType::F32).unwrap();
    g.quant_gemv(12, &w, shape(m, 0, k), &x, &mut y, ElemType::F32).unwrap();
    assert!(g.dtoh(&y, m * rows * 4).unwrap().iter().all(|b| *b == 0xFF));
    assert!(g.dtoh(&out, rows * k * 4).unwrap().iter().all(|b| *b == 0xFF));
}
