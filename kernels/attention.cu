// attention.cu -- causal scaled-dot-product attention with grouped-query heads, a block per
// (query token, head), online softmax. Simple, correct at any length; not flash-attention.
//
// * tp_attention_T(out, q, k, v, tokens, hq, hkv, group, group_offset, d, kv_len, scale, window,
//   sinks): sinks is null, or hq f32 attention-sink logits (head h's joins its softmax);
//   q, out: tokens x hq x d; k, v: (>= kv_len) x hkv x d, all row-major T; d <= 256.
//   Query t sits at position p = kv_len - tokens + t and sees keys j in [lo, p], lo = 0, or
//   p + 1 - window when window > 0 and p + 1 > window (Mistral's sliding window). Query head h
//   uses KV head (h + group_offset) / group (the host checks it is < hkv; a tensor-parallel
//   rank's heads need not start at a group boundary). s_j = scale * (q . k_j) in f32;
//   out = sum_j softmax(s)_j v_j in f32, rounded once to T.
// Launch: 128 threads (4 warps); blocks stride over the tokens * hq rows, each row computed by
//   attend_row (attention_row.cuh: online softmax per warp, merged in warp order).
#include "attention_row.cuh"

template <typename T>
__device__ __forceinline__ void attention(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ k,
                                          const T* __restrict__ v, int64_t tokens, int64_t hq, int64_t hkv,
                                          int64_t group, int64_t group_offset, int64_t d, int64_t kv_len,
                                          float scale, int64_t window, const float* __restrict__ sinks) {
    for (int64_t row = blockIdx.x; row < tokens * hq; row += gridDim.x) {
        const int64_t t = row / hq, h = row - t * hq;
        const int64_t kvh = (h + group_offset) / group;
        const int64_t p = kv_len - tokens + t;
        const int64_t lo = (window > 0 && p + 1 > window) ? p + 1 - window : 0;
        const float sink = sinks ? sinks[h] : -INFINITY;
        tp::attend_row<T>(out + row * d, q + row * d, k, v, d, lo, p, scale, sink,
                          [=](int64_t j) { return (j * hkv + kvh) * d; });
    }
}

#define TP_ATTENTION(SUFFIX, T)                                                                              \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32) tp_attention_##SUFFIX(                       \
        T* out, const T* q, const T* k, const T* v, int64_t tokens, int64_t hq, int64_t hkv, int64_t group,  \
        int64_t group_offset, int64_t d, int64_t kv_len, float scale, int64_t window, const float* sinks) {  \
        attention<T>(out, q, k, v, tokens, hq, hkv, group, group_offset, d, kv_len, scale, window, sinks);  \
    }
TP_ATTENTION(f32, float)
TP_ATTENTION(f16, __half)
TP_ATTENTION(bf16, __nv_bfloat16)
