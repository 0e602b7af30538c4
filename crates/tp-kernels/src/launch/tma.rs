//! TMA descriptors (`CUtensorMap`) for the Hopper GEMM's operands.

use super::{ElemType, invalid};
use crate::error::{Result, driver};
use crate::gpu::Gpu;
use cudarc::driver::{CudaSlice, SyncOnDrop};

/// A TMA descriptor as a kernel parameter (`const __grid_constant__ CUtensorMap`).
#[repr(C, align(128))]
#[derive(Clone, Copy)]
pub(super) struct TensorMap(cudarc::driver::sys::CUtensorMap);

// SAFETY: CUtensorMap is 128 bytes of plain data that the kernel receives by value; the
// wrapper keeps its 128-byte alignment, and it holds no host pointers the device would follow
// (the global address inside is a device address).
unsafe impl cudarc::driver::DeviceRepr for TensorMap {}

impl Gpu {
    /// A 2-D TMA descriptor over a row-major `rows x k` matrix of 2-byte elements at `buf`, box
    /// `box_k x box_rows`, 128-byte swizzle, zero fill past the edges.
    ///
    /// The kernel reads `buf` only through the descriptor, so cudarc never sees it as a launch
    /// argument: the returned guard stands for that read. Keep it alive until the kernel has been
    /// launched; dropping it then records the read on the stream (cudarc's stream ordering), so
    /// later writers on other streams wait for the kernel.
    pub(super) fn tensor_map<'a>(
        &'a self,
        buf: &'a CudaSlice<u8>,
        ty: ElemType,
        rows: usize,
        k: usize,
        (box_k, box_rows): (u32, u32),
    ) -> Result<(TensorMap, SyncOnDrop<'a>)> {
        use cudarc::driver::DevicePtr;
        use cudarc::driver::sys::{
            CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave, CUtensorMapL2promotion,
            CUtensorMapSwizzle,
        };
        let dt = match ty {
            ElemType::BF16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            ElemType::F16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            _ => return Err(invalid("gemm_wgmma", "TMA maps here are for 2-byte types")),
        };
        let (ptr, guard) = buf.device_ptr(self.stream());
        let dims = [k as u64, rows as u64];
        let strides = [(k * ty.size()) as u64]; // bytes between rows; dim 0 is contiguous
        let boxes = [box_k, box_rows];
        let elem_strides = [1u32, 1];
        // SAFETY: all-zero bytes are a valid (if meaningless) CUtensorMap, fully overwritten by
        // a successful cuTensorMapEncodeTiled below.
        let mut map: cudarc::driver::sys::CUtensorMap = unsafe { std::mem::zeroed() };
        // SAFETY: the arrays hold `rank` = 2 entries each and outlive the call; `ptr` is the
        // device address of `buf`, which holds rows*k elements (checked by check_gemm), is
        // 256-byte aligned, and has a row stride that is a multiple of 16 bytes (k % 8 == 0,
        // checked by the caller), as TMA requires.
        let r = unsafe {
            cudarc::driver::sys::cuTensorMapEncodeTiled(
                &mut map,
                dt,
                2,
                ptr as usize as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                elem_strides.as_ptr(),
                CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        r.result().map_err(driver("cuTensorMapEncodeTiled"))?;
        Ok((TensorMap(map), guard))
    }
}
