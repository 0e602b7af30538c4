// gemm_wgmma.cu -- Hopper (sm_90a) bf16/f16 GEMM: TMA loads on an mbarrier ring, wgmma issued
// by consumer warpgroups, a producer warpgroup, setmaxnreg, a persistent grid with grouped tile
// order, fp32 accumulation and a fused bias. C = A * B^T + bias.
//
// Layouts (row-major), T = __nv_bfloat16 or __half:
//   A:    M x K activations, read through TMA descriptor tma_a (box 64 x 128, 128-byte swizzle).
//   B:    N x K weight (nn.Linear layout), read through tma_b (box 64 x 256, 128-byte swizzle).
//   bias: N entries of T, or null.        C: M x N of T, each element rounded once.
// Requirements (checked by the launcher, which falls back to gemm_mma otherwise): sm_90a,
// K % 8 == 0 (TMA needs 16-byte row strides), 16-byte aligned A and B. TMA zero-fills reads past
// M, N and K, so any M, N, K works; stores past M, N are skipped.
//
// Tiling: a CTA computes 128 x 256 tiles of C, K in steps of 64. Warpgroup 0 is the producer:
// one thread waits for a free stage (empty barrier), arms the stage's full barrier with the
// byte count and issues two TMA loads. Warpgroups 1 and 2 are consumers: each owns 64 rows of the
// tile, waits for a full stage, issues 4 x 2 wgmma.m64n128k16 (K 16 per step, N 128 per
// instruction) from shared-memory descriptors, waits for them, and frees the stage. STAGES = 4
// stages of 48 KiB. Registers move to the consumers: setmaxnreg WGMMA_PRODUCER_REGS (40) for the
// producer, WGMMA_CONSUMER_REGS (232) for the consumers (launch_config.cuh; `cargo xtask ptx`
// checks the split against the register count ptxas reports). A stuck mbarrier wait traps after
// 10 s with a message instead of hanging the GPU.
// The grid is persistent (one CTA per SM, from the launcher) and walks tiles in groups of 8
// tile-rows so that concurrently running CTAs share B tiles in L2.
// Launch: grid = min(tiles, SMs), block = 384, dynamic shared memory SMEM_BYTES.
//
// wgmma descriptor bits (PTX ISA, "Matrix Descriptor Format"): [0,14) start address >> 4,
// [16,30) leading byte offset >> 4 (unused for swizzled K-major), [32,46) stride byte offset >> 4
// (1024 B: 8 rows of 128 B), [62,64) swizzle mode (1 = 128B).
#include <cuda.h>

#include "common.cuh"

namespace {

constexpr int BM = WGMMA_BM, BN = WGMMA_BN, BK = WGMMA_BK, STAGES = 4, GROUP_M = 8;
constexpr int THREADS = WGMMA_THREADS;  // producer warpgroup + 2 consumer warpgroups
static_assert(THREADS == 3 * 128, "one producer and two consumer warpgroups");
constexpr int A_STAGE = BM * BK, B_STAGE = BN * BK;  // elements
constexpr int SMEM_DATA = STAGES * (A_STAGE + B_STAGE) * 2;
constexpr int SMEM_BYTES = SMEM_DATA + 1024 /* alignment slack */ + 2 * STAGES * 8 /* barriers */;
static_assert(SMEM_BYTES <= 227 * 1024, "fits Hopper's 227 KiB of shared memory per block");
static_assert(BK * 2 == 128, "one 128-byte swizzle row per K step of the tile");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// Nanoseconds of the global timer.
__device__ __forceinline__ uint64_t global_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Longest an mbarrier wait may take before the kernel gives up (a stage normally completes in
// microseconds; this only catches a pipeline bug, which would otherwise hang the GPU).
constexpr uint64_t MBAR_TIMEOUT_NS = 10ull * 1000 * 1000 * 1000;

// Waits for phase `parity` of `bar`; past MBAR_TIMEOUT_NS the kernel traps, and the launch fails
// with CUDA_ERROR_LAUNCH_FAILED, which tp-kernels reports naming this timeout. (No printf: it is
// a function call, and any call in this kernel makes ptxas serialise the wgmma pipeline, which
// `cargo xtask ptx` refuses.)
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
    uint64_t start = 0;
    for (uint32_t spin = 0;; ++spin) {
        uint32_t done;
        asm volatile(
            "{\n.reg .pred p;\n"
            "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(smem_u32(bar)), "r"(parity)
            : "memory");
        if (done) return;
        if ((spin & 1023) == 0) {
            const uint64_t now = global_ns();
            if (spin == 0) {
                start = now;
            } else if (now - start > MBAR_TIMEOUT_NS) {
                __trap();
            }
        }
    }
}

// 2-D TMA tile load of box (c0 = K offset, c1 = row offset) into dst, completing on bar.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
            smem_u32(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
        : "memory");
}

__device__ __forceinline__ uint64_t desc_encode(uint64_t x) { return (x & 0x3FFFF) >> 4; }

// Descriptor of a K-major, 128B-swizzled tile starting at p (8-row groups 1024 B apart).
__device__ __forceinline__ uint64_t make_desc(const void* p) {
    return desc_encode(smem_u32(p)) | (desc_encode(16) << 16) | (desc_encode(1024) << 32) | (1ull << 62);
}

template <typename T>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d);

template <>
__device__ __forceinline__ void wgmma_m64n128k16<__nv_bfloat16>(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

template <>
__device__ __forceinline__ void wgmma_m64n128k16<__half>(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS)); }
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS)); }

template <typename T>
__device__ __forceinline__ void gemm_wgmma(T* __restrict__ C, const T* __restrict__ bias, const CUtensorMap* tma_a,
                                           const CUtensorMap* tma_b, int M, int N, int K) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // TMA's 128-byte swizzle needs 1024-byte aligned destinations.
    unsigned char* base = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
    T* sA = reinterpret_cast<T*>(base);
    T* sB = sA + STAGES * A_STAGE;
    uint64_t* full = reinterpret_cast<uint64_t*>(base + SMEM_DATA);
    uint64_t* empty = full + STAGES;

    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
    const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN, tiles = tiles_m * tiles_n;
    const int ktiles = (K + BK - 1) / BK;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 2 * 128);  // every consumer thread frees the stage
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        // ---------------- producer ----------------
        setmaxnreg_dec<WGMMA_PRODUCER_REGS>();
        if (tid == 0) {
            int it = 0;
            for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
                int tm, tn;
                tp::grouped_tile(t, tiles_m, tiles_n, GROUP_M, &tm, &tn);
                for (int kt = 0; kt < ktiles; ++kt, ++it) {
                    const int s = it % STAGES;
                    mbar_wait(&empty[s], (it / STAGES) & 1);
                    mbar_expect_tx(&full[s], (A_STAGE + B_STAGE) * 2);
                    tma_load(sA + s * A_STAGE, tma_a, &full[s], kt * BK, tm * BM);
                    tma_load(sB + s * B_STAGE, tma_b, &full[s], kt * BK, tn * BN);
                }
            }
        }
    } else {
        // ---------------- consumers ----------------
        setmaxnreg_inc<WGMMA_CONSUMER_REGS>();
        const int c = wg - 1;  // which 64-row half of the tile
        for (int s = 0; s < STAGES; ++s) mbar_arrive(&empty[s]);  // every stage starts free
        const int warp = tid / 32, lane = tid % 32;
        int it = 0;
        for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
            int tm, tn;
            tp::grouped_tile(t, tiles_m, tiles_n, GROUP_M, &tm, &tn);
            float acc[2][64];
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int i = 0; i < 64; ++i) acc[h][i] = 0.f;
            for (int kt = 0; kt < ktiles; ++kt, ++it) {
                const int s = it % STAGES;
                mbar_wait(&full[s], (it / STAGES) & 1);
                const T* a = sA + s * A_STAGE + c * 64 * BK;
                const T* b = sB + s * B_STAGE;
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BK / 16; ++kk) {
                    const uint64_t da = make_desc(a + kk * 16);
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        wgmma_m64n128k16<T>(acc[h], da, make_desc(b + h * 128 * BK + kk * 16), 1);
                    }
                }
                wgmma_commit();
                wgmma_wait_all();
                mbar_arrive(&empty[s]);
            }
            // Epilogue: accumulator fragment i of the n128 half h holds row warp*16 + lane/4
            // (+8 for i%4 >= 2), column (i/4)*8 + 2*(lane%4) + (i%2).
            const int row0 = tm * BM + c * 64 + warp * 16 + lane / 4;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int j = 0; j < 16; ++j) {
                    const int col = tn * BN + h * 128 + j * 8 + 2 * (lane % 4);
                    const float b0 = (bias && col < N) ? tp::to_f32(bias[col]) : 0.f;
                    const float b1 = (bias && col + 1 < N) ? tp::to_f32(bias[col + 1]) : 0.f;
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const int row = row0 + half * 8;
                        if (row >= M) continue;
                        T* out = C + (int64_t)row * N + col;
                        if (col < N) out[0] = tp::from_f32<T>(acc[h][4 * j + 2 * half] + b0);
                        if (col + 1 < N) out[1] = tp::from_f32<T>(acc[h][4 * j + 2 * half + 1] + b1);
                    }
                }
            }
        }
    }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace

// The launcher requests WGMMA_SMEM_BYTES (launch_config.cuh): it must be what the tiles need.
static_assert(SMEM_BYTES == WGMMA_SMEM_BYTES, "update WGMMA_SMEM_BYTES in launch_config.cuh");
static_assert(128 * WGMMA_PRODUCER_REGS + 256 * WGMMA_CONSUMER_REGS <= 65536, "the split fits the register file");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TP_WGMMA_BODY(T) gemm_wgmma<T>(C, bias, &tma_a, &tma_b, M, N, K);
#else
// Built for other architectures only so the module loads everywhere; the launcher never
// launches it off sm_90a.
#define TP_WGMMA_BODY(T) __trap();
#endif

#define TP_GEMM_WGMMA(NAME, T)                                                                                \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                                 \
        NAME(T* C, const T* bias, const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b, \
             int M, int N, int K) {                                                                           \
        TP_WGMMA_BODY(T)                                                                                      \
    }
TP_GEMM_WGMMA(tp_gemm_wgmma_bf16, __nv_bfloat16)
TP_GEMM_WGMMA(tp_gemm_wgmma_f16, __half)
