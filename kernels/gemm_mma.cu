// gemm_mma.cu -- bf16/f16 tensor-core GEMM (Ampere-style: mma.sync, ldmatrix, cp.async) with
// fp32 accumulation, in the three layouts a linear layer's forward and backward need:
//   NT (tp_gemm_mma_T_nk):  C = A B^T + bias   (forward y = x W^T; B the [N, K] weight)
//   NN (tp_gemm_mma_T_kn):  C = A B + bias     (data gradient dX = dY W: an [N, K] weight read as
//                                               [K, N])
//   TN (tp_gemm_mma_T_tn):  C (+)= A^T B, C f32 (weight gradient dW = dY^T X, accumulated in f32:
//                                               beta = 1 adds to C, beta = 0 overwrites it)
//   grouped NT (tp_gemm_mma_T_grouped): a mixture's experts in one launch, each expert's rows
//                                               of A times its own weight (see the macro)
//
// Layouts (row-major, 64-bit offsets), T = __nv_bfloat16 or __half:
//   A:    M x K (T); for TN K x M (K rows, e.g. tokens).
//   B:    N x K (T) for NT, the nn.Linear / checkpoint layout; K x N for NN and TN.
//   bias: N entries (T), or null (NT, NN; TN has none).
//   C:    M x N; T for NT and NN, each element rounded once from the fp32 accumulator (plus the
//         bias); f32 for TN.
// A K-contiguous operand (A of NT/NN, B of NT) is staged as [rows][K] and fed to mma.sync's
// row.col form by plain ldmatrix; an operand stored with K as its rows (A of TN, B of NN/TN) is
// staged as [K][rows] and fed by ldmatrix.trans, which hands each thread the same fragment.
// Tiling: a 256-thread block (8 warps, 2 along M x 4 along N) computes a 128 x 128 tile of C;
// each warp a 64 x 32 tile as 4 x 4 mma.m16n8k16. K advances 32 at a time through a ring of
// STAGES shared-memory stages filled by cp.async (16 B, zero-filled past M, N and K), so up to
// STAGES - 1 tiles are in flight while one is multiplied. Shared rows are padded ([rows][K]: 40
// elements, 80 B; [K][rows]: 136 elements, 272 B) so that the 8 rows an ldmatrix phase reads
// fall in 8 distinct 16-byte bank groups.
// Edges: any M, N, K. The cp.async path (ALIGNED) needs every operand's contiguous dim (K for a
// [rows][K] operand, M or N for a [K][rows] one) a multiple of 8, so that every 16-byte chunk
// is aligned and wholly in or out; anything else takes the same pipeline with predicated element
// loads.
// Launch: grid = (ceil(N / 128), ceil(M / 128)), block = 256, dynamic shared memory
// SMEM_BYTES for every layout (above 48 KiB: the launcher raises the function's limit).
#include "common.cuh"

namespace {

constexpr int BM = MMA_BM, BN = MMA_BN, BK = 32, PAD = 8, LDS = BK + PAD, STAGES = 4, THREADS = MMA_THREADS;
constexpr int LDT = BM + PAD;  // row pitch of a [K][rows] staged operand
constexpr int WARPS_M = 2, WARPS_N = 4, WM = BM / WARPS_M, WN = BN / WARPS_N;  // 64 x 32 per warp
constexpr int MI = WM / 16, NI = WN / 8;                                        // mma tiles per warp
constexpr int ROWS_K_ELEMS = BM * LDS;  // one operand's tile staged [rows][K]
constexpr int K_ROWS_ELEMS = BK * LDT;  // ... staged [K][rows]
constexpr int STAGE_ELEMS = (BM + BN) * LDS;
constexpr int SMEM_BYTES = STAGES * STAGE_ELEMS * 2;
static_assert(BM == BN, "both operands' tiles have 128 rows");
static_assert(WARPS_M * WARPS_N * 32 == THREADS, "8 warps");
static_assert((LDS * 2) % 16 == 0 && (LDT * 2) % 16 == 0, "padded rows keep 16-byte alignment for cp.async");
static_assert((LDT * 2 / 4) % 32 == 4, "[K][rows] rows start 4 banks apart: ldmatrix.trans is conflict-free");
static_assert(K_ROWS_ELEMS <= ROWS_K_ELEMS, "every layout's stages fit SMEM_BYTES");
static_assert((K_ROWS_ELEMS * 2) % 16 == 0, "the second operand's tile starts 16-byte aligned");
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

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
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

// Fills one stage: k [k0, k0 + 32) x columns [col0, col0 + 128) of a matrix X stored K x cols
// (cols contiguous) into s (32 x LDT). Thread t moves chunks t and t + 256 of 8 elements each.
template <typename T, bool ALIGNED>
__device__ __forceinline__ void load_tile_t(T* s, const T* __restrict__ X, int64_t K, int64_t cols, int64_t k0,
                                            int64_t col0) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int c = threadIdx.x + i * THREADS;
        const int kr = c / (BM / 8), cc = (c % (BM / 8)) * 8;
        const int64_t k = k0 + kr, col = col0 + cc;
        T* dst = s + kr * LDT + cc;
        if (ALIGNED) {
            const bool in = k < K && col < cols;  // cols % 8 == 0: a chunk is wholly in or out
            cp_async16(dst, in ? X + k * cols + col : X, in ? 16 : 0);
        } else {
            const T zero = tp::from_f32<T>(0.f);
#pragma unroll
            for (int e = 0; e < 8; ++e) dst[e] = (k < K && col + e < cols) ? X[k * cols + col + e] : zero;
        }
    }
}

// The layouts: whether A is stored K x M (TN) and B K x N (NN, TN); the output type; bias or beta.
enum Layout { NT, NN, TN };

// One 128 x 128 tile of C, its first row m0 and column n0.
template <typename T, typename OutT, bool ALIGNED, Layout L>
__device__ __forceinline__ void gemm_mma(OutT* __restrict__ C, const T* __restrict__ A, const T* __restrict__ B,
                                         const T* __restrict__ bias, int64_t M, int64_t N, int64_t K, int beta,
                                         int64_t m0, int64_t n0) {
    constexpr bool A_T = L == TN, B_T = L != NT;  // stored with K as the rows: staged [K][rows]
    constexpr int A_ELEMS = A_T ? K_ROWS_ELEMS : ROWS_K_ELEMS;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* smem = reinterpret_cast<T*>(smem_raw);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    const int64_t ktiles = (K + BK - 1) / BK;

    auto stage_a = [&](int s) { return smem + s * STAGE_ELEMS; };
    auto stage_b = [&](int s) { return smem + s * STAGE_ELEMS + A_ELEMS; };
    auto load_stage = [&](int s, int64_t kt) {
        if (A_T) load_tile_t<T, ALIGNED>(stage_a(s), A, K, M, kt * BK, m0);
        else load_tile<T, ALIGNED>(stage_a(s), A, M, K, m0, kt * BK);
        if (B_T) load_tile_t<T, ALIGNED>(stage_b(s), B, K, N, kt * BK, n0);
        else load_tile<T, ALIGNED>(stage_b(s), B, N, K, n0, kt * BK);
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

        // [rows][K] tiles start at the warp's first row; [K][rows] tiles at its first column.
        const T* sa = stage_a(kt % STAGES) + (A_T ? wm * WM : (wm * WM) * LDS);
        const T* sb = stage_b(kt % STAGES) + (B_T ? wn * WN : (wn * WN) * LDS);
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            uint32_t af[MI][4], bf[NI][2];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
                // Matrices a0..a3: (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15),
                // their 8 row addresses from lanes 8j..8j+7.
                if (A_T) {  // row address = one k, 8 consecutive m: transposed on the way in
                    ldmatrix_x4_trans(af[mi], sa + (kk + lane % 8 + (lane / 16) * 8) * LDT + mi * 16 + ((lane / 8) % 2) * 8);
                } else {  // lanes 0-15 address rows 0-15 at k, lanes 16-31 rows 0-15 at k + 8
                    ldmatrix_x4(af[mi], sa + (mi * 16 + lane % 16) * LDS + kk + (lane / 16) * 8);
                }
            }
#pragma unroll
            for (int nj = 0; nj < NI; nj += 2) {
                // Matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15).
                uint32_t r[4];
                if (B_T) {  // row address = one k, 8 consecutive n
                    ldmatrix_x4_trans(r, sb + (kk + lane % 8 + ((lane / 8) % 2) * 8) * LDT + nj * 8 + (lane / 16) * 8);
                } else {
                    ldmatrix_x4(r, sb + (nj * 8 + lane % 8 + (lane / 16) * 8) * LDS + kk + ((lane / 8) % 2) * 8);
                }
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
    const bool pairs = (N % 2) == 0;  // then (m*N + n) is even for even n: aligned pairs
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
                OutT* out = C + m * N + n;
                if constexpr (L == TN) {  // f32 output, accumulated when beta
                    float v0 = acc[mi][ni][2 * h], v1 = acc[mi][ni][2 * h + 1];
                    if (pairs && n + 1 < N) {
                        float2* o2 = reinterpret_cast<float2*>(out);
                        if (beta) {
                            const float2 old = *o2;
                            v0 = __fadd_rn(old.x, v0);
                            v1 = __fadd_rn(old.y, v1);
                        }
                        *o2 = make_float2(v0, v1);
                    } else {
                        if (n < N) out[0] = beta ? __fadd_rn(out[0], v0) : v0;
                        if (n + 1 < N) out[1] = beta ? __fadd_rn(out[1], v1) : v1;
                    }
                } else {
                    const T v0 = tp::from_f32<T>(acc[mi][ni][2 * h] + b0);
                    const T v1 = tp::from_f32<T>(acc[mi][ni][2 * h + 1] + b1);
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
}

}  // namespace

// The launcher's copy of SMEM_BYTES (crates/tp-kernels, MMA_SMEM_BYTES) must equal this.
static_assert(SMEM_BYTES == 81920, "update MMA_SMEM_BYTES in tp-kernels");

#define TP_GEMM_MMA(NAME, T, ALIGNED, L)                                                                       \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME(T* C, const T* A, const T* B, const T* bias,   \
                                                               int64_t M, int64_t N, int64_t K) {              \
        gemm_mma<T, T, ALIGNED, L>(C, A, B, bias, M, N, K, 0, (int64_t)blockIdx.y * BM, (int64_t)blockIdx.x * BN); \
    }
#define TP_GEMM_MMA_TN(NAME, T, ALIGNED)                                                                       \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME(float* C, const T* A, const T* B, int64_t M,   \
                                                               int64_t N, int64_t K, int beta) {               \
        gemm_mma<T, float, ALIGNED, TN>(C, A, B, nullptr, M, N, K, beta, (int64_t)blockIdx.y * BM,              \
                                        (int64_t)blockIdx.x * BN);                                              \
    }
// The grouped NT product of a mixture's experts, one launch for all: expert e's rows
// offsets[e] .. offsets[e + 1] of A (the tokens' rows sorted by expert) times its own [N, K]
// weight B[e] (and bias[e], where bias and its entry are not null) into the same rows of C.
// Block (x, y) is column tile x of row tile tiles[2y + 1] of expert tiles[2y]: each expert's
// tiles are exactly those of its own NT product, so its rows get the bits a per-expert launch
// gives them.
#define TP_GEMM_MMA_GROUPED(NAME, T, ALIGNED)                                                                  \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                      \
        NAME(T* C, const T* A, const T* const* B, const T* const* bias, const int64_t* offsets,               \
             const int32_t* tiles, int64_t N, int64_t K) {                                                     \
        const int e = tiles[2 * blockIdx.y], mt = tiles[2 * blockIdx.y + 1];                                   \
        const int64_t r0 = offsets[e], M = offsets[e + 1] - r0;                                                \
        gemm_mma<T, T, ALIGNED, NT>(C + r0 * N, A + r0 * K, B[e], bias ? bias[e] : nullptr, M, N, K, 0,       \
                                    (int64_t)mt * BM, (int64_t)blockIdx.x * BN);                               \
    }
TP_GEMM_MMA_GROUPED(tp_gemm_mma_bf16_grouped, __nv_bfloat16, true)
TP_GEMM_MMA_GROUPED(tp_gemm_mma_f16_grouped, __half, true)
TP_GEMM_MMA_GROUPED(tp_gemm_mma_bf16_grouped_unaligned, __nv_bfloat16, false)
TP_GEMM_MMA_GROUPED(tp_gemm_mma_f16_grouped_unaligned, __half, false)
TP_GEMM_MMA(tp_gemm_mma_bf16_nk, __nv_bfloat16, true, NT)
TP_GEMM_MMA(tp_gemm_mma_f16_nk, __half, true, NT)
TP_GEMM_MMA(tp_gemm_mma_bf16_nk_unaligned, __nv_bfloat16, false, NT)
TP_GEMM_MMA(tp_gemm_mma_f16_nk_unaligned, __half, false, NT)
TP_GEMM_MMA(tp_gemm_mma_bf16_kn, __nv_bfloat16, true, NN)
TP_GEMM_MMA(tp_gemm_mma_f16_kn, __half, true, NN)
TP_GEMM_MMA(tp_gemm_mma_bf16_kn_unaligned, __nv_bfloat16, false, NN)
TP_GEMM_MMA(tp_gemm_mma_f16_kn_unaligned, __half, false, NN)
TP_GEMM_MMA_TN(tp_gemm_mma_bf16_tn, __nv_bfloat16, true)
TP_GEMM_MMA_TN(tp_gemm_mma_f16_tn, __half, true)
TP_GEMM_MMA_TN(tp_gemm_mma_bf16_tn_unaligned, __nv_bfloat16, false)
TP_GEMM_MMA_TN(tp_gemm_mma_f16_tn_unaligned, __half, false)
