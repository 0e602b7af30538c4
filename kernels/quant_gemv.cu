// quant_gemv.cu -- decode-shaped products with a block-quantized weight:
// y = x * W^T, x: M x k (M <= 8), W: rows x k in one of ggml's block formats (quant_blocks.cuh).
//
// Layouts (row-major): W: rows x (k / B::ELEMS) blocks, row after row with no padding, 2-byte
// aligned; x: M x k elements of T, 16-byte aligned; y: M x rows elements of T; T = float or
// __nv_bfloat16 (tp's model dtype on GPU); k a multiple of B::ELEMS (the launcher checks).
// Each weight element is dequantized in registers to ggml's exact f32 value and multiplied with
// x in f32 (fmaf); f32 accumulation, one rounding per output. x is NOT re-quantized to 8 bits
// (as llama.cpp's q8_1 + dp4a path does): the result is the f32-accumulated product of the exact
// dequantized weight, with no 8-bit activation error, and at M <= 8 the kernel is bound by
// reading W (4.5 bits per weight), not by the M FMAs per weight element.
// One warp owns one row of W at a time and streams it once for all M rows of x: lane l takes
// unit l % UNITS (8 elements) of block l / UNITS of each step (a step is 32 units: 8 legacy
// blocks or 1 K-quant block), so the warp reads consecutive bytes of W; it multiplies those 8
// weights with the matching elements of each row of x (two runs of 4: 16-byte f32 or 8-byte
// bf16 loads, reused by every warp from L1/L2), keeps M partial sums per lane, and reduces them
// across the warp with shuffles at the end of the row.
// Launch: block = 32 * QUANT_GEMV_WARPS threads, grid = min(ceil(rows / QUANT_GEMV_WARPS),
// 32 * SMs); warps stride over rows; 64-bit indices. __launch_bounds__ names a minimum of 1
// block per SM: with the thread count alone, ptxas 13.0 chose 32-40 registers for some variants
// and spilled a few bytes to a stack frame; with it, none spills (`cargo xtask ptx`).
#include "common.cuh"
#include "quant_blocks.cuh"

namespace {

constexpr int MAX_M = QUANT_GEMV_MAX_M, WARPS = QUANT_GEMV_WARPS;

// 4 consecutive elements at p as f32 (16-byte aligned for f32, 8-byte for bf16).
__device__ __forceinline__ void load4(const float* p, float* v) {
    const float4 f = __ldg(reinterpret_cast<const float4*>(p));
    v[0] = f.x;
    v[1] = f.y;
    v[2] = f.z;
    v[3] = f.w;
}
__device__ __forceinline__ void load4(const __nv_bfloat16* p, float* v) {
    const uint2 h = __ldg(reinterpret_cast<const uint2*>(p));
    v[0] = __uint_as_float(h.x << 16);
    v[1] = __uint_as_float(h.x & 0xFFFF0000u);
    v[2] = __uint_as_float(h.y << 16);
    v[3] = __uint_as_float(h.y & 0xFFFF0000u);
}

template <class B, typename T>
__device__ __forceinline__ void gemv(T* __restrict__ y, const uint8_t* __restrict__ w, const T* __restrict__ x, int M,
                                     int64_t rows, int64_t k) {
    static_assert(32 % B::UNITS == 0, "a warp step covers whole blocks");
    constexpr int STEP = 32 / B::UNITS;  // blocks per warp step
    const int lane = threadIdx.x % 32;
    const int64_t warp = (int64_t)blockIdx.x * WARPS + threadIdx.x / 32;
    const int64_t warps = (int64_t)gridDim.x * WARPS;
    const int64_t nb = k / B::ELEMS;  // blocks per row
    const int unit = lane % B::UNITS;
    for (int64_t r = warp; r < rows; r += warps) {
        float acc[MAX_M];
#pragma unroll
        for (int m = 0; m < MAX_M; ++m) acc[m] = 0.f;
        const B* row = reinterpret_cast<const B*>(w) + r * nb;
        for (int64_t ib = lane / B::UNITS; ib < nb; ib += STEP) {
            const tp::quant::Unit q = row[ib].unit(unit);
            const T* xm = x + ib * B::ELEMS;
#pragma unroll
            for (int m = 0; m < MAX_M; ++m, xm += k) {
                if (m >= M) break;
                float a[4], b[4];
                load4(xm + q.e0, a);
                load4(xm + q.e1, b);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    acc[m] = fmaf(q.w[i], a[i], acc[m]);
                    acc[m] = fmaf(q.w[4 + i], b[i], acc[m]);
                }
            }
        }
#pragma unroll
        for (int m = 0; m < MAX_M; ++m) {
            if (m >= M) break;
            const float v = tp::warp_sum(acc[m]);
            if (lane == 0) y[m * rows + r] = tp::from_f32<T>(v);
        }
    }
}

}  // namespace

#define TP_QUANT_GEMV(NAME, B, T)                                                                    \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, 1)                                      \
        NAME(T* y, const uint8_t* w, const T* x, int M, int64_t rows, int64_t k) {                   \
        gemv<tp::quant::B, T>(y, w, x, M, rows, k);                                                  \
    }
#define TP_QUANT_GEMV_BOTH(NAME, B)                    \
    TP_QUANT_GEMV(tp_quant_gemv_##NAME##_f32, B, float) \
    TP_QUANT_GEMV(tp_quant_gemv_##NAME##_bf16, B, __nv_bfloat16)
TP_QUANT_GEMV_BOTH(q4_0, BlockQ4_0)
TP_QUANT_GEMV_BOTH(q4_1, BlockQ4_1)
TP_QUANT_GEMV_BOTH(q5_0, BlockQ5_0)
TP_QUANT_GEMV_BOTH(q5_1, BlockQ5_1)
TP_QUANT_GEMV_BOTH(q8_0, BlockQ8_0)
TP_QUANT_GEMV_BOTH(q2_k, BlockQ2_K)
TP_QUANT_GEMV_BOTH(q3_k, BlockQ3_K)
TP_QUANT_GEMV_BOTH(q4_k, BlockQ4_K)
TP_QUANT_GEMV_BOTH(q5_k, BlockQ5_K)
TP_QUANT_GEMV_BOTH(q6_k, BlockQ6_K)
