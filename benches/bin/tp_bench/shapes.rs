//! The named shape sets of tp-bench, and `--shapes` / `--dtype` parsing.

use anyhow::{Result, bail};
use tp_core::DType;

/// One GEMM problem `C[M,N] = A[M,K] B[N,K]^T`, with a label saying where it comes from.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemm {
    pub label: String,
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

impl Gemm {
    fn new(label: impl Into<String>, m: usize, n: usize, k: usize) -> Gemm {
        Gemm { label: label.into(), m, n, k }
    }
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }
    /// Bytes that must move at least once: A, B and C.
    pub fn bytes(&self, elem: usize) -> f64 {
        ((self.m * self.k + self.n * self.k + self.m * self.n) * elem) as f64
    }
    pub fn shape(&self) -> String {
        format!("{}x{}x{}", self.m, self.n, self.k)
    }
}

/// Square problems from `lo` to `hi` (powers of two).
pub fn squares(lo: usize, hi: usize) -> Vec<Gemm> {
    std::iter::successors(Some(lo), |s| Some(s * 2))
        .take_while(|&s| s <= hi)
        .map(|s| Gemm::new("square", s, s, s))
        .collect()
}

/// (model, hidden, intermediate, fused QKV width) for Llama 3 8B and 70B.
const MODELS: [(&str, usize, usize, usize); 2] = [("8B", 4096, 14336, 6144), ("70B", 8192, 28672, 10240)];

/// Tensor-parallel inference shapes: for each model, TP degree and token count, the four
/// projections as one rank sees them: column-parallel QKV (`N = qkv/tp`, `K = hidden`) and
/// merged gate/up (`N = 2·inter/tp`), row-parallel output (`N = hidden`, `K = hidden/tp`) and
/// down (`K = inter/tp`).
pub fn tensor_parallel(models: &[&str], tps: &[usize], tokens: &[usize]) -> Vec<Gemm> {
    let mut v = Vec::new();
    for &(name, h, i, qkv) in MODELS.iter().filter(|m| models.contains(&m.0)) {
        for &tp in tps {
            for &m in tokens {
                v.push(Gemm::new(format!("{name} qkv tp{tp}"), m, qkv / tp, h));
                v.push(Gemm::new(format!("{name} o tp{tp}"), m, h, h / tp));
                v.push(Gemm::new(format!("{name} gate_up tp{tp}"), m, 2 * i / tp, h));
                v.push(Gemm::new(format!("{name} down tp{tp}"), m, h, i / tp));
            }
        }
    }
    v
}

/// The default sets. GPU: squares 1024..16384 and every TP shape (quick: 2 squares, 8B at TP 2
/// with 1 and 128 tokens). CPU: squares 256..2048 and 8B at TP 2 (quick: squares to 1024 and
/// the 8B QKV projection at TP 2 with 1 and 128 tokens).
pub fn default_set(gpu: bool, quick: bool) -> Vec<Gemm> {
    match (gpu, quick) {
        (true, false) => {
            let mut v = squares(1024, 16384);
            v.extend(tensor_parallel(&["8B", "70B"], &[1, 2, 4, 8], &[1, 16, 64, 128, 256, 1024, 4096]));
            v
        }
        (true, true) => {
            let mut v = squares(2048, 4096);
            v.extend(tensor_parallel(&["8B"], &[2], &[1, 128]));
            v
        }
        (false, false) => {
            let mut v = squares(256, 2048);
            v.extend(
                tensor_parallel(&["8B"], &[2], &[1, 16, 128])
                    .into_iter()
                    .filter(|g| g.label.contains("qkv") || g.label.contains("down")),
            );
            v
        }
        (false, true) => {
            let mut v = squares(256, 1024);
            v.extend(tensor_parallel(&["8B"], &[2], &[1, 128]).into_iter().filter(|g| g.label.contains("qkv")));
            v
        }
    }
}

/// `--shapes`: `squares`, `tp`, `all` (the defaults' parts), or a comma list of `MxNxK`.
pub fn parse_shapes(spec: &str, gpu: bool, quick: bool) -> Result<Vec<Gemm>> {
    let all = default_set(gpu, quick);
    match spec {
        "all" => return Ok(all),
        "squares" => return Ok(all.into_iter().filter(|g| g.label == "square").collect()),
        "tp" => return Ok(all.into_iter().filter(|g| g.label != "square").collect()),
        _ => {}
    }
    spec.split(',')
        .map(|s| {
            let d: Vec<usize> = s
                .split('x')
                .map(|v| v.trim().parse())
                .collect::<Result<_, _>>()
                .map_err(|_| anyhow::anyhow!("bad shape {s:?}: use MxNxK"))?;
            match d[..] {
                [m, n, k] if m > 0 && n > 0 && k > 0 => Ok(Gemm::new("custom", m, n, k)),
                _ => bail!("bad shape {s:?}: use MxNxK with positive sizes"),
            }
        })
        .collect()
}

/// `--dtype`: a comma list of f32, f16, bf16.
pub fn parse_dtypes(spec: &str) -> Result<Vec<DType>> {
    spec.split(',').map(|s| s.trim().parse::<DType>().map_err(|e| anyhow::anyhow!("--dtype: {e}"))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tp_shapes_follow_the_sharding() {
        let v = tensor_parallel(&["70B"], &[8], &[16]);
        let find = |l: &str| v.iter().find(|g| g.label.contains(l)).unwrap().clone();
        assert_eq!((find("qkv").n, find("qkv").k), (1280, 8192));
        assert_eq!((find("gate_up").n, find("gate_up").k), (7168, 8192));
        assert_eq!((find("down").n, find("down").k), (8192, 3584));
        assert_eq!((find(" o ").n, find(" o ").k), (8192, 1024));
        assert_eq!(default_set(true, false).len(), 5 + 2 * 4 * 7 * 4);
    }

    #[test]
    fn shape_specs_parse() {
        assert_eq!(parse_shapes("3x5x7", false, true).unwrap(), vec![Gemm::new("custom", 3, 5, 7)]);
        assert!(parse_shapes("3x5", false, true).is_err());
        assert!(parse_shapes("0x5x7", false, true).is_err());
        assert_eq!(parse_dtypes("bf16,f32").unwrap(), vec![DType::BF16, DType::F32]);
        assert!(parse_dtypes("f64").is_err());
    }
}
