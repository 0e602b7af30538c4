//! RMSNorm, in the two ways decoders apply its weight ([`NormStyle`]).
//!
//! For each row `x` of the last dim (length `H`), with `rstd = (mean(x²) + eps)^-1/2` in f32:
//!
//! * [`NormStyle::Weight`] (Hugging Face's `LlamaRMSNorm`; Qwen, Mistral, Phi-3, OLMo 2):
//!   `y = round(w ⊙ round(x · rstd))`: the normalisation rounded to the input dtype before the
//!   product with the weight, whose result is rounded again (`weight * hidden_states.to(dtype)`).
//! * [`NormStyle::OnePlusWeight`] (Gemma's `Gemma3RMSNorm`): `y = round(x · rstd · (1 + w))`,
//!   all in f32 and rounded once (`(x.float() * rstd * (1.0 + w.float())).type_as(x)`).
//! * [`NormStyle::WeightF32`] (OLMo 2's `Olmo2RMSNorm`): `y = round(w ⊙ (x · rstd))`, the
//!   weight product in f32 and rounded once (`(weight * hidden_states).to(input_dtype)`).
//!
//! In f32 every rounding is a no-op. The mean may come from outside ([`Tensor::rms_norm_with`]
//! with a sum of squares over `n` features): a norm over features split across ranks, whose
//! per-row sums of squares ([`Tensor::sum_squares`]) the ranks add up first.

use super::grad::cuda_float;
use crate::storage::{CpuStorage, Storage};
use crate::{DType, Element, Error, Result, Tensor, with_dtype};

/// How an RMSNorm applies its weight `w` (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NormStyle {
    /// `w ⊙ round(x · rstd)`, two roundings (Llama and most others).
    #[default]
    Weight,
    /// `round(x · rstd · (1 + w))` in f32, one rounding (Gemma).
    OnePlusWeight,
    /// `round(w ⊙ (x · rstd))` in f32, one rounding (OLMo 2).
    WeightF32,
}

impl NormStyle {
    /// The kernels' code for the style.
    pub(crate) fn code(self) -> i32 {
        match self {
            NormStyle::Weight => 0,
            NormStyle::OnePlusWeight => 1,
            NormStyle::WeightF32 => 2,
        }
    }
}

impl Tensor {
    /// RMSNorm over the last dim with weight `w: [H]` (same dtype and device) and `eps >= 0`,
    /// in Llama's style: `rms_norm_with(w, eps, NormStyle::Weight, None)`.
    pub fn rms_norm(&self, weight: &Tensor, eps: f64) -> Result<Tensor> {
        self.rms_norm_with(weight, eps, NormStyle::Weight, None)
    }

    /// RMSNorm over the last dim with weight `w: [H]` applied in `style`. With `stats = (s, n)`
    /// the mean of squares of row `i` is `s[i] / n` (`s: [rows]`, f32, on the same device)
    /// instead of the row's own: the rows hold `H` of `n` features, the rest on other ranks.
    ///
    /// Errors: [`Error::RankMismatch`] for a scalar, [`Error::ShapeMismatch`] if `w` is not
    /// `[H]` or `s` not `[rows]`, dtype/device mismatches, [`Error::InvalidArgument`] for a
    /// negative or non-finite `eps` or `n == 0`, [`Error::NotFloat`] for integer tensors.
    pub fn rms_norm_with(
        &self,
        weight: &Tensor,
        eps: f64,
        style: NormStyle,
        stats: Option<(&Tensor, usize)>,
    ) -> Result<Tensor> {
        const OP: &str = "rms_norm";
        self.require_float()?;
        super::same_dtype_device(OP, self, weight)?;
        let h = *self.dims().last().ok_or(Error::RankMismatch { op: OP, expected: "at least 1", dims: vec![] })?;
        if weight.dims() != [h] {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.dims().to_vec(),
                rhs: weight.dims().to_vec(),
                why: "the weight must be [H] for an input [.., H]",
            });
        }
        if !(eps.is_finite() && eps >= 0.0 && (eps as f32).is_finite()) {
            return Err(Error::InvalidArgument { op: OP, why: format!("eps must be finite and >= 0, got {eps}") });
        }
        let rows = self.numel().checked_div(h).unwrap_or(0);
        let stats = match stats {
            None => None,
            Some((s, n)) => {
                if s.dtype() != DType::F32 || s.device() != self.device() {
                    return Err(Error::InvalidArgument {
                        op: OP,
                        why: format!(
                            "sums of squares must be f32 on {}, got {} on {}",
                            self.device(),
                            s.dtype(),
                            s.device()
                        ),
                    });
                }
                if s.dims() != [rows] || n == 0 {
                    return Err(Error::ShapeMismatch {
                        op: OP,
                        lhs: self.dims().to_vec(),
                        rhs: s.dims().to_vec(),
                        why: "sums of squares must be [rows] over n > 0 features",
                    });
                }
                Some((s, n))
            }
        };
        if let (Storage::Cuda(x), Storage::Cuda(w)) = (self.storage(), weight.storage()) {
            let stats = match stats {
                Some((s, n)) => match s.storage() {
                    Storage::Cuda(s) => Some((s, n)),
                    Storage::Cpu(_) => {
                        return Err(Error::DeviceMismatch { op: OP, lhs: self.device(), rhs: s.device() });
                    }
                },
                None => None,
            };
            let out = super::cuda::rms_norm(x, w, rows, h, eps as f32, style, stats)?;
            return Ok(Tensor::from_cuda(self.shape().clone(), out));
        }
        let (x, w) = (self.cpu_storage(OP)?, weight.cpu_storage(OP)?);
        let means: Option<Vec<f32>> = match stats {
            Some((s, n)) => {
                Some(s.cpu_storage(OP)?.as_slice::<f32>().unwrap_or_default().iter().map(|v| v / n as f32).collect())
            }
            None => None,
        };
        let out = with_dtype!(x.dtype(), T => {
            let (xs, ws) = (x.as_slice::<T>().unwrap_or_default(), w.as_slice::<T>().unwrap_or_default());
            CpuStorage::from_vec(host_rms_norm::<T>(xs, ws, h, eps as f32, style, means.as_deref())?)
        });
        Ok(Tensor::from_cpu(self.shape().clone(), out))
    }

    /// Each row's sum of squares over the last dim, `[..]` in f32 (accumulated in f64 on the
    /// host, f32 on the GPU): the statistic of an RMSNorm whose features are split across ranks.
    ///
    /// Errors: [`Error::RankMismatch`] for a scalar, [`Error::NotFloat`].
    pub fn sum_squares(&self) -> Result<Tensor> {
        const OP: &str = "sum_squares";
        self.require_float()?;
        let (&h, lead) =
            self.dims().split_last().ok_or(Error::RankMismatch { op: OP, expected: "at least 1", dims: vec![] })?;
        let rows: usize = lead.iter().product();
        let shape = crate::Shape::new(lead)?;
        if let Storage::Cuda(x) = self.storage() {
            return Ok(Tensor::from_cuda(shape, super::cuda::sum_squares(x, rows, h)?));
        }
        let x = self.cpu_storage(OP)?;
        let out: Vec<f32> = with_dtype!(x.dtype(), T => {
            let xs = x.as_slice::<T>().unwrap_or_default();
            (0..rows).map(|r| xs[r * h..(r + 1) * h].iter().map(|v| f64::from(v.to_f32()).powi(2)).sum::<f64>() as f32).collect()
        });
        Ok(Tensor::from_cpu(shape, CpuStorage::from_vec(out)))
    }
}

/// The host RMSNorm of every row of `x` (rows of `h` elements); the sum of squares is taken in
/// f64, the rest in f32 as on the GPU. `means`: each row's mean of squares, given.
fn host_rms_norm<T: Element>(
    x: &[T],
    w: &[T],
    h: usize,
    eps: f32,
    style: NormStyle,
    means: Option<&[f32]>,
) -> Result<Vec<T>> {
    const BLOCK: usize = 256;
    let mut out = crate::alloc::zeroed::<T>("rms_norm", x.len())?;
    let w: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
    // Rows are independent: spread over the pool, each row computed as on one thread.
    super::par::rows(&mut out, h.max(1), 2 * h, |r0, chunk| {
        let (mut v, mut t) = ([0f32; BLOCK], [T::from_f32(0.0); BLOCK]);
        for (i, o) in chunk.chunks_exact_mut(h.max(1)).enumerate() {
            let r = r0 + i;
            let row = &x[r * h..(r + 1) * h];
            let mean = match means {
                Some(m) => m[r],
                None => (row.iter().map(|v| f64::from(v.to_f32()).powi(2)).sum::<f64>() / h as f64) as f32,
            };
            let rstd = 1.0 / (mean + eps).sqrt();
            // The same roundings element by element, in f32 blocks widened and narrowed whole.
            for ((o, row), w) in o.chunks_mut(BLOCK).zip(row.chunks(BLOCK)).zip(w.chunks(BLOCK)) {
                let (v, t) = (&mut v[..o.len()], &mut t[..o.len()]);
                T::slice_to_f32(row, v);
                match style {
                    NormStyle::Weight => {
                        v.iter_mut().for_each(|v| *v *= rstd);
                        T::slice_from_f32(v, t); // rounding point 1: to the input dtype
                        T::slice_to_f32(t, v);
                        v.iter_mut().zip(w).for_each(|(v, w)| *v *= w); // rounding point 2: below
                    }
                    NormStyle::OnePlusWeight => v.iter_mut().zip(w).for_each(|(v, w)| *v = *v * rstd * (1.0 + w)),
                    NormStyle::WeightF32 => v.iter_mut().zip(w).for_each(|(v, w)| *v = w * (*v * rstd)),
                }
                T::slice_from_f32(v, o);
            }
        }
    });
    Ok(out)
}

/// The weight as the style applies it: `w`, or Gemma's `1 + w`.
fn applied_weight(w: &[f32], style: NormStyle) -> Vec<f32> {
    match style {
        NormStyle::Weight | NormStyle::WeightF32 => w.to_vec(),
        NormStyle::OnePlusWeight => w.iter().map(|v| 1.0 + v).collect(),
    }
}

/// Backward of the RMSNorm (training; f32 results, on the host or the GPU: `kernels/grad.cu`,
/// `dw` as a deterministic two-pass column sum).
///
/// With `r = (mean(x²) + eps)^-1/2` per row, `w'` the applied weight (`w` or `1 + w`) and
/// `g = dy ⊙ w'`:
///
/// * `dx = r · g - x · r³ · (Σ_i g_i x_i) / n`
/// * `dw = Σ_rows dy ⊙ x · r` (the same for both styles, `d(1 + w)/dw = 1`)
///
/// where `n` and the sum `Σ_i g_i x_i` run over the row's full width. For a norm whose features
/// are split across ranks, each rank computes its part of the sum ([`Tensor::rms_norm_grad_dot`]),
/// the ranks add them up, and [`Tensor::rms_norm_backward`] takes the total with the statistics
/// of the forward.
impl Tensor {
    /// `Σ_i g_i x_i` of every row of `self = x: [.., H]`, `g = dy ⊙ w'`: `[rows]` f32 (summed in
    /// f64 on the host, f32 on a GPU). This rank's part of the sum a split norm's backward needs.
    ///
    /// Errors: shapes as [`rms_norm_with`](Tensor::rms_norm_with), `dy` not shaped as `x`,
    /// operands on different devices.
    pub fn rms_norm_grad_dot(&self, weight: &Tensor, dy: &Tensor, style: NormStyle) -> Result<Tensor> {
        const OP: &str = "rms_norm_grad_dot";
        let (rows, h) = norm_grad_shapes(OP, self, weight, dy)?;
        if let Storage::Cuda(x) = self.storage() {
            self.require_float()?;
            let (w, g) = (cuda_float(OP, self, weight)?, cuda_float(OP, self, dy)?);
            let out = super::cuda::rms_norm_grad_dot(x, w, g, (rows, h), style)?;
            return Ok(Tensor::from_cuda(crate::Shape::new(&[rows])?, out));
        }
        let (x, w, dy) = (f32_of(OP, self)?, f32_of(OP, weight)?, f32_of(OP, dy)?);
        let (x, dy) = (x.as_slice::<f32>()?, dy.as_slice::<f32>()?);
        let w = applied_weight(w.as_slice::<f32>()?, style);
        let mut dots = vec![0f32; rows];
        super::par::rows(&mut dots, 1, h, |r0, chunk| {
            for (i, o) in chunk.iter_mut().enumerate() {
                let r = r0 + i;
                let (xr, gr) = (&x[r * h..(r + 1) * h], &dy[r * h..(r + 1) * h]);
                *o =
                    xr.iter().zip(gr).zip(&w).map(|((&x, &g), &w)| f64::from(g * w) * f64::from(x)).sum::<f64>() as f32;
            }
        });
        Tensor::from_vec(dots, &[rows], &crate::Device::Cpu)
    }

    /// `(dx, dw)` of [`rms_norm_with`](Tensor::rms_norm_with)`(self, weight, eps, style, ..)`
    /// given `dy`, both f32: `dx` shaped as `self`, `dw: [H]` summed over the rows (see the
    /// docs above). `split = Some((sum_sq, n, dot))` for a norm over features split across
    /// ranks: the forward's sums of squares `sum_sq: [rows]` over `n` features, and the total
    /// of [`rms_norm_grad_dot`](Tensor::rms_norm_grad_dot) over the ranks, `dot: [rows]`.
    ///
    /// Errors: as [`rms_norm_grad_dot`](Tensor::rms_norm_grad_dot), statistics not `[rows]`, `n == 0`.
    pub fn rms_norm_backward(
        &self,
        weight: &Tensor,
        dy: &Tensor,
        eps: f64,
        style: NormStyle,
        split: Option<(&Tensor, usize, &Tensor)>,
    ) -> Result<(Tensor, Tensor)> {
        const OP: &str = "rms_norm_backward";
        let (rows, h) = norm_grad_shapes(OP, self, weight, dy)?;
        if let Storage::Cuda(x) = self.storage() {
            self.require_float()?;
            let (w, g) = (cuda_float(OP, self, weight)?, cuda_float(OP, self, dy)?);
            let split = match split {
                None => None,
                Some((ss, n, dot)) => {
                    if ss.dims() != [rows] || dot.dims() != [rows] || n == 0 {
                        return Err(Error::ShapeMismatch {
                            op: OP,
                            lhs: self.dims().to_vec(),
                            rhs: ss.dims().to_vec(),
                            why: "a split norm's statistics must be [rows] over n > 0 features",
                        });
                    }
                    Some((cuda_float(OP, self, ss)?, n, cuda_float(OP, self, dot)?))
                }
            };
            let (dx, dw) = super::cuda::rms_norm_backward(x, w, g, (rows, h), eps as f32, style, split)?;
            return Ok((Tensor::from_cuda(self.shape().clone(), dx), Tensor::from_cuda(crate::Shape::new(&[h])?, dw)));
        }
        let (xt, wt, dyt) = (f32_of(OP, self)?, f32_of(OP, weight)?, f32_of(OP, dy)?);
        let (x, dy) = (xt.as_slice::<f32>()?, dyt.as_slice::<f32>()?);
        let w = applied_weight(wt.as_slice::<f32>()?, style);
        let split = match split {
            None => None,
            Some((ss, n, dot)) => {
                let (ss, dot) = (f32_of(OP, ss)?, f32_of(OP, dot)?);
                if ss.dims() != [rows] || dot.dims() != [rows] || n == 0 {
                    return Err(Error::ShapeMismatch {
                        op: OP,
                        lhs: self.dims().to_vec(),
                        rhs: ss.dims().to_vec(),
                        why: "a split norm's statistics must be [rows] over n > 0 features",
                    });
                }
                Some((ss, n, dot))
            }
        };
        let eps = eps as f32;
        let split = match &split {
            Some((ss, n, dot)) => Some((ss.as_slice::<f32>()?, *n, dot.as_slice::<f32>()?)),
            None => None,
        };
        // Each row's rstd and c = rstd³ · dot / n.
        let mut stats = vec![[0f32; 2]; rows];
        super::par::rows(&mut stats, 1, h, |r0, chunk| {
            for (i, st) in chunk.iter_mut().enumerate() {
                let r = r0 + i;
                let (xr, dyr) = (&x[r * h..(r + 1) * h], &dy[r * h..(r + 1) * h]);
                let (mean, n, dot) = match split {
                    Some((ss, n, dot)) => (ss[r] / n as f32, n, dot[r]),
                    None => {
                        let ms = (xr.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / h as f64) as f32;
                        let dot = xr.iter().zip(dyr).zip(&w).map(|((&x, &g), &w)| f64::from(g * w) * f64::from(x));
                        (ms, h, dot.sum::<f64>() as f32)
                    }
                };
                let rstd = 1.0 / (mean + eps).sqrt();
                *st = [rstd, rstd * rstd * rstd * dot / n as f32];
            }
        });
        let mut dx = vec![0f32; rows * h];
        super::par::rows(&mut dx, h, h, |r0, chunk| {
            for (i, o) in chunk.chunks_exact_mut(h.max(1)).enumerate() {
                let r = r0 + i;
                let [rstd, c] = stats[r];
                let (xr, dyr) = (&x[r * h..(r + 1) * h], &dy[r * h..(r + 1) * h]);
                for j in 0..h {
                    o[j] = rstd * dyr[j] * w[j] - xr[j] * c;
                }
            }
        });
        let dw = super::par::col_sums(rows, h, |r, j| f64::from(dy[r * h + j] * x[r * h + j] * stats[r][0]));
        let cpu = crate::Device::Cpu;
        Ok((Tensor::from_vec(dx, self.dims(), &cpu)?, Tensor::from_vec(dw, &[h], &cpu)?))
    }
}

fn f32_of(op: &'static str, t: &Tensor) -> Result<Tensor> {
    super::grad::f32_host(op, t)
}

/// `(rows, H)` of a norm's backward inputs, checked.
fn norm_grad_shapes(op: &'static str, x: &Tensor, w: &Tensor, dy: &Tensor) -> Result<(usize, usize)> {
    let (rows, h) = super::grad::rows_cols(op, x)?;
    if w.dims() != [h] || dy.dims() != x.dims() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: x.dims().to_vec(),
            rhs: dy.dims().to_vec(),
            why: "needs x and dy of one shape [.., H] and a weight [H]",
        });
    }
    Ok((rows, h))
}
