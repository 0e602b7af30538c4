// gemm_simt.cu -- tiled fp32 SIMT GEMM with fused bias: C = op(A) * op(B) + bias, and the
// accumulating weight-gradient form C (+)= A^T B.
//
// Layouts (all row-major, 64-bit offsets):
//   A:    M x K activations, or K x M for tp_gemm_simt_f32_tn (C = A^T B: a weight gradient
//         dW = dY^T X, the K rows being tokens).
//   B:    weight, either N x K ("NK": nn.Linear / checkpoint layout, C = A B^T) or K x N ("KN":
//         C = A B, the data gradient dX = dY W of an [N, K] weight read as [K, N]; and TN's B).
//   bias: N entries, or null (TN: none).
//   C:    M x N output; TN with beta = 1 adds the product to it (C += A^T B), beta = 0 overwrites.
// Tiling: a 256-thread block computes a 128 x 128 tile of C in K-steps of 8; each thread owns an
// 8 x 8 sub-tile held in registers. A and B tiles are staged through shared memory, k-major, with
// double buffering: the next tile is fetched into registers while the current one is multiplied.
// Edges: any M, N, K; out-of-range loads read 0 and out-of-range stores are skipped. 16-byte
// loads are used where the contiguous dim of an operand (A: K, or M for TN; B: K for NK, N
// otherwise) is a multiple of 4 and the pointers are 16-byte aligned (`vec` bit 0 for A, bit 1
// for B, set by the launcher), scalar loads otherwise.
// Launch: grid = (ceil(N / 128), ceil(M / 128)), block = 256, no dynamic shared memory.
#include "common.cuh"

namespace {

constexpr int BM = SIMT_BM, BN = SIMT_BN, BK = 8, TM = 8, TN = 8, THREADS = SIMT_THREADS;
static_assert((BM / TM) * (BN / TN) == THREADS, "one 8x8 sub-tile per thread");
static_assert(2 * BK * (BM + BN) * sizeof(float) <= 48 * 1024, "static shared memory budget");

// Loads 4 consecutive floats p[0..4) of a row whose valid length from p is `avail` (<= 0: none).
__device__ __forceinline__ float4 load4(const float* p, int64_t avail, bool vec) {
    if (vec && avail >= 4) return *reinterpret_cast<const float4*>(p);
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (avail > 0) v.x = p[0];
    if (avail > 1) v.y = p[1];
    if (avail > 2) v.z = p[2];
    if (avail > 3) v.w = p[3];
    return v;
}

// One thread's share of a 128 x 8 tile of a K-contiguous matrix (rows x K): row t/2, k 4*(t%2).
__device__ __forceinline__ float4 fetch_rows_k(const float* X, int64_t rows, int64_t K, int64_t row0, int64_t k0,
                                               bool vec) {
    const int t = threadIdx.x;
    const int64_t row = row0 + t / 2, k = k0 + 4 * (t % 2);
    if (row >= rows) return make_float4(0.f, 0.f, 0.f, 0.f);
    return load4(X + row * K + k, K - k, vec);
}

// One thread's share of an 8 x 128 tile of a K x N matrix: k t/32, n 4*(t%32).
__device__ __forceinline__ float4 fetch_kn(const float* B, int64_t K, int64_t N, int64_t k0, int64_t n0, bool vec) {
    const int t = threadIdx.x;
    const int64_t k = k0 + t / 32, n = n0 + 4 * (t % 32);
    if (k >= K) return make_float4(0.f, 0.f, 0.f, 0.f);
    return load4(B + k * N + n, N - n, vec);
}

// Stores a K-contiguous share transposed: s[k][row].
__device__ __forceinline__ void store_rows_k(float (*s)[BM], float4 v) {
    const int t = threadIdx.x, row = t / 2, k = 4 * (t % 2);
    s[k + 0][row] = v.x;
    s[k + 1][row] = v.y;
    s[k + 2][row] = v.z;
    s[k + 3][row] = v.w;
}

__device__ __forceinline__ void store_kn(float (*s)[BN], float4 v) {
    const int t = threadIdx.x;
    *reinterpret_cast<float4*>(&s[t / 32][4 * (t % 32)]) = v;
}

// One thread's share of A's next tile and its store: A is M x K (K-contiguous), or K x M when AT
// (transposed: the TN form).
template <bool AT>
__device__ __forceinline__ float4 fetch_a(const float* A, int64_t M, int64_t K, int64_t m0, int64_t k0, bool vec) {
    return AT ? fetch_kn(A, K, M, k0, m0, vec) : fetch_rows_k(A, M, K, m0, k0, vec);
}
template <bool AT>
__device__ __forceinline__ void store_a(float (*s)[BM], float4 v) {
    static_assert(BM == BN, "a K x M tile of A is staged as a K x N tile of B");
    if (AT) store_kn(s, v); else store_rows_k(s, v);
}

template <bool AT, bool NK>
__device__ __forceinline__ void gemm_simt(float* __restrict__ C, const float* __restrict__ A,
                                          const float* __restrict__ B, const float* __restrict__ bias, int64_t M,
                                          int64_t N, int64_t K, int vec, int beta) {
    __shared__ __align__(16) float As[2][BK][BM];
    __shared__ __align__(16) float Bs[2][BK][BN];

    const int64_t m0 = (int64_t)blockIdx.y * BM, n0 = (int64_t)blockIdx.x * BN;
    const int tr = threadIdx.x / (BN / TN), tc = threadIdx.x % (BN / TN);
    const bool vec_a = vec & 1, vec_b = vec & 2;

    float acc[TM][TN] = {};
    float4 ra = fetch_a<AT>(A, M, K, m0, 0, vec_a);
    float4 rb = NK ? fetch_rows_k(B, N, K, n0, 0, vec_b) : fetch_kn(B, K, N, 0, n0, vec_b);
    store_a<AT>(As[0], ra);
    if (NK) store_rows_k(Bs[0], rb); else store_kn(Bs[0], rb);
    __syncthreads();

    const int64_t ktiles = (K + BK - 1) / BK;
    for (int64_t kt = 0; kt < ktiles; ++kt) {
        const int cur = kt & 1;
        const bool more = kt + 1 < ktiles;
        if (more) {  // fetch the next tile into registers while this one is multiplied
            const int64_t k0 = (kt + 1) * BK;
            ra = fetch_a<AT>(A, M, K, m0, k0, vec_a);
            rb = NK ? fetch_rows_k(B, N, K, n0, k0, vec_b) : fetch_kn(B, K, N, k0, n0, vec_b);
        }
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            float a[TM], b[TN];
            const float4 a0 = *reinterpret_cast<const float4*>(&As[cur][k][tr * TM]);
            const float4 a1 = *reinterpret_cast<const float4*>(&As[cur][k][tr * TM + 4]);
            const float4 b0 = *reinterpret_cast<const float4*>(&Bs[cur][k][tc * TN]);
            const float4 b1 = *reinterpret_cast<const float4*>(&Bs[cur][k][tc * TN + 4]);
            a[0] = a0.x; a[1] = a0.y; a[2] = a0.z; a[3] = a0.w; a[4] = a1.x; a[5] = a1.y; a[6] = a1.z; a[7] = a1.w;
            b[0] = b0.x; b[1] = b0.y; b[2] = b0.z; b[3] = b0.w; b[4] = b1.x; b[5] = b1.y; b[6] = b1.z; b[7] = b1.w;
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        if (more) {  // the other buffer was last read before the previous barrier
            store_a<AT>(As[cur ^ 1], ra);
            if (NK) store_rows_k(Bs[cur ^ 1], rb); else store_kn(Bs[cur ^ 1], rb);
        }
        __syncthreads();
    }

    // Epilogue: C = acc + bias, or C = C + acc (beta), bounds-checked.
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int64_t m = m0 + tr * TM + i;
        if (m >= M) break;
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            const int64_t n = n0 + tc * TN + j;
            if (n >= N) continue;
            if (beta) C[m * N + n] = __fadd_rn(C[m * N + n], acc[i][j]);
            else C[m * N + n] = acc[i][j] + (bias ? bias[n] : 0.f);
        }
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS) tp_gemm_simt_f32_nk(float* C, const float* A, const float* B,
                                                                           const float* bias, int64_t M, int64_t N,
                                                                           int64_t K, int vec) {
    gemm_simt<false, true>(C, A, B, bias, M, N, K, vec, 0);
}

extern "C" __global__ void __launch_bounds__(THREADS) tp_gemm_simt_f32_kn(float* C, const float* A, const float* B,
                                                                           const float* bias, int64_t M, int64_t N,
                                                                           int64_t K, int vec) {
    gemm_simt<false, false>(C, A, B, bias, M, N, K, vec, 0);
}

extern "C" __global__ void __launch_bounds__(THREADS) tp_gemm_simt_f32_tn(float* C, const float* A, const float* B,
                                                                           int64_t M, int64_t N, int64_t K, int vec,
                                                                           int beta) {
    gemm_simt<true, false>(C, A, B, nullptr, M, N, K, vec, beta);
}
