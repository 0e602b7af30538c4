// attention.cu -- causal scaled-dot-product attention with grouped-query heads, a block per
// (query token, head), online softmax. Simple, correct at any length; not flash-attention.
//
// * tp_attention_T(out, q, k, v, tokens, hq, hkv, group, group_offset, d, kv_len, scale, window):
//   q, out: tokens x hq x d; k, v: (>= kv_len) x hkv x d, all row-major T; d <= 256.
//   Query t sits at position p = kv_len - tokens + t and sees keys j in [lo, p], lo = 0, or
//   p + 1 - window when window > 0 and p + 1 > window (Mistral's sliding window). Query head h
//   uses KV head (h + group_offset) / group (the host checks it is < hkv; a tensor-parallel
//   rank's heads need not start at a group boundary). s_j = scale * (q . k_j) in f32;
//   out = sum_j softmax(s)_j v_j in f32, rounded once to T.
// Launch: 128 threads (4 warps); blocks stride over the tokens * hq rows. Warp w takes keys
//   lo + w, lo + w + 4, ...: lane l holds dims l, l + 32, ... (at most 8), the dot product is a
//   warp sum, and each warp keeps a running max m, sum l and weighted sum acc (online softmax).
//   The four warps' states are merged through shared memory at the end.
#include "common.cuh"

constexpr int ATT_WARPS = ATTENTION_WARPS;
constexpr int ATT_MAX_D = ATTENTION_MAX_HEAD_DIM;
constexpr int ATT_PER_LANE = ATT_MAX_D / 32;
static_assert(ATT_PER_LANE * 32 == ATT_MAX_D, "head_dim bound must be a multiple of the warp size");

template <typename T>
__device__ __forceinline__ void attention(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ k,
                                          const T* __restrict__ v, int64_t tokens, int64_t hq, int64_t hkv,
                                          int64_t group, int64_t group_offset, int64_t d, int64_t kv_len,
                                          float scale, int64_t window) {
    __shared__ float qs[ATT_MAX_D];
    __shared__ float acc_s[ATT_WARPS][ATT_MAX_D];
    __shared__ float m_s[ATT_WARPS], l_s[ATT_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int64_t row = blockIdx.x; row < tokens * hq; row += gridDim.x) {
        const int64_t t = row / hq, h = row - t * hq;
        const int64_t kvh = (h + group_offset) / group;
        const int64_t p = kv_len - tokens + t;
        const int64_t lo = (window > 0 && p + 1 > window) ? p + 1 - window : 0;
        __syncthreads();  // the previous row's shared state may still be read
        for (int64_t i = threadIdx.x; i < d; i += blockDim.x) qs[i] = tp::to_f32(q[row * d + i]);
        __syncthreads();
        float m = -INFINITY, l = 0.0f, acc[ATT_PER_LANE];
#pragma unroll
        for (int c = 0; c < ATT_PER_LANE; ++c) acc[c] = 0.0f;
        for (int64_t j = lo + warp; j <= p; j += ATT_WARPS) {
            const int64_t base = (j * hkv + kvh) * d;
            float part = 0.0f;
#pragma unroll
            for (int c = 0; c < ATT_PER_LANE; ++c) {
                const int64_t i = lane + 32 * c;
                if (i < d) part = fmaf(qs[i], tp::to_f32(k[base + i]), part);
            }
            const float s = tp::warp_sum(part) * scale;
            const float m_new = fmaxf(m, s);
            const float corr = expf(m - m_new);  // 0 for the first key (m = -inf)
            const float w = expf(s - m_new);
            l = l * corr + w;
#pragma unroll
            for (int c = 0; c < ATT_PER_LANE; ++c) {
                const int64_t i = lane + 32 * c;
                if (i < d) acc[c] = acc[c] * corr + w * tp::to_f32(v[base + i]);
            }
            m = m_new;
        }
#pragma unroll
        for (int c = 0; c < ATT_PER_LANE; ++c) {
            const int64_t i = lane + 32 * c;
            if (i < d) acc_s[warp][i] = acc[c];
        }
        if (lane == 0) {
            m_s[warp] = m;
            l_s[warp] = l;
        }
        __syncthreads();
        // Merge: M = max_w m_w, L = sum_w l_w e^(m_w - M), out = sum_w acc_w e^(m_w - M) / L. Key p
        // is always visible, so some warp has a finite m and L > 0.
        float big = m_s[0];
        for (int w = 1; w < ATT_WARPS; ++w) big = fmaxf(big, m_s[w]);
        float sum = 0.0f, f[ATT_WARPS];
        for (int w = 0; w < ATT_WARPS; ++w) {
            f[w] = l_s[w] > 0.0f ? expf(m_s[w] - big) : 0.0f;
            sum += l_s[w] * f[w];
        }
        const float inv = 1.0f / sum;
        for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
            float o = 0.0f;
            for (int w = 0; w < ATT_WARPS; ++w) o += acc_s[w][i] * f[w];
            out[row * d + i] = tp::from_f32<T>(o * inv);
        }
    }
}

#define TP_ATTENTION(SUFFIX, T)                                                                              \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32) tp_attention_##SUFFIX(                       \
        T* out, const T* q, const T* k, const T* v, int64_t tokens, int64_t hq, int64_t hkv, int64_t group,  \
        int64_t group_offset, int64_t d, int64_t kv_len, float scale, int64_t window) {                      \
        attention<T>(out, q, k, v, tokens, hq, hkv, group, group_offset, d, kv_len, scale, window);         \
    }
TP_ATTENTION(f32, float)
TP_ATTENTION(f16, __half)
TP_ATTENTION(bf16, __nv_bfloat16)
