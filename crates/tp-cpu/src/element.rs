//! The element types the kernels read: [`Float`], implemented for `f32`, `half::f16` and
//! `half::bf16` only (sealed), each tagged with its [`FloatKind`].
//!
//! The kernels branch on [`Float::KIND`] to reinterpret a slice as the type it names (vector
//! loads of `f32`, `vcvtph2ps` of `f16`, shifts of `bf16`), so the tag must be the truth: the
//! trait is sealed, and this file holds its only three implementations.

use half::{bf16, f16};

/// Which of the three float formats an element is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FloatKind {
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary16.
    F16,
    /// bfloat16: binary32's exponent with a 7-bit mantissa.
    BF16,
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// A float element the kernels take: plain old data whose bytes are a [`FloatKind::F32`],
/// [`FloatKind::F16`] or [`FloatKind::BF16`] value, as [`Float::KIND`] says.
pub trait Float: bytemuck::Pod + Send + Sync + 'static + sealed::Sealed {
    /// The format of this type.
    const KIND: FloatKind;
    /// Exact widening to `f32`.
    fn widen(self) -> f32;
    /// Exact widening of a whole slice (`dst.len() == src.len()`; extra elements of either are
    /// left alone), vectorised.
    fn widen_slice(src: &[Self], dst: &mut [f32]);
    /// Rounds `src` to nearest even into `dst` (`dst.len() == src.len()`), NaNs kept NaN: the
    /// rounding tp-core's tensors use, so a product rounded here has their bits.
    fn narrow_slice(src: &[f32], dst: &mut [std::mem::MaybeUninit<Self>]);
}

impl Float for f32 {
    const KIND: FloatKind = FloatKind::F32;
    fn widen(self) -> f32 {
        self
    }
    fn widen_slice(src: &[Self], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        dst[..n].copy_from_slice(&src[..n]);
    }
    fn narrow_slice(src: &[f32], dst: &mut [std::mem::MaybeUninit<Self>]) {
        dst.iter_mut().zip(src).for_each(|(d, &s)| *d = std::mem::MaybeUninit::new(s));
    }
}

impl Float for f16 {
    const KIND: FloatKind = FloatKind::F16;
    fn widen(self) -> f32 {
        self.to_f32()
    }
    fn widen_slice(src: &[Self], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(&src[..n], &mut dst[..n]);
    }
    fn narrow_slice(src: &[f32], dst: &mut [std::mem::MaybeUninit<Self>]) {
        dst.iter_mut().zip(src).for_each(|(d, &s)| *d = std::mem::MaybeUninit::new(f16::from_f32(s)));
    }
}

impl Float for bf16 {
    const KIND: FloatKind = FloatKind::BF16;
    fn widen(self) -> f32 {
        self.to_f32()
    }
    /// bf16 is the top half of an f32: widening is a shift (exact, NaN payloads kept). Written
    /// as a plain loop so it vectorises.
    fn widen_slice(src: &[Self], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(u32::from(s.to_bits()) << 16);
        }
    }
    /// [`bf16_rounded`] element by element (a plain loop, so it vectorises).
    fn narrow_slice(src: &[f32], dst: &mut [std::mem::MaybeUninit<Self>]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = std::mem::MaybeUninit::new(bf16_rounded(s));
        }
    }
}

/// `v` rounded to nearest even on its low 16 bits; a NaN keeps its top bits, made quiet: the
/// one bf16 rounding of tp's host code (tp-core's tensors use it too).
#[inline]
pub fn bf16_rounded(v: f32) -> bf16 {
    let bits = v.to_bits();
    let out = if v.is_nan() {
        (bits >> 16) as u16 | 0x0040
    } else {
        (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16
    };
    bf16::from_bits(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every format's slice widening against `half`'s own scalar conversion, specials included.
    #[test]
    fn slice_widening_matches_scalar_conversion() {
        let values = [0.0f32, -0.0, 1.0, -2.5, 65504.0, 1e-7, f32::INFINITY, f32::NEG_INFINITY, 3.1e38];
        fn check<T: Float>(src: &[T], scalar: impl Fn(T) -> f32) {
            let mut dst = vec![7f32; src.len()];
            T::widen_slice(src, &mut dst);
            for (i, (&s, &d)) in src.iter().zip(&dst).enumerate() {
                assert_eq!(d.to_bits(), scalar(s).to_bits(), "{:?} element {i}", T::KIND);
                assert_eq!(s.widen().to_bits(), d.to_bits());
            }
        }
        check(&values, |v| v);
        check(&values.map(f16::from_f32), f16::to_f32);
        check(&values.map(bf16::from_f32), bf16::to_f32);
        let nan = [bf16::from_bits(0x7fc1)];
        let mut out = [0f32];
        bf16::widen_slice(&nan, &mut out);
        assert_eq!(out[0].to_bits(), 0x7fc1_0000, "a bf16 NaN keeps its payload");
    }
}
