// activation.cuh -- the gated MLP's activations and their derivatives in f32, shared by the
// forward (elementwise.cu) and backward (grad.cu) kernels. act 0 is silu, act 1 GELU's tanh
// approximation (PyTorch's gelu(approximate="tanh")), act 2 gpt-oss's clamped SwiGLU: with
// g' = min(g, limit), act(g) = g' / (1 + e^(-alpha g')), and the up projection enters as
// clamp(u, -limit, limit) + 1 (up_factor; u itself for the others). Explicit _rn intrinsics fix every rounding
// point (no contraction into FMAs), in the order the host code (tp-core's Activation) computes.
#pragma once
#include "common.cuh"

// sqrt(2/pi), as PyTorch's kBeta = M_SQRT2 * M_2_SQRTPI * 0.5 rounded to float.
#define TP_GELU_BETA 0.7978845608028654f
#define TP_GELU_KAPPA 0.044715f

namespace tp {

// silu(g) = g / (1 + e^-g); gelu_tanh(g) = 0.5 g (1 + tanh(beta (g + kappa g^3))).
__device__ __forceinline__ float activation(float g, int act, float alpha, float limit) {
    if (act == 0) return __fdiv_rn(g, __fadd_rn(1.0f, expf(-g)));
    if (act == 2) {
        const float c = fminf(g, limit);
        return __fdiv_rn(c, __fadd_rn(1.0f, expf(__fmul_rn(-alpha, c))));
    }
    const float cube = __fmul_rn(__fmul_rn(g, g), g);
    const float inner = __fmul_rn(TP_GELU_BETA, __fadd_rn(g, __fmul_rn(TP_GELU_KAPPA, cube)));
    return __fmul_rn(__fmul_rn(0.5f, g), __fadd_rn(1.0f, tanhf(inner)));
}

// silu'(g) = s (1 + g (1 - s)) with s = 1 / (1 + e^-g);
// gelu_tanh'(g) = (1 + t) / 2 + (g / 2) (1 - t^2) beta (1 + 3 kappa g^2), t = tanh(beta (g + kappa g^3)).
// clamped swiglu'(g) = s (1 + alpha g (1 - s)), s = 1 / (1 + e^(-alpha g)), below the clamp; 0
// above it (torch.clamp passes the gradient where g <= limit).
__device__ __forceinline__ float activation_derivative(float g, int act, float alpha, float limit) {
    if (act == 0) {
        const float s = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g)));
        return __fmul_rn(s, __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, s))));
    }
    if (act == 2) {
        if (g > limit) return 0.0f;
        const float s = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(__fmul_rn(-alpha, g))));
        return __fmul_rn(s, __fadd_rn(1.0f, __fmul_rn(__fmul_rn(alpha, g), __fsub_rn(1.0f, s))));
    }
    const float kg3 = __fmul_rn(__fmul_rn(__fmul_rn(TP_GELU_KAPPA, g), g), g);
    const float t = tanhf(__fmul_rn(TP_GELU_BETA, __fadd_rn(g, kg3)));
    const float left = __fmul_rn(0.5f, __fadd_rn(1.0f, t));
    const float poly = __fadd_rn(1.0f, __fmul_rn(__fmul_rn(__fmul_rn(3.0f, TP_GELU_KAPPA), g), g));
    const float right = __fmul_rn(__fmul_rn(__fmul_rn(__fmul_rn(0.5f, g), __fsub_rn(1.0f, __fmul_rn(t, t))), TP_GELU_BETA), poly);
    return __fadd_rn(left, right);
}

// What multiplies act(gate): u, or for act 2 clamp(u, -limit, limit) + 1.
__device__ __forceinline__ float up_factor(float u, int act, float limit) {
    return act == 2 ? __fadd_rn(fminf(fmaxf(u, -limit), limit), 1.0f) : u;
}

// d up_factor / du: 1, or for act 2 the clamp's pass-through mask (1 on [-limit, limit]).
__device__ __forceinline__ float up_factor_derivative(float u, int act, float limit) {
    return act == 2 ? ((u >= -limit && u <= limit) ? 1.0f : 0.0f) : 1.0f;
}

}  // namespace tp
