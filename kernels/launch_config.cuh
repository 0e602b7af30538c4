// launch_config.cuh -- the launch constants the host and the kernels must agree on, in one place.
//
// The kernels include this header; build.rs reads every `TP_CONST(NAME, VALUE)` line (VALUE an
// integer literal) and gives tp-kernels `pub const NAME: u32 = VALUE;`, and `cargo xtask ptx`
// reads the register split from it. Change a value here and both sides follow; each kernel
// static_asserts that its derived sizes (shared memory) still equal the values given here.
#pragma once

#define TP_CONST(NAME, VALUE) constexpr int NAME = VALUE;

// 1-D element-wise and row kernels: threads per block.
TP_CONST(ELEMENTWISE_THREADS, 256)

// gemm_simt.cu: C tile and threads.
TP_CONST(SIMT_BM, 128)
TP_CONST(SIMT_BN, 128)
TP_CONST(SIMT_THREADS, 256)

// gemm_mma.cu: C tile, threads, dynamic shared memory (4 stages of (128 + 128) x 40 halves).
TP_CONST(MMA_BM, 128)
TP_CONST(MMA_BN, 128)
TP_CONST(MMA_THREADS, 256)
TP_CONST(MMA_SMEM_BYTES, 81920)

// gemm_wgmma.cu: C tile (BM x BN), K step (= the TMA box's inner extent), threads (producer +
// 2 consumer warpgroups), dynamic shared memory, and the setmaxnreg split.
TP_CONST(WGMMA_BM, 128)
TP_CONST(WGMMA_BN, 256)
TP_CONST(WGMMA_BK, 64)
TP_CONST(WGMMA_THREADS, 384)
TP_CONST(WGMMA_SMEM_BYTES, 197696)
TP_CONST(WGMMA_PRODUCER_REGS, 40)
TP_CONST(WGMMA_CONSUMER_REGS, 232)

// gemm_small_m.cu: largest M, warps (= weight rows) per block.
TP_CONST(SMALL_M_MAX, 8)
TP_CONST(SMALL_M_WARPS, 8)

// quant_gemv.cu: largest M, warps (= weight rows in flight) per block.
TP_CONST(QUANT_GEMV_MAX_M, 8)
TP_CONST(QUANT_GEMV_WARPS, 8)

// attention.cu: largest head_dim, warps per block.
TP_CONST(ATTENTION_MAX_HEAD_DIM, 256)
TP_CONST(ATTENTION_WARPS, 4)

// sampling.cu: most candidates tp_top_k_T returns per row.
TP_CONST(SAMPLING_TOP_K_MAX, 64)

// grad.cu: rows per chunk of a column sum's first pass, and the most chunks (then the chunks
// grow): the partial sums are at most COL_SUM_MAX_CHUNKS x cols floats.
TP_CONST(COL_SUM_CHUNK_ROWS, 64)
TP_CONST(COL_SUM_MAX_CHUNKS, 128)

// optim.cu: tensors per launch of the multi-tensor AdamW (its table is a kernel parameter of
// ADAMW_TABLE_BYTES), and elements per block-sized chunk of work.
TP_CONST(ADAMW_MAX_TENSORS, 32)
TP_CONST(ADAMW_TABLE_BYTES, 1680)
TP_CONST(ADAMW_CHUNK, 16384)
