// attention_row.cuh -- one (query, head) row of causal attention, shared by the contiguous
// (attention.cu) and the paged (paged_attention.cu) kernels, so both compute a row the same way.
//
// attend_row<T>(out_row, q_row, k, v, d, lo, p, scale, sink, key_at): the query q_row (d <= 256
// elements) sees keys j in [lo, p]; key j's K row is k + key_at(j) and its V row v + key_at(j)
// (d elements each). s_j = scale * (q . k_j) in f32; out_row = sum_j softmax(s)_j v_j in f32,
// rounded once to T. An attention sink (gpt-oss; -INFINITY for none) joins the softmax as a
// logit whose value is zero: it enters the merge's maximum and adds e^(sink - M) to the sum.
//
// Called by all ATT_WARPS * 32 threads of a block. Warp w takes keys lo + w, lo + w + ATT_WARPS,
// ...: lane l holds dims l, l + 32, ... (at most 8), the dot product is a warp sum, and each warp
// keeps a running max m, sum l and weighted sum acc (online softmax). The warps' states are
// merged through shared memory in warp order at the end. The order of every reduction depends
// only on (lo, p, d), never on the launch or on other rows: a row's result is bitwise the same
// whatever else the launch computes (batch invariance).
#pragma once
#include "common.cuh"

constexpr int ATT_WARPS = ATTENTION_WARPS;
constexpr int ATT_MAX_D = ATTENTION_MAX_HEAD_DIM;
constexpr int ATT_PER_LANE = ATT_MAX_D / 32;
static_assert(ATT_PER_LANE * 32 == ATT_MAX_D, "head_dim bound must be a multiple of the warp size");

namespace tp {

template <typename T, typename KeyAt>
__device__ __forceinline__ void attend_row(T* __restrict__ out_row, const T* __restrict__ q_row,
                                           const T* __restrict__ k, const T* __restrict__ v, int64_t d, int64_t lo,
                                           int64_t p, float scale, float sink, KeyAt key_at) {
    __shared__ float qs[ATT_MAX_D];
    __shared__ float acc_s[ATT_WARPS][ATT_MAX_D];
    __shared__ float m_s[ATT_WARPS], l_s[ATT_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();  // the previous row's shared state may still be read
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) qs[i] = to_f32(q_row[i]);
    __syncthreads();
    float m = -INFINITY, l = 0.0f, acc[ATT_PER_LANE];
#pragma unroll
    for (int c = 0; c < ATT_PER_LANE; ++c) acc[c] = 0.0f;
    for (int64_t j = lo + warp; j <= p; j += ATT_WARPS) {
        const int64_t base = key_at(j);
        float part = 0.0f;
#pragma unroll
        for (int c = 0; c < ATT_PER_LANE; ++c) {
            const int64_t i = lane + 32 * c;
            if (i < d) part = fmaf(qs[i], to_f32(k[base + i]), part);
        }
        const float s = warp_sum(part) * scale;
        const float m_new = fmaxf(m, s);
        const float corr = expf(m - m_new);  // 0 for the first key (m = -inf)
        const float w = expf(s - m_new);
        l = l * corr + w;
#pragma unroll
        for (int c = 0; c < ATT_PER_LANE; ++c) {
            const int64_t i = lane + 32 * c;
            if (i < d) acc[c] = acc[c] * corr + w * to_f32(v[base + i]);
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
    float big = fmaxf(m_s[0], sink);
    for (int w = 1; w < ATT_WARPS; ++w) big = fmaxf(big, m_s[w]);
    float sum = 0.0f, f[ATT_WARPS];
    for (int w = 0; w < ATT_WARPS; ++w) {
        f[w] = l_s[w] > 0.0f ? expf(m_s[w] - big) : 0.0f;
        sum += l_s[w] * f[w];
    }
    sum += expf(sink - big);  // 0 without a sink (-INFINITY)
    const float inv = 1.0f / sum;
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < ATT_WARPS; ++w) o += acc_s[w][i] * f[w];
        out_row[i] = from_f32<T>(o * inv);
    }
}

}  // namespace tp
