// norm.cu -- RMSNorm over the last dim, in the two styles decoders use, and the per-row sums of
// squares a norm over features split across ranks needs.
//
// * tp_rms_norm_T(out, x, w, rows, h, eps, style, sum_sq, n): x, out: rows x h row-major;
//   w: h; sum_sq: null, or rows floats. rstd_r = 1 / sqrt(m_r + eps) with
//   m_r = sum_sq ? sum_sq[r] / n : mean_j x[r, j]^2, all in f32 (IEEE sqrtf and division, no
//   fast math). style 0 (Llama): out[r, j] = round(w[j] * round(x[r, j] * rstd_r)), the two
//   rounding points of `weight * hidden_states.to(input_dtype)`; style 1 (Gemma):
//   out[r, j] = round((x[r, j] * rstd_r) * (1 + w[j])), one rounding; style 2 (OLMo 2):
//   out[r, j] = round(w[j] * (x[r, j] * rstd_r)), one rounding. round() is
//   round-to-nearest-even to T; explicit _rn intrinsics keep nvcc from contracting.
// * tp_sum_squares_T(out, x, rows, h): out[r] = sum_j x[r, j]^2 in f32 (rows floats).
// Launch: one block of 256 threads per row (blocks stride over rows), grid = min(rows, 32 * SMs).
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void rms_norm(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ w,
                                         int64_t rows, int64_t h, float eps, int style,
                                         const float* __restrict__ sum_sq, int64_t n) {
    __shared__ float scratch[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * h;
        float mean;
        if (sum_sq != nullptr) {
            mean = __fdiv_rn(sum_sq[r], (float)n);
        } else {
            float ss = 0.0f;
            for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
                const float v = tp::to_f32(xr[j]);
                ss = fmaf(v, v, ss);
            }
            ss = tp::block_sum(ss, scratch);
            mean = __fdiv_rn(ss, (float)h);
        }
        const float rstd = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
        for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
            const float xn = __fmul_rn(tp::to_f32(xr[j]), rstd);
            if (style == 0) {
                const T normed = tp::from_f32<T>(xn);
                out[r * h + j] = tp::from_f32<T>(__fmul_rn(tp::to_f32(w[j]), tp::to_f32(normed)));
            } else if (style == 1) {
                out[r * h + j] = tp::from_f32<T>(__fmul_rn(xn, __fadd_rn(1.0f, tp::to_f32(w[j]))));
            } else {
                out[r * h + j] = tp::from_f32<T>(__fmul_rn(tp::to_f32(w[j]), xn));
            }
        }
    }
}

template <typename T>
__device__ __forceinline__ void sum_squares(float* __restrict__ out, const T* __restrict__ x, int64_t rows,
                                            int64_t h) {
    __shared__ float scratch[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        float ss = 0.0f;
        for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
            const float v = tp::to_f32(x[r * h + j]);
            ss = fmaf(v, v, ss);
        }
        ss = tp::block_sum(ss, scratch);
        if (threadIdx.x == 0) out[r] = ss;
    }
}

#define TP_NORM(SUFFIX, T)                                                                                  \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS)                                       \
        tp_rms_norm_##SUFFIX(T* out, const T* x, const T* w, int64_t rows, int64_t h, float eps, int style, \
                             const float* sum_sq, int64_t n) {                                              \
        rms_norm<T>(out, x, w, rows, h, eps, style, sum_sq, n);                                             \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS)                                       \
        tp_sum_squares_##SUFFIX(float* out, const T* x, int64_t rows, int64_t h) {                          \
        sum_squares<T>(out, x, rows, h);                                                                    \
    }
TP_NORM(f32, float)
TP_NORM(f16, __half)
TP_NORM(bf16, __nv_bfloat16)
