//! Rotary position embedding (RoPE) in Llama's "rotate half" convention, with the `llama3`
//! frequency scaling of Llama 3.x checkpoints.
//!
//! A head vector `x` of even length `D` is split in halves `x = [x1 | x2]`. At absolute position
//! `p`, frequency `i < D/2` turns by `θ_i = p · f_i`:
//!
//! `y1 = x1 ⊙ cos θ − x2 ⊙ sin θ`, `y2 = x2 ⊙ cos θ + x1 ⊙ sin θ`,
//!
//! Hugging Face's `q * cos + rotate_half(q) * sin`. The frequencies are `f_i = 1 / θ_base^(2i/D)`,
//! computed in f32 as transformers does, then rescaled by [`RopeScaling`]. Rounding follows
//! PyTorch's operation by operation: the angle `p · f_i` and its cosine and sine in f32, `cos`
//! and `sin` rounded to the input dtype, then each product and the sum rounded to it.

use crate::storage::{CpuStorage, Storage};
use crate::{Element, Error, Result, Tensor, with_dtype};

/// How the base frequencies are rescaled for long contexts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// No scaling (`rope_type: "default"`, or no `rope_scaling` at all).
    Default,
    /// Llama 3.1's scaling (`rope_type: "llama3"`): wavelengths beyond
    /// `original_max_position_embeddings / low_freq_factor` are stretched by `factor`, those
    /// below `original_max_position_embeddings / high_freq_factor` kept, and the band between
    /// interpolated smoothly.
    Llama3 {
        /// Stretch of the low frequencies (8 for Llama 3.1).
        factor: f64,
        /// Lower edge of the smoothed band, as a divisor of the original context (1).
        low_freq_factor: f64,
        /// Upper edge of the smoothed band (4).
        high_freq_factor: f64,
        /// The context length the model was pre-trained with (8192).
        original_max_position_embeddings: f64,
    },
}

impl RopeScaling {
    /// The scaling a Hugging Face config names (`rope_scaling.rope_type`, or its older `type`),
    /// its numeric parameters read through `param`.
    ///
    /// Errors: [`Error::UnsupportedRopeScaling`] naming any kind but `default` and `llama3`, or
    /// a `llama3` parameter that is missing, non-finite, or not positive (or equal band edges).
    pub fn from_kind(kind: &str, param: impl Fn(&str) -> Option<f64>) -> Result<RopeScaling> {
        let bad = |why: String| Error::UnsupportedRopeScaling { kind: kind.to_string(), why };
        match kind {
            "default" => Ok(RopeScaling::Default),
            "llama3" => {
                let get = |name: &str| {
                    let v = param(name).ok_or_else(|| bad(format!("missing {name}")))?;
                    if v.is_finite() && v > 0.0 { Ok(v) } else { Err(bad(format!("{name} = {v} must be positive"))) }
                };
                let s = RopeScaling::Llama3 {
                    factor: get("factor")?,
                    low_freq_factor: get("low_freq_factor")?,
                    high_freq_factor: get("high_freq_factor")?,
                    original_max_position_embeddings: get("original_max_position_embeddings")?,
                };
                if let RopeScaling::Llama3 { low_freq_factor: lo, high_freq_factor: hi, .. } = s
                    && lo == hi
                {
                    return Err(bad("low_freq_factor must differ from high_freq_factor".into()));
                }
                Ok(s)
            }
            other => Err(Error::UnsupportedRopeScaling {
                kind: other.to_string(),
                why: "tp implements \"default\" and \"llama3\"".into(),
            }),
        }
    }
}

/// The rotary embedding of one attention layer: head size and the per-pair frequencies.
#[derive(Debug, Clone, PartialEq)]
pub struct RotaryEmbedding {
    head_dim: usize,
    inv_freq: Vec<f32>,
}

impl RotaryEmbedding {
    /// Frequencies for heads of `head_dim` (even, > 0) with base `theta` (`rope_theta`, > 0).
    ///
    /// Errors: [`Error::InvalidArgument`] for an odd or zero `head_dim` or a bad `theta`.
    pub fn new(head_dim: usize, theta: f64, scaling: RopeScaling) -> Result<RotaryEmbedding> {
        const OP: &str = "RotaryEmbedding::new";
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(Error::InvalidArgument { op: OP, why: format!("head_dim {head_dim} must be even and > 0") });
        }
        if !(theta.is_finite() && theta > 0.0) {
            return Err(Error::InvalidArgument { op: OP, why: format!("rope_theta {theta} must be positive") });
        }
        // transformers: 1.0 / (base ** (arange(0, dim, 2).float() / dim)), each step in f32.
        let mut inv_freq: Vec<f32> = (0..head_dim / 2)
            .map(|i| {
                let exponent = (2 * i) as f32 / head_dim as f32;
                let power = theta.powf(f64::from(exponent)) as f32;
                1.0f32 / power
            })
            .collect();
        if let RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } =
            scaling
        {
            let low_wavelen = original_max_position_embeddings / low_freq_factor;
            let high_wavelen = original_max_position_embeddings / high_freq_factor;
            for f in &mut inv_freq {
                let freq = f64::from(*f);
                let wavelen = 2.0 * std::f64::consts::PI / freq;
                let scaled = if wavelen > low_wavelen {
                    freq / factor
                } else if wavelen < high_wavelen {
                    freq
                } else {
                    let smooth = (original_max_position_embeddings / wavelen - low_freq_factor)
                        / (high_freq_factor - low_freq_factor);
                    (1.0 - smooth) * freq / factor + smooth * freq
                };
                *f = scaled as f32;
            }
        }
        Ok(RotaryEmbedding { head_dim, inv_freq })
    }

    /// Features per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The `head_dim / 2` frequencies `f_i`, after scaling.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// `(cos θ, sin θ)` in f32 for pair `i` at position `p`: the angle `p · f_i` rounded to f32
    /// (as transformers' f32 product), its cosine and sine correctly rounded from f64.
    pub fn cos_sin(&self, position: usize, i: usize) -> (f32, f32) {
        let angle = position as f32 * self.inv_freq[i];
        let a = f64::from(angle);
        (a.cos() as f32, a.sin() as f32)
    }
}

impl Tensor {
    /// RoPE applied to `self: [T, H, D]` (tokens, heads, head features), token `t` at absolute
    /// position `positions[t]` (a decode step of a sequence holding `L` tokens sits at `L`).
    ///
    /// Errors: [`Error::RankMismatch`] unless 3-D, [`Error::ShapeMismatch`] if `D` is not the
    /// embedding's head size or `positions` has not `T` entries, [`Error::NotFloat`].
    pub fn rope(&self, positions: &[usize], rope: &RotaryEmbedding) -> Result<Tensor> {
        const OP: &str = "rope";
        self.require_float()?;
        let &[t, h, d] = self.dims() else {
            return Err(Error::RankMismatch {
                op: OP,
                expected: "3 ([tokens, heads, head_dim])",
                dims: self.dims().to_vec(),
            });
        };
        if d != rope.head_dim || positions.len() != t {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.dims().to_vec(),
                rhs: vec![positions.len(), h, rope.head_dim],
                why: "needs [tokens, heads, head_dim] with one position per token and the embedding's head_dim",
            });
        }
        if let Storage::Cuda(x) = self.storage() {
            return Ok(Tensor::from_cuda(
                self.shape().clone(),
                super::cuda::rope(x, positions, &rope.inv_freq, (t, h, d))?,
            ));
        }
        let x = self.cpu_storage(OP)?;
        let out = with_dtype!(x.dtype(), T => {
            CpuStorage::from_vec(host_rope::<T>(x.as_slice::<T>().unwrap_or_default(), positions, rope, h))
        });
        Ok(Tensor::from_cpu(self.shape().clone(), out))
    }
}

fn host_rope<T: Element>(x: &[T], positions: &[usize], rope: &RotaryEmbedding, heads: usize) -> Vec<T> {
    let d = rope.head_dim;
    let half = d / 2;
    let mut out = x.to_vec();
    let r = |v: f32| T::from_f32(v).to_f32(); // one rounding to the dtype
    for (tok, &p) in positions.iter().enumerate() {
        let cs: Vec<(f32, f32)> = (0..half)
            .map(|i| {
                let (c, s) = rope.cos_sin(p, i);
                (r(c), r(s))
            })
            .collect();
        for head in 0..heads {
            let base = (tok * heads + head) * d;
            for (i, &(c, s)) in cs.iter().enumerate() {
                let (x1, x2) = (x[base + i].to_f32(), x[base + half + i].to_f32());
                out[base + i] = T::from_f32(r(x1 * c) + r(-x2 * s));
                out[base + half + i] = T::from_f32(r(x2 * c) + r(x1 * s));
            }
        }
    }
    out
}
