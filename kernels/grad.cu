// grad.cu -- the backward passes of the decoder's row and element-wise ops (training). Inputs in
// T = float, __half or __nv_bfloat16 (every T operand of one call has the same T); every result
// is f32, accumulated in f32. Explicit _rn intrinsics fix each rounding point in the order
// tp-core's host ops compute it (no FMA contraction), so element-wise results equal the host's
// bit for bit and only reductions (f32 here, f64 on the host) differ in rounding.
//
// * tp_rms_norm_grad_dot_T(out, x, w, dy, rows, h, style): x, dy: rows x h; w: h; out: rows.
//   out[r] = sum_j round(dy[r, j] * w'[j]) * x[r, j] with w' = w (style 0, 2) or 1 + w (style 1,
//   Gemma): one rank's part of the sum a split norm's backward needs.
// * tp_rms_norm_backward_T(dx, rstd, x, w, dy, rows, h, eps, style, sum_sq, n, dot):
//   dx: rows x h; rstd: rows (written: each row's rstd, for the dw pass); sum_sq, dot: null (the
//   row's own statistics) or rows floats each (a norm split over ranks, over n features).
//   mean_r = sum_sq ? sum_sq[r] / n : sum_j x^2 / h; dot_r = dot ? dot[r] : the grad_dot sum;
//   rstd_r = 1 / sqrt(mean_r + eps); c = rstd^3 dot_r / n_r (n_r = n or h);
//   dx[r, j] = (rstd dy) w'[j] - x c.
// * tp_col_sum_T(partial, a, b, s, rows, cols, chunk): a, b: rows x cols (b null or T), s: rows
//   floats (null iff b is). partial[q, c] = sum of a[r, c] (b null) or (a[r, c] b[r, c]) s[r] over
//   the rows r of chunk q, [q chunk, min((q + 1) chunk, rows)), each thread summing its rows in
//   order and the 8 row lanes of a column then added in order: deterministic.
//   Launch: grid (ceil(cols / 32), chunks), 256 threads = 32 columns x 8 row lanes.
// * tp_col_sum_finish(out, partial, chunks, cols): out[c] = sum_q partial[q, c], q ascending.
//   Launch: grid-stride over cols.
//   (Column sums: sum_rows' bias gradient; with b = x and s = rstd, RMSNorm's dw.)
// * tp_rope_backward_T(out, dy, pos, inv_freq, scale, tokens, heads, half, dim): the transposed
//   rotation of rope.cu's (same angle, sincospi in double): out1 = c dy1 + s dy2,
//   out2 = c dy2 - s dy1 with c = round_f32(cos(angle)) * scale (no rounding to T: gradients stay
//   f32); features past 2 * half pass through.
// * tp_glu_backward_T(out, in, dy, rows, inner, act): in: rows x [gate | up] (2 inner), dy:
//   rows x inner, out: rows x 2 inner = [(dy up) act'(gate) | dy act(gate)].
// * tp_softcap_backward_T(out, y, dy, n, cap): out[i] = dy[i] (1 - (y[i] / cap)^2), y the
//   forward's output. Grid-stride over n.
// * tp_embedding_backward_T_I(out, dy, ids, n, rows, h, offset): out: rows x h, zeroed by the
//   launcher first; dy: n x h; ids: n of I. Row ids[i] - offset of out receives the sum of dy[j]
//   over every j with ids[j] = ids[i], in ascending j (the host's order: bit-exact), computed by
//   the block of the first such i alone (no atomics: deterministic); ids outside
//   [offset, offset + rows) add nothing. Blocks stride over the ids.
// * tp_transpose_T(out, x, rows, cols): out (cols x rows) = x^T in f32, through 32 x 33 shared
//   tiles; blocks stride over the tiles.
// Launch (unless said otherwise): 256 threads (a multiple of 32, as block_sum needs), one block
// per row with blocks striding over rows, grid = min(rows, 32 * SMs); 64-bit indices.
#include "activation.cuh"

namespace {

constexpr int COL_LANES = 8;  // row lanes of tp_col_sum (256 threads = 32 columns x 8)
static_assert(32 * COL_LANES == ELEMENTWISE_THREADS, "tp_col_sum's block is 32 columns x 8 row lanes");

// 1/pi in double, as rope.cu.
#define TP_INV_PI 0.318309886183790671537767526745028724

template <typename T>
__device__ __forceinline__ float applied_weight(const T* w, int64_t j, int style) {
    const float v = tp::to_f32(w[j]);
    return style == 1 ? __fadd_rn(1.0f, v) : v;
}

template <typename T>
__device__ __forceinline__ void rms_norm_grad_dot(float* __restrict__ out, const T* __restrict__ x,
                                                  const T* __restrict__ w, const T* __restrict__ dy, int64_t rows,
                                                  int64_t h, int style) {
    __shared__ float scratch[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        float dot = 0.0f;
        for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
            const float g = __fmul_rn(tp::to_f32(dy[r * h + j]), applied_weight(w, j, style));
            dot = fmaf(g, tp::to_f32(x[r * h + j]), dot);
        }
        dot = tp::block_sum(dot, scratch);
        if (threadIdx.x == 0) out[r] = dot;
    }
}

template <typename T>
__device__ __forceinline__ void rms_norm_backward(float* __restrict__ dx, float* __restrict__ rstd_out,
                                                  const T* __restrict__ x, const T* __restrict__ w,
                                                  const T* __restrict__ dy, int64_t rows, int64_t h, float eps,
                                                  int style, const float* __restrict__ sum_sq, int64_t n,
                                                  const float* __restrict__ dots) {
    __shared__ float scratch[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * h;
        const T* gr = dy + r * h;
        float mean, dot, width;
        if (sum_sq != nullptr) {
            width = (float)n;
            mean = __fdiv_rn(sum_sq[r], width);
            dot = dots[r];
        } else {
            float ss = 0.0f, d = 0.0f;
            for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
                const float v = tp::to_f32(xr[j]);
                ss = fmaf(v, v, ss);
                d = fmaf(__fmul_rn(tp::to_f32(gr[j]), applied_weight(w, j, style)), v, d);
            }
            ss = tp::block_sum(ss, scratch);
            dot = tp::block_sum(d, scratch);
            width = (float)h;
            mean = __fdiv_rn(ss, width);
        }
        const float rstd = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
        const float c = __fdiv_rn(__fmul_rn(__fmul_rn(__fmul_rn(rstd, rstd), rstd), dot), width);
        for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
            const float g = __fmul_rn(__fmul_rn(rstd, tp::to_f32(gr[j])), applied_weight(w, j, style));
            dx[r * h + j] = __fsub_rn(g, __fmul_rn(tp::to_f32(xr[j]), c));
        }
        if (threadIdx.x == 0) rstd_out[r] = rstd;
    }
}

template <typename T>
__device__ __forceinline__ void col_sum(float* __restrict__ partial, const T* __restrict__ a,
                                        const T* __restrict__ b, const float* __restrict__ s, int64_t rows,
                                        int64_t cols, int64_t chunk) {
    __shared__ float lanes[COL_LANES][33];
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    const int64_t c = (int64_t)blockIdx.x * 32 + tx;
    const int64_t r0 = (int64_t)blockIdx.y * chunk;
    const int64_t r1 = r0 + chunk < rows ? r0 + chunk : rows;
    float acc = 0.0f;
    if (c < cols) {
        for (int64_t r = r0 + ty; r < r1; r += COL_LANES) {
            float v = tp::to_f32(a[r * cols + c]);
            if (b != nullptr) v = __fmul_rn(__fmul_rn(v, tp::to_f32(b[r * cols + c])), s[r]);
            acc = __fadd_rn(acc, v);
        }
    }
    lanes[ty][tx] = acc;
    __syncthreads();
    if (ty == 0 && c < cols) {
        float t = lanes[0][tx];
#pragma unroll
        for (int i = 1; i < COL_LANES; ++i) t = __fadd_rn(t, lanes[i][tx]);
        partial[(int64_t)blockIdx.y * cols + c] = t;
    }
}

template <typename T>
__device__ __forceinline__ void rope_backward(float* __restrict__ out, const T* __restrict__ dy,
                                              const int64_t* __restrict__ pos, const float* __restrict__ inv_freq,
                                              float scale, int64_t tokens, int64_t heads, int64_t half,
                                              int64_t dim) {
    const int64_t rows = tokens * heads;
    for (int64_t th = blockIdx.x; th < rows; th += gridDim.x) {  // th = token * heads + head
        const float p = (float)pos[th / heads];
        const int64_t base = th * dim;
        for (int64_t j = 2 * half + threadIdx.x; j < dim; j += blockDim.x) out[base + j] = tp::to_f32(dy[base + j]);
        for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
            const float angle = __fmul_rn(p, inv_freq[i]);
            double sd, cd;
            sincospi((double)angle * TP_INV_PI, &sd, &cd);
            const float c = __fmul_rn((float)cd, scale), s = __fmul_rn((float)sd, scale);
            const float g1 = tp::to_f32(dy[base + i]), g2 = tp::to_f32(dy[base + half + i]);
            out[base + i] = __fadd_rn(__fmul_rn(c, g1), __fmul_rn(s, g2));
            out[base + half + i] = __fsub_rn(__fmul_rn(c, g2), __fmul_rn(s, g1));
        }
    }
}

template <typename T>
__device__ __forceinline__ void glu_backward(float* __restrict__ out, const T* __restrict__ in,
                                             const T* __restrict__ dy, int64_t rows, int64_t inner, int act,
                                             float alpha, float limit) {
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* gate = in + r * 2 * inner;
        const T* up = gate + inner;
        float* o = out + r * 2 * inner;
        for (int64_t j = threadIdx.x; j < inner; j += blockDim.x) {
            const float g = tp::to_f32(gate[j]), u = tp::to_f32(up[j]), d = tp::to_f32(dy[r * inner + j]);
            const float uf = tp::up_factor(u, act, limit);
            o[j] = __fmul_rn(__fmul_rn(d, uf), tp::activation_derivative(g, act, alpha, limit));
            o[inner + j] =
                __fmul_rn(__fmul_rn(d, tp::activation(g, act, alpha, limit)), tp::up_factor_derivative(u, act, limit));
        }
    }
}

template <typename T>
__device__ __forceinline__ void softcap_backward(float* __restrict__ out, const T* __restrict__ y,
                                                 const T* __restrict__ dy, int64_t n, float cap) {
    for (int64_t i = tp::global_thread(); i < n; i += tp::grid_stride()) {
        const float q = __fdiv_rn(tp::to_f32(y[i]), cap);
        out[i] = __fmul_rn(tp::to_f32(dy[i]), __fsub_rn(1.0f, __fmul_rn(q, q)));
    }
}

template <typename T, typename I>
__device__ __forceinline__ void embedding_backward(float* __restrict__ out, const T* __restrict__ dy,
                                                   const I* __restrict__ ids, int64_t n, int64_t rows, int64_t h,
                                                   int64_t offset) {
    __shared__ int64_t list[ELEMENTWISE_THREADS];
    __shared__ int counts[ELEMENTWISE_THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
        const int64_t id = (int64_t)ids[i];
        // Uniform over the block: every thread reads the same id. (id >= offset first: no overflow.)
        if (id < offset || id - offset >= rows) continue;
        int seen = 0;
        for (int64_t j = threadIdx.x; j < i; j += blockDim.x) seen |= (int64_t)ids[j] == id;
        if (__syncthreads_or(seen)) continue;  // an earlier id's block owns this row
        float* row = out + (id - offset) * h;
        // The matches j >= i, in ascending order, a block-wide window at a time.
        for (int64_t j0 = i; j0 < n; j0 += blockDim.x) {
            const int64_t j = j0 + threadIdx.x;
            const bool match = j < n && (int64_t)ids[j] == id;
            const unsigned mask = __ballot_sync(0xffffffffu, match);
            if (lane == 0) counts[warp] = __popc(mask);
            __syncthreads();
            int before = 0, total = 0;
            for (int w = 0; w < warps; ++w) {
                before += w < warp ? counts[w] : 0;
                total += counts[w];
            }
            if (match) list[before + __popc(mask & ((1u << lane) - 1u))] = j;
            __syncthreads();
            for (int k = 0; k < total; ++k) {
                const T* src = dy + list[k] * h;
                for (int64_t c = threadIdx.x; c < h; c += blockDim.x) row[c] = __fadd_rn(row[c], tp::to_f32(src[c]));
            }
            __syncthreads();  // list and counts are rewritten by the next window
        }
    }
}

template <typename T>
__device__ __forceinline__ void transpose(float* __restrict__ out, const T* __restrict__ x, int64_t rows,
                                          int64_t cols) {
    __shared__ float tile[32][33];
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5, lanes = blockDim.x >> 5;
    const int64_t tile_cols = (cols + 31) / 32, tiles = ((rows + 31) / 32) * tile_cols;
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
        const int64_t r0 = (t / tile_cols) * 32, c0 = (t % tile_cols) * 32;
        __syncthreads();  // the previous tile has been read out
        for (int k = ty; k < 32; k += lanes) {
            const int64_t r = r0 + k, c = c0 + tx;
            if (r < rows && c < cols) tile[k][tx] = tp::to_f32(x[r * cols + c]);
        }
        __syncthreads();
        for (int k = ty; k < 32; k += lanes) {
            const int64_t c = c0 + k, r = r0 + tx;
            if (c < cols && r < rows) out[c * rows + r] = tile[tx][k];
        }
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS)
    tp_col_sum_finish(float* out, const float* partial, int64_t chunks, int64_t cols) {
    for (int64_t c = tp::global_thread(); c < cols; c += tp::grid_stride()) {
        float t = 0.0f;
        for (int64_t q = 0; q < chunks; ++q) t = __fadd_rn(t, partial[q * cols + c]);
        out[c] = t;
    }
}

#define TP_EMBEDDING_BACKWARD(SUFFIX, T, ISUFFIX, I)                                                         \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS) tp_embedding_backward_##SUFFIX##_##ISUFFIX( \
        float* out, const T* dy, const I* ids, int64_t n, int64_t rows, int64_t h, int64_t offset) {          \
        embedding_backward<T, I>(out, dy, ids, n, rows, h, offset);                                           \
    }

#define TP_GRAD(SUFFIX, T)                                                                                     \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS) tp_rms_norm_grad_dot_##SUFFIX(           \
        float* out, const T* x, const T* w, const T* dy, int64_t rows, int64_t h, int style) {                \
        rms_norm_grad_dot<T>(out, x, w, dy, rows, h, style);                                                   \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS) tp_rms_norm_backward_##SUFFIX(           \
        float* dx, float* rstd, const T* x, const T* w, const T* dy, int64_t rows, int64_t h, float eps,        \
        int style, const float* sum_sq, int64_t n, const float* dot) {                                         \
        rms_norm_backward<T>(dx, rstd, x, w, dy, rows, h, eps, style, sum_sq, n, dot);                          \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS) tp_col_sum_##SUFFIX(                     \
        float* partial, const T* a, const T* b, const float* s, int64_t rows, int64_t cols, int64_t chunk) {   \
        col_sum<T>(partial, a, b, s, rows, cols, chunk);                                                       \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS) tp_rope_backward_##SUFFIX(               \
        float* out, const T* dy, const int64_t* pos, const float* inv_freq, float scale, int64_t tokens,       \
        int64_t heads, int64_t half, int64_t dim) {                                                            \
        rope_backward<T>(out, dy, pos, inv_freq, scale, tokens, heads, half, dim);                             \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS) tp_glu_backward_##SUFFIX(                \
        float* out, const T* in, const T* dy, int64_t rows, int64_t inner, int act, float alpha, float limit) {\
        glu_backward<T>(out, in, dy, rows, inner, act, alpha, limit);                                          \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS) tp_softcap_backward_##SUFFIX(            \
        float* out, const T* y, const T* dy, int64_t n, float cap) {                                           \
        softcap_backward<T>(out, y, dy, n, cap);                                                               \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS) tp_transpose_##SUFFIX(                   \
        float* out, const T* x, int64_t rows, int64_t cols) {                                                  \
        transpose<T>(out, x, rows, cols);                                                                      \
    }                                                                                                          \
    TP_EMBEDDING_BACKWARD(SUFFIX, T, i32, int32_t)                                                             \
    TP_EMBEDDING_BACKWARD(SUFFIX, T, i64, int64_t)
TP_GRAD(f32, float)
TP_GRAD(f16, __half)
TP_GRAD(bf16, __nv_bfloat16)
