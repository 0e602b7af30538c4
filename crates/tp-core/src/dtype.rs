//! Element types: the [`DType`] tag and the [`Element`] trait that ties a Rust type to it.
//!
//! Reduced-precision types (`f16`, `bf16`) are stored as themselves and converted to `f32` for
//! arithmetic; conversions to them round to nearest, ties to even (IEEE 754 default).

use std::fmt;

pub use half::{bf16, f16};

/// The element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary16.
    F16,
    /// bfloat16: binary32's exponent with a 7-bit mantissa.
    BF16,
}

impl DType {
    /// Every dtype, in a fixed order (handy for tests and benchmarks).
    pub const ALL: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    /// Bytes per element.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// Lower-case name as used by PyTorch and safetensors docs (`f32`, `f16`, `bf16`).
    pub const fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }

    /// Relative rounding error of one conversion into this dtype (half an ulp at 1.0).
    pub const fn unit_roundoff(self) -> f64 {
        match self {
            DType::F32 => 5.960_464_477_539_063e-8, // 2^-24
            DType::F16 => 4.882_812_5e-4,           // 2^-11
            DType::BF16 => 3.906_25e-3,             // 2^-8
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f32" | "float32" => Ok(DType::F32),
            "f16" | "float16" | "half" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            other => Err(format!("unknown dtype {other:?}; expected f32, f16 or bf16")),
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for super::f16 {}
    impl Sealed for super::bf16 {}
}

/// A Rust type that is the element of some [`DType`]. Plain old data, so buffers of it can be
/// viewed as bytes (`bytemuck`) for I/O and device copies.
pub trait Element: bytemuck::Pod + Copy + Send + Sync + PartialEq + fmt::Debug + 'static + sealed::Sealed {
    /// The dtype tag of this type.
    const DTYPE: DType;
    /// Exact widening to `f32`.
    fn to_f32(self) -> f32;
    /// Narrowing from `f32`, round to nearest even.
    fn from_f32(v: f32) -> Self;
    /// Exact widening to `f64`.
    fn to_f64(self) -> f64 {
        f64::from(self.to_f32())
    }
    /// Narrowing from `f64`, one rounding (round to nearest even).
    fn from_f64(v: f64) -> Self;
    /// Widen a whole slice to `f32` (SIMD where the `half` crate has it).
    fn slice_to_f32(src: &[Self], dst: &mut [f32]);
    /// Narrow a whole `f32` slice, round to nearest even.
    fn slice_from_f32(src: &[f32], dst: &mut [Self]);
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn slice_to_f32(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn slice_from_f32(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    fn slice_to_f32(src: &[Self], dst: &mut [f32]) {
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(src, dst);
    }
    fn slice_from_f32(src: &[f32], dst: &mut [Self]) {
        half::slice::HalfFloatSliceExt::convert_from_f32_slice(dst, src);
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
    /// bf16 is the top half of an f32: widening is a shift (exact, NaN payloads kept). Written
    /// as a plain loop so it vectorizes.
    fn slice_to_f32(src: &[Self], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(u32::from(s.to_bits()) << 16);
        }
    }
    /// Round to nearest even on the bit pattern (add `0x7fff` plus the lowest kept bit, then
    /// truncate); NaNs stay NaN (quieted). Same results as `bf16::from_f32`, but vectorizes.
    fn slice_from_f32(src: &[f32], dst: &mut [Self]) {
        for (d, s) in dst.iter_mut().zip(src) {
            let bits = s.to_bits();
            let out = if s.is_nan() {
                (bits >> 16) as u16 | 0x0040
            } else {
                (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16
            };
            *d = bf16::from_bits(out);
        }
    }
}

/// Runs `$body` with the type alias `$T` bound to the Rust element type of `$dtype`.
/// This is the one place that turns a runtime [`DType`] into a compile-time type; every
/// dtype-generic operation goes through it.
#[macro_export]
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F16 => {
                type $T = $crate::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $T = $crate::bf16;
                $body
            }
        }
    };
}
