// norm.cu -- RMSNorm over the last dim, Hugging Face's LlamaRMSNorm.
//
// * tp_rms_norm_T(out, x, w, rows, h, eps): x, out: rows x h row-major; w: h.
//   out[r, j] = round(w[j] * round(x[r, j] * rstd_r)), rstd_r = 1 / sqrt(mean_j x[r, j]^2 + eps),
//   all in f32; round() is round-to-nearest-even to T: the two rounding points of
//   `weight * hidden_states.to(input_dtype)`. sqrtf and the division are IEEE (no fast math),
//   so rstd matches the host's f32 computation up to the order of the sum of squares.
// Launch: one block of 256 threads per row (blocks stride over rows), grid = min(rows, 32 * SMs).
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void rms_norm(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ w,
                                         int64_t rows, int64_t h, float eps) {
    __shared__ float scratch[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * h;
        float ss = 0.0f;
        for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
            const float v = tp::to_f32(xr[j]);
            ss = fmaf(v, v, ss);
        }
        ss = tp::block_sum(ss, scratch);
        const float rstd = 1.0f / sqrtf(ss / (float)h + eps);
        for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
            const T normed = tp::from_f32<T>(__fmul_rn(tp::to_f32(xr[j]), rstd));
            out[r * h + j] = tp::from_f32<T>(__fmul_rn(tp::to_f32(w[j]), tp::to_f32(normed)));
        }
    }
}

#define TP_NORM(SUFFIX, T)                                                                                 \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS)                                                      \
        tp_rms_norm_##SUFFIX(T* out, const T* x, const T* w, int64_t rows, int64_t h, float eps) {         \
        rms_norm<T>(out, x, w, rows, h, eps);                                                              \
    }
TP_NORM(f32, float)
TP_NORM(f16, __half)
TP_NORM(bf16, __nv_bfloat16)
