//! Rotary position embedding (RoPE) in Llama's "rotate half" convention, with the frequency
//! scalings of Hugging Face's `rope_type`s `default`, `linear`, `dynamic`, `yarn`, `llama3` and
//! `longrope`.
//!
//! A head vector `x` of even length `D` is split in halves `x = [x1 | x2]`. At absolute position
//! `p`, frequency `i < D/2` turns by `θ_i = p · f_i`:
//!
//! `y1 = m·(x1 ⊙ cos θ − x2 ⊙ sin θ)`, `y2 = m·(x2 ⊙ cos θ + x1 ⊙ sin θ)`,
//!
//! Hugging Face's `q * cos + rotate_half(q) * sin` with `cos = emb.cos() * attention_scaling`
//! (`m`: 1 except for YaRN). The frequencies are `f_i = 1 / θ_base^(2i/D)`, rescaled by
//! [`RopeScaling`], each step in the precision transformers (5.x) computes it in: the base
//! rounded to f32 and raised to the f32 exponent `2i/D` by the C library's `powf` (PyTorch's
//! scalar loop; its SIMD loop, used from 2 vectors of pairs on, may differ by an ulp), the
//! scalings' f32 tensor arithmetic in f32 and their Python scalar arithmetic in f64. Rounding
//! of the rotation follows PyTorch's operation by operation: the angle `p · f_i` and its cosine
//! and sine in f32, times `m` in f32, `cos` and `sin` rounded to the input dtype, then each
//! product and the sum rounded to it.
//!
//! Dynamic NTK scaling depends on the call: like transformers' `dynamic_rope_update`, a call
//! whose largest position is `P` uses frequencies for `P + 1` tokens ([`RotaryEmbedding::inv_freq_for`]).

use crate::storage::{CpuStorage, Storage};
use crate::{Element, Error, Result, Tensor, with_dtype};
use std::borrow::Cow;

/// How the base frequencies are rescaled for long contexts.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// No scaling (`rope_type: "default"`, or no `rope_scaling` at all).
    Default,
    /// Position interpolation (`rope_type: "linear"`): every frequency divided by `factor`
    /// (in f32, as transformers' `inv_freq /= factor`).
    Linear {
        /// The stretch of the context (> 0; transformers expects >= 1).
        factor: f64,
    },
    /// Dynamic NTK scaling (`rope_type: "dynamic"`): for a call over `L` tokens (largest position
    /// plus one) beyond `max_position_embeddings`, the base becomes
    /// `θ · (factor·L/max_position_embeddings − (factor − 1))^(D/(D−2))` (in f32, as transformers
    /// computes it from the position tensor); within it, the frequencies of
    /// `θ · (factor·M/M − (factor − 1))^(D/(D−2))` (in f64: transformers' init, `≈ θ`).
    Dynamic {
        /// The NTK factor.
        factor: f64,
        /// The config's `max_position_embeddings` `M` (an integer; transformers' dynamic RoPE
        /// reads this, not `original_max_position_embeddings`).
        max_position_embeddings: f64,
    },
    /// YaRN (`rope_type: "yarn"`): frequencies blended between interpolated (`f / factor`) and
    /// original by a linear ramp over the pairs `[low, high]` that turn between `beta_fast` and
    /// `beta_slow` times over `original_max_position_embeddings`, and cos/sin multiplied by
    /// `attention_factor` (tp-models reads transformers' parameters and defaults into it).
    Yarn {
        /// The interpolation factor.
        factor: f64,
        /// The context length the model was pre-trained with.
        original_max_position_embeddings: f64,
        /// Rotations bounding the extrapolated (unscaled) band (transformers' default 32).
        beta_fast: f64,
        /// Rotations bounding the interpolated band (default 1).
        beta_slow: f64,
        /// Whether the ramp's ends are rounded outward to whole pairs (default true).
        truncate: bool,
        /// The multiplier of cos and sin (`attention_scaling`): the config's `attention_factor`,
        /// else `0.1·ln(factor) + 1` (or the `mscale`/`mscale_all_dim` ratio), 1 for `factor <= 1`.
        attention_factor: f64,
    },
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
    /// Phi-3's LongRoPE (`rope_type: "longrope"`): pair `i`'s frequency divided by a factor of
    /// its own, `f_i / e_i` (in f32, as transformers' `1 / (ext * base^(2i/D))`), with `e` the
    /// `short_factor` list for calls over at most `original_max_position_embeddings` tokens and
    /// `long_factor` beyond (chosen per call, as transformers' `longrope_frequency_update`), and
    /// cos/sin times `attention_factor`.
    LongRope {
        /// One factor per pair (`head_dim / 2`) for short calls.
        short_factor: Vec<f64>,
        /// One factor per pair for calls past the original length.
        long_factor: Vec<f64>,
        /// The context length the model was pre-trained with.
        original_max_position_embeddings: f64,
        /// The multiplier of cos and sin.
        attention_factor: f64,
    },
}

/// Largest `head_dim` a rotary embedding takes.
pub const MAX_HEAD_DIM: usize = 1 << 16;

/// Dynamic NTK's inputs, kept to recompute the frequencies per call.
#[derive(Debug, Clone, Copy, PartialEq)]
struct DynamicNtk {
    theta: f64,
    factor: f64,
    max_position_embeddings: f64,
}

/// LongRoPE's frequencies for long calls.
#[derive(Debug, Clone, PartialEq)]
struct LongFreqs {
    inv_freq: Vec<f32>,
    original_max_position_embeddings: f64,
}

/// The rotary embedding of one attention layer: head size, the per-pair frequencies and the
/// cos/sin multiplier.
#[derive(Debug, Clone, PartialEq)]
pub struct RotaryEmbedding {
    head_dim: usize,
    inv_freq: Vec<f32>,
    attention_scaling: f32,
    dynamic: Option<DynamicNtk>,
    long: Option<LongFreqs>,
}

/// `1 / base^(2i/D)` for every pair, as transformers' `1.0 / (base ** (arange(0, D, 2).float() / D))`:
/// the exponent in f32, the base rounded to f32 and `powf` in f32, the reciprocal in f32.
fn base_inv_freq(head_dim: usize, base: f64) -> Vec<f32> {
    pos_freqs(head_dim, base).into_iter().map(|p| 1.0f32 / p).collect()
}

/// `base^(2i/D)` in f32 (see [`base_inv_freq`]).
fn pos_freqs(head_dim: usize, base: f64) -> Vec<f32> {
    let base = base as f32;
    (0..head_dim / 2).map(|i| base.powf((2 * i) as f32 / head_dim as f32)).collect()
}

impl RotaryEmbedding {
    /// Frequencies for heads of `head_dim` (even, > 0; > 2 for dynamic scaling) with base `theta`
    /// (`rope_theta`, > 0).
    ///
    /// Errors: [`Error::InvalidArgument`] for an odd or zero `head_dim`, a bad `theta`, or
    /// scaling parameters out of range (a factor or length that is not positive and finite, a
    /// fractional dynamic length, non-finite YaRN betas, LongRoPE lists of the wrong length).
    pub fn new(head_dim: usize, theta: f64, scaling: RopeScaling) -> Result<RotaryEmbedding> {
        const OP: &str = "RotaryEmbedding::new";
        let invalid = |why: String| Error::InvalidArgument { op: OP, why };
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(invalid(format!("head_dim {head_dim} must be even and > 0")));
        }
        if !(theta.is_finite() && theta > 0.0 && (theta as f32).is_finite() && theta as f32 > 0.0) {
            return Err(invalid(format!("rope_theta {theta} must be positive")));
        }
        // Values used in f32 must be positive f32s too (1e-320 is a positive f64 but 0 in f32).
        let positive = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 && (v as f32).is_finite() && v as f32 > 0.0 {
                Ok(v)
            } else {
                Err(invalid(format!("{name} {v} must be positive (and a positive f32)")))
            }
        };
        if head_dim > MAX_HEAD_DIM {
            return Err(invalid(format!("head_dim {head_dim} exceeds {MAX_HEAD_DIM}")));
        }
        let mut attention_scaling = 1.0f32;
        let mut dynamic = None;
        let mut long = None;
        let inv_freq = match scaling {
            RopeScaling::Default => base_inv_freq(head_dim, theta),
            RopeScaling::Linear { factor } => {
                // `inv_freq /= factor`: an f32 tensor divided by the f32-rounded scalar.
                let factor = positive("factor", factor)? as f32;
                base_inv_freq(head_dim, theta).into_iter().map(|f| f / factor).collect()
            }
            RopeScaling::Dynamic { factor, max_position_embeddings: m } => {
                positive("factor", factor)?;
                if positive("max_position_embeddings", m)?.fract() != 0.0 {
                    return Err(invalid(format!("max_position_embeddings {m} must be an integer")));
                }
                if head_dim == 2 {
                    return Err(invalid("dynamic NTK scaling needs head_dim > 2 (it raises to D/(D-2))".into()));
                }
                let d = head_dim as f64;
                dynamic = Some(DynamicNtk { theta, factor, max_position_embeddings: m });
                // At init transformers passes seq_len = max_position_embeddings: Python floats.
                base_inv_freq(head_dim, theta * ((factor * m / m) - (factor - 1.0)).powf(d / (d - 2.0)))
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: orig,
                beta_fast,
                beta_slow,
                truncate,
                attention_factor,
            } => {
                positive("factor", factor)?;
                positive("original_max_position_embeddings", orig)?;
                positive("attention_factor", attention_factor)?;
                if !(beta_fast.is_finite() && beta_slow.is_finite()) {
                    return Err(invalid(format!("beta_fast {beta_fast} and beta_slow {beta_slow} must be finite")));
                }
                attention_scaling = attention_factor as f32;
                yarn_inv_freq(head_dim, theta, factor, orig, (beta_fast, beta_slow), truncate)
            }
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let mut inv_freq = base_inv_freq(head_dim, theta);
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
                inv_freq
            }
            RopeScaling::LongRope { short_factor, long_factor, original_max_position_embeddings, attention_factor } => {
                positive("original_max_position_embeddings", original_max_position_embeddings)?;
                attention_scaling = positive("attention_factor", attention_factor)? as f32;
                let scaled = |name: &str, factors: &[f64]| -> Result<Vec<f32>> {
                    if factors.len() != head_dim / 2 {
                        return Err(invalid(format!(
                            "{name} has {} entries; head_dim {head_dim} needs {}",
                            factors.len(),
                            head_dim / 2
                        )));
                    }
                    let base = pos_freqs(head_dim, theta);
                    factors.iter().zip(base).map(|(&e, b)| Ok(1.0f32 / (positive(name, e)? as f32 * b))).collect()
                };
                let short = scaled("short_factor", &short_factor)?;
                long = Some(LongFreqs {
                    inv_freq: scaled("long_factor", &long_factor)?,
                    original_max_position_embeddings,
                });
                short
            }
        };
        Ok(RotaryEmbedding { head_dim, inv_freq, attention_scaling, dynamic, long })
    }

    /// Features per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The `head_dim / 2` frequencies `f_i`, after scaling; for dynamic scaling, those of calls
    /// within `max_position_embeddings` (see [`RotaryEmbedding::inv_freq_for`]).
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// The frequencies a call over `seq_len` tokens uses (`seq_len`: its largest position plus
    /// one, transformers' `torch.max(position_ids) + 1`). The same as [`RotaryEmbedding::inv_freq`]
    /// except for dynamic scaling beyond `max_position_embeddings`, where they are recomputed
    /// from the rescaled base in f32 as transformers' `_compute_dynamic_ntk_parameters` does
    /// with a tensor `seq_len`.
    ///
    /// transformers keeps the last growth's frequencies until a call falls back below the
    /// original length; for the growing sequences of prefill and decoding that is the same.
    pub fn inv_freq_for(&self, seq_len: usize) -> Cow<'_, [f32]> {
        if let Some(long) = &self.long {
            return Cow::Borrowed(if seq_len as f64 > long.original_max_position_embeddings {
                &long.inv_freq
            } else {
                &self.inv_freq
            });
        }
        match self.dynamic {
            Some(DynamicNtk { theta, factor, max_position_embeddings: m }) if seq_len as f64 > m => {
                let d = self.head_dim as f64;
                // factor * seq_len / M - (factor - 1): f32 tensor arithmetic with f32-rounded
                // scalars; `** (D / (D - 2))`: std::pow(float, double); times the base in f32.
                let t = (factor as f32) * (seq_len as f32) / (m as f32) - ((factor - 1.0) as f32);
                let t = f64::from(t).powf(d / (d - 2.0)) as f32;
                Cow::Owned(base_inv_freq(self.head_dim, f64::from((theta as f32) * t)))
            }
            _ => Cow::Borrowed(&self.inv_freq),
        }
    }

    /// The multiplier of cos and sin (transformers' `attention_scaling`, rounded to f32 as its
    /// f32 product rounds it): YaRN's attention factor, otherwise 1.
    pub fn attention_scaling(&self) -> f32 {
        self.attention_scaling
    }

    /// `(m · cos θ, m · sin θ)` in f32 for pair `i` at `position`, as a call whose largest
    /// position is `position` computes them (a decode step): the angle `p · f_i` rounded to f32
    /// (as transformers' f32 product), its cosine and sine correctly rounded from f64, each times
    /// the attention scaling `m` in f32.
    pub fn cos_sin(&self, position: usize, i: usize) -> (f32, f32) {
        cos_sin(&self.inv_freq_for(position.saturating_add(1)), self.attention_scaling, position, i)
    }
}

fn cos_sin(inv_freq: &[f32], scale: f32, position: usize, i: usize) -> (f32, f32) {
    let angle = position as f32 * inv_freq[i];
    let a = f64::from(angle);
    ((a.cos() as f32) * scale, (a.sin() as f32) * scale)
}

/// YaRN's frequencies, step by step as transformers' `_compute_yarn_parameters`: the
/// correction range in Python floats, the rest in f32 tensors.
fn yarn_inv_freq(
    head_dim: usize,
    theta: f64,
    factor: f64,
    original: f64,
    (beta_fast, beta_slow): (f64, f64),
    truncate: bool,
) -> Vec<f32> {
    let dim = head_dim as f64;
    let correction_dim =
        |rotations: f64| (dim * (original / (rotations * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * theta.ln());
    let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
    if truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
    if low == high {
        high += 0.001; // transformers: "prevent singularity"
    }
    let (low32, span32, factor32) = (low as f32, (high - low) as f32, factor as f32);
    pos_freqs(head_dim, theta)
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let extrapolation = 1.0f32 / p;
            let interpolation = 1.0f32 / (factor32 * p);
            let ramp = ((i as f32 - low32) / span32).clamp(0.0, 1.0);
            let extrapolation_factor = 1.0f32 - ramp;
            interpolation * (1.0f32 - extrapolation_factor) + extrapolation * extrapolation_factor
        })
        .collect()
}

impl Tensor {
    /// RoPE applied to `self: [T, H, D]` (tokens, heads, head features), token `t` at absolute
    /// position `positions[t]` (a decode step of a sequence holding `L` tokens sits at `L`).
    /// Under dynamic scaling the frequencies are those of `max(positions) + 1` tokens, as
    /// transformers computes them per forward (so a step's rotation equals the row at its
    /// position of a prefill ending there, not of a longer one). The embedding may cover fewer
    /// features than the head (`rope.head_dim() = R <= D`, partial rotary: Phi-4-mini's
    /// `partial_rotary_factor`): the first `R` features of each head rotate (rotate-half within
    /// them) and the other `D - R` pass through unchanged, as transformers' `cat((q_rot * cos +
    /// rotate_half(q_rot) * sin), q_pass)`.
    ///
    /// Errors: [`Error::RankMismatch`] unless 3-D, [`Error::ShapeMismatch`] if `D` is smaller
    /// than the embedding's head size or `positions` has not `T` entries, [`Error::NotFloat`].
    pub fn rope(&self, positions: &[usize], rope: &RotaryEmbedding) -> Result<Tensor> {
        self.rope_with_len(positions, rope, 0)
    }

    /// [`rope`](Tensor::rope) with the length-dependent frequencies (dynamic scaling, LongRoPE)
    /// of `max(len, max(positions) + 1)` tokens: a chunk of a longer known sequence (a prompt
    /// prefilled in chunks) turns as the whole sequence's one-call forward would.
    ///
    /// Errors: as [`rope`](Tensor::rope).
    pub fn rope_with_len(&self, positions: &[usize], rope: &RotaryEmbedding, len: usize) -> Result<Tensor> {
        const OP: &str = "rope";
        self.require_float()?;
        let (t, h, d) = rope_dims(OP, self, positions, rope)?;
        // Dynamic scaling: the frequencies of this call's length (its largest position + 1).
        let inv_freq = rope.inv_freq_for(positions.iter().max().map_or(0, |&p| p.saturating_add(1)).max(len));
        let scale = rope.attention_scaling;
        if let Storage::Cuda(x) = self.storage() {
            return Ok(Tensor::from_cuda(
                self.shape().clone(),
                super::cuda::rope(x, positions, &inv_freq, scale, (t, h, d))?,
            ));
        }
        let x = self.cpu_storage(OP)?;
        let out = with_dtype!(x.dtype(), T => {
            CpuStorage::from_vec(host_rope::<T>(x.as_slice::<T>().unwrap_or_default(), positions, &inv_freq, scale, (h, d)))
        });
        Ok(Tensor::from_cpu(self.shape().clone(), out))
    }
}

/// `(T, H, D)` of a rotation's input `x: [T, H, D]`, checked against `positions` (one per
/// token) and the embedding (`D >= rope.head_dim`).
fn rope_dims(
    op: &'static str,
    x: &Tensor,
    positions: &[usize],
    rope: &RotaryEmbedding,
) -> Result<(usize, usize, usize)> {
    let &[t, h, d] = x.dims() else {
        return Err(Error::RankMismatch { op, expected: "3 ([tokens, heads, head_dim])", dims: x.dims().to_vec() });
    };
    if d < rope.head_dim || positions.len() != t {
        return Err(Error::ShapeMismatch {
            op,
            lhs: x.dims().to_vec(),
            rhs: vec![positions.len(), h, rope.head_dim],
            why: "needs [tokens, heads, D] with one position per token and D at least the embedding's head_dim",
        });
    }
    Ok((t, h, d))
}

/// The host rotation of heads of `d` features, the first `2 * inv_freq.len()` of which rotate.
fn host_rope<T: Element>(
    x: &[T],
    positions: &[usize],
    inv_freq: &[f32],
    scale: f32,
    (heads, d): (usize, usize),
) -> Vec<T> {
    let half = inv_freq.len();
    let mut out = x.to_vec();
    // Each product rounded to the dtype once, as torch's `x * cos + rotate_half(x) * sin`:
    // `r(x1 c) + r(-x2 s)` and `r(x2 c) + r(x1 s)`, a head's halves widened and narrowed whole.
    let zero = T::from_f32(0.0);
    let (mut c, mut s, mut x1, mut x2, mut a, mut b) =
        (vec![0f32; half], vec![0f32; half], vec![0f32; half], vec![0f32; half], vec![0f32; half], vec![0f32; half]);
    let mut t = vec![zero; half];
    let round = |v: &mut [f32], t: &mut [T]| {
        T::slice_from_f32(v, t);
        T::slice_to_f32(t, v);
    };
    for (tok, &p) in positions.iter().enumerate() {
        cos_sin_cached(inv_freq, scale, p, &mut c, &mut s);
        round(&mut c, &mut t);
        round(&mut s, &mut t);
        for head in 0..heads {
            let base = (tok * heads + head) * d;
            T::slice_to_f32(&x[base..base + half], &mut x1);
            T::slice_to_f32(&x[base + half..base + 2 * half], &mut x2);
            a.iter_mut().zip(&x1).zip(&c).for_each(|((a, x1), c)| *a = x1 * c);
            b.iter_mut().zip(&x2).zip(&s).for_each(|((b, x2), s)| *b = -x2 * s);
            round(&mut a, &mut t);
            round(&mut b, &mut t);
            a.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
            T::slice_from_f32(&a, &mut out[base..base + half]);
            a.iter_mut().zip(&x2).zip(&c).for_each(|((a, x2), c)| *a = x2 * c);
            b.iter_mut().zip(&x1).zip(&s).for_each(|((b, x1), s)| *b = x1 * s);
            round(&mut a, &mut t);
            round(&mut b, &mut t);
            a.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
            T::slice_from_f32(&a, &mut out[base + half..base + 2 * half]);
        }
    }
    out
}

/// `cos_sin(inv_freq, scale, p, i)` for every `i` into `c` and `s`, remembered per thread for
/// the last few frequency sets (every layer of a step turns the same positions with the same
/// frequencies; Gemma 3 alternates two sets), so each layer after the first reads them.
fn cos_sin_cached(inv_freq: &[f32], scale: f32, p: usize, c: &mut [f32], s: &mut [f32]) {
    use std::cell::RefCell;
    use std::collections::HashMap;
    /// Frequency sets remembered, and positions per set.
    const SETS: usize = 4;
    const POSITIONS: usize = 1 << 16;
    type Set = (Vec<u32>, u32, HashMap<usize, Box<[(f32, f32)]>>);
    thread_local! {
        static CACHE: RefCell<Vec<Set>> = const { RefCell::new(Vec::new()) };
    }
    CACHE.with(|cache| {
        let mut cache = cache.borrow_mut();
        let bits = scale.to_bits();
        let same = |e: &Set| {
            e.1 == bits && e.0.len() == inv_freq.len() && e.0.iter().zip(inv_freq).all(|(a, b)| *a == b.to_bits())
        };
        let i = match cache.iter().position(same) {
            Some(i) => i,
            None => {
                if cache.len() == SETS {
                    cache.remove(0);
                }
                cache.push((inv_freq.iter().map(|f| f.to_bits()).collect(), bits, HashMap::new()));
                cache.len() - 1
            }
        };
        let map = &mut cache[i].2;
        if map.len() >= POSITIONS && !map.contains_key(&p) {
            map.clear();
        }
        let row = map.entry(p).or_insert_with(|| (0..inv_freq.len()).map(|i| cos_sin(inv_freq, scale, p, i)).collect());
        for ((c, s), &(cv, sv)) in c.iter_mut().zip(s.iter_mut()).zip(row.iter()) {
            *c = cv;
            *s = sv;
        }
    });
}

impl Tensor {
    /// The gradient of [`rope`](Tensor::rope)`(positions, rope)` with respect to its input,
    /// given the output's gradient `self = dy: [T, H, D]`, in f32. The rotation is orthogonal
    /// (up to the attention scaling `m` on both cos and sin), so its transpose rotates by the
    /// negated angle: `dx1 = c·dy1 + s·dy2`, `dx2 = c·dy2 - s·dy1` per rotated pair, and the
    /// features past the embedding's `head_dim` pass through. `positions` must be those of the
    /// forward call (dynamic scaling takes its frequencies from their maximum).
    ///
    /// On a GPU (`kernels/grad.cu`) cos and sin are the forward kernel's (the angle in f32, its
    /// cosine and sine from double, times the scaling in f32), unrounded to the dtype.
    ///
    /// Errors: as [`rope`](Tensor::rope).
    pub fn rope_backward(&self, positions: &[usize], rope: &RotaryEmbedding) -> Result<Tensor> {
        const OP: &str = "rope_backward";
        let (t, h, d) = rope_dims(OP, self, positions, rope)?;
        let inv_freq = rope.inv_freq_for(positions.iter().max().map_or(0, |&p| p.saturating_add(1)));
        let half = inv_freq.len();
        if let Storage::Cuda(dy) = self.storage() {
            self.require_float()?;
            let out = super::cuda::rope_backward(dy, positions, &inv_freq, rope.attention_scaling, (t, h, d))?;
            return Ok(Tensor::from_cuda(self.shape().clone(), out));
        }
        let dy = super::grad::f32_host(OP, self)?;
        let dy = dy.as_slice::<f32>()?;
        let mut out = dy.to_vec();
        let scale = rope.attention_scaling;
        super::par::rows(&mut out, h * d, h * d, |t0, chunk| {
            for (i, tok_out) in chunk.chunks_exact_mut((h * d).max(1)).enumerate() {
                let (tok, p) = (t0 + i, positions[t0 + i]);
                let cs: Vec<(f32, f32)> = (0..half).map(|i| cos_sin(&inv_freq, scale, p, i)).collect();
                for head in 0..h {
                    let (base, src) = (head * d, (tok * h + head) * d);
                    for (i, &(c, s)) in cs.iter().enumerate() {
                        let (g1, g2) = (dy[src + i], dy[src + half + i]);
                        tok_out[base + i] = c * g1 + s * g2;
                        tok_out[base + half + i] = c * g2 - s * g1;
                    }
                }
            }
        });
        Tensor::from_vec(out, self.dims(), &crate::Device::Cpu)
    }
}
