//! `tp_cpu::quant::quant_matmul` against `f64` products of the dequantized weight (whose
//! dequantization `quant_dequant.rs` checks against gguf), for every type, on every kernel family
//! this machine runs, at `m` = 1, 3, 7, 17, 47 (integer path: 1, 2 and 4 activation rows at a
//! time) and 48 (dequantize-and-GEMM path, across a 256-row tile; on AVX512-VNNI the integer GEMM
//! for Q4_K and Q6_K), with row counts off every tile and task size.
//!
//! The bound is the one `quant_matmul` documents: activation rounding `Σ_b (d_b / 2) Σ |w|` plus
//! `f32` arithmetic `(N + 8) 2^-22 Σ_b r_b Σ (|x| + d_b)` (integer path), `bf16` rounding plus
//! accumulation (GEMM path), accumulation alone (float weights). Each integer-path output is also
//! checked against the product with the activations quantized as documented (`d = amax / 127`,
//! `q = round(x / d)`), within the arithmetic term alone, which any wrong integer or scale
//! would break; and every family's output against the portable one's, within twice that term.

mod common;
use common::Rng;
use tp_cpu::quant::{
    QuantPart, QuantType, RowLayout, dequantize, quant_matmul, quant_matmul_paired, quant_matmul_parts, to_layout,
};
use tp_cpu::{CpuKernel, Error, with_kernel};

fn f16(b: &[u8], at: usize) -> f64 {
    f64::from(half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32())
}

/// A random weight of `rows x k`: random code bytes, `f16` scales in +-[2^-8, 2^-4) (mins too).
fn weight(t: QuantType, rows: usize, k: usize, rng: &mut Rng) -> Vec<u8> {
    let mut w: Vec<u8> = (0..rows * t.row_bytes(k).unwrap()).map(|_| rng.next() as u8).collect();
    let scales: &[usize] = match t {
        QuantType::Q4_0 | QuantType::Q5_0 | QuantType::Q8_0 => &[0],
        QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q4K | QuantType::Q5K => &[0, 2],
        QuantType::Q2K => &[80, 82],
        QuantType::Q3K => &[108],
        QuantType::Q6K => &[208],
        QuantType::F32 | QuantType::F16 | QuantType::BF16 | QuantType::Mxfp4 => &[],
    };
    for block in w.chunks_exact_mut(t.block_bytes()) {
        for &at in scales {
            let v = rng.unit() * 0.06;
            let v = if v.abs() < 0.004 { 0.004f32.copysign(v) } else { v };
            block[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
        }
        let v = rng.unit();
        match t {
            QuantType::F32 => block.copy_from_slice(&v.to_le_bytes()),
            QuantType::F16 => block.copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes()),
            QuantType::BF16 => block.copy_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes()),
            // An E8M0 scale of 2^-8 .. 2^-4 (the byte's `2^(e - 128)`).
            QuantType::Mxfp4 => block[0] = 120 + (rng.next() % 5) as u8,
            _ => {}
        }
    }
    w
}

/// `r_b`: the largest magnitude a block can encode given its scales (see `quant_matmul`).
fn reach(t: QuantType, b: &[u8]) -> f64 {
    let d = |at: usize| f16(b, at).abs();
    match t {
        QuantType::Q4_0 => 8.0 * d(0),
        QuantType::Q4_1 => d(2) + 15.0 * d(0),
        QuantType::Q5_0 => 16.0 * d(0),
        QuantType::Q5_1 => d(2) + 31.0 * d(0),
        QuantType::Q8_0 => 128.0 * d(0),
        QuantType::Q2K => 45.0 * d(80) + 15.0 * d(82),
        QuantType::Q3K => 128.0 * d(108),
        QuantType::Q4K => 945.0 * d(0) + 63.0 * d(2),
        QuantType::Q5K => 1953.0 * d(0) + 63.0 * d(2),
        QuantType::Q6K => 4096.0 * d(208),
        QuantType::Mxfp4 => 12.0 * 2f64.powi(i32::from(b[0]) - 128),
        QuantType::F32 | QuantType::F16 | QuantType::BF16 => 0.0,
    }
}

/// One product's references: per output, the exact value, the value with quantized activations,
/// the activation-rounding and arithmetic terms of the integer path's bound, and the bounds of the
/// `f32` paths (float weights) and of the `bf16` GEMM path.
struct Reference {
    exact: Vec<f64>,
    quantized: Vec<f64>,
    act: Vec<f64>,
    arith: Vec<f64>,
    float: Vec<f64>,
    bf16: Vec<f64>,
}

fn reference(t: QuantType, w: &[u8], rows: usize, k: usize, x: &[f32], m: usize) -> Reference {
    let mut wf = vec![0f32; rows * k];
    dequantize(t, w, &mut wf).unwrap();
    let block = if t.block_elems() == 256 { 256 } else { 32 };
    let nb = k / block;
    let row_bytes = t.row_bytes(k).unwrap();
    // Activations quantized as documented: d = amax / 127, q = round(x / d), ties to even.
    let mut xq = vec![0f64; m * k];
    let mut dx = vec![0f64; m * nb];
    for (b, (xb, qb)) in x.chunks_exact(block).zip(xq.chunks_exact_mut(block)).enumerate() {
        let d = xb.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
        dx[b] = f64::from(d);
        for (q, &v) in qb.iter_mut().zip(xb) {
            *q = if d == 0.0 { 0.0 } else { f64::from((v / d).round_ties_even()) * f64::from(d) };
        }
    }
    let size = m * rows;
    let zeros = vec![0f64; size];
    let mut r = Reference {
        exact: zeros.clone(),
        quantized: zeros.clone(),
        act: zeros.clone(),
        arith: zeros.clone(),
        float: zeros.clone(),
        bf16: zeros,
    };
    for j in 0..rows {
        let wr = &wf[j * k..(j + 1) * k];
        let wb = &w[j * row_bytes..(j + 1) * row_bytes];
        for i in 0..m {
            let (xr, qr) = (&x[i * k..(i + 1) * k], &xq[i * k..(i + 1) * k]);
            let (mut exact, mut quantized, mut act, mut arith, mut sum_abs) = (0f64, 0f64, 0f64, 0f64, 0f64);
            for b in 0..nb {
                let d = dx[i * nb + b];
                let rb = reach(t, &wb[b * row_bytes / nb..]);
                for l in b * block..(b + 1) * block {
                    let (wv, xv) = (f64::from(wr[l]), f64::from(xr[l]));
                    exact += wv * xv;
                    quantized += wv * qr[l];
                    act += d / 2.0 * (1.0 + 2f64.powi(-20)) * wv.abs();
                    arith += rb * (xv.abs() + d);
                    sum_abs += (wv * xv).abs();
                }
            }
            let o = i * rows + j;
            r.exact[o] = exact;
            r.quantized[o] = quantized;
            r.act[o] = act;
            r.arith[o] = (nb as f64 + 8.0) * 2f64.powi(-22) * arith;
            r.float[o] = (k as f64 + 8.0) * 2f64.powi(-23) * sum_abs;
            r.bf16[o] = (2f64.powi(-8) + 2f64.powi(-17) + (k as f64 + 8.0) * 2f64.powi(-22)) * sum_abs;
        }
    }
    r
}

fn run(kernel: CpuKernel, t: QuantType, w: &[u8], rows: usize, k: usize, x: &[f32], m: usize) -> Vec<f32> {
    let mut y = vec![f32::NAN; m * rows];
    with_kernel(kernel, || quant_matmul(t, w, rows, k, x, m, &mut y)).unwrap().unwrap();
    y
}

/// Every type, kernel family and shape within the documented bound; the integer path also
/// within the arithmetic term of the product with quantized activations; the families agree.
#[test]
fn products_stay_within_the_documented_bound_on_every_kernel() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let kernels = CpuKernel::available();
    for t in QuantType::ALL {
        // An odd number of blocks: legacy rows of 37 (two passes of 16 and 5 blocks, groups of 8
        // and a remainder), K rows of 3 (a pair and one).
        let k = if t.block_elems() == 256 { 768 } else { 37 * 32 };
        for (rows, m) in [(300, 1), (37, 3), (45, 7), (40, 17), (30, 47), (260, 48)] {
            let w = weight(t, rows, k, &mut rng);
            // Rows of x at different magnitudes, a few large elements among small ones.
            let x: Vec<f32> =
                (0..m * k).map(|i| rng.unit() * if i % 97 == 5 { 8.0 } else { 1.0 } * (1 + i / k % 3) as f32).collect();
            let r = reference(t, &w, rows, k, &x, m);
            let portable = run(CpuKernel::Portable, t, &w, rows, k, &x, m);
            let portable_integer = int_path(CpuKernel::Portable, t, false, m);
            let mut max_err = 0f64;
            for &kernel in &kernels {
                // quant_matmul's paths: integer below 48 rows of x (quantized types; on
                // AVX512-VNNI at every m for Q4_0 / Q4_K / Q6_K), the GEMM from 48 (bf16 tiles
                // but for F32 / F16), f32 dots for float weights below 48.
                let integer = int_path(kernel, t, false, m);
                let bf16_gemm = !integer && m >= 48 && !matches!(t, QuantType::F32 | QuantType::F16);
                let y =
                    if kernel == CpuKernel::Portable { portable.clone() } else { run(kernel, t, &w, rows, k, &x, m) };
                for o in 0..m * rows {
                    let case = format!("{t} {kernel} rows {rows} m {m} output {o}");
                    let arith = if integer {
                        r.arith[o]
                    } else if bf16_gemm {
                        r.bf16[o]
                    } else {
                        r.float[o]
                    };
                    let got = f64::from(y[o]);
                    let bound = if integer { r.act[o] + arith } else { arith };
                    let err = (got - r.exact[o]).abs();
                    assert!(err <= bound, "{case}: {got} vs exact {}, error {err:e} > bound {bound:e}", r.exact[o]);
                    max_err = max_err.max(err);
                    if integer {
                        let err = (got - r.quantized[o]).abs();
                        assert!(err <= arith, "{case}: {got} vs {} (quantized x), error {err:e}", r.quantized[o]);
                    }
                    if integer == portable_integer {
                        let diff = (got - f64::from(portable[o])).abs();
                        assert!(diff <= 2.0 * arith, "{case}: {got} vs portable {}", portable[o]);
                    }
                }
            }
            assert!(max_err > 0.0, "{t} rows {rows} m {m}: no rounding error at all");
        }
    }
}

/// Wrong lengths, `k` off the block, overflow: typed errors, nothing written.
#[test]
fn bad_shapes_are_typed_errors() {
    let t = QuantType::Q4_0;
    let (rows, k, m) = (3, 64, 2);
    let w = vec![0u8; rows * 36];
    let (x, mut y) = (vec![0f32; m * k], vec![7f32; m * rows]);
    let call = |t, w: &[u8], rows, k, x: &[f32], m, y_len| {
        let mut y = vec![7f32; y_len];
        let r = quant_matmul(t, w, rows, k, x, m, &mut y);
        assert!(r.is_ok() || y.iter().all(|&v| v == 7.0), "an error wrote to y");
        r
    };
    assert_eq!(
        call(t, &w, rows, 48, &x[..96], m, 6),
        Err(Error::NotWholeBlocks { ty: "Q4_0", operand: "k", len: 48, block: 32, unit: "elements" })
    );
    assert_eq!(
        call(QuantType::Q6K, &w, rows, 64, &x, m, 6),
        Err(Error::NotWholeBlocks { ty: "Q6_K", operand: "k", len: 64, block: 256, unit: "elements" })
    );
    assert_eq!(
        call(t, &w[..107], rows, k, &x, m, 6),
        Err(Error::QuantLength { ty: "Q4_0", operand: "w", unit: "bytes", expected: 108, got: 107 })
    );
    assert_eq!(
        call(t, &w, rows, k, &x[..127], m, 6),
        Err(Error::OperandLength { operand: "x", expected: 128, got: 127 })
    );
    assert_eq!(call(t, &w, rows, k, &x, m, 5), Err(Error::OperandLength { operand: "y", expected: 6, got: 5 }));
    assert_eq!(call(t, &w, usize::MAX / 4, k, &x, m, 6), Err(Error::ShapeOverflow { m: 2, n: usize::MAX / 4, k: 64 }));
    assert_eq!(
        call(t, &w, rows, k, &x, usize::MAX / 2, 6),
        Err(Error::ShapeOverflow { m: usize::MAX / 2, n: 3, k: 64 })
    );
    // Empty products succeed; k = 0 writes zeros.
    assert!(call(t, &[], 0, k, &x, m, 0).is_ok());
    quant_matmul(t, &[], rows, 0, &[], m, &mut y).unwrap();
    assert_eq!(y, vec![0.0; m * rows]);
}

/// A non-finite element of x makes its row of y NaN on the integer path (its block's scale is
/// NaN), and leaves the other rows alone.
#[test]
fn a_non_finite_activation_poisons_its_row_only() {
    let mut rng = Rng(7);
    for t in [QuantType::Q4_0, QuantType::Q4K] {
        let k = t.block_elems() * 2;
        let w = weight(t, 5, k, &mut rng);
        let mut x: Vec<f32> = (0..2 * k).map(|_| rng.unit()).collect();
        x[k + 3] = f32::INFINITY;
        for kernel in CpuKernel::available() {
            let y = run(kernel, t, &w, 5, k, &x, 2);
            assert!(y[..5].iter().all(|v| v.is_finite()) && y[5..].iter().all(|v| v.is_nan()), "{t} {kernel}: {y:?}");
        }
    }
}

/// On a batch-invariant thread every `m` runs the dequantize-and-GEMM path, so a row of `x` gets
/// the same bits alone and among others.
#[test]
fn batch_invariant_products_give_each_row_the_same_bits() {
    let mut rng = Rng(11);
    let (rows, k) = (40, 512);
    for t in [QuantType::Q4_0, QuantType::Q6K] {
        let w = weight(t, rows, k, &mut rng);
        let x: Vec<f32> = (0..20 * k).map(|_| rng.unit()).collect();
        tp_cpu::set_batch_invariant(true);
        let mut alone = vec![0f32; rows];
        quant_matmul(t, &w, rows, k, &x[..k], 1, &mut alone).unwrap();
        for m in [2, 5, 20] {
            let mut y = vec![0f32; m * rows];
            quant_matmul(t, &w, rows, k, &x[..m * k], m, &mut y).unwrap();
            let same = y[..rows].iter().zip(&alone).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{t} m {m}");
        }
        tp_cpu::set_batch_invariant(false);
    }
}

/// Parts of mixed types stacked along the rows (as a Q4_K_M file's fused q/k/v or gate/up) give
/// bit for bit the per-part products side by side, on every kernel and on every path (among
/// them, with only Q4_0 / Q4_K / Q6_K parts, the integer GEMM's one job over all parts on
/// AVX512-VNNI); a bad part is a typed error that writes nothing.
#[test]
fn stacked_parts_are_the_per_part_products_side_by_side() {
    let mut rng = Rng(23);
    let k = 512;
    let mixed =
        [(QuantType::Q4K, 70), (QuantType::Q6K, 33), (QuantType::Q8_0, 40), (QuantType::F16, 9), (QuantType::Q4_0, 1)];
    let integer = [(QuantType::Q4K, 70), (QuantType::Q6K, 33), (QuantType::Q4_0, 41)];
    for (spec, ms) in [(&mixed[..], &[1, 5, 47, 48][..]), (&integer[..], &[3, 64, 260][..])] {
        let ws: Vec<Vec<u8>> = spec.iter().map(|&(t, rows)| weight(t, rows, k, &mut rng)).collect();
        let parts: Vec<QuantPart<'_>> =
            spec.iter().zip(&ws).map(|(&(t, rows), w)| QuantPart { t, w, rows, layout: RowLayout::Ggml }).collect();
        let n: usize = spec.iter().map(|s| s.1).sum();
        for &m in ms {
            let x: Vec<f32> = (0..m * k).map(|_| rng.unit()).collect();
            for kernel in CpuKernel::available() {
                let mut y = vec![f32::NAN; m * n];
                with_kernel(kernel, || quant_matmul_parts(&parts, k, &x, m, &mut y)).unwrap().unwrap();
                let mut col = 0;
                for (&(t, rows), w) in spec.iter().zip(&ws) {
                    let alone = run(kernel, t, w, rows, k, &x, m);
                    for i in 0..m {
                        for j in 0..rows {
                            let (a, b) = (y[i * n + col + j], alone[i * rows + j]);
                            assert_eq!(a.to_bits(), b.to_bits(), "{kernel} m {m} {t} row {i} col {j}: {a} vs {b}");
                        }
                    }
                    col += rows;
                }
            }
        }
    }
    let ws: Vec<Vec<u8>> = mixed.iter().map(|&(t, rows)| weight(t, rows, k, &mut rng)).collect();
    let parts: Vec<QuantPart<'_>> =
        mixed.iter().zip(&ws).map(|(&(t, rows), w)| QuantPart { t, w, rows, layout: RowLayout::Ggml }).collect();
    let n: usize = mixed.iter().map(|s| s.1).sum();
    let x = vec![0.5f32; k];
    let mut y = vec![7f32; n];
    let mut bad = parts.clone();
    bad[2].w = &ws[2][..ws[2].len() - 1];
    let expected = ws[2].len();
    assert_eq!(
        quant_matmul_parts(&bad, k, &x, 1, &mut y),
        Err(Error::QuantLength { ty: "Q8_0", operand: "w", unit: "bytes", expected, got: expected - 1 })
    );
    assert_eq!(
        quant_matmul_parts(&parts, 288, &x[..288], 1, &mut y),
        Err(Error::NotWholeBlocks { ty: "Q4_K", operand: "k", len: 288, block: 256, unit: "elements" })
    );
    assert!(y.iter().all(|&v| v == 7.0), "an error wrote to y");
}

/// Q4_0, Q4_K, Q6_K, MXFP4 and Q8_0 rows interleaved eight at a time (`RowLayout::Q4_0x8`,
/// `Q4Kx8`, `Q6Kx8`, `Mxfp4x8`, `Q8_0x8`: what `RowLayout::preferred` gives them) stay within the documented bound on every kernel and
/// both paths, at row counts off the group of eight and task sizes, with 1 to 600 activation
/// rows (past 95 the integer path runs in passes; on AVX512-VNNI the integer GEMM takes over from
/// 32 rows): the same checks as for ggml's layout (the integer sums are the same; only
/// the order of the f32 additions differs).
#[test]
fn interleaved_rows_stay_within_the_bound_on_every_kernel() {
    assert_eq!(RowLayout::preferred(QuantType::Q4_0), RowLayout::Q4_0x8);
    assert_eq!(RowLayout::preferred(QuantType::Q4K), RowLayout::Q4Kx8);
    assert_eq!(RowLayout::preferred(QuantType::Q6K), RowLayout::Q6Kx8);
    assert_eq!(RowLayout::preferred(QuantType::Mxfp4), RowLayout::Mxfp4x8);
    assert_eq!(RowLayout::preferred(QuantType::Q8_0), RowLayout::Q8_0x8);
    assert_eq!(RowLayout::preferred(QuantType::Q5_0), RowLayout::Ggml);
    let mut rng = Rng(31);
    // The last case's rows are long enough that the GEMM path's tiles (224 rows there) end
    // inside the weight: the second tile starts on a group and ends in the ggml-layout rows.
    let cases = [
        (8, 1, 1),
        (13, 1, 1),
        (300, 1, 1),
        (70, 2, 1),
        (45, 3, 1),
        (64, 5, 1),
        (83, 47, 1),
        (260, 48, 1),
        (300, 48, 8),
        (70, 64, 1),
        (40, 95, 1),
        (40, 96, 1),
        (70, 130, 1),
        (101, 270, 1),
        (24, 600, 1),
    ];
    for t in [QuantType::Q4_0, QuantType::Q4K, QuantType::Q6K, QuantType::Mxfp4, QuantType::Q8_0] {
        let layout = RowLayout::preferred(t);
        for (rows, m, scale_k) in cases {
            // An odd number of blocks: 37 of Q4_0 / MXFP4, 5 super-blocks of Q4_K / Q6_K (times 8
            // in the last case).
            let k =
                scale_k * if t.block_elems() == 256 { 5 * 256 } else { 37 * 32 } + if scale_k > 1 { 256 } else { 0 };
            let row_bytes = t.row_bytes(k).unwrap();
            let w = weight(t, rows, k, &mut rng);
            let mut x8 = w.clone();
            to_layout(t, layout, &mut x8, row_bytes).unwrap();
            assert_eq!(x8 == w, rows < 8, "{t} rows {rows}: the layout moved nothing");
            let x: Vec<f32> = (0..m * k).map(|i| rng.unit() * if i % 89 == 3 { 6.0 } else { 1.0 }).collect();
            let r = reference(t, &w, rows, k, &x, m);
            let part = [QuantPart { t, w: &x8, rows, layout }];
            for kernel in CpuKernel::available() {
                let mut y = vec![f32::NAN; m * rows];
                with_kernel(kernel, || quant_matmul_parts(&part, k, &x, m, &mut y)).unwrap().unwrap();
                let ggml = run(kernel, t, &w, rows, k, &x, m);
                let (int_path, ggml_int_path) = (int_path(kernel, t, true, m), int_path(kernel, t, false, m));
                for o in 0..m * rows {
                    let case = format!("{t} {kernel} rows {rows} m {m} k {k} output {o}");
                    let got = f64::from(y[o]);
                    let arith = if int_path { r.arith[o] } else { r.bf16[o] };
                    let bound = if int_path { r.act[o] + arith } else { arith };
                    let err = (got - r.exact[o]).abs();
                    assert!(err <= bound, "{case}: {got} vs exact {}, error {err:e} > {bound:e}", r.exact[o]);
                    if int_path {
                        let err = (got - r.quantized[o]).abs();
                        assert!(err <= arith, "{case}: {got} vs {} (quantized x)", r.quantized[o]);
                    }
                    if int_path == ggml_int_path {
                        // Both layouts took the same path.
                        let diff = (got - f64::from(ggml[o])).abs();
                        assert!(diff <= 2.0 * arith, "{case}: {got} vs ggml layout {}", ggml[o]);
                    }
                }
            }
        }
    }
}

/// Whether `kernel` runs the product of `m` activation rows by weights of `t` (in an
/// `interleaved` layout or ggml's) on integers: on AVX512-VNNI, Q4_0, Q4_K and Q6_K at every `m`
/// (the decode kernels, then the integer GEMM); otherwise quantized types below 48 rows, or 96
/// for interleaved rows on the AVX2 kernels (in passes of at most 92 rows from 96).
fn int_path(kernel: CpuKernel, t: QuantType, interleaved: bool, m: usize) -> bool {
    if t.block_elems() == 1 {
        return false;
    }
    if vnni(kernel) && igemm_min_m(t).is_some() {
        return true;
    }
    let avx2 = cfg!(target_arch = "x86_64") && kernel != CpuKernel::Portable && !vnni(kernel);
    m < if interleaved && avx2 && RowLayout::preferred(t) != RowLayout::Ggml { 96 } else { 48 }
}

/// Whether `kernel` runs the integer kernels on AVX512-VNNI on this machine (the AVX-512 rungs,
/// and the AMX emulation, whose other work runs on the best of them).
fn vnni(kernel: CpuKernel) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512vnni")
            && kernel != CpuKernel::Portable
            && kernel != CpuKernel::Avx2
            && (kernel != CpuKernel::AmxEmulated || CpuKernel::Avx512.is_available())
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = kernel;
        false
    }
}

/// Activation rows from which `quant_matmul` takes the integer GEMM for `t` on AVX512-VNNI.
fn igemm_min_m(t: QuantType) -> Option<usize> {
    match t {
        QuantType::Q4_0 => Some(32),
        QuantType::Q4K => Some(32),
        QuantType::Q6K => Some(32),
        _ => None,
    }
}

/// On AVX512-VNNI the integer GEMM gives each activation row the bits the decode kernels give it
/// alone (weight rows in whole interleaved groups; the rest, in ggml's layout, within the
/// bound as above): so a row's outputs do not depend on how many rows share its product. At row
/// counts on and off the micro-kernel's 4-row panels, 48-row tasks and 16-row tiles, with rows of
/// one block and of several, and tasks that end inside the ggml-layout tail.
#[test]
fn the_integer_gemm_gives_each_row_its_decode_bits() {
    let mut rng = Rng(53);
    let kernels: Vec<CpuKernel> = CpuKernel::available().into_iter().filter(|&k| vnni(k)).collect();
    if kernels.is_empty() {
        eprintln!("no AVX512-VNNI on this machine: the integer GEMM does not run here");
        return;
    }
    let mut checked = 0usize;
    for t in [QuantType::Q4_0, QuantType::Q4K, QuantType::Q6K] {
        let min_m = igemm_min_m(t).unwrap();
        for (rows, m, blocks) in [(8, min_m, 1), (53, min_m + 3, 3), (101, min_m + 17, 2), (196, 2 * min_m + 33, 1)] {
            let k = blocks * t.block_elems();
            let row_bytes = t.row_bytes(k).unwrap();
            let mut w = weight(t, rows, k, &mut rng);
            to_layout(t, RowLayout::preferred(t), &mut w, row_bytes).unwrap();
            let part = [QuantPart { t, w: &w, rows, layout: RowLayout::preferred(t) }];
            let x: Vec<f32> = (0..m * k).map(|i| rng.unit() * if i % 41 == 7 { 9.0 } else { 1.0 }).collect();
            for &kernel in &kernels {
                let mut y = vec![f32::NAN; m * rows];
                with_kernel(kernel, || quant_matmul_parts(&part, k, &x, m, &mut y)).unwrap().unwrap();
                for i in 0..m {
                    let mut alone = vec![f32::NAN; rows];
                    with_kernel(kernel, || quant_matmul_parts(&part, k, &x[i * k..(i + 1) * k], 1, &mut alone))
                        .unwrap()
                        .unwrap();
                    for j in 0..rows / 8 * 8 {
                        let (a, b) = (y[i * rows + j], alone[j]);
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{t} {kernel} rows {rows} m {m} k {k}: ({i}, {j}) {a} vs {b}"
                        );
                        checked += 1;
                    }
                }
            }
        }
    }
    assert!(checked > 0);
}

/// Parts that take different paths at one activation count (an interleaved Q4_K part on the
/// integer kernels up to 95 rows, a Q6_K part on the GEMM path from 48) give bit for bit each
/// part's own product, on every kernel.
#[test]
fn parts_on_different_paths_are_each_parts_own_product() {
    let mut rng = Rng(41);
    let k = 512;
    let (q4, q6) = (weight(QuantType::Q4K, 72, k, &mut rng), weight(QuantType::Q6K, 33, k, &mut rng));
    let mut q4x8 = q4.clone();
    to_layout(QuantType::Q4K, RowLayout::Q4Kx8, &mut q4x8, QuantType::Q4K.row_bytes(k).unwrap()).unwrap();
    let parts = [
        QuantPart { t: QuantType::Q4K, w: &q4x8, rows: 72, layout: RowLayout::Q4Kx8 },
        QuantPart { t: QuantType::Q6K, w: &q6, rows: 33, layout: RowLayout::Ggml },
    ];
    for m in [5, 64, 100] {
        let x: Vec<f32> = (0..m * k).map(|_| rng.unit()).collect();
        for kernel in CpuKernel::available() {
            let mut y = vec![f32::NAN; m * 105];
            with_kernel(kernel, || quant_matmul_parts(&parts, k, &x, m, &mut y)).unwrap().unwrap();
            let mut col = 0;
            for p in &parts {
                let mut alone = vec![f32::NAN; m * p.rows];
                with_kernel(kernel, || quant_matmul_parts(std::slice::from_ref(p), k, &x, m, &mut alone))
                    .unwrap()
                    .unwrap();
                for i in 0..m {
                    for j in 0..p.rows {
                        let (a, b) = (y[i * 105 + col + j], alone[i * p.rows + j]);
                        assert_eq!(a.to_bits(), b.to_bits(), "{kernel} m {m} {} row {i} col {j}", p.t);
                    }
                }
                col += p.rows;
            }
        }
    }
}

/// A gate and an up projection combined as they are made (`quant_matmul_paired`) give bit for
/// bit the epilogue applied to the two halves of the stacked product, on the integer GEMM of
/// every AVX512-VNNI kernel, for each type it takes, in ggml's and the interleaved layout, at
/// row counts on and off its chunks; below its threshold, on other kernels and for parts of two
/// types the answer is "not taken" with the output untouched; bad shapes are typed errors.
#[test]
fn paired_products_are_the_epilogue_of_the_stacked_product() {
    let mut rng = Rng(61);
    // Any element-wise function of both: its bits show any element taken from the wrong place.
    let f = |g: &[f32], u: &[f32], o: &mut [f32]| {
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = g / (1.0 + u.abs()) - 0.5 * u;
        }
    };
    let mut taken = 0usize;
    for t in [QuantType::Q4_0, QuantType::Q4K, QuantType::Q6K] {
        let min_m = igemm_min_m(t).unwrap_or(32);
        for layout in [RowLayout::Ggml, RowLayout::preferred(t)] {
            for (rows, m, blocks) in [(8, min_m, 1), (53, min_m + 3, 2), (100, 2 * min_m + 17, 1), (5, min_m - 1, 1)] {
                let k = blocks * t.block_elems();
                let row_bytes = t.row_bytes(k).unwrap();
                let (mut wg, mut wu) = (weight(t, rows, k, &mut rng), weight(t, rows, k, &mut rng));
                to_layout(t, layout, &mut wg, row_bytes).unwrap();
                to_layout(t, layout, &mut wu, row_bytes).unwrap();
                let gate = QuantPart { t, w: &wg, rows, layout };
                let up = QuantPart { t, w: &wu, rows, layout };
                let x: Vec<f32> = (0..m * k).map(|_| rng.unit()).collect();
                for kernel in CpuKernel::available() {
                    let mut both = vec![f32::NAN; m * 2 * rows];
                    with_kernel(kernel, || quant_matmul_parts(&[gate, up], k, &x, m, &mut both)).unwrap().unwrap();
                    let mut y = vec![f32::NAN; m * rows];
                    let done =
                        with_kernel(kernel, || quant_matmul_paired(&gate, &up, k, &x, m, &mut y, &f)).unwrap().unwrap();
                    assert_eq!(done, vnni(kernel) && m >= min_m, "{t} {layout:?} {kernel} m {m}: taken");
                    if !done {
                        assert!(y.iter().all(|v| v.is_nan()), "{t} {kernel}: untouched when not taken");
                        continue;
                    }
                    taken += 1;
                    for (i, (yr, br)) in y.chunks_exact(rows).zip(both.chunks_exact(2 * rows)).enumerate() {
                        let mut want = vec![0f32; rows];
                        f(&br[..rows], &br[rows..], &mut want);
                        for (j, (a, b)) in yr.iter().zip(&want).enumerate() {
                            assert_eq!(
                                a.to_bits(),
                                b.to_bits(),
                                "{t} {layout:?} {kernel} rows {rows} m {m}: ({i}, {j})"
                            );
                        }
                    }
                }
            }
        }
    }
    if CpuKernel::available().into_iter().any(vnni) {
        assert!(taken > 0);
    }
    // Parts of two types are not taken; bad shapes are typed errors.
    let k = 256;
    let (w4, w6) = (weight(QuantType::Q4K, 8, k, &mut rng), weight(QuantType::Q6K, 8, k, &mut rng));
    let gate = QuantPart { t: QuantType::Q4K, w: &w4, rows: 8, layout: RowLayout::Ggml };
    let up = QuantPart { t: QuantType::Q6K, w: &w6, rows: 8, layout: RowLayout::Ggml };
    let x = vec![0.5f32; 64 * k];
    let mut y = vec![f32::NAN; 64 * 8];
    assert!(!quant_matmul_paired(&gate, &up, k, &x, 64, &mut y, &f).unwrap());
    assert!(y.iter().all(|v| v.is_nan()));
    let mut short = vec![0f32; 64 * 8 - 1];
    assert!(matches!(
        quant_matmul_paired(&gate, &gate, k, &x, 64, &mut short, &f),
        Err(Error::OperandLength { operand: "y", .. })
    ));
    assert!(matches!(
        quant_matmul_paired(&gate, &gate, k, &x[1..], 64, &mut y, &f),
        Err(Error::OperandLength { operand: "x", .. })
    ));
}
