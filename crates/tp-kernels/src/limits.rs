//! The kernels' size limits as `usize`, for the launchers' checks and for callers.

use crate::consts;

/// Largest M the decode-shaped GEMM takes (`SMALL_M_MAX` of kernels/launch_config.cuh).
pub const SMALL_M_MAX: usize = consts::SMALL_M_MAX as usize;
/// Largest head size the attention kernel takes.
pub const ATTENTION_MAX_HEAD_DIM: usize = consts::ATTENTION_MAX_HEAD_DIM as usize;
/// Largest M the quantized-weight product takes (`QUANT_GEMV_MAX_M` of kernels/launch_config.cuh).
pub const QUANT_GEMV_MAX_M: usize = consts::QUANT_GEMV_MAX_M as usize;
