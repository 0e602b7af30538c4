//! `tp_cpu::quant::dequantize` against the gguf Python package (0.19.0, llama.cpp's own Python
//! reference, `gguf.quants.dequantize`), bit for bit, for every type: random raw blocks (every
//! code pattern, with sane finite `f16` scales), and for the types gguf can quantize (Q4_0, Q4_1,
//! Q5_0, Q5_1, Q8_0) the blocks gguf makes from random floats. Without python3 and gguf the test
//! fails, naming the package to install.

mod common;
use common::Rng;
use std::path::{Path, PathBuf};
use std::process::Command;
use tp_cpu::quant::{QuantType, dequantize};
use tp_cpu::{CpuKernel, Error, with_kernel};

/// Reads `jobs.txt` in the folder given as its argument: `deq NAME TYPE` dequantizes `NAME.bin`
/// into `NAME.out` (f32); `quant NAME TYPE` quantizes the f32 `NAME.f32` into `NAME.q` and
/// dequantizes that into `NAME.out`.
const SCRIPT: &str = r#"
import os, sys
try:
    import numpy as np
    import gguf.quants
    from gguf import GGMLQuantizationType as T
except ImportError as e:
    sys.stderr.write(f"{e}\n")
    sys.exit(3)
folder = sys.argv[1]
for line in open(os.path.join(folder, "jobs.txt")):
    op, name, ty = line.split()
    t = T[ty]
    size = gguf.GGML_QUANT_SIZES[t][1]
    path = lambda ext: os.path.join(folder, name + ext)
    if op == "quant":
        q = gguf.quants.quantize(np.fromfile(path(".f32"), dtype=np.float32).reshape(-1, 256), t)
        raw = np.ascontiguousarray(q).reshape(-1)
        raw.tofile(path(".q"))
    else:
        raw = np.fromfile(path(".bin"), dtype=np.uint8)
    out = gguf.quants.dequantize(raw.reshape(-1, size), t)
    np.asarray(out, dtype=np.float32).reshape(-1).tofile(path(".out"))
"#;

/// Byte offsets of the `f16` scales of each type's block (set to sane values in raw blocks).
fn scale_offsets(t: QuantType) -> &'static [usize] {
    match t {
        QuantType::Q4_0 | QuantType::Q5_0 | QuantType::Q8_0 => &[0],
        QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q4K | QuantType::Q5K => &[0, 2],
        QuantType::Q2K => &[80, 82],
        QuantType::Q3K => &[108],
        QuantType::Q6K => &[208],
        // MXFP4's E8M0 scale byte: every value is a finite power of two (or 0), kept random.
        QuantType::F32 | QuantType::F16 | QuantType::BF16 | QuantType::Mxfp4 => &[],
    }
}

/// `blocks` random raw blocks of `t` (floats: random finite values of every magnitude).
fn raw_blocks(t: QuantType, blocks: usize, rng: &mut Rng) -> Vec<u8> {
    let bb = t.block_bytes();
    let mut out = Vec::with_capacity(blocks * bb);
    for _ in 0..blocks {
        let start = out.len();
        out.extend((0..bb).map(|_| rng.next() as u8));
        let block = &mut out[start..];
        for &at in scale_offsets(t) {
            block[at..at + 2].copy_from_slice(&rng.scale());
        }
        // Float elements: clear an all-ones exponent (no infinities or NaNs).
        match t {
            QuantType::F32 if block[3] & 0x7F == 0x7F && block[2] & 0x80 != 0 => block[3] &= 0xBF,
            QuantType::F16 if block[1] & 0x7C == 0x7C => block[1] &= 0xBF,
            QuantType::BF16 if block[1] & 0x7F == 0x7F && block[0] & 0x80 != 0 => block[1] &= 0xBF,
            _ => {}
        }
    }
    out
}

fn python(folder: &Path) {
    let hint = "the dequantization reference is the gguf Python package: pip install gguf==0.19.0";
    let out = Command::new("python3")
        .arg("-c")
        .arg(SCRIPT)
        .arg(folder)
        .output()
        .unwrap_or_else(|e| panic!("cannot run python3 ({e}); {hint}"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    match out.status.code() {
        Some(0) => {}
        Some(3) => panic!("python3 cannot import gguf / numpy ({}); {hint}", stderr.trim()),
        _ => panic!("the gguf reference script failed ({}): {stderr}\n({hint})", out.status),
    }
}

fn read_f32(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

/// Ours against gguf's output, bit for bit, on every kernel family (the portable and the
/// vectorised builds of the conversion).
fn compare(t: QuantType, what: &str, raw: &[u8], want: &[f32]) {
    for kernel in CpuKernel::available() {
        let mut got = vec![f32::NAN; raw.len() / t.block_bytes() * t.block_elems()];
        with_kernel(kernel, || dequantize(t, raw, &mut got)).unwrap().unwrap();
        assert_eq!(got.len(), want.len(), "{t} {what}: element count");
        if let Some(i) = got.iter().zip(want).position(|(a, b)| a.to_bits() != b.to_bits()) {
            let block = i / t.block_elems();
            panic!(
                "{t} {what} ({kernel}): element {i} (block {block}) is {} ({:#x}), gguf says {} ({:#x})",
                got[i],
                got[i].to_bits(),
                want[i],
                want[i].to_bits()
            );
        }
    }
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn dequantize_is_bit_exact_with_gguf() {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let dir = TempDir(std::env::temp_dir().join(format!("tp-quant-{}-{nanos}", std::process::id())));
    std::fs::create_dir_all(&dir.0).unwrap();
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let mut jobs = String::new();
    let mut cases = Vec::new();
    for t in QuantType::ALL {
        // Several hundred blocks (K-quants), or as many elements (legacy, floats).
        let blocks = 600 * 256 / t.block_elems().max(32);
        let raw = raw_blocks(t, blocks, &mut rng);
        std::fs::write(dir.0.join(format!("raw_{t}.bin")), &raw).unwrap();
        jobs += &format!("deq raw_{t} {t}\n");
        cases.push((t, format!("raw_{t}"), Some(raw)));
        if matches!(t, QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q5_0 | QuantType::Q5_1 | QuantType::Q8_0) {
            // Floats of mixed scales: 600 blocks of 32, each block its own magnitude.
            let x: Vec<f32> = (0..600 * 32).map(|i| rng.unit() * 10f32.powi(i / 32 % 7 - 3)).collect();
            let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
            std::fs::write(dir.0.join(format!("q_{t}.f32")), bytes).unwrap();
            jobs += &format!("quant q_{t} {t}\n");
            cases.push((t, format!("q_{t}"), None));
        }
    }
    std::fs::write(dir.0.join("jobs.txt"), jobs).unwrap();
    python(&dir.0);
    for (t, name, raw) in cases {
        let raw = raw.unwrap_or_else(|| std::fs::read(dir.0.join(format!("{name}.q"))).unwrap());
        let want = read_f32(&dir.0.join(format!("{name}.out")));
        compare(t, &name, &raw, &want);
    }
}

#[test]
fn dequantize_refuses_partial_blocks_and_wrong_lengths() {
    let mut dst = vec![0f32; 64];
    assert_eq!(
        dequantize(QuantType::Q4_0, &[0u8; 35], &mut dst),
        Err(Error::NotWholeBlocks { ty: "Q4_0", operand: "src", len: 35, block: 18, unit: "bytes" })
    );
    assert_eq!(
        dequantize(QuantType::Q6K, &[0u8; 210], &mut dst),
        Err(Error::QuantLength { ty: "Q6_K", operand: "dst", unit: "elements", expected: 256, got: 64 })
    );
    assert!(dequantize(QuantType::Q4_0, &[0u8; 36], &mut dst).is_ok());
    assert!(dequantize(QuantType::F32, &[], &mut []).is_ok());
}

/// The ggml numbers, names and sizes of every type (`ggml.h`, `ggml.c`'s type traits).
#[test]
fn types_carry_ggml_ids_names_and_sizes() {
    let table = [
        (QuantType::F32, 0, "F32", 1, 4),
        (QuantType::F16, 1, "F16", 1, 2),
        (QuantType::BF16, 30, "BF16", 1, 2),
        (QuantType::Q4_0, 2, "Q4_0", 32, 18),
        (QuantType::Q4_1, 3, "Q4_1", 32, 20),
        (QuantType::Q5_0, 6, "Q5_0", 32, 22),
        (QuantType::Q5_1, 7, "Q5_1", 32, 24),
        (QuantType::Q8_0, 8, "Q8_0", 32, 34),
        (QuantType::Q2K, 10, "Q2_K", 256, 84),
        (QuantType::Q3K, 11, "Q3_K", 256, 110),
        (QuantType::Q4K, 12, "Q4_K", 256, 144),
        (QuantType::Q5K, 13, "Q5_K", 256, 176),
        (QuantType::Q6K, 14, "Q6_K", 256, 210),
        (QuantType::Mxfp4, 39, "MXFP4", 32, 17),
    ];
    assert_eq!(table.map(|r| r.0), QuantType::ALL);
    for (t, id, name, elems, bytes) in table {
        assert_eq!((t.ggml_id(), t.name(), t.block_elems(), t.block_bytes()), (id, name, elems, bytes));
        assert_eq!(QuantType::from_ggml_id(id), Some(t));
        assert_eq!(t.row_bytes(elems * 3), Some(bytes * 3));
    }
    assert_eq!(QuantType::Q4K.row_bytes(255), None);
    assert_eq!(QuantType::F32.row_bytes(usize::MAX / 2), None, "overflow");
    for id in [4, 5, 9, 15, 16, 29, 31, 1000] {
        assert_eq!(QuantType::from_ggml_id(id), None);
    }
}
