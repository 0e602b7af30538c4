//! [`ElemType`]: the element types the kernels know, and the names their functions carry.
//! A leaf module: the kernel-name table ([`crate::kernels`]) and the launchers both use it.

/// Element types the kernels know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElemType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    BF16,
    /// 32-bit signed integer (token ids).
    I32,
    /// 64-bit signed integer (token ids).
    I64,
}

impl ElemType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            ElemType::F32 | ElemType::I32 => 4,
            ElemType::F16 | ElemType::BF16 => 2,
            ElemType::I64 => 8,
        }
    }
    /// Whether this is one of the floating-point types the arithmetic kernels take.
    pub fn is_float(self) -> bool {
        matches!(self, ElemType::F32 | ElemType::F16 | ElemType::BF16)
    }
    /// The suffix kernel function names carry for this type (`f32`, `bf16`, `i64`...).
    pub(crate) fn name(self) -> &'static str {
        match self {
            ElemType::F32 => "f32",
            ElemType::F16 => "f16",
            ElemType::BF16 => "bf16",
            ElemType::I32 => "i32",
            ElemType::I64 => "i64",
        }
    }
}
