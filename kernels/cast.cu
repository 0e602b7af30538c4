// cast.cu -- elementwise dtype conversion: dst[i] = convert(src[i]).
//
// src, dst: n contiguous elements. Widening to f32 is exact; narrowing rounds to nearest even
// (__float2half_rn, __float2bfloat16_rn), f16 <-> bf16 through the exact f32 value (one rounding).
// Launch: 1-D grid-stride, 256 threads per block, grid = min(ceil(n / 256), 4 * 65535).
#include "common.cuh"

template <typename S, typename D>
__device__ __forceinline__ void cast(D* __restrict__ dst, const S* __restrict__ src, int64_t n) {
    for (int64_t i = tp::global_thread(); i < n; i += tp::grid_stride()) {
        dst[i] = tp::from_f32<D>(tp::to_f32(src[i]));
    }
}

#define TP_CAST(NAME, S, D)                                                                    \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS) NAME(D* dst, const S* src, int64_t n) { \
        cast<S, D>(dst, src, n);                                                               \
    }
TP_CAST(tp_cast_f32_f16, float, __half)
TP_CAST(tp_cast_f32_bf16, float, __nv_bfloat16)
TP_CAST(tp_cast_f16_f32, __half, float)
TP_CAST(tp_cast_bf16_f32, __nv_bfloat16, float)
TP_CAST(tp_cast_f16_bf16, __half, __nv_bfloat16)
TP_CAST(tp_cast_bf16_f16, __nv_bfloat16, __half)
