// quant_dequant.cu -- a block-quantized weight (ggml's formats, quant_blocks.cuh) dequantized
// into f32 or bf16: the prefill path dequantizes into a scratch buffer and runs the bf16 GEMM.
//
// Layouts: W: `blocks` whole blocks of format B back to back, 2-byte aligned (a rows x k weight
// stored row after row, k a multiple of B::ELEMS, is rows * k / B::ELEMS blocks: ggml rows carry
// no padding); out: blocks * B::ELEMS elements of T (f32 or bf16) in the same order (so a
// rows x k row-major matrix), 16-byte aligned.
// out[i] is ggml's value of element i: bit-exact in f32; in bf16 that value rounded to nearest
// even. Each thread dequantizes one unit (8 elements: two runs of 4, written as two 16-byte
// (f32) or 8-byte (bf16) stores); consecutive threads take consecutive units of a block, so the
// loads and the stores of a warp coalesce.
// Launch: 1-D grid-stride over blocks * B::UNITS units, 256 threads per block,
// grid = min(ceil(units / 256), 32 * SMs); 64-bit indices.
#include "common.cuh"
#include "quant_blocks.cuh"

namespace {

// Stores 4 consecutive elements at p (16-byte aligned for f32, 8-byte for bf16).
__device__ __forceinline__ void store4(float* p, const float* v) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void store4(__nv_bfloat16* p, const float* v) {
    uint32_t h[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __bfloat16_as_ushort(tp::from_f32<__nv_bfloat16>(v[i]));
    *reinterpret_cast<uint2*>(p) = make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
}

template <class B, typename T>
__device__ __forceinline__ void dequant(T* __restrict__ out, const uint8_t* __restrict__ w, int64_t blocks) {
    const B* b = reinterpret_cast<const B*>(w);
    const int64_t units = blocks * B::UNITS;
    for (int64_t i = tp::global_thread(); i < units; i += tp::grid_stride()) {
        const int64_t blk = i / B::UNITS;
        const tp::quant::Unit r = b[blk].unit(static_cast<int>(i % B::UNITS));
        T* o = out + blk * B::ELEMS;
        store4(o + r.e0, r.w);
        store4(o + r.e1, r.w + 4);
    }
}

}  // namespace

#define TP_DEQUANT(NAME, B, T)                                                                                  \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS) NAME(T* out, const uint8_t* w, int64_t blocks) { \
        dequant<tp::quant::B, T>(out, w, blocks);                                                               \
    }
#define TP_DEQUANT_BOTH(NAME, B)                 \
    TP_DEQUANT(tp_dequant_##NAME##_f32, B, float) \
    TP_DEQUANT(tp_dequant_##NAME##_bf16, B, __nv_bfloat16)
TP_DEQUANT_BOTH(q4_0, BlockQ4_0)
TP_DEQUANT_BOTH(q4_1, BlockQ4_1)
TP_DEQUANT_BOTH(q5_0, BlockQ5_0)
TP_DEQUANT_BOTH(q5_1, BlockQ5_1)
TP_DEQUANT_BOTH(q8_0, BlockQ8_0)
TP_DEQUANT_BOTH(q2_k, BlockQ2_K)
TP_DEQUANT_BOTH(q3_k, BlockQ3_K)
TP_DEQUANT_BOTH(q4_k, BlockQ4_K)
TP_DEQUANT_BOTH(q5_k, BlockQ5_K)
TP_DEQUANT_BOTH(q6_k, BlockQ6_K)
