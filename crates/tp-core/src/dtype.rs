//! Element types: the [`DType`] tag, the [`Storable`] trait that ties a Rust type to it, and
//! the [`Element`] trait of the floating-point ones.
//!
//! Reduced-precision types (`f16`, `bf16`) are stored as themselves and converted to `f32` for
//! arithmetic; conversions to them round to nearest, ties to even (IEEE 754 default). The
//! integer types (`i32`, `i64`) hold token ids: they are stored, copied, sliced, joined and
//! moved between devices, but take no part in arithmetic.

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
    /// 32-bit signed integer (token ids).
    I32,
    /// 64-bit signed integer (token ids, as PyTorch's `long`).
    I64,
}

impl DType {
    /// Every floating-point dtype, in a fixed order (handy for tests and benchmarks).
    pub const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    /// The integer dtypes.
    pub const INTS: [DType; 2] = [DType::I32, DType::I64];

    /// Bytes per element.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I64 => 8,
        }
    }

    /// Whether this is a floating-point dtype (one that arithmetic accepts).
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// Lower-case name as used by PyTorch and safetensors docs (`f32`, `f16`, `bf16`).
    pub const fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
        }
    }

    /// Relative rounding error of one conversion into this dtype (half an ulp at 1.0; 0 for the
    /// integer dtypes, which are never rounded into).
    pub const fn unit_roundoff(self) -> f64 {
        match self {
            DType::F32 => 5.960_464_477_539_063e-8, // 2^-24
            DType::F16 => 4.882_812_5e-4,           // 2^-11
            DType::BF16 => 3.906_25e-3,             // 2^-8
            DType::I32 | DType::I64 => 0.0,
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
            "i32" | "int32" => Ok(DType::I32),
            "i64" | "int64" | "long" => Ok(DType::I64),
            other => Err(format!("unknown dtype {other:?}; expected f32, f16, bf16, i32 or i64")),
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for super::f16 {}
    impl Sealed for super::bf16 {}
    impl Sealed for i32 {}
    impl Sealed for i64 {}
}

/// A Rust type that is the element of some [`DType`]: `f32`, `f16`, `bf16`, `i32`, `i64`. Plain
/// old data, so buffers of it can be viewed as bytes (`bytemuck`) for I/O and device copies.
pub trait Storable: bytemuck::Pod + Copy + Send + Sync + PartialEq + fmt::Debug + 'static + sealed::Sealed {
    /// The dtype tag of this type.
    const DTYPE: DType;
}

/// An integer element (`i32`, `i64`): token ids.
pub trait IntElement: Storable {
    /// The value as `i64` (exact).
    fn to_i64(self) -> i64;
    /// `v` as this type, or `None` if it does not fit.
    fn from_i64(v: i64) -> Option<Self>;
}

impl Storable for i32 {
    const DTYPE: DType = DType::I32;
}
impl Storable for i64 {
    const DTYPE: DType = DType::I64;
}
impl IntElement for i32 {
    fn to_i64(self) -> i64 {
        i64::from(self)
    }
    fn from_i64(v: i64) -> Option<Self> {
        i32::try_from(v).ok()
    }
}
impl IntElement for i64 {
    fn to_i64(self) -> i64 {
        self
    }
    fn from_i64(v: i64) -> Option<Self> {
        Some(v)
    }
}

/// A floating-point element (`f32`, `f16`, `bf16`): the types arithmetic runs on, always
/// computing in `f32` (or `f64` for references) and rounding back. The host kernels' element
/// trait ([`tp_cpu::Float`]) is a supertrait, so every `Element` goes straight to them.
pub trait Element: Storable + tp_cpu::Float {
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
    /// Widen a whole slice to `f32` (vectorised; [`tp_cpu::Float::widen_slice`]); the slices
    /// have one length.
    fn slice_to_f32(src: &[Self], dst: &mut [f32]) {
        debug_assert_eq!(src.len(), dst.len(), "slice_to_f32 needs slices of one length");
        tp_cpu::Float::widen_slice(src, dst);
    }
    /// Narrow a whole `f32` slice, round to nearest even.
    fn slice_from_f32(src: &[f32], dst: &mut [Self]);
    /// The slice itself where the type is `f32` (no copy), else `None`.
    fn as_f32(_s: &[Self]) -> Option<&[f32]> {
        None
    }
}

impl Storable for f32 {
    const DTYPE: DType = DType::F32;
}

impl Element for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn slice_from_f32(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
}

impl Storable for f16 {
    const DTYPE: DType = DType::F16;
}

impl Element for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    fn slice_from_f32(src: &[f32], dst: &mut [Self]) {
        half::slice::HalfFloatSliceExt::convert_from_f32_slice(dst, src);
    }
}

impl Storable for bf16 {
    const DTYPE: DType = DType::BF16;
}

impl Element for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
    /// Round to nearest even on the bit pattern (add `0x7fff` plus the lowest kept bit, then
    /// truncate); NaNs stay NaN (quieted). Same results as `bf16::from_f32`, but vectorizes.
    fn slice_from_f32(src: &[f32], dst: &mut [Self]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = tp_cpu::bf16_rounded(s);
        }
    }
}

/// Runs `$body` with the type alias `$T` bound to the Rust element type of the floating-point
/// dtype `$dtype`. For an integer dtype the enclosing function returns
/// `Err(Error::NotFloat { .. }.into())` instead: arithmetic takes floats only. Together with
/// [`with_storable!`](crate::with_storable) this is the one place that turns a runtime
/// [`DType`] into a compile-time type; every dtype-generic operation goes through them.
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
            dtype @ ($crate::DType::I32 | $crate::DType::I64) => {
                return Err($crate::Error::NotFloat { dtype }.into());
            }
        }
    };
}

/// Runs `$body` with `$T` bound to the Rust element type of any `$dtype`, integers included
/// (`$T: Storable`): for operations that only move elements (copies, narrow, cat).
#[macro_export]
macro_rules! with_storable {
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
            $crate::DType::I32 => {
                type $T = i32;
                $body
            }
            $crate::DType::I64 => {
                type $T = i64;
                $body
            }
        }
    };
}
