//! [`Tensor`]: a contiguous, row-major n-dimensional array of one dtype on one device.

use crate::rng::SplitMix64;
use crate::storage::{CpuStorage, Storage};
use crate::{DType, Device, Element, Error, Result, Shape, with_dtype};
use std::fmt;

/// A contiguous, row-major n-dimensional array of one [`DType`] on one [`Device`].
///
/// Operations return new tensors; `Clone` copies the elements. Every constructor validates the
/// shape ([`Shape::new`]) and the data length, so a `Tensor` always holds exactly `numel`
/// elements.
#[derive(Clone, PartialEq)]
pub struct Tensor {
    shape: Shape,
    storage: Storage,
}

/// Constructors.
impl Tensor {
    pub(crate) fn from_parts(shape: Shape, storage: Storage) -> Self {
        debug_assert_eq!(storage.dtype().size_in_bytes() * shape.numel(), storage_bytes(&storage));
        Tensor { shape, storage }
    }

    pub(crate) fn from_cpu(shape: Shape, storage: CpuStorage) -> Self {
        Self::from_parts(shape, Storage::Cpu(storage))
    }

    /// A tensor of shape `dims` holding `data` in row-major order, on `device`.
    ///
    /// Errors: [`Error::ElementCountMismatch`] if `data.len()` is not the product of `dims`,
    /// [`Error::ShapeOverflow`] if that product overflows.
    pub fn from_vec<T: Element>(data: Vec<T>, dims: &[usize], device: &Device) -> Result<Self> {
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
    pub fn from_slice<T: Element>(data: &[T], dims: &[usize], device: &Device) -> Result<Self> {
        Self::from_vec(data.to_vec(), dims, device)
    }

    /// A tensor of zeros.
    pub fn zeros(dims: &[usize], dtype: DType, device: &Device) -> Result<Self> {
        Self::from_fn_f64(dims, dtype, device, |_| 0.0)
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

    /// A tensor whose element at flat index `i` is `f(i)` rounded to `dtype`.
    pub fn from_fn_f64(dims: &[usize], dtype: DType, device: &Device, mut f: impl FnMut(usize) -> f64) -> Result<Self> {
        let shape = Shape::new(dims)?;
        let n = shape.numel();
        let storage =
            with_dtype!(dtype, T => CpuStorage::from_vec((0..n).map(|i| T::from_f64(f(i))).collect::<Vec<T>>()));
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

    /// The host storage; the CUDA backend adds an `UnsupportedDevice` arm here.
    pub(crate) fn cpu_storage(&self, _op: &'static str) -> Result<&CpuStorage> {
        match &self.storage {
            Storage::Cpu(s) => Ok(s),
        }
    }

    /// The host elements as `&[T]`. Errors if `T` is not the dtype or the tensor is not on the host.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        let dtype = self.dtype();
        self.cpu_storage("as_slice")?.as_slice::<T>().ok_or(Error::DTypeMismatch {
            op: "as_slice",
            lhs: dtype,
            rhs: T::DTYPE,
        })
    }

    /// The host elements as `&mut [T]`, for writing results in place.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        let dtype = self.dtype();
        match &mut self.storage {
            Storage::Cpu(s) => s.as_mut_slice::<T>(),
        }
        .ok_or(Error::DTypeMismatch { op: "as_mut_slice", lhs: dtype, rhs: T::DTYPE })
    }

    /// The host elements' bytes (little-endian), e.g. for writing a file.
    pub fn as_bytes(&self) -> Result<&[u8]> {
        Ok(self.cpu_storage("as_bytes")?.as_bytes())
    }

    /// Copies the elements out as `Vec<T>`, from any device. `T` must be the tensor's dtype.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        self.to_device(&Device::Cpu)?.as_slice::<T>().map(<[T]>::to_vec)
    }

    /// Copies the elements out widened to `f64` (exact for every dtype), from any device.
    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        let host = self.to_device(&Device::Cpu)?;
        let s = host.cpu_storage("to_f64_vec")?;
        Ok(with_dtype!(s.dtype(), T => s.as_slice::<T>().unwrap_or_default().iter().map(|v| v.to_f64()).collect()))
    }

    /// This tensor on `device` (a copy if it moves, a clone if it is already there).
    pub fn to_device(&self, device: &Device) -> Result<Tensor> {
        match (self.device(), *device) {
            (a, b) if a == b => Ok(self.clone()),
            (_, Device::Cuda(ordinal)) => Err(Error::CudaUnavailable {
                reason: format!(
                    "cannot place a tensor on cuda:{ordinal}: this build of tp-core has no CUDA backend yet; \
                     use Device::Cpu"
                ),
            }),
            (from, Device::Cpu) => Err(Error::UnsupportedDevice { op: "to_device", device: from }),
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

fn storage_bytes(storage: &Storage) -> usize {
    match storage {
        Storage::Cpu(s) => s.as_bytes().len(),
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor[{:?}, {}, {}]", self.dims(), self.dtype(), self.device())
    }
}
