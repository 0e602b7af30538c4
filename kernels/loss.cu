// loss.cu -- the pieces of a vocab-parallel cross-entropy on one rank's logit columns
// (training). x: rows x n logits of T = float, __half or __nv_bfloat16 (this rank's columns);
// every result is f32. Each kernel reads each logit once: one block per row, blocks striding over
// rows, 256 threads (a multiple of 32, as the block reductions need), grid = min(rows, 32 * SMs).
//
// * tp_row_max_T(out, x, rows, n): out[r] = max_j x[r, j] (fmaxf: NaN is ignored unless every
//   element is NaN, as Rust's f32::max fold; -inf for n = 0). Exact.
// * tp_cross_entropy_parts_T(out, x, max, targets, rows, n): out: 2 x rows floats.
//   out[r] = sum_j exp(x[r, j] - max[r]) (each difference rounded to f32, expf, f32 sum);
//   out[rows + r] = x[r, targets[r]] when 0 <= targets[r] < n (a local column), else 0.
//   max: rows floats (the rows' global maxima); targets: rows int64 (-1: not on this rank).
// * tp_cross_entropy_backward_T(out, x, max, sum_exp, targets, weights, rows, n): out: rows x n,
//   out[r, j] = exp(x[r, j] - max[r]) * (w_r / sum_exp[r]) - (j == targets[r] ? w_r : 0), and
//   zeros in rows of weight w_r = weights[r] = 0: the gradient of sum_r w_r loss_r. The product
//   and the difference are rounded in the host's order (_rn intrinsics).
#include "common.cuh"

namespace {

// Maximum of `v` over the block (fmaxf); every thread gets it. `scratch`: 32 floats of shared
// memory; the call synchronises the block.
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < warps ? scratch[lane] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, o));
    return t;
}

template <typename T>
__device__ __forceinline__ void row_max(float* __restrict__ out, const T* __restrict__ x, int64_t rows, int64_t n) {
    __shared__ float scratch[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        float m = -INFINITY;
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, tp::to_f32(x[r * n + j]));
        m = block_max(m, scratch);
        if (threadIdx.x == 0) out[r] = m;
    }
}

template <typename T>
__device__ __forceinline__ void cross_entropy_parts(float* __restrict__ out, const T* __restrict__ x,
                                                    const float* __restrict__ max, const int64_t* __restrict__ targets,
                                                    int64_t rows, int64_t n) {
    __shared__ float scratch[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const float m = max[r];
        float s = 0.0f;
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) s = __fadd_rn(s, expf(__fsub_rn(tp::to_f32(x[r * n + j]), m)));
        s = tp::block_sum(s, scratch);
        if (threadIdx.x == 0) {
            const int64_t t = targets[r];
            out[r] = s;
            out[rows + r] = (t >= 0 && t < n) ? tp::to_f32(x[r * n + t]) : 0.0f;
        }
    }
}

template <typename T>
__device__ __forceinline__ void cross_entropy_backward(float* __restrict__ out, const T* __restrict__ x,
                                                       const float* __restrict__ max,
                                                       const float* __restrict__ sum_exp,
                                                       const int64_t* __restrict__ targets,
                                                       const float* __restrict__ weights, int64_t rows, int64_t n) {
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const float w = weights[r];
        float* o = out + r * n;
        if (w == 0.0f) {
            for (int64_t j = threadIdx.x; j < n; j += blockDim.x) o[j] = 0.0f;
            continue;
        }
        const float m = max[r], inv = __fdiv_rn(w, sum_exp[r]);
        const int64_t t = targets[r];
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
            const float p = __fmul_rn(expf(__fsub_rn(tp::to_f32(x[r * n + j]), m)), inv);
            o[j] = j == t ? __fsub_rn(p, w) : p;
        }
    }
}

}  // namespace

#define TP_LOSS(SUFFIX, T)                                                                                    \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS)                                         \
        tp_row_max_##SUFFIX(float* out, const T* x, int64_t rows, int64_t n) {                                \
        row_max<T>(out, x, rows, n);                                                                          \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS) tp_cross_entropy_parts_##SUFFIX(        \
        float* out, const T* x, const float* max, const int64_t* targets, int64_t rows, int64_t n) {          \
        cross_entropy_parts<T>(out, x, max, targets, rows, n);                                                \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS) tp_cross_entropy_backward_##SUFFIX(     \
        float* out, const T* x, const float* max, const float* sum_exp, const int64_t* targets,               \
        const float* weights, int64_t rows, int64_t n) {                                                      \
        cross_entropy_backward<T>(out, x, max, sum_exp, targets, weights, rows, n);                           \
    }
TP_LOSS(f32, float)
TP_LOSS(f16, __half)
TP_LOSS(bf16, __nv_bfloat16)
