//! # tp-kernels
//!
//! The leaf crate of tp. It embeds the CUDA kernels in `kernels/*.cu`, compiled by the
//! workspace `build.rs` into fatbins (nvcc found through `NVCC`, `CUDA_HOME/bin` or `PATH`; SASS
//! for sm_80 and sm_90a plus compute_80 PTX), loads them through `cudarc` once per device
//! ([`Gpu`]), and launches them through typed launchers that check sizes, alignment and grid
//! limits first ([`Gpu::row_copy`], [`Gpu::gather_interleave`], [`Gpu::cast`],
//! [`Gpu::gemm_simt_f32`], [`Gpu::gemm_mma`], [`Gpu::gemm_wgmma`], [`Gpu::gemm_tensor_core`];
//! for training the data- and weight-gradient GEMMs [`Gpu::gemm_nn`] and [`Gpu::gemm_tn`], the
//! backward kernels, the cross-entropy pieces and [`Gpu::adamw`];
//! for ggml block-quantized weights [`Gpu::dequantize`] and [`Gpu::quant_gemv`], the formats
//! named by [`QuantFormat`]). All `unsafe` of the GPU path lives here.
//!
//! Without a GPU: [`driver_available`] and [`Gpu::get`] return
//! [`KernelError::CudaUnavailable`] (cudarc itself would panic); when the build had no nvcc,
//! [`MODULES`] is empty and every launch returns [`KernelError::NotCompiled`].
//!
//! [`host_index`] is the kernels' index arithmetic and [`host_quant`] their block dequantization,
//! compiled for the host, for CPU tests.

pub mod consts;
mod elem;
mod error;
mod gpu;
pub mod host_index;
pub mod host_quant;
mod kernels;
mod launch;
mod limits;
mod modules;
mod quant;

pub use cudarc;
pub use elem::ElemType;
pub use error::{KernelError, Result, STICKY_ERROR_NOTE, note_sticky_errors_on_panic, sticky_error_note};
pub use gpu::{Gpu, count_host_sync, device_count, driver_available, host_syncs, set_poison_allocations};
pub use launch::{
    AdamwFactors, AdamwTensor, AttentionShape, GemmArgs, GemmKernel, GemmShape, GemmTnArgs, GroupedExpert, LoraFactor,
    LoraShape, MAX_LORA_RANK, MAX_ROUTED_EXPERTS, NormSplit, PagedSequence, PagedShape, RowCopy, RowPenalties,
    TOP_K_MAX,
};
pub use limits::{ATTENTION_MAX_HEAD_DIM, QUANT_GEMV_MAX_M, SMALL_M_MAX};
pub use modules::{KernelModule, MODULES, NOT_COMPILED, module};
pub use quant::{QUANT_FORMATS, QuantFormat};
