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

/// `Σ_j e^{row_j - max}` (every exponent <= 0), in f32 over blocks of 64 (vectorised), the
/// blocks added in f64.
fn sum_exp(row: &[f32], max: f32) -> f64 {
    row.chunks(64).map(|c| f64::from(c.iter().map(|&v| exp_neg(v - max)).sum::<f32>())).sum()
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
                let inv = w / s[r];
                let mr = m[r];
                dst.iter_mut().zip(&x[r * n..(r + 1) * n]).for_each(|(d, &v)| *d = exp_neg(v - mr) * inv);
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
                let (inv, mr) = (w / s[r], m[r]);
                row.iter_mut().for_each(|v| *v = exp_neg(*v - mr) * inv);
                if let Some(j) = targets[r] {
                    row[j] -= w;
                }
            }
        });
        Ok(())
    }
}
