// moe.cu -- a mixture of experts' router and combine on the device, so that neither the
// router's logits nor the experts' outputs cross to the host (only each token's k expert ids
// and weights do, to group the rows by expert for the experts' GEMMs).
//
// * tp_moe_route_T(experts, weights, logits, rows, e, k, renorm): one warp per row (blocks of
//   256 threads, 8 rows, striding over rows). p = softmax(x) over the row's e logits (the
//   maximum, then expf(x - max) and their warp sum, p_i = exp_i / sum, each rounded to f32),
//   then the k largest p in descending order, NaN last and ties to the lower expert (the
//   host's stable sort): k passes of a warp arg-max over the not-yet-chosen experts. The
//   weights are p_i, or with renorm p_i / (sum of the k chosen p, added in choice order).
//   experts: rows*k int32; weights: rows*k f32; logits: rows*e of T. 1 <= k <= e <= 256
//   (each lane holds e / 32 probabilities in registers, at most 8; routers with more experts
//   are routed on the host).
// * tp_moe_combine_T(out, y, pos, weights, rows, k, h): out[r, c] = sum over j < k, in order,
//   of weights[r*k + j] * y[pos[r*k + j], c], each product and sum rounded to f32 in that order
//   (the host's add_rows_scaled, expert after expert); a slot with pos < 0 adds nothing (an
//   expert this rank does not compute). out: rows*h f32; y: rows_y*h of T; pos: rows*k int64;
//   weights: rows*k f32. One block per row, threads over the columns.
#include "common.cuh"

namespace {

constexpr int kMaxPerLane = 8;  // e <= 256

// Whether probability a of expert ia comes before b of ib: the larger first, NaN last, ties to
// the lower expert.
__device__ __forceinline__ bool route_before(float a, int ia, float b, int ib) {
    const bool na = a != a, nb = b != b;
    if (na != nb) return nb;
    if (!na && a != b) return a > b;
    return ia < ib;
}

template <typename T>
__device__ __forceinline__ void moe_route(int32_t* __restrict__ experts, float* __restrict__ weights,
                                          const T* __restrict__ logits, int64_t rows, int e, int k, int renorm) {
    const int lane = threadIdx.x & 31;
    const int64_t warps_per_block = blockDim.x >> 5;
    const int64_t first = (int64_t)blockIdx.x * warps_per_block + (threadIdx.x >> 5);
    const int64_t stride = (int64_t)gridDim.x * warps_per_block;
    for (int64_t r = first; r < rows; r += stride) {
        const T* x = logits + r * e;
        float p[kMaxPerLane];
        float m = -INFINITY;
#pragma unroll
        for (int s = 0; s < kMaxPerLane; ++s) {
            const int i = s * 32 + lane;
            p[s] = i < e ? tp::to_f32(x[i]) : -INFINITY;
            if (i < e) m = fmaxf(m, p[s]);
        }
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float sum = 0.0f;
#pragma unroll
        for (int s = 0; s < kMaxPerLane; ++s) {
            const int i = s * 32 + lane;
            p[s] = i < e ? expf(__fsub_rn(p[s], m)) : 0.0f;
            sum = __fadd_rn(sum, p[s]);
        }
        sum = tp::warp_sum(sum);
#pragma unroll
        for (int s = 0; s < kMaxPerLane; ++s) p[s] = __fdiv_rn(p[s], sum);
        // k passes of an arg-max over the experts not chosen yet (chosen ones marked by index).
        uint32_t taken = 0;  // bit s: this lane's expert s*32 + lane is chosen
        float chosen_sum = 0.0f;
        for (int j = 0; j < k; ++j) {
            float best = 0.0f;
            int best_i = -1;
#pragma unroll
            for (int s = 0; s < kMaxPerLane; ++s) {
                const int i = s * 32 + lane;
                if (i < e && !(taken >> s & 1u) && (best_i < 0 || route_before(p[s], i, best, best_i))) {
                    best = p[s];
                    best_i = i;
                }
            }
            for (int o = 16; o > 0; o >>= 1) {
                const float ob = __shfl_xor_sync(0xffffffffu, best, o);
                const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
                if (oi >= 0 && (best_i < 0 || route_before(ob, oi, best, best_i))) {
                    best = ob;
                    best_i = oi;
                }
            }
            if ((best_i & 31) == lane) taken |= 1u << (best_i >> 5);
            chosen_sum = __fadd_rn(chosen_sum, best);
            if (lane == 0) {
                experts[r * k + j] = best_i;
                weights[r * k + j] = best;
            }
        }
        __syncwarp();
        if (renorm && lane < k) weights[r * k + lane] = __fdiv_rn(weights[r * k + lane], chosen_sum);
        __syncwarp();
    }
}

template <typename T>
__device__ __forceinline__ void moe_combine(float* __restrict__ out, const T* __restrict__ y,
                                            const int64_t* __restrict__ pos, const float* __restrict__ weights,
                                            int64_t rows, int k, int64_t h) {
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
            float acc = 0.0f;
            for (int j = 0; j < k; ++j) {
                const int64_t src = pos[r * k + j];
                if (src >= 0) acc = __fadd_rn(acc, __fmul_rn(weights[r * k + j], tp::to_f32(y[src * h + c])));
            }
            out[r * h + c] = acc;
        }
    }
}

}  // namespace

#define TP_MOE(T, NAME)                                                                                        \
    extern "C" __global__ void __launch_bounds__(256) tp_moe_route_##NAME(                                    \
        int32_t* experts, float* weights, const T* logits, int64_t rows, int e, int k, int renorm) {          \
        moe_route<T>(experts, weights, logits, rows, e, k, renorm);                                            \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(256) tp_moe_combine_##NAME(                                  \
        float* out, const T* y, const int64_t* pos, const float* weights, int64_t rows, int k, int64_t h) {  \
        moe_combine<T>(out, y, pos, weights, rows, k, h);                                                      \
    }

TP_MOE(float, f32)
TP_MOE(__half, f16)
TP_MOE(__nv_bfloat16, bf16)
