// shard_copy.cu -- the shard-copy family: moving slices of tensors between full and sharded form.
//
// All three operations are copies of "units": 16, 8, 4, 2 or 1 bytes, the widest that every
// address, pitch and length of the call is a multiple of (the host launcher picks it).
//
// * tp_row_copy_uN: `rows` rows of `row_units` units from src to dst, each side with its own
//   pitch and offset (index_math.cuh, RowCopy). With a tensor seen as [outer, size, inner]:
//     narrow(dim, start, len) -> contiguous shard: rows = outer, row_units = len*inner,
//       src_pitch = size*inner, src_off = start*inner, dst_pitch = len*inner, dst_off = 0;
//     shard -> its slot in the full tensor (scatter-back, and each input of cat): the reverse.
//   src: the rows as above; dst: likewise; the two ranges must not overlap.
// * tp_gather_uN: all-gather buffer (rank, rows, cols_r), cols_r the balanced split of `cols`
//   over `world` ranks, to (rows, cols) row-major, in one pass, uneven widths included. The
//   launcher uses wide units only when every cols_r is a multiple of the unit.
//
// Launch: 1-D grid-stride, 256 threads per block, grid = min(ceil(total / 256), 4 * 65535);
// every index is 64-bit, with a 32-bit fast path when the whole copy fits in 32 bits.
#include "common.cuh"

namespace tp {

template <typename U>
__device__ __forceinline__ void row_copy(U* __restrict__ dst, const U* __restrict__ src, RowCopy c) {
    const int64_t total = c.rows * c.row_units;
    const bool small = total <= INT32_MAX && c.src_off + c.rows * c.src_pitch <= INT32_MAX &&
                       c.dst_off + c.rows * c.dst_pitch <= INT32_MAX;
    if (small) {
        // Same arithmetic in 32 bits: a 64-bit division costs several times a 32-bit one.
        const uint32_t n = (uint32_t)total, w = (uint32_t)c.row_units;
        for (uint32_t u = blockIdx.x * blockDim.x + threadIdx.x; u < n; u += gridDim.x * blockDim.x) {
            const uint32_t row = u / w, col = u - row * w;
            dst[c.dst_off + row * (uint32_t)c.dst_pitch + col] = src[c.src_off + row * (uint32_t)c.src_pitch + col];
        }
        return;
    }
    for (int64_t u = global_thread(); u < total; u += grid_stride()) {
        dst[row_copy_dst(c, u)] = src[row_copy_src(c, u)];
    }
}

template <typename U>
__device__ __forceinline__ void gather(U* __restrict__ dst, const U* __restrict__ src, int64_t rows, int64_t cols,
                                       Split s) {
    const int64_t total = rows * cols;
    for (int64_t u = global_thread(); u < total; u += grid_stride()) {
        const int64_t row = u / cols, col = u - row * cols;
        dst[u] = src[gather_src(s, rows, row, col)];
    }
}

}  // namespace tp

#define TP_ROW_COPY(NAME, U)                                                                              \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS) NAME(U* dst, const U* src, int64_t rows, int64_t row_units, \
                                                           int64_t src_pitch, int64_t src_off, int64_t dst_pitch, \
                                                           int64_t dst_off) {                                \
        tp::row_copy<U>(dst, src, tp::RowCopy{rows, row_units, src_pitch, src_off, dst_pitch, dst_off});   \
    }
TP_ROW_COPY(tp_row_copy_u16, uint4)
TP_ROW_COPY(tp_row_copy_u8, uint2)
TP_ROW_COPY(tp_row_copy_u4, uint32_t)
TP_ROW_COPY(tp_row_copy_u2, uint16_t)
TP_ROW_COPY(tp_row_copy_u1, uint8_t)

#define TP_GATHER(NAME, U)                                                                                 \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS) NAME(U* dst, const U* src, int64_t rows, int64_t cols, \
                                                           int64_t q, int64_t r) {                          \
        tp::gather<U>(dst, src, rows, cols, tp::Split{q, r});                                               \
    }
TP_GATHER(tp_gather_u16, uint4)
TP_GATHER(tp_gather_u8, uint2)
TP_GATHER(tp_gather_u4, uint32_t)
TP_GATHER(tp_gather_u2, uint16_t)
TP_GATHER(tp_gather_u1, uint8_t)
