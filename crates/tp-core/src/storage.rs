//! Backing memory of a tensor: host vectors, or bytes on a CUDA device.

use crate::{DType, Device, Error, Result, Storable, bf16, f16};
use std::sync::Arc;
use tp_kernels::Gpu;
use tp_kernels::cudarc::driver::CudaSlice;

/// Host buffer of one dtype. Always exactly `numel` elements, row-major.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum CpuStorage {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    I32(Vec<i32>),
    I64(Vec<i64>),
}

/// Applies `$f` to the inner vector of a `CpuStorage`, whatever its type.
macro_rules! each_vec {
    ($s:expr, $v:ident => $f:expr) => {
        match $s {
            CpuStorage::F32($v) => $f,
            CpuStorage::F16($v) => $f,
            CpuStorage::BF16($v) => $f,
            CpuStorage::I32($v) => $f,
            CpuStorage::I64($v) => $f,
        }
    };
}

impl CpuStorage {
    pub(crate) fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::I32(_) => DType::I32,
            CpuStorage::I64(_) => DType::I64,
        }
    }

    /// Wraps a typed vector (no copy).
    pub(crate) fn from_vec<T: Storable>(v: Vec<T>) -> Self {
        // `cast_vec` between identical types is a no-op move; the dtype match makes it so.
        fn same<T: Storable, U: Storable>(v: Vec<T>) -> Vec<U> {
            bytemuck::allocation::cast_vec(v)
        }
        match T::DTYPE {
            DType::F32 => CpuStorage::F32(same(v)),
            DType::F16 => CpuStorage::F16(same(v)),
            DType::BF16 => CpuStorage::BF16(same(v)),
            DType::I32 => CpuStorage::I32(same(v)),
            DType::I64 => CpuStorage::I64(same(v)),
        }
    }

    /// The elements as `&[T]`, or `None` if `T` is not this storage's dtype.
    pub(crate) fn as_slice<T: Storable>(&self) -> Option<&[T]> {
        if T::DTYPE != self.dtype() {
            return None;
        }
        each_vec!(self, v => bytemuck::try_cast_slice(v).ok())
    }

    /// The elements as `&mut [T]`, or `None` if `T` is not this storage's dtype.
    pub(crate) fn as_mut_slice<T: Storable>(&mut self) -> Option<&mut [T]> {
        if T::DTYPE != self.dtype() {
            return None;
        }
        each_vec!(self, v => bytemuck::try_cast_slice_mut(v).ok())
    }

    /// A host buffer of `dtype` from raw little-endian bytes (`bytes.len()` a multiple of the
    /// element size; checked by the caller).
    pub(crate) fn from_bytes(dtype: DType, bytes: &[u8]) -> Result<Self> {
        fn copy<T: Storable>(bytes: &[u8]) -> Result<Vec<T>> {
            let mut v = crate::alloc::zeroed::<T>("from_bytes", bytes.len() / size_of::<T>())?;
            bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(bytes);
            Ok(v)
        }
        Ok(match dtype {
            DType::F32 => CpuStorage::F32(copy(bytes)?),
            DType::F16 => CpuStorage::F16(copy(bytes)?),
            DType::BF16 => CpuStorage::BF16(copy(bytes)?),
            DType::I32 => CpuStorage::I32(copy(bytes)?),
            DType::I64 => CpuStorage::I64(copy(bytes)?),
        })
    }

    /// The raw bytes, little-endian as the host stores them.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        each_vec!(self, v => bytemuck::cast_slice(v))
    }

    /// The raw bytes, writable (every bit pattern is a valid element of every dtype).
    pub(crate) fn as_bytes_mut(&mut self) -> &mut [u8] {
        each_vec!(self, v => bytemuck::cast_slice_mut(v))
    }
}

/// Elements on a CUDA device: `len` bytes of `buf` (which may be longer: empty tensors hold
/// one byte), shared and immutable, so cloning a tensor is cheap and never fails.
#[derive(Clone)]
pub(crate) struct CudaStorage {
    pub(crate) buf: Arc<CudaSlice<u8>>,
    pub(crate) len: usize,
    pub(crate) dtype: DType,
    pub(crate) gpu: Arc<Gpu>,
}

impl std::fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaStorage({} bytes of {} on {:?})", self.len, self.dtype, self.gpu)
    }
}

impl CudaStorage {
    /// Wraps a freshly written device buffer.
    pub(crate) fn new(buf: CudaSlice<u8>, len: usize, dtype: DType, gpu: Arc<Gpu>) -> Self {
        CudaStorage { buf: Arc::new(buf), len, dtype, gpu }
    }

    /// The buffer, owned by this storage alone (copied on the device first if it is shared),
    /// for an in-place write.
    pub(crate) fn unique_buf(&mut self) -> Result<&mut CudaSlice<u8>> {
        if Arc::get_mut(&mut self.buf).is_none() {
            let mut copy = self.gpu.alloc(self.len)?;
            let whole = tp_kernels::RowCopy {
                rows: 1,
                row_bytes: self.len,
                src_pitch: self.len,
                src_off: 0,
                dst_pitch: self.len,
                dst_off: 0,
            };
            self.gpu.row_copy(&mut copy, &self.buf, whole)?;
            self.buf = Arc::new(copy);
        }
        // A fresh `Arc` has one owner and no weak references, so this cannot fail.
        Arc::get_mut(&mut self.buf).ok_or_else(|| {
            Error::Cuda(tp_kernels::KernelError::InvalidLaunch {
                kernel: "in-place write",
                why: "buffer shared".into(),
            })
        })
    }

    /// A copy of the elements on the host.
    pub(crate) fn to_host(&self) -> Result<CpuStorage> {
        let bytes = self.gpu.dtoh(&self.buf, self.len)?;
        CpuStorage::from_bytes(self.dtype, &bytes)
    }

    /// The device's handle.
    pub(crate) fn device(&self) -> Device {
        Device::Cuda(self.gpu.ordinal())
    }
}

/// The GPU behind `Device::Cuda(ordinal)`: a typed error on machines without CUDA.
pub(crate) fn gpu_for(ordinal: usize) -> Result<Arc<Gpu>> {
    Gpu::get(ordinal).map_err(Error::from)
}

/// Where a tensor's elements are. Both kinds are reference-counted: cloning a tensor shares its
/// elements; the rare in-place writes (`as_mut_slice`, `copy_from`) copy first if shared.
#[derive(Clone, Debug)]
pub(crate) enum Storage {
    Cpu(Arc<CpuStorage>),
    Cuda(CudaStorage),
}

impl Storage {
    pub(crate) fn dtype(&self) -> DType {
        match self {
            Storage::Cpu(s) => s.dtype(),
            Storage::Cuda(s) => s.dtype,
        }
    }

    pub(crate) fn device(&self) -> Device {
        match self {
            Storage::Cpu(_) => Device::Cpu,
            Storage::Cuda(s) => s.device(),
        }
    }

    /// Host storages with identical bytes (device storages never compare equal here).
    pub(crate) fn byte_eq(&self, other: &Storage) -> bool {
        match (self, other) {
            (Storage::Cpu(a), Storage::Cpu(b)) => a.as_bytes() == b.as_bytes(),
            _ => false,
        }
    }

    pub(crate) fn byte_len(&self) -> usize {
        match self {
            Storage::Cpu(s) => s.as_bytes().len(),
            Storage::Cuda(s) => s.len,
        }
    }
}
