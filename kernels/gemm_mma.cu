// gemm_mma.cu -- bf16/f16 tensor-core GEMM (Ampere-style: mma.sync, ldmatrix, cp.async) with
// fp32 accumulation and a fused bias: C = A * B^T + bias.
//
// Layouts (row-major, 64-bit offsets), T = __nv_bfloat16 or __half:
//   A:    M x K activations (T).
//   B:    N x K weight (T), the nn.Linear / checkpoint layout ("NT": both operands K-contiguous,
//         which is exactly what mma.sync's row.col form and non-transposed ldmatrix want).
//   bias: N entries (T), or null.
//   C:    M x N output (T), each element rounded once from the fp32 accumulator.
// Tiling: a 256-thread block (8 warps, 2 along M x 4 along N) computes a 128 x 128 tile of C;
// each warp a 64 x 32 tile as 4 x 4 mma.m16n8k16. K advances 32 at a time through a ring of
// STAGES shared-memory stages filled by cp.async (16 B, zero-filled past M, N and K), so up to
// STAGES - 1 tiles are in flight while one is multiplied. Shared rows are padded to 40 elements
// (80 B) so that the 8 rows an ldmatrix phase reads fall in 8 distinct 16-byte bank groups.
// Edges: any M, N; K a multiple of 8 with 16-byte aligned A and B takes the cp.async path
// (ALIGNED); any other K takes the same pipeline with predicated element loads.
// Launch: grid = (ceil(N / 128), ceil(M / 128)), block = 256, dynamic shared memory
// SMEM_BYTES (above 48 KiB: the launcher raises the function's limit).
#include "common.cuh"

namespace {

constexpr int BM = MMA_BM, BN = MMA_BN, BK = 32, PAD = 8, LDS = BK + PAD, STAGES = 4, THREADS = MMA_THREADS;
constexpr int WARPS_M = 2, WARPS_N = 4, WM = BM / WARPS_M, WN = BN / WARPS_N;  // 64 x 32 per warp
constexpr int MI = WM / 16, NI = WN / 8;                                        // mma tiles per warp
constexpr int STAGE_ELEMS = (BM + BN) * LDS;
constexpr int SMEM_BYTES = STAGES * STAGE_ELEMS * 2;
static_assert(WARPS_M * WARPS_N * 32 == THREADS, "8 warps");
static_assert((LDS * 2) % 16 == 0, "padded rows keep 16-byte alignment for cp.async");
static_assert(SMEM_BYTES <= 227 * 1024, "fits the sm_80/sm_90 shared-memory limit");
static_assert(SMEM_BYTES == MMA_SMEM_BYTES, "update MMA_SMEM_BYTES in launch_config.cuh");
static_assert(BM * BK / 8 == 2 * THREADS && BN * BK / 8 == 2 * THREADS, "two 16-byte chunks per thread per operand");

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; reads src_bytes (0 or 16) and zero-fills the rest.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Fills one stage: rows [row0, row0 + 128) x k [k0, k0 + 32) of a K-contiguous matrix X
// (rows x K) into s (128 x LDS). Thread t moves chunks t and t + 256 of 8 elements each.
template <typename T, bool ALIGNED>
__device__ __forceinline__ void load_tile(T* s, const T* __restrict__ X, int64_t rows, int64_t K, int64_t row0,
                                          int64_t k0) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int c = threadIdx.x + i * THREADS;
        const int r = c / (BK / 8), kc = (c % (BK / 8)) * 8;
        const int64_t row = row0 + r, k = k0 + kc;
        T* dst = s + r * LDS + kc;
        if (ALIGNED) {
            const bool in = row < rows && k < K;  // K % 8 == 0: a chunk is wholly in or out
            cp_async16(dst, in ? X + row * K + k : X, in ? 16 : 0);
        } else {
            const T zero = tp::from_f32<T>(0.f);
#pragma unroll
            for (int e = 0; e < 8; ++e) dst[e] = (row < rows && k + e < K) ? X[row * K + k + e] : zero;
        }
    }
}

template <typename T, bool ALIGNED>
__device__ __forceinline__ void gemm_mma(T* __restrict__ C, const T* __restrict__ A, const T* __restrict__ B,
                                         const T* __restrict__ bias, int64_t M, int64_t N, int64_t K) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* smem = reinterpret_cast<T*>(smem_raw);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    const int64_t m0 = (int64_t)blockIdx.y * BM, n0 = (int64_t)blockIdx.x * BN;
    const int64_t ktiles = (K + BK - 1) / BK;

    auto stage_a = [&](int s) { return smem + s * STAGE_ELEMS; };
    auto stage_b = [&](int s) { return smem + s * STAGE_ELEMS + BM * LDS; };
    auto load_stage = [&](int s, int64_t kt) {
        load_tile<T, ALIGNED>(stage_a(s), A, M, K, m0, kt * BK);
        load_tile<T, ALIGNED>(stage_b(s), B, N, K, n0, kt * BK);
    };

    float acc[MI][NI][4] = {};

    // Prologue: STAGES - 1 tiles in flight (empty groups keep the wait counts uniform).
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < ktiles) load_stage(s, s);
        cp_async_commit();
    }

    for (int64_t kt = 0; kt < ktiles; ++kt) {
        cp_async_wait<STAGES - 2>();  // tile kt has landed (this thread's part)
        __syncthreads();              // ... everyone's part; and stage (kt - 1) % STAGES is free
        const int64_t next = kt + STAGES - 1;
        if (next < ktiles) load_stage(next % STAGES, next);
        cp_async_commit();

        const T* sa = stage_a(kt % STAGES) + (wm * WM) * LDS;
        const T* sb = stage_b(kt % STAGES) + (wn * WN) * LDS;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            uint32_t af[MI][4], bf[NI][2];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
                // Lanes 0-15 address rows 0-15 at k, lanes 16-31 rows 0-15 at k + 8: a0..a3.
                ldmatrix_x4(af[mi], sa + (mi * 16 + lane % 16) * LDS + kk + (lane / 16) * 8);
            }
#pragma unroll
            for (int nj = 0; nj < NI; nj += 2) {
                // Matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15).
                uint32_t r[4];
                ldmatrix_x4(r, sb + (nj * 8 + lane % 8 + (lane / 16) * 8) * LDS + kk + ((lane / 8) % 2) * 8);
                bf[nj][0] = r[0];
                bf[nj][1] = r[1];
                bf[nj + 1][0] = r[2];
                bf[nj + 1][1] = r[3];
            }
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int ni = 0; ni < NI; ++ni) mma16816<T>(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
        }
    }
    cp_async_wait<0>();

    // Epilogue. Accumulator d0, d1: row lane/4, cols 2*(lane%4) + {0, 1}; d2, d3: row + 8.
    const bool pairs = (N % 2) == 0;  // then (m*N + n) is even for even n: 4-byte aligned pairs
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
            const int64_t n = n0 + wn * WN + ni * 8 + 2 * (lane % 4);
            const float b0 = (bias && n < N) ? tp::to_f32(bias[n]) : 0.f;
            const float b1 = (bias && n + 1 < N) ? tp::to_f32(bias[n + 1]) : 0.f;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int64_t m = m0 + wm * WM + mi * 16 + lane / 4 + h * 8;
                if (m >= M) continue;
                const T v0 = tp::from_f32<T>(acc[mi][ni][2 * h] + b0);
                const T v1 = tp::from_f32<T>(acc[mi][ni][2 * h + 1] + b1);
                T* out = C + m * N + n;
                if (pairs && n + 1 < N) {
                    const T pair[2] = {v0, v1};
                    *reinterpret_cast<uint32_t*>(out) = *reinterpret_cast<const uint32_t*>(pair);
                } else {
                    if (n < N) out[0] = v0;
                    if (n + 1 < N) out[1] = v1;
                }
            }
        }
    }
}

}  // namespace

// The launcher's copy of SMEM_BYTES (crates/tp-kernels, MMA_SMEM_BYTES) must equal this.
static_assert(SMEM_BYTES == 81920, "update MMA_SMEM_BYTES in tp-kernels");

#define TP_GEMM_MMA(NAME, T, ALIGNED)                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME(T* C, const T* A, const T* B, const T* bias,   \
                                                               int64_t M, int64_t N, int64_t K) {              \
        gemm_mma<T, ALIGNED>(C, A, B, bias, M, N, K);                                                          \
    }
TP_GEMM_MMA(tp_gemm_mma_bf16_nk, __nv_bfloat16, true)
TP_GEMM_MMA(tp_gemm_mma_f16_nk, __half, true)
TP_GEMM_MMA(tp_gemm_mma_bf16_nk_unaligned, __nv_bfloat16, false)
TP_GEMM_MMA(tp_gemm_mma_f16_nk_unaligned, __half, false)
