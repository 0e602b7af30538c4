//! Backing memory of a tensor. Host memory today; the CUDA variant joins [`Storage`] without
//! changing the public `Tensor` API.

use crate::{DType, Device, Element, bf16, f16};

/// Host buffer of one dtype. Always exactly `numel` elements, row-major.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum CpuStorage {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

impl CpuStorage {
    pub(crate) fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::BF16(_) => DType::BF16,
        }
    }

    /// Wraps a typed vector (no copy).
    pub(crate) fn from_vec<T: Element>(v: Vec<T>) -> Self {
        // `cast_vec` between identical types is a no-op move; the dtype match makes it so.
        fn same<T: Element, U: Element>(v: Vec<T>) -> Vec<U> {
            bytemuck::allocation::cast_vec(v)
        }
        match T::DTYPE {
            DType::F32 => CpuStorage::F32(same(v)),
            DType::F16 => CpuStorage::F16(same(v)),
            DType::BF16 => CpuStorage::BF16(same(v)),
        }
    }

    /// The elements as `&[T]`, or `None` if `T` is not this storage's dtype.
    pub(crate) fn as_slice<T: Element>(&self) -> Option<&[T]> {
        if T::DTYPE != self.dtype() {
            return None;
        }
        match self {
            CpuStorage::F32(v) => bytemuck::try_cast_slice(v).ok(),
            CpuStorage::F16(v) => bytemuck::try_cast_slice(v).ok(),
            CpuStorage::BF16(v) => bytemuck::try_cast_slice(v).ok(),
        }
    }

    /// The elements as `&mut [T]`, or `None` if `T` is not this storage's dtype.
    pub(crate) fn as_mut_slice<T: Element>(&mut self) -> Option<&mut [T]> {
        if T::DTYPE != self.dtype() {
            return None;
        }
        match self {
            CpuStorage::F32(v) => bytemuck::try_cast_slice_mut(v).ok(),
            CpuStorage::F16(v) => bytemuck::try_cast_slice_mut(v).ok(),
            CpuStorage::BF16(v) => bytemuck::try_cast_slice_mut(v).ok(),
        }
    }

    /// The raw bytes, little-endian as the host stores them.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        match self {
            CpuStorage::F32(v) => bytemuck::cast_slice(v),
            CpuStorage::F16(v) => bytemuck::cast_slice(v),
            CpuStorage::BF16(v) => bytemuck::cast_slice(v),
        }
    }
}

/// Where a tensor's elements are.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Storage {
    Cpu(CpuStorage),
}

impl Storage {
    pub(crate) fn dtype(&self) -> DType {
        match self {
            Storage::Cpu(s) => s.dtype(),
        }
    }

    pub(crate) fn device(&self) -> Device {
        match self {
            Storage::Cpu(_) => Device::Cpu,
        }
    }
}
