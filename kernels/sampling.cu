// sampling.cu -- what a sampler needs from a rank's shard of the logits [rows, n] without
// copying the shard to the host: penalised logits, each row's best candidates, and each row's
// (max, sum of exponentials) for a softmax split across ranks.
//
// * tp_penalize_T(out, x, rows, n, meta): out[r, j] = x[r, j] as f32, then for each penalty entry
//   (j, c) of row r (the row's ids seen in the prompt or the output that fall in this shard; c
//   its count in the output, 0 for prompt-only ids), in this order and each operation rounded on
//   its own (no fused multiply-add):
//     l = l > 0 ? l / rep : l * rep                  (repetition penalty, as transformers)
//     l = (l - c * freq) - (c > 0 ? pres : 0)        (frequency, then presence, as OpenAI/vLLM)
//   meta (built and checked by the host launcher): off[rows + 1] (int64, row r's entries are
//   off[r]..off[r + 1]), col[E] (int64, distinct within a row, < n), cnt[E] (f32), then
//   par[3 * rows] (f32: rep, freq, pres of each row).
//   Launch: one block of 256 threads per row (blocks stride over rows).
// * tp_top_k_T(vals, ids, x, rows, n, k, id_offset): the k best (value, index) pairs of each row
//   in the order of tp::better (NaN first, then larger, then lower index; the argmax's rule),
//   best first: vals[r, i] as f32, ids[r, i] = index + id_offset (the global vocabulary id of a
//   shard starting at id_offset). Slots past n hold (-inf, -1). k <= SAMPLING_TOP_K_MAX.
//   k rounds; round i takes the best pair strictly after round i - 1's (exact, deterministic).
//   Launch: one block of 256 threads per row (blocks stride over rows).
// * tp_row_max_sum_exp_T(maxs, sums, x, scales, rows, n): m = max_j x[r, j] (NaN skipped),
//   s = sum_j exp((x[r, j] - m) * scales[r]) in f32 (0 when m = -inf: the row has no mass; NaN
//   when the row holds one). Across ranks: M = max m_k, S = sum_k s_k exp((m_k - M) * scale).
//   Each thread sums its strided elements, then warps and the block in a fixed order: the result
//   depends only on the row (and n).
//   Launch: one block of 256 threads per row (blocks stride over rows).
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void penalize(float* __restrict__ out, const T* __restrict__ x, int64_t rows, int64_t n,
                                         const int64_t* __restrict__ meta) {
    const int64_t* off = meta;
    const int64_t entries = off[rows];
    const int64_t* col = meta + rows + 1;
    const float* cnt = reinterpret_cast<const float*>(col + entries);
    const float* par = cnt + entries;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) out[r * n + j] = tp::to_f32(x[r * n + j]);
        __syncthreads();  // entries may touch any column of the row
        const float rep = par[3 * r], freq = par[3 * r + 1], pres = par[3 * r + 2];
        for (int64_t e = off[r] + threadIdx.x; e < off[r + 1]; e += blockDim.x) {
            const int64_t j = col[e];
            const float c = cnt[e];
            float l = out[r * n + j];
            l = l > 0.0f ? __fdiv_rn(l, rep) : __fmul_rn(l, rep);
            l = __fsub_rn(l, __fmul_rn(c, freq));
            l = __fsub_rn(l, c > 0.0f ? pres : 0.0f);
            out[r * n + j] = l;
        }
    }
}

// The block's best pair (in tp::better's order) among each thread's (v, i); i == none means
// "no pair". Every thread gets the result. sv/si: 32 slots of shared memory.
__device__ __forceinline__ void block_best(float& v, int64_t& i, int64_t none, float* sv, int64_t* si) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int64_t oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (oi != none && (i == none || tp::better(ov, oi, v, i))) {
            v = ov;
            i = oi;
        }
    }
    __syncthreads();  // the previous round's slots may still be read
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    v = sv[0];
    i = si[0];
    for (int w = 1; w < warps; ++w) {
        if (si[w] != none && (i == none || tp::better(sv[w], si[w], v, i))) {
            v = sv[w];
            i = si[w];
        }
    }
}

template <typename T>
__device__ __forceinline__ void top_k(float* __restrict__ vals, int64_t* __restrict__ ids, const T* __restrict__ x,
                                      int64_t rows, int64_t n, int64_t k, int64_t id_offset) {
    __shared__ float sv[32];
    __shared__ int64_t si[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        float prev_v = 0.0f;
        int64_t prev_i = n;  // none yet: every pair is eligible
        for (int64_t round = 0; round < k; ++round) {
            float v = -INFINITY;
            int64_t i = n;
            for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
                const float xv = tp::to_f32(x[r * n + j]);
                const bool after = prev_i == n || tp::better(prev_v, prev_i, xv, j);
                if (after && (i == n || tp::better(xv, j, v, i))) {
                    v = xv;
                    i = j;
                }
            }
            block_best(v, i, n, sv, si);  // the same (v, i) in every thread: uniform branches
            if (i == n) {
                // Fewer than k pairs in the row: fill the remaining slots.
                for (int64_t rest = round + threadIdx.x; rest < k; rest += blockDim.x) {
                    vals[r * k + rest] = -INFINITY;
                    ids[r * k + rest] = -1;
                }
                break;
            }
            if (threadIdx.x == 0) {
                vals[r * k + round] = v;
                ids[r * k + round] = i + id_offset;
            }
            prev_v = v;
            prev_i = i;
        }
    }
}

// Max over the block (NaN skipped by fmaxf); every thread gets it. scratch: 32 floats.
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < warps ? scratch[lane] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, o));
    return t;
}

template <typename T>
__device__ __forceinline__ void row_max_sum_exp(float* __restrict__ maxs, float* __restrict__ sums,
                                                const T* __restrict__ x, const float* __restrict__ scales,
                                                int64_t rows, int64_t n) {
    __shared__ float scratch[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        float m = -INFINITY;
        for (int64_t j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, tp::to_f32(x[r * n + j]));
        m = block_max(m, scratch);
        const float s = scales[r];
        float acc = 0.0f;
        if (m != -INFINITY) {
            for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
                acc += expf(__fmul_rn(__fsub_rn(tp::to_f32(x[r * n + j]), m), s));
            }
        }
        acc = tp::block_sum(acc, scratch);
        if (threadIdx.x == 0) {
            maxs[r] = m;
            sums[r] = acc;
        }
    }
}

#define TP_SAMPLING(SUFFIX, T)                                                                                \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS)                                         \
        tp_penalize_##SUFFIX(float* out, const T* x, int64_t rows, int64_t n, const int64_t* meta) {          \
        penalize<T>(out, x, rows, n, meta);                                                                   \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS) tp_top_k_##SUFFIX(                      \
        float* vals, int64_t* ids, const T* x, int64_t rows, int64_t n, int64_t k, int64_t id_offset) {       \
        top_k<T>(vals, ids, x, rows, n, k, id_offset);                                                        \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS) tp_row_max_sum_exp_##SUFFIX(            \
        float* maxs, float* sums, const T* x, const float* scales, int64_t rows, int64_t n) {                 \
        row_max_sum_exp<T>(maxs, sums, x, scales, rows, n);                                                   \
    }
TP_SAMPLING(f32, float)
TP_SAMPLING(f16, __half)
TP_SAMPLING(bf16, __nv_bfloat16)
