// lora.cu -- LoRA's batched multi-adapter products (Punica's BGMV shape): every token of a
// flat batch through its own adapter in one launch, the tokens of the base model skipped.
//
// A layer's adapters sit in slots 0 .. nslots-1; token t's slot is slot[t] (< 0 or >= nslots: no
// adapter, so a bad slot id reads nothing out of bounds). Each slot has a
// factor W_s (f32, device pointer ws[s], null where the slot is empty at this layer) read as
// w(i, j) = W_s[i * ld_i + j * ld_j], so one kernel serves a factor and its transpose:
//
// * tp_lora_shrink_T(u, x, ws, slot, nslots, rows, width, r, ld_i, ld_j, scale):
//     u[t, i] = scale * sum_j x[t, j] * w(i, j)   for i < r, j < width,
//   the sum in f32 over j in order (x widened exactly). Forward: W = A [r, in] (ld_i = in,
//   ld_j = 1, scale 1). Backward du = s * dY B: W = B^T (B [out, r]: ld_i = 1, ld_j = r).
//   One block per token (blocks stride over rows), one warp per output i (warps stride over
//   i), lanes over j, a warp sum at the end. u: rows * r f32 (rows of skipped tokens untouched).
// * tp_lora_expand_T(y, u, ws, slot, scales, nslots, rows, out, r, ld_i, ld_j):
//     y[t, c] = round_T(f32(y[t, c]) + scales[slot] * sum_i u[t, i] * w(c, i))   for c < out,
//   the sum in f32 over i in order, then the scale, then one rounding to T (the host adds the
//   adapter's product to the base's output in f32 and rounds once). Forward: W = B [out, r]
//   (ld_i = r, ld_j = 1). Backward dX += du A: W = A^T (ld_i = 1, ld_j = in), scale 1.
//   Blocks of 256 threads over (token, 256 columns); the token's u row in shared memory.
//   r <= 128 (kMaxRank).
//
// The weight gradients of a trained adapter (dA = du^T X, dB = (s dY)^T u) are plain TN
// GEMMs over the rows of its one slot (gemm_mma's and gemm_simt's TN kernels).
#include "common.cuh"

namespace {

constexpr int kMaxRank = 128;
constexpr int kExpandCols = 256;

template <typename T>
__device__ __forceinline__ void lora_shrink(float* __restrict__ u, const T* __restrict__ x,
                                            const float* const* __restrict__ ws, const int32_t* __restrict__ slot,
                                            int nslots, int64_t rows, int64_t width, int r, int64_t ld_i,
                                            int64_t ld_j, float scale) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int64_t t = blockIdx.x; t < rows; t += gridDim.x) {
        const int s = slot[t];
        if (s < 0 || s >= nslots) continue;
        const float* w = ws[s];
        if (w == nullptr) continue;
        const T* xr = x + t * width;
        for (int i = warp; i < r; i += warps) {
            float acc = 0.0f;
            for (int64_t j = lane; j < width; j += 32) {
                acc = __fmaf_rn(tp::to_f32(xr[j]), w[i * ld_i + j * ld_j], acc);
            }
            acc = tp::warp_sum(acc);
            if (lane == 0) u[t * r + i] = __fmul_rn(scale, acc);
        }
    }
}

template <typename T>
__device__ __forceinline__ void lora_expand(T* __restrict__ y, const float* __restrict__ u,
                                            const float* const* __restrict__ ws, const int32_t* __restrict__ slot,
                                            const float* __restrict__ scales, int nslots, int64_t rows,
                                            int64_t out, int r, int64_t ld_i, int64_t ld_j) {
    __shared__ float ut[kMaxRank];
    const int64_t tiles = (out + kExpandCols - 1) / kExpandCols;
    for (int64_t b = blockIdx.x; b < rows * tiles; b += gridDim.x) {
        const int64_t t = b / tiles, c = (b % tiles) * kExpandCols + threadIdx.x;
        const int s = slot[t];
        const float* w = (s < 0 || s >= nslots) ? nullptr : ws[s];
        // The same for the whole block (one token): every thread takes the branch alike.
        if (w == nullptr) continue;
        __syncthreads();
        for (int i = threadIdx.x; i < r; i += blockDim.x) ut[i] = u[t * r + i];
        __syncthreads();
        if (c < out) {
            float acc = 0.0f;
            for (int i = 0; i < r; ++i) acc = __fmaf_rn(ut[i], w[c * ld_i + i * ld_j], acc);
            const float d = __fmul_rn(scales[s], acc);
            y[t * out + c] = tp::from_f32<T>(__fadd_rn(tp::to_f32(y[t * out + c]), d));
        }
    }
}

}  // namespace

#define TP_LORA(T, NAME)                                                                                      \
    extern "C" __global__ void __launch_bounds__(256) tp_lora_shrink_##NAME(                                 \
        float* u, const T* x, const float* const* ws, const int32_t* slot, int nslots, int64_t rows,         \
        int64_t width, int r, int64_t ld_i, int64_t ld_j, float scale) {                                     \
        lora_shrink<T>(u, x, ws, slot, nslots, rows, width, r, ld_i, ld_j, scale);                            \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256) tp_lora_expand_##NAME(                                 \
        T* y, const float* u, const float* const* ws, const int32_t* slot, const float* scales, int nslots,   \
        int64_t rows, int64_t out, int r, int64_t ld_i, int64_t ld_j) {                                      \
        lora_expand<T>(y, u, ws, slot, scales, nslots, rows, out, r, ld_i, ld_j);                             \
    }

TP_LORA(float, f32)
TP_LORA(__half, f16)
TP_LORA(__nv_bfloat16, bf16)
