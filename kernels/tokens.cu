// tokens.cu -- where token ids meet vectors: the embedding lookup and the greedy argmax.
//
// * tp_embedding_T_I(out, table, ids, n, rows, h, offset): table: rows x h (this rank's rows
//   [offset, offset + rows) of the vocabulary), ids: n ids of integer type I, out: n x h.
//   out[i] = table[ids[i] - offset] when that row is local, zeros otherwise (the vocab-parallel
//   lookup; an all-reduce of the ranks' outputs completes it).
//   Launch: blocks stride over ids, threads over h; 256 threads, grid = min(n, 32 * SMs).
// * tp_max_index_T(vals, idx, x, rows, n): x: rows x n (n >= 1). vals[r] = max_j x[r, j] as f32,
//   idx[r] = the first j holding it; NaN beats every number (torch.argmax's rule).
//   Launch: one block of 256 threads per row (blocks stride over rows).
#include "common.cuh"

template <typename T, typename I>
__device__ __forceinline__ void embedding(T* __restrict__ out, const T* __restrict__ table, const I* __restrict__ ids,
                                          int64_t n, int64_t rows, int64_t h, int64_t offset) {
    for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
        const int64_t local = (int64_t)ids[i] - offset;
        const bool mine = local >= 0 && local < rows;
        for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
            out[i * h + j] = mine ? table[local * h + j] : tp::from_f32<T>(0.0f);
        }
    }
}

using tp::better;

template <typename T>
__device__ __forceinline__ void max_index(float* __restrict__ vals, int64_t* __restrict__ idx, const T* __restrict__ x,
                                          int64_t rows, int64_t n) {
    __shared__ float sv[32];
    __shared__ int64_t si[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        float best = -INFINITY;
        int64_t bi = n;  // no element yet: loses to every real one
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
            const float v = tp::to_f32(x[r * n + j]);
            if (bi == n || better(v, j, best, bi)) {
                best = v;
                bi = j;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int64_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi != n && (bi == n || better(ov, oi, best, bi))) {
                best = ov;
                bi = oi;
            }
        }
        __syncthreads();  // the previous row's results may still be read
        if (lane == 0) {
            sv[warp] = best;
            si[warp] = bi;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < warps; ++w) {
                if (si[w] != n && (bi == n || better(sv[w], si[w], best, bi))) {
                    best = sv[w];
                    bi = si[w];
                }
            }
            vals[r] = best;
            idx[r] = bi;
        }
    }
}

#define TP_EMBEDDING(SUFFIX, T, ISUFFIX, I)                                                                     \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS) tp_embedding_##SUFFIX##_##ISUFFIX(                        \
        T* out, const T* table, const I* ids, int64_t n, int64_t rows, int64_t h, int64_t offset) {            \
        embedding<T, I>(out, table, ids, n, rows, h, offset);                                                   \
    }
#define TP_TOKENS(SUFFIX, T)                                                                                    \
    TP_EMBEDDING(SUFFIX, T, i32, int32_t)                                                                       \
    TP_EMBEDDING(SUFFIX, T, i64, int64_t)                                                                       \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS)                                                           \
        tp_max_index_##SUFFIX(float* vals, int64_t* idx, const T* x, int64_t rows, int64_t n) {                 \
        max_index<T>(vals, idx, x, rows, n);                                                                    \
    }
TP_TOKENS(f32, float)
TP_TOKENS(f16, __half)
TP_TOKENS(bf16, __nv_bfloat16)
