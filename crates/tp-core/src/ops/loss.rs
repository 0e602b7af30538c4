//! The host pieces of a vocab-parallel cross-entropy (training; f32).
//!
//! A rank holds columns `[v_r, v_{r+1})` of the logits `L: [T, V]`. For row `t` with target
//! `y_t`: `loss_t = log Σ_j e^{L_tj} - L_{t,y_t} = M_t + log S_t - L_{t,y_t}` with
//! `M_t = max_j L_tj` and `S_t = Σ_j e^{L_tj - M_t}`. Each term is a sum or a maximum over the
//! columns, so each rank computes its part on its own columns ([`Tensor::row_max`], then
//! [`Tensor::cross_entropy_parts`] with the global maximum) and the ranks reduce `O(T)`
//! numbers; the logits never move. The gradient is local too:
//! `dL_tj = w_t · (e^{L_tj - M_t} / S_t - [j = y_t])` on the rank's own columns
//! ([`Tensor::cross_entropy_backward`]), `w_t` the row's weight in the loss.
//!
//! On a GPU each piece is one kernel (`kernels/loss.cu`), one block per row reading each logit
//! once; the statistics (`max`, `sum_exp`) are then expected on the same GPU.

use super::attention::exp_neg;
use super::grad::{cuda_float, f32_host, rows_cols};
use super::par;
use crate::storage::Storage;
use crate::{Device, Error, Result, Shape, Tensor};

/// `Σ_j e^{row_j - max}` (every exponent <= 0), in f32 over blocks of 64, the blocks added in
/// f64. With AVX-512 each block is sixteen lanes wide (lane `l` takes the elements
/// `j ≡ l (mod 16)` in order, then a fixed tree of the lanes), else element by element.
fn sum_exp(row: &[f32], max: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if simd::available() {
        // SAFETY: AVX-512F was detected at run time.
        return unsafe { simd::sum_exp(row, max) };
    }
    row.chunks(64).map(|c| f64::from(c.iter().map(|&v| exp_neg(v - max)).sum::<f32>())).sum()
}

/// `row[j] = e^{row_j - max} · scale`, each element's bits those of the scalar `exp_neg`.
fn scaled_exp(row: &mut [f32], max: f32, scale: f32) {
    #[cfg(target_arch = "x86_64")]
    if simd::available() {
        // SAFETY: AVX-512F was detected at run time.
        unsafe { simd::scaled_exp(row, max, scale) };
        return;
    }
    row.iter_mut().for_each(|v| *v = exp_neg(*v - max) * scale);
}

/// The AVX-512 loops of [`sum_exp`] and [`scaled_exp`] (sixteen lanes, a masked tail).
#[cfg(target_arch = "x86_64")]
mod simd {
    use super::super::paged_group::{exp_neg16, tree_sum};
    use std::arch::x86_64::*;

    /// Whether the host runs AVX-512F.
    pub(super) fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
    }

    /// The mask of the first `n` (at most 16) lanes.
    fn mask(n: usize) -> __mmask16 {
        if n >= 16 { 0xFFFF } else { ((1u32 << n) - 1) as __mmask16 }
    }

    /// See [`super::sum_exp`].
    ///
    /// # Safety
    /// AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn sum_exp(row: &[f32], max: f32) -> f64 {
        let mut total = 0f64;
        for block in row.chunks(64) {
            // SAFETY: each masked load reads only the block's own elements (`j0 + lanes <= len`).
            let lanes = unsafe {
                let (m, mut acc) = (_mm512_set1_ps(max), _mm512_setzero_ps());
                for j0 in (0..block.len()).step_by(16) {
                    let k = mask(block.len() - j0);
                    let x = _mm512_maskz_loadu_ps(k, block.as_ptr().add(j0));
                    acc = _mm512_mask_add_ps(acc, k, acc, exp_neg16(_mm512_sub_ps(x, m)));
                }
                let mut lanes = [0f32; 16];
                _mm512_storeu_ps(lanes.as_mut_ptr(), acc);
                lanes
            };
            total += f64::from(tree_sum(&lanes));
        }
        total
    }

    /// See [`super::scaled_exp`].
    ///
    /// # Safety
    /// AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scaled_exp(row: &mut [f32], max: f32, scale: f32) {
        let n = row.len();
        // SAFETY: each masked load and store touches only `row`'s elements (`j0 + lanes <= n`).
        unsafe {
            let (m, s) = (_mm512_set1_ps(max), _mm512_set1_ps(scale));
            for j0 in (0..n).step_by(16) {
                let k = mask(n - j0);
                let p = row.as_mut_ptr().add(j0);
                let e = exp_neg16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p), m));
                _mm512_mask_storeu_ps(p, k, _mm512_mul_ps(e, s));
            }
        }
    }
}

/// Checks that there is one target per row.
fn check_targets(op: &'static str, rows: usize, targets: &[Option<usize>], cols: usize) -> Result<()> {
    if targets.len() != rows || targets.iter().flatten().any(|&c| c >= cols) {
        return Err(Error::InvalidArgument {
            op,
            why: format!("needs one target per row ({rows} rows, got {}) within the {cols} columns", targets.len()),
        });
    }
    Ok(())
}

impl Tensor {
    /// The maximum of every row of `self: [.., N]`: `[rows]` f32 (`-inf` for `N = 0`).
    ///
    /// Errors: [`Error::NotFloat`], [`Error::RankMismatch`] for a scalar.
    pub fn row_max(&self) -> Result<Tensor> {
        const OP: &str = "row_max";
        let (rows, n) = rows_cols(OP, self)?;
        if let Storage::Cuda(x) = self.storage() {
            self.require_float()?;
            return Ok(Tensor::from_cuda(Shape::new(&[rows])?, super::cuda::row_max(x, rows, n)?));
        }
        let x = f32_host(OP, self)?;
        let x = x.as_slice::<f32>()?;
        let mut out = vec![f32::NEG_INFINITY; rows];
        par::rows(&mut out, 1, n, |r0, chunk| {
            for (i, o) in chunk.iter_mut().enumerate() {
                *o = x[(r0 + i) * n..(r0 + i + 1) * n].iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            }
        });
        Tensor::from_vec(out, &[rows], &Device::Cpu)
    }

    /// This rank's parts of the cross-entropy of the logit columns `self: [rows, N]`, given the
    /// rows' global maxima `max: [rows]`: `[2, rows]` f32 holding `Σ_j e^{L_tj - M_t}` over the
    /// local columns and the target's logit `L_{t,y_t}` where the target is a local column
    /// (`targets[t] = Some(j)`), else 0. Summed over the ranks they give `S_t` and `L_{t,y_t}`.
    ///
    /// Errors: `max` not `[rows]`, a target outside the columns, operands on different devices.
    pub fn cross_entropy_parts(&self, max: &Tensor, targets: &[Option<usize>]) -> Result<Tensor> {
        const OP: &str = "cross_entropy_parts";
        let (rows, n) = rows_cols(OP, self)?;
        check_targets(OP, rows, targets, n)?;
        if let Storage::Cuda(x) = self.storage() {
            self.require_float()?;
            let m = cuda_float(OP, self, max)?;
            if max.dims() != [rows] {
                return Err(Error::ShapeMismatch {
                    op: OP,
                    lhs: self.dims().to_vec(),
                    rhs: max.dims().to_vec(),
                    why: "max must be [rows]",
                });
            }
            let out = super::cuda::cross_entropy_parts(x, m, targets, (rows, n))?;
            return Ok(Tensor::from_cuda(Shape::new(&[2, rows])?, out));
        }
        let (x, m) = (f32_host(OP, self)?, f32_host(OP, max)?);
        if m.dims() != [rows] {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.dims().to_vec(),
                rhs: m.dims().to_vec(),
                why: "max must be [rows]",
            });
        }
        let (x, m) = (x.as_slice::<f32>()?, m.as_slice::<f32>()?);
        let mut pairs = vec![[0f32; 2]; rows];
        par::rows(&mut pairs, 1, n, |r0, chunk| {
            for (i, o) in chunk.iter_mut().enumerate() {
                let r = r0 + i;
                let row = &x[r * n..(r + 1) * n];
                *o = [sum_exp(row, m[r]) as f32, targets[r].map_or(0.0, |j| row[j])];
            }
        });
        let out: Vec<f32> = pairs.iter().map(|p| p[0]).chain(pairs.iter().map(|p| p[1])).collect();
        Tensor::from_vec(out, &[2, rows], &Device::Cpu)
    }

    /// The gradient of `Σ_t w_t · loss_t` with respect to this rank's logit columns
    /// `self: [rows, N]`: `w_t · (e^{L_tj - M_t} / S_t - [j = y_t])`, f32, from the global
    /// `max` and `sum_exp` (`[rows]` each); rows of weight 0 get zeros.
    ///
    /// Errors: statistics or weights not `[rows]`, a target outside the columns, operands on
    /// different devices.
    pub fn cross_entropy_backward(
        &self,
        max: &Tensor,
        sum_exp: &Tensor,
        targets: &[Option<usize>],
        weights: &[f32],
    ) -> Result<Tensor> {
        const OP: &str = "cross_entropy_backward";
        let (rows, n) = rows_cols(OP, self)?;
        check_targets(OP, rows, targets, n)?;
        if let Storage::Cuda(x) = self.storage() {
            self.require_float()?;
            let (m, s) = (cuda_float(OP, self, max)?, cuda_float(OP, self, sum_exp)?);
            if max.dims() != [rows] || sum_exp.dims() != [rows] || weights.len() != rows {
                return Err(Error::InvalidArgument {
                    op: OP,
                    why: format!("statistics and weights must have {rows} entries"),
                });
            }
            let out = super::cuda::cross_entropy_backward(x, (m, s), targets, weights, (rows, n))?;
            return Ok(Tensor::from_cuda(self.shape().clone(), out));
        }
        let (x, m, s) = (f32_host(OP, self)?, f32_host(OP, max)?, f32_host(OP, sum_exp)?);
        if m.dims() != [rows] || s.dims() != [rows] || weights.len() != rows {
            return Err(Error::InvalidArgument {
                op: OP,
                why: format!("statistics and weights must have {rows} entries"),
            });
        }
        let (x, m, s) = (x.as_slice::<f32>()?, m.as_slice::<f32>()?, s.as_slice::<f32>()?);
        let mut out = vec![0f32; rows * n];
        par::rows(&mut out, n, n, |r0, chunk| {
            for (i, dst) in chunk.chunks_exact_mut(n.max(1)).enumerate() {
                let r = r0 + i;
                let w = weights[r];
                if w == 0.0 {
                    continue;
                }
                dst.copy_from_slice(&x[r * n..(r + 1) * n]);
                scaled_exp(dst, m[r], w / s[r]);
                if let Some(j) = targets[r] {
                    dst[j] -= w;
                }
            }
        });
        Tensor::from_vec(out, self.dims(), &Device::Cpu)
    }
}

impl Tensor {
    /// [`cross_entropy_backward`](Tensor::cross_entropy_backward) written over the logits
    /// themselves (host, f32 logits not shared with another tensor: no second `[rows, N]`
    /// buffer); elsewhere the result replaces `self`.
    ///
    /// Errors: as `cross_entropy_backward`; on error `self` is unchanged.
    pub fn cross_entropy_backward_in_place(
        &mut self,
        max: &Tensor,
        sum_exp: &Tensor,
        targets: &[Option<usize>],
        weights: &[f32],
    ) -> Result<()> {
        const OP: &str = "cross_entropy_backward_in_place";
        let (rows, n) = rows_cols(OP, self)?;
        check_targets(OP, rows, targets, n)?;
        if self.dtype() != crate::DType::F32 || !matches!(self.storage(), Storage::Cpu(_)) {
            *self = self.cross_entropy_backward(max, sum_exp, targets, weights)?;
            return Ok(());
        }
        let (m, s) = (f32_host(OP, max)?, f32_host(OP, sum_exp)?);
        if m.dims() != [rows] || s.dims() != [rows] || weights.len() != rows {
            return Err(Error::InvalidArgument {
                op: OP,
                why: format!("statistics and weights must have {rows} entries"),
            });
        }
        let (m, s) = (m.as_slice::<f32>()?, s.as_slice::<f32>()?);
        let x = self.as_mut_slice::<f32>()?;
        par::rows(x, n, n, |r0, chunk| {
            for (i, row) in chunk.chunks_exact_mut(n.max(1)).enumerate() {
                let r = r0 + i;
                let w = weights[r];
                if w == 0.0 {
                    row.fill(0.0);
                    continue;
                }
                scaled_exp(row, m[r], w / s[r]);
                if let Some(j) = targets[r] {
                    row[j] -= w;
                }
            }
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows of every length around the 16-lane and 64-element blocks: the sum within 1e-6 of
    /// float64's, and each scaled exponential the scalar `exp_neg`'s bits.
    #[test]
    fn sums_and_scaled_exponentials_match_the_scalar_reference() {
        let mut rng = crate::rng::SplitMix64::new(5);
        for n in [1, 15, 16, 17, 63, 64, 65, 200, 1000] {
            let row: Vec<f32> = (0..n).map(|_| (rng.next_u64() % 20_000) as f32 / 1000.0 - 10.0).collect();
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let want: f64 = row.iter().map(|&v| (f64::from(v) - f64::from(max)).exp()).sum();
            let got = sum_exp(&row, max);
            assert!((got - want).abs() <= 1e-6 * want, "n {n}: {got} vs {want}");
            let mut scaled = row.clone();
            scaled_exp(&mut scaled, max, 0.37);
            for (j, (&g, &v)) in scaled.iter().zip(&row).enumerate() {
                assert_eq!(g.to_bits(), (exp_neg(v - max) * 0.37).to_bits(), "n {n} element {j}");
            }
        }
    }
}
