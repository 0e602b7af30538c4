//! [`Tensor`]: a contiguous, row-major n-dimensional array of one dtype on one device.

use crate::rng::SplitMix64;
use crate::storage::{CpuStorage, CudaStorage, Storage, gpu_for};
use crate::{DType, Device, Element, Error, IntElement, Result, Shape, Storable, with_dtype, with_storable};
use std::fmt;

/// A contiguous, row-major n-dimensional array of one [`DType`] on one [`Device`].
///
/// Operations return new tensors. `Clone` shares the elements (host or device); writing through
/// [`Tensor::as_mut_slice`] or [`Tensor::copy_from`] copies them first if they are shared. Every constructor validates the shape ([`Shape::new`]) and the data length, so a
/// `Tensor` always holds exactly `numel` elements.
///
/// Equality compares shape, dtype, device and the elements' bits (device elements are copied to
/// the host to compare; a failed copy compares unequal).
#[derive(Clone)]
pub struct Tensor {
    shape: Shape,
    storage: Storage,
}

/// Constructors.
impl Tensor {
    pub(crate) fn from_parts(shape: Shape, storage: Storage) -> Self {
        debug_assert_eq!(storage.dtype().size_in_bytes() * shape.numel(), storage.byte_len());
        Tensor { shape, storage }
    }

    pub(crate) fn from_cpu(shape: Shape, storage: CpuStorage) -> Self {
        Self::from_parts(shape, Storage::Cpu(std::sync::Arc::new(storage)))
    }

    pub(crate) fn from_cuda(shape: Shape, storage: CudaStorage) -> Self {
        Self::from_parts(shape, Storage::Cuda(storage))
    }

    /// A tensor of shape `dims` holding `data` in row-major order, on `device`.
    ///
    /// Errors: [`Error::ElementCountMismatch`] if `data.len()` is not the product of `dims`,
    /// [`Error::ShapeOverflow`] if that product overflows.
    pub fn from_vec<T: Storable>(data: Vec<T>, dims: &[usize], device: &Device) -> Result<Self> {
        let shape = Shape::new(dims)?;
        if data.len() != shape.numel() {
            return Err(Error::ElementCountMismatch {
                op: "from_vec",
                dims: dims.to_vec(),
                expected: shape.numel(),
                got: data.len(),
            });
        }
        Tensor::from_cpu(shape, CpuStorage::from_vec(data)).to_device(device)
    }

    /// Like [`Tensor::from_vec`], copying from a slice.
    pub fn from_slice<T: Storable>(data: &[T], dims: &[usize], device: &Device) -> Result<Self> {
        Self::from_vec(data.to_vec(), dims, device)
    }

    /// A tensor of `dtype` from its raw little-endian bytes (as safetensors stores them).
    ///
    /// Errors: [`Error::ElementCountMismatch`] if `bytes` is not exactly `numel` elements.
    pub fn from_bytes(bytes: &[u8], dims: &[usize], dtype: DType, device: &Device) -> Result<Self> {
        let shape = Shape::new(dims)?;
        if bytes.len() != shape.numel() * dtype.size_in_bytes() {
            return Err(Error::ElementCountMismatch {
                op: "from_bytes",
                dims: dims.to_vec(),
                expected: shape.numel(),
                got: bytes.len() / dtype.size_in_bytes(),
            });
        }
        Tensor::from_cpu(shape, CpuStorage::from_bytes(dtype, bytes)?).to_device(device)
    }

    /// A tensor of zeros.
    pub fn zeros(dims: &[usize], dtype: DType, device: &Device) -> Result<Self> {
        let shape = Shape::new(dims)?;
        let storage =
            with_storable!(dtype, T => CpuStorage::from_vec(crate::alloc::zeroed::<T>("zeros", shape.numel())?));
        Tensor::from_cpu(shape, storage).to_device(device)
    }

    /// Seeded uniform samples in `[-1, 1)`, rounded to `dtype`.
    pub fn rand(dims: &[usize], dtype: DType, seed: u64, device: &Device) -> Result<Self> {
        let mut rng = SplitMix64::new(seed);
        Self::from_fn_f64(dims, dtype, device, |_| rng.uniform(-1.0, 1.0))
    }

    /// Seeded standard-normal samples, rounded to `dtype`.
    pub fn randn(dims: &[usize], dtype: DType, seed: u64, device: &Device) -> Result<Self> {
        let mut rng = SplitMix64::new(seed);
        Self::from_fn_f64(dims, dtype, device, |_| rng.normal())
    }

    /// Seeded uniform integers in `[lo, hi]`, stored as `dtype`. Small integers are exact in every
    /// dtype, so products of them make results that can be compared bit for bit.
    pub fn rand_int(dims: &[usize], dtype: DType, lo: i64, hi: i64, seed: u64, device: &Device) -> Result<Self> {
        let mut rng = SplitMix64::new(seed);
        Self::from_fn_f64(dims, dtype, device, |_| rng.int_in(lo, hi) as f64)
    }

    /// A tensor whose element at flat index `i` is `f(i)` rounded to `dtype` (for the integer
    /// dtypes: rounded to the nearest integer, saturating at the type's range, NaN as 0).
    pub fn from_fn_f64(dims: &[usize], dtype: DType, device: &Device, mut f: impl FnMut(usize) -> f64) -> Result<Self> {
        let shape = Shape::new(dims)?;
        let n = shape.numel();
        let storage = match dtype {
            DType::I32 => {
                CpuStorage::from_vec(crate::alloc::collect("from_fn", n, (0..n).map(|i| f(i).round() as i32))?)
            }
            DType::I64 => {
                CpuStorage::from_vec(crate::alloc::collect("from_fn", n, (0..n).map(|i| f(i).round() as i64))?)
            }
            _ => with_dtype!(dtype, T => {
                CpuStorage::from_vec(crate::alloc::collect("from_fn", n, (0..n).map(|i| T::from_f64(f(i))))?)
            }),
        };
        Tensor::from_cpu(shape, storage).to_device(device)
    }
}

/// Accessors.
impl Tensor {
    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The dimensions, outermost first.
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.shape.ndim()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.numel()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.storage.dtype()
    }

    /// The device holding the elements.
    pub fn device(&self) -> Device {
        self.storage.device()
    }

    /// Size of the elements in bytes.
    pub fn size_in_bytes(&self) -> usize {
        self.numel() * self.dtype().size_in_bytes()
    }

    /// [`Error::NotFloat`] unless this tensor has a floating-point dtype (arithmetic's check).
    pub(crate) fn require_float(&self) -> Result<()> {
        if self.dtype().is_float() { Ok(()) } else { Err(Error::NotFloat { dtype: self.dtype() }) }
    }

    /// The host storage, or [`Error::UnsupportedDevice`] for a device tensor.
    pub(crate) fn cpu_storage(&self, op: &'static str) -> Result<&CpuStorage> {
        match &self.storage {
            Storage::Cpu(s) => Ok(s),
            Storage::Cuda(_) => Err(Error::UnsupportedDevice { op, device: self.device() }),
        }
    }

    /// The device storage, for in-place device writes (which go through
    /// `CudaStorage::unique_buf`); [`Error::UnsupportedDevice`] for a host tensor.
    pub(crate) fn cuda_storage_mut(&mut self, op: &'static str) -> Result<&mut CudaStorage> {
        let device = self.device();
        match &mut self.storage {
            Storage::Cuda(s) => Ok(s),
            Storage::Cpu(_) => Err(Error::UnsupportedDevice { op, device }),
        }
    }

    pub(crate) fn storage(&self) -> &Storage {
        &self.storage
    }

    /// The host elements as `&[T]`. Errors if `T` is not the dtype or the tensor is not on the host.
    pub fn as_slice<T: Storable>(&self) -> Result<&[T]> {
        let dtype = self.dtype();
        self.cpu_storage("as_slice")?.as_slice::<T>().ok_or(Error::DTypeMismatch {
            op: "as_slice",
            lhs: dtype,
            rhs: T::DTYPE,
        })
    }

    /// The host elements as `&mut [T]`, for writing results in place.
    pub fn as_mut_slice<T: Storable>(&mut self) -> Result<&mut [T]> {
        let (dtype, device) = (self.dtype(), self.device());
        match &mut self.storage {
            Storage::Cpu(s) => std::sync::Arc::make_mut(s).as_mut_slice::<T>(),
            Storage::Cuda(_) => return Err(Error::UnsupportedDevice { op: "as_mut_slice", device }),
        }
        .ok_or(Error::DTypeMismatch { op: "as_mut_slice", lhs: dtype, rhs: T::DTYPE })
    }

    /// The host elements' bytes (little-endian), e.g. for writing a file.
    pub fn as_bytes(&self) -> Result<&[u8]> {
        Ok(self.cpu_storage("as_bytes")?.as_bytes())
    }

    /// The host elements' bytes (little-endian), writable, e.g. for reading a file into a
    /// tensor without an intermediate buffer. Any bytes are valid elements of every dtype.
    pub fn as_bytes_mut(&mut self) -> Result<&mut [u8]> {
        let device = self.device();
        match &mut self.storage {
            Storage::Cpu(s) => Ok(std::sync::Arc::make_mut(s).as_bytes_mut()),
            Storage::Cuda(_) => Err(Error::UnsupportedDevice { op: "as_bytes_mut", device }),
        }
    }

    /// Copies the elements out as `Vec<T>`, from any device. `T` must be the tensor's dtype.
    pub fn to_vec<T: Storable>(&self) -> Result<Vec<T>> {
        self.to_device(&Device::Cpu)?.as_slice::<T>().map(<[T]>::to_vec)
    }

    /// Copies the elements out widened to `f64` (exact for every float dtype and for integers
    /// up to 2^53 in magnitude), from any device.
    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        let host = self.to_device(&Device::Cpu)?;
        let s = host.cpu_storage("to_f64_vec")?;
        let n = host.numel();
        match s.dtype() {
            DType::I32 => crate::alloc::collect(
                "to_f64_vec",
                n,
                s.as_slice::<i32>().unwrap_or_default().iter().map(|&v| f64::from(v)),
            ),
            DType::I64 => crate::alloc::collect(
                "to_f64_vec",
                n,
                s.as_slice::<i64>().unwrap_or_default().iter().map(|&v| v as f64),
            ),
            dtype => with_dtype!(dtype, T => {
                crate::alloc::collect("to_f64_vec", n, s.as_slice::<T>().unwrap_or_default().iter().map(|v| v.to_f64()))
            }),
        }
    }

    /// The elements of an integer tensor (`i32` or `i64`) as `i64`, from any device.
    ///
    /// Errors: [`Error::NotInteger`] for a float tensor.
    pub fn to_i64_vec(&self) -> Result<Vec<i64>> {
        fn widen<T: IntElement>(v: &[T]) -> Vec<i64> {
            v.iter().map(|x| x.to_i64()).collect()
        }
        let host = self.to_device(&Device::Cpu)?;
        let s = host.cpu_storage("to_i64_vec")?;
        match s.dtype() {
            DType::I32 => Ok(widen(s.as_slice::<i32>().unwrap_or_default())),
            DType::I64 => Ok(widen(s.as_slice::<i64>().unwrap_or_default())),
            dtype => Err(Error::NotInteger { op: "to_i64_vec", dtype }),
        }
    }

    /// This tensor on `device`: a copy if it moves, a cheap clone if it is already there.
    ///
    /// Errors: [`Error::CudaUnavailable`] when the CUDA device cannot be used (no driver, no such
    /// device, kernels not built), [`Error::Cuda`] when a copy fails.
    pub fn to_device(&self, device: &Device) -> Result<Tensor> {
        if self.device() == *device {
            return Ok(self.clone());
        }
        let storage = match (&self.storage, *device) {
            (Storage::Cpu(s), Device::Cuda(ordinal)) => {
                let gpu = gpu_for(ordinal)?;
                let buf = gpu.htod(s.as_bytes())?;
                Storage::Cuda(CudaStorage::new(buf, s.as_bytes().len(), s.dtype(), gpu))
            }
            (Storage::Cuda(s), Device::Cpu) => Storage::Cpu(std::sync::Arc::new(s.to_host()?)),
            (Storage::Cuda(s), Device::Cuda(ordinal)) => {
                let host = s.to_host()?;
                let gpu = gpu_for(ordinal)?;
                let buf = gpu.htod(host.as_bytes())?;
                Storage::Cuda(CudaStorage::new(buf, s.len, s.dtype, gpu))
            }
            (Storage::Cpu(_), Device::Cpu) => self.storage.clone(),
        };
        Ok(Tensor::from_parts(self.shape.clone(), storage))
    }

    /// For backends that drive CUDA themselves (NCCL): the device and raw bytes of a CUDA
    /// tensor (`numel * dtype size` bytes are valid), or `None` for a host tensor.
    pub fn cuda_buffer(
        &self,
    ) -> Option<(&std::sync::Arc<tp_kernels::Gpu>, &tp_kernels::cudarc::driver::CudaSlice<u8>)> {
        match &self.storage {
            Storage::Cuda(s) => Some((&s.gpu, &s.buf)),
            Storage::Cpu(_) => None,
        }
    }

    /// A CUDA tensor of shape `dims` and `dtype` over `buf`, which a backend has filled.
    ///
    /// Errors: [`Error::ElementCountMismatch`] if `buf` is shorter than the shape needs.
    pub fn from_cuda_buffer(
        buf: tp_kernels::cudarc::driver::CudaSlice<u8>,
        dims: &[usize],
        dtype: DType,
        gpu: std::sync::Arc<tp_kernels::Gpu>,
    ) -> Result<Tensor> {
        let shape = Shape::new(dims)?;
        let len = shape.numel() * dtype.size_in_bytes();
        if buf.len() < len {
            return Err(Error::ElementCountMismatch {
                op: "from_cuda_buffer",
                dims: dims.to_vec(),
                expected: shape.numel(),
                got: buf.len() / dtype.size_in_bytes(),
            });
        }
        Ok(Tensor::from_cuda(shape, CudaStorage::new(buf, len, dtype, gpu)))
    }

    /// Overwrites this tensor's elements with `src`'s (same shape and dtype; `src` may be on
    /// another device). Host tensors are written in place, so a caller's buffer is reused; a
    /// device tensor takes a copy of `src` on its own device (device buffers are shared and
    /// immutable in this version).
    ///
    /// Errors: [`Error::ShapeMismatch`], [`Error::DTypeMismatch`], and copy failures.
    pub fn copy_from(&mut self, src: &Tensor) -> Result<()> {
        if src.dims() != self.dims() {
            return Err(Error::ShapeMismatch {
                op: "copy_from",
                lhs: self.dims().to_vec(),
                rhs: src.dims().to_vec(),
                why: "source and destination shapes must be equal",
            });
        }
        if src.dtype() != self.dtype() {
            return Err(Error::DTypeMismatch { op: "copy_from", lhs: self.dtype(), rhs: src.dtype() });
        }
        let device = self.device();
        match &mut self.storage {
            Storage::Cpu(dst) => {
                let dst = std::sync::Arc::make_mut(dst);
                let moved = src.to_device(&Device::Cpu)?;
                let bytes = moved.as_bytes()?;
                with_storable!(dst.dtype(), T => {
                    if let Some(d) = dst.as_mut_slice::<T>() {
                        d.copy_from_slice(bytemuck::cast_slice(bytes));
                    }
                });
                Ok(())
            }
            Storage::Cuda(_) => {
                self.storage = src.to_device(&device)?.storage;
                Ok(())
            }
        }
    }

    /// The same elements viewed with new dimensions of equal element count.
    pub fn reshape(&self, dims: &[usize]) -> Result<Tensor> {
        let shape = Shape::new(dims)?;
        if shape.numel() != self.numel() {
            return Err(Error::ElementCountMismatch {
                op: "reshape",
                dims: dims.to_vec(),
                expected: shape.numel(),
                got: self.numel(),
            });
        }
        Ok(Tensor { shape, storage: self.storage.clone() })
    }
}

impl PartialEq for Tensor {
    fn eq(&self, other: &Self) -> bool {
        if self.shape != other.shape || self.dtype() != other.dtype() || self.device() != other.device() {
            return false;
        }
        match (&self.storage, &other.storage) {
            (Storage::Cpu(_), Storage::Cpu(_)) => self.storage.byte_eq(&other.storage),
            _ => match (self.to_device(&Device::Cpu), other.to_device(&Device::Cpu)) {
                (Ok(a), Ok(b)) => a.storage.byte_eq(&b.storage),
                _ => false,
            },
        }
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor[{:?}, {}, {}]", self.dims(), self.dtype(), self.device())
    }
}
