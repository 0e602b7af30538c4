// elementwise.cu -- the small element-wise ops the layers need between GEMMs.
//
// * tp_glu_T(out, in, rows, inner, act, alpha, limit): in is rows x (2*inner) row-major holding
//   [gate | up] per row (a merged gate/up projection's output); out is rows x inner with
//   out[r, j] = round(round(act(gate[r, j])) * round(up_factor(up[r, j]))), computed in f32:
//   act 0 is silu, g / (1 + exp(-g)); act 1 is GELU's tanh approximation,
//   0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) (PyTorch's gelu(approximate="tanh")); act 2
//   gpt-oss's clamped SwiGLU (activation.cuh; alpha and limit are read by it alone).
//   act(gate) is rounded to T before the product, as PyTorch's separate activation op rounds it.
// * tp_scale_T(out, x, n, s): out[i] = round(x[i] * round(s)) (a tensor times a scalar that
//   PyTorch first converts to the tensor's dtype). Grid-stride over n.
// * tp_softcap_T(out, x, n, cap): out[i] = round(round(tanh(round(x[i] / cap))) * cap), the
//   three ops `x / cap; tanh; * cap` each rounded. Grid-stride over n.
// * tp_add_row_T(out, in, bias, rows, cols): out[r, c] = in[r, c] + bias[c] (f32 add, one
//   rounding): the bias a row-parallel layer adds once, after its all-reduce.
// * tp_add_T(x, y, n): x[i] += y[i] in place (f32 add, one rounding): the residual add.
//   Launch: grid-stride over n.
// Launch: blocks stride over rows, threads over the columns of a row (no integer division in
// the loop), 256 threads per block, grid = min(rows, 32 * SMs); 64-bit indices.
#include "activation.cuh"

using tp::activation;

template <typename T>
__device__ __forceinline__ void glu(T* __restrict__ out, const T* __restrict__ in, int64_t rows, int64_t inner,
                                    int act, float alpha, float limit) {
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* gate = in + r * 2 * inner;
        const T* up = gate + inner;
        for (int64_t j = threadIdx.x; j < inner; j += blockDim.x) {
            const float a = tp::to_f32(tp::from_f32<T>(activation(tp::to_f32(gate[j]), act, alpha, limit)));
            const float u = tp::to_f32(tp::from_f32<T>(tp::up_factor(tp::to_f32(up[j]), act, limit)));
            out[r * inner + j] = tp::from_f32<T>(__fmul_rn(a, u));
        }
    }
}

template <typename T>
__device__ __forceinline__ void scale(T* __restrict__ out, const T* __restrict__ x, int64_t n, float s) {
    const float f = tp::to_f32(tp::from_f32<T>(s));
    for (int64_t i = tp::global_thread(); i < n; i += tp::grid_stride()) {
        out[i] = tp::from_f32<T>(__fmul_rn(tp::to_f32(x[i]), f));
    }
}

template <typename T>
__device__ __forceinline__ void softcap(T* __restrict__ out, const T* __restrict__ x, int64_t n, float cap) {
    for (int64_t i = tp::global_thread(); i < n; i += tp::grid_stride()) {
        const float d = tp::to_f32(tp::from_f32<T>(__fdiv_rn(tp::to_f32(x[i]), cap)));
        const float t = tp::to_f32(tp::from_f32<T>(tanhf(d)));
        out[i] = tp::from_f32<T>(__fmul_rn(t, cap));
    }
}

template <typename T>
__device__ __forceinline__ void add_row(T* __restrict__ out, const T* __restrict__ in, const T* __restrict__ bias,
                                        int64_t rows, int64_t cols) {
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
            out[r * cols + c] = tp::from_f32<T>(tp::to_f32(in[r * cols + c]) + tp::to_f32(bias[c]));
        }
    }
}

template <typename T>
__device__ __forceinline__ void add_inplace(T* __restrict__ x, const T* __restrict__ y, int64_t n) {
    for (int64_t i = tp::global_thread(); i < n; i += tp::grid_stride()) {
        x[i] = tp::from_f32<T>(tp::to_f32(x[i]) + tp::to_f32(y[i]));
    }
}

#define TP_ELEMENTWISE(SUFFIX, T)                                                                             \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS) tp_glu_##SUFFIX(T* out, const T* in, int64_t rows,      \
                                                                      int64_t inner, int act, float alpha,    \
                                                                      float limit) {                          \
        glu<T>(out, in, rows, inner, act, alpha, limit);                                                      \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS) tp_scale_##SUFFIX(T* out, const T* x, int64_t n,        \
                                                                        float s) {                            \
        scale<T>(out, x, n, s);                                                                               \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS) tp_softcap_##SUFFIX(T* out, const T* x, int64_t n,      \
                                                                          float cap) {                        \
        softcap<T>(out, x, n, cap);                                                                           \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS) tp_add_row_##SUFFIX(T* out, const T* in, const T* bias, \
                                                                          int64_t rows, int64_t cols) {      \
        add_row<T>(out, in, bias, rows, cols);                                                                \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS) tp_add_##SUFFIX(T* x, const T* y, int64_t n) {          \
        add_inplace<T>(x, y, n);                                                                              \
    }
TP_ELEMENTWISE(f32, float)
TP_ELEMENTWISE(f16, __half)
TP_ELEMENTWISE(bf16, __nv_bfloat16)
