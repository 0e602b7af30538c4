// gemm_small_m.cu -- decode-shaped products: few rows of activations against a large weight,
// C = A * B^T + bias with M <= 8, where the work is reading B once from HBM.
//
// Layouts (row-major): A: M x K, B: N x K (nn.Linear layout), bias: N or null, C: M x N; all of
// T = float, __half or __nv_bfloat16; fp32 accumulation, one rounding per output.
// Each warp owns one row n of B at a time and streams it with 16-byte loads (8 half or 4 float
// elements per lane, 32 lanes side by side: coalesced 512-byte transactions); for every such
// chunk it multiplies the matching chunk of each of the M rows of A (small, reused by every warp,
// served from L1/L2), keeps M partial sums per lane, then reduces them across the warp with
// shuffles. VEC requires K to be a multiple of the vector width and 16-byte aligned rows (the
// launcher checks); otherwise the scalar variant runs.
// Launch: block = 256 (8 warps), grid = min(ceil(N / 8), 32 * SMs); warps stride over rows.
#include "common.cuh"

namespace {

constexpr int MAX_M = SMALL_M_MAX, WARPS = SMALL_M_WARPS;

template <typename T>
struct Vec16 {
    static constexpr int N = 16 / sizeof(T);  // elements per 16-byte load
};

template <typename T, bool VEC>
__device__ __forceinline__ void small_m(T* __restrict__ C, const T* __restrict__ A, const T* __restrict__ B,
                                        const T* __restrict__ bias, int M, int64_t N, int64_t K) {
    const int lane = threadIdx.x % 32;
    const int64_t warp = (int64_t)blockIdx.x * WARPS + threadIdx.x / 32;
    const int64_t warps = (int64_t)gridDim.x * WARPS;
    constexpr int W = VEC ? Vec16<T>::N : 1;
    for (int64_t n = warp; n < N; n += warps) {
        float acc[MAX_M];
#pragma unroll
        for (int m = 0; m < MAX_M; ++m) acc[m] = 0.f;
        const T* brow = B + n * K;
        for (int64_t k = (int64_t)lane * W; k < K; k += 32 * W) {
            alignas(16) T b[W];
            if (VEC) {
                *reinterpret_cast<uint4*>(b) = *reinterpret_cast<const uint4*>(brow + k);
            } else {
                b[0] = brow[k];
            }
#pragma unroll
            for (int m = 0; m < MAX_M; ++m) {
                if (m >= M) break;
                alignas(16) T a[W];
                if (VEC) {
                    *reinterpret_cast<uint4*>(a) = *reinterpret_cast<const uint4*>(A + m * K + k);
                } else {
                    a[0] = A[m * K + k];
                }
#pragma unroll
                for (int e = 0; e < W; ++e) acc[m] = fmaf(tp::to_f32(a[e]), tp::to_f32(b[e]), acc[m]);
            }
        }
        const float bv = bias ? tp::to_f32(bias[n]) : 0.f;
#pragma unroll
        for (int m = 0; m < MAX_M; ++m) {
            if (m >= M) break;
            float v = acc[m];
#pragma unroll
            for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
            if (lane == 0) C[m * N + n] = tp::from_f32<T>(v + bv);
        }
    }
}

}  // namespace

#define TP_SMALL_M(NAME, T, VEC)                                                                              \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) NAME(T* C, const T* A, const T* B, const T* bias, int M, \
                                                           int64_t N, int64_t K) {                           \
        small_m<T, VEC>(C, A, B, bias, M, N, K);                                                              \
    }
TP_SMALL_M(tp_gemm_small_m_f32, float, true)
TP_SMALL_M(tp_gemm_small_m_f16, __half, true)
TP_SMALL_M(tp_gemm_small_m_bf16, __nv_bfloat16, true)
TP_SMALL_M(tp_gemm_small_m_f32_unaligned, float, false)
TP_SMALL_M(tp_gemm_small_m_f16_unaligned, __half, false)
TP_SMALL_M(tp_gemm_small_m_bf16_unaligned, __nv_bfloat16, false)
