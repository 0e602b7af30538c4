// rope.cu -- rotary position embedding, Llama's rotate-half convention.
//
// * tp_rope_T(out, x, pos, inv_freq, scale, tokens, heads, half, dim): x, out: tokens x heads x
//   dim row-major, dim >= 2*half: the first 2*half features of each head rotate, the rest pass
//   through unchanged (partial rotary, Phi-4-mini's partial_rotary_factor); pos: tokens int64 absolute positions; inv_freq: half floats; scale: the
//   cos/sin multiplier (Hugging Face's attention_scaling, YaRN's attention factor; else 1).
//   For pair i of head h of token t: angle = round_f32(float(pos[t]) * inv_freq[i]);
//   c = round_T(round_f32(round_f32(cos(angle)) * scale)), s likewise (cos/sin in double, then
//   rounded, which is what the host computes; `emb.cos() * attention_scaling` in f32, then
//   `.to(dtype)`); x1 = x[.., i], x2 = x[.., half + i];
//   out1 = round_T(round_T(x1 c) + round_T(-x2 s)), out2 = round_T(round_T(x2 c) + round_T(x1 s)):
//   PyTorch's `q * cos + rotate_half(q) * sin` rounding point by point. Explicit _rn
//   intrinsics keep nvcc from contracting a product and a sum into one FMA.
// Launch: blocks stride over the tokens * heads rows, threads over the pairs of a row, 256
// threads, grid = min(rows, 32 * SMs).
#include "common.cuh"

// 1/pi in double. sin/cos go through sincospi, whose argument reduction is exact and needs no
// stack (sincos's large-argument path does); the product's relative error, 2^-53, moves the
// result far less than f32's ulp at the angles positions give.
#define TP_INV_PI 0.318309886183790671537767526745028724

template <typename T>
__device__ __forceinline__ float rnd(float v) {
    return tp::to_f32(tp::from_f32<T>(v));
}

template <typename T>
__device__ __forceinline__ void rope(T* __restrict__ out, const T* __restrict__ x, const int64_t* __restrict__ pos,
                                     const float* __restrict__ inv_freq, float scale, int64_t tokens, int64_t heads,
                                     int64_t half, int64_t dim) {
    const int64_t rows = tokens * heads;
    for (int64_t th = blockIdx.x; th < rows; th += gridDim.x) {  // th = token * heads + head
        const float p = (float)pos[th / heads];
        const int64_t base = th * dim;
        for (int64_t j = 2 * half + threadIdx.x; j < dim; j += blockDim.x) out[base + j] = x[base + j];
        for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
            const float angle = __fmul_rn(p, inv_freq[i]);
            double sd, cd;
            sincospi((double)angle * TP_INV_PI, &sd, &cd);
            const float c = rnd<T>(__fmul_rn((float)cd, scale)), s = rnd<T>(__fmul_rn((float)sd, scale));
            const float x1 = tp::to_f32(x[base + i]), x2 = tp::to_f32(x[base + half + i]);
            out[base + i] = tp::from_f32<T>(__fadd_rn(rnd<T>(__fmul_rn(x1, c)), rnd<T>(__fmul_rn(-x2, s))));
            out[base + half + i] = tp::from_f32<T>(__fadd_rn(rnd<T>(__fmul_rn(x2, c)), rnd<T>(__fmul_rn(x1, s))));
        }
    }
}

#define TP_ROPE(SUFFIX, T)                                                                                   \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS) tp_rope_##SUFFIX(T* out, const T* x, const int64_t* pos, \
                                                                      const float* inv_freq, float scale,     \
                                                                      int64_t tokens, int64_t heads,          \
                                                                      int64_t half, int64_t dim) {            \
        rope<T>(out, x, pos, inv_freq, scale, tokens, heads, half, dim);                                       \
    }
TP_ROPE(f32, float)
TP_ROPE(f16, __half)
TP_ROPE(bf16, __nv_bfloat16)
