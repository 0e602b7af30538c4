// optim.cu -- the multi-tensor AdamW step over f32 master weights (training).
//
// * tp_adamw(table, f): for each of table.count (<= ADAMW_MAX_TENSORS) tensors k, in place over
//   its n[k] elements (p, m, v written; g read), torch.optim.AdamW's single-tensor formulas as
//   tp-train's optim.rs computes them, every rounding point in its order (_rn intrinsics):
//     g  = g * clip                                   (clip: the clip_grad_norm_ coefficient)
//     p  = p * keep                                   (only where decay[k]; keep = 1 - lr * wd)
//     m  = m + (g - m) * w1                           (w1 = 1 - beta1: torch's lerp)
//     v  = v * b2 + (w2 * g) * g                      (b2 = beta2, w2 = 1 - beta2)
//     p  = p - (step_size * m) / (sqrt(v) / bc2_sqrt + eps)
//   with step_size = lr / (1 - beta1^t) and bc2_sqrt = sqrt(1 - beta2^t), computed on the host
//   in f64 and rounded to f32 (torch's Python floats), as every factor of `f`.
//   table (a kernel parameter, ADAMW_TABLE_BYTES): per tensor its four pointers, its length, the
//   index of its first chunk of ADAMW_CHUNK elements (first_chunk[count] = all chunks) and its
//   decay flag. Blocks stride over the chunks of all tensors; threads over a chunk's elements.
// Launch: 256 threads, grid = min(chunks, 32 * SMs).
#include "common.cuh"

struct AdamwTable {
    float* p[ADAMW_MAX_TENSORS];
    const float* g[ADAMW_MAX_TENSORS];
    float* m[ADAMW_MAX_TENSORS];
    float* v[ADAMW_MAX_TENSORS];
    int64_t n[ADAMW_MAX_TENSORS];
    int64_t first_chunk[ADAMW_MAX_TENSORS + 1];
    int32_t decay[ADAMW_MAX_TENSORS];
    int32_t count;
};
static_assert(sizeof(AdamwTable) == ADAMW_TABLE_BYTES, "update ADAMW_TABLE_BYTES in launch_config.cuh");

struct AdamwFactors {
    float keep, w1, b2, w2, step_size, bc2_sqrt, eps, clip;
};
static_assert(sizeof(AdamwFactors) == 32, "eight floats, as tp-kernels' AdamwFactors");

extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS) tp_adamw(const AdamwTable t, const AdamwFactors f) {
    const int64_t chunks = t.first_chunk[t.count];
    int k = 0;
    for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
        while (k + 1 < t.count && t.first_chunk[k + 1] <= c) ++k;  // c only grows: k only grows
        const int64_t start = (c - t.first_chunk[k]) * ADAMW_CHUNK;
        const int64_t end = start + ADAMW_CHUNK < t.n[k] ? start + ADAMW_CHUNK : t.n[k];
        float* __restrict__ p = t.p[k];
        const float* __restrict__ g = t.g[k];
        float* __restrict__ m = t.m[k];
        float* __restrict__ v = t.v[k];
        const bool decay = t.decay[k] != 0;
        for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
            const float gi = __fmul_rn(g[i], f.clip);
            float pi = p[i], mi = m[i];
            if (decay) pi = __fmul_rn(pi, f.keep);
            mi = __fadd_rn(mi, __fmul_rn(__fsub_rn(gi, mi), f.w1));
            const float vi = __fadd_rn(__fmul_rn(v[i], f.b2), __fmul_rn(__fmul_rn(f.w2, gi), gi));
            const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), f.bc2_sqrt), f.eps);
            p[i] = __fsub_rn(pi, __fdiv_rn(__fmul_rn(f.step_size, mi), denom));
            m[i] = mi;
            v[i] = vi;
        }
    }
}
