//! [`Gpu`]: one CUDA device as tp uses it: its context, a stream, the embedded kernel modules
//! (loaded lazily, once) and the facts launchers need (SM count, shared-memory limit).

use crate::error::{KernelError, Result, driver};
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

static POISON: AtomicBool = AtomicBool::new(false);
static HOST_SYNCS: AtomicU64 = AtomicU64::new(0);

/// How many times this process has made the host wait for a GPU (device-to-host copies,
/// stream synchronisations, host waits on events), on any device. Tests read it around code that
/// must not synchronise, such as a layer's forward pass over NCCL.
pub fn host_syncs() -> u64 {
    HOST_SYNCS.load(Ordering::Relaxed)
}

/// Counts one host synchronisation (see [`host_syncs`]).
pub fn count_host_sync() {
    HOST_SYNCS.fetch_add(1, Ordering::Relaxed);
}

/// Test support: when on, [`Gpu::alloc`] fills new buffers with `0xFF` bytes (NaN in f32, f16
/// and bf16) instead of zeros, so an output element a kernel forgot to write cannot pass as a
/// plausible value. Off by default; the GPU test suite turns it on.
pub fn set_poison_allocations(on: bool) {
    POISON.store(on, Ordering::Relaxed);
}

/// Checks that the CUDA driver can be used at all, without panicking when it is absent.
///
/// cudarc's dynamic loader panics on the first driver call if `libcuda` cannot be opened, so
/// this probes for the library first and turns its absence into [`KernelError::CudaUnavailable`].
pub fn driver_available() -> Result<()> {
    // SAFETY: `is_culib_present` only attempts to dlopen the driver library by its known names
    // and reports whether that worked; it calls no driver function.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(KernelError::CudaUnavailable {
            reason: "the NVIDIA driver library (libcuda.so) was not found on this machine".into(),
        });
    }
    cudarc::driver::result::init()
        .map_err(|e| KernelError::CudaUnavailable { reason: format!("cuInit failed: {e:?} (no usable GPU?)") })
}

/// Number of CUDA devices, or the reason there are none.
pub fn device_count() -> Result<usize> {
    driver_available()?;
    let n = CudaContext::device_count().map_err(driver("cuDeviceGetCount"))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// One CUDA device. Obtained with [`Gpu::get`], shared (`Arc`) by every tensor on the device.
pub struct Gpu {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    name: String,
    sm_count: u32,
    compute_capability: (i32, i32),
    smem_optin: u32,
    /// One slot per embedded module (`crate::modules::MODULES` order), loaded on first use.
    modules: Vec<OnceLock<std::result::Result<Arc<CudaModule>, KernelError>>>,
    /// One slot per kernel function (`crate::kernels::ALL` order), looked up on first use.
    functions: Vec<OnceLock<std::result::Result<CudaFunction, KernelError>>>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu({}: {}, sm_{}{})", self.ordinal, self.name, self.compute_capability.0, self.compute_capability.1)
    }
}

impl Gpu {
    /// The device with this ordinal, created on first use and cached for the process.
    ///
    /// Errors: [`KernelError::CudaUnavailable`] (no driver, no device),
    /// [`KernelError::NoSuchDevice`], [`KernelError::Driver`].
    pub fn get(ordinal: usize) -> Result<Arc<Gpu>> {
        static GPUS: OnceLock<Mutex<HashMap<usize, Arc<Gpu>>>> = OnceLock::new();
        let count = device_count()?;
        if ordinal >= count {
            return Err(KernelError::NoSuchDevice { ordinal, count });
        }
        let mut gpus = GPUS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
        if let Some(g) = gpus.get(&ordinal) {
            return Ok(g.clone());
        }
        let ctx = CudaContext::new(ordinal).map_err(driver("cuCtxCreate"))?;
        let attr = |a| ctx.attribute(a).map_err(driver("cuDeviceGetAttribute"));
        let sm_count = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let smem_optin = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
        let gpu = Arc::new(Gpu {
            ordinal,
            name: ctx.name().map_err(driver("cuDeviceGetName"))?,
            compute_capability: ctx.compute_capability().map_err(driver("cuDeviceGetAttribute"))?,
            sm_count: u32::try_from(sm_count).unwrap_or(1).max(1),
            smem_optin: u32::try_from(smem_optin).unwrap_or(0),
            stream: ctx.default_stream(),
            ctx,
            modules: crate::modules::MODULES.iter().map(|_| OnceLock::new()).collect(),
            functions: crate::kernels::ALL.iter().map(|_| OnceLock::new()).collect(),
        });
        gpus.insert(ordinal, gpu.clone());
        Ok(gpu)
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
    /// Device name as the driver reports it (e.g. "NVIDIA H200").
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The device's UUID as hex (stable across processes, whatever CUDA_VISIBLE_DEVICES says).
    pub fn uuid(&self) -> Result<String> {
        let u = self.ctx.uuid().map_err(driver("cuDeviceGetUuid"))?;
        Ok(u.bytes.iter().map(|b| format!("{:02x}", *b as u8)).collect())
    }

    /// Number of streaming multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }
    /// Compute capability `(major, minor)`.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }
    /// Largest dynamic shared memory a block may opt into, in bytes.
    pub fn smem_optin(&self) -> u32 {
        self.smem_optin
    }
    /// The stream every tp operation on this device runs on, in order.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    /// The CUDA context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Waits for all work queued on the stream (a host synchronisation, counted).
    pub fn synchronize(&self) -> Result<()> {
        count_host_sync();
        self.stream.synchronize().map_err(driver("cuStreamSynchronize"))
    }

    /// `len` bytes on the device, zeroed (or poisoned, see [`set_poison_allocations`]). At least
    /// one byte is allocated, so empty tensors work. Allocations are at least 256-byte aligned,
    /// which the launchers' alignment checks rely on.
    pub fn alloc(&self, len: usize) -> Result<CudaSlice<u8>> {
        if POISON.load(Ordering::Relaxed) {
            return self.stream.clone_htod(&vec![0xFFu8; len.max(1)]).map_err(driver("cuMemcpyHtoD"));
        }
        self.stream.alloc_zeros::<u8>(len.max(1)).map_err(driver("cuMemAlloc"))
    }

    /// A device copy of `bytes` (synchronous with respect to `bytes`).
    pub fn htod(&self, bytes: &[u8]) -> Result<CudaSlice<u8>> {
        if bytes.is_empty() {
            return self.alloc(0);
        }
        self.stream.clone_htod(bytes).map_err(driver("cuMemcpyHtoD"))
    }

    /// The first `len` bytes of `buf`, copied to the host.
    pub fn dtoh(&self, buf: &CudaSlice<u8>, len: usize) -> Result<Vec<u8>> {
        if len > buf.len() {
            return Err(KernelError::InvalidLaunch {
                kernel: "dtoh",
                why: format!("asked for {len} bytes of a {}-byte buffer", buf.len()),
            });
        }
        count_host_sync();
        let mut v = self.stream.clone_dtoh(buf).map_err(driver("cuMemcpyDtoH"))?;
        v.truncate(len);
        Ok(v)
    }

    /// The kernel function `name`, its module loaded and the function looked up on first use
    /// and kept: later calls take no lock and make no driver call. With `smem > 0` the
    /// function's dynamic shared-memory limit is raised to `smem` bytes once, at that first use
    /// (every caller of a function asks for the same amount: the kernel's constant).
    pub(crate) fn function(&self, name: &str, smem: u32) -> Result<&CudaFunction> {
        if let Some(reason) = crate::modules::NOT_COMPILED {
            return Err(KernelError::NotCompiled { reason });
        }
        let &index = crate::kernels::INDEX.get(name).ok_or_else(|| KernelError::MissingKernel { name: name.into() })?;
        let slot = self.functions.get(index).ok_or_else(|| KernelError::MissingKernel { name: name.into() })?;
        slot.get_or_init(|| {
            let module_name = crate::kernels::ALL[index].0;
            let m = self.module(module_name)?;
            let f = m
                .load_function(name)
                .map_err(|_| KernelError::MissingKernel { name: format!("{module_name}::{name}") })?;
            if smem > 0 {
                f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
                    .map_err(driver("cuFuncSetAttribute"))?;
            }
            Ok(f)
        })
        .as_ref()
        .map_err(Clone::clone)
    }

    /// The embedded module `name`, loaded into this context on first use.
    fn module(&self, name: &str) -> Result<Arc<CudaModule>> {
        let index = crate::modules::MODULES
            .iter()
            .position(|m| m.name == name)
            .ok_or_else(|| KernelError::MissingKernel { name: name.into() })?;
        self.modules[index]
            .get_or_init(|| {
                let fatbin = crate::modules::MODULES[index].fatbin.to_vec();
                self.ctx.load_module(Ptx::from_binary(fatbin)).map_err(driver("cuModuleLoadData"))
            })
            .clone()
    }
}
