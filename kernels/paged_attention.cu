// paged_attention.cu -- attention over a paged KV cache (chunked prefill and decode of many
// sequences in one flat token batch), and the scatter of new keys/values into cache slots.
//
// The cache of one layer on one rank is [num_blocks, block_size, hkv, d]: position j of a
// sequence lives in block table[j / block_size], row j % block_size.
//
// * tp_paged_attention_T(out, q, k_cache, v_cache, meta, tokens, hq, hkv, group, group_offset, d,
//   block_size, scale, window, sinks): sinks null or hq f32 attention-sink logits (as
//   tp_attention_T's); q, out: tokens x hq x d (the flat batch, sequence after
//   sequence). meta (built and checked by the host launcher) holds, as int64, pos[tokens] (the
//   position of each query row) and tab[tokens] (where its sequence's block table starts), then
//   the block tables as uint32. Row t sits at position p = pos[t] and sees its own sequence's keys
//   j in [lo, p], lo = 0, or p + 1 - window when window > 0 and p + 1 > window; query head h uses
//   KV head (h + group_offset) / group. Each (row, head) is attend_row (attention_row.cuh): the
//   same arithmetic, in the same order, as tp_attention_T on a contiguous cache, and independent
//   of the other rows of the batch. d <= 256; every table entry read is < num_blocks and
//   p < 2^31 (the launcher checks both).
//   Launch: 128 threads (4 warps); blocks stride over the tokens * hq rows.
// * tp_write_slots_uN(cache, src, slots, tokens, row_units): src is tokens rows of row_units
//   units (16, 8, 4, 2 or 1 bytes: one [H, D] row of keys or values), cache is slots of
//   row_units units; row t goes to slot slots[t] (int64, distinct, in range: the launcher checks).
//   Launch: 1-D grid-stride over tokens * row_units, 256 threads per block.
#include "attention_row.cuh"

template <typename T>
__device__ __forceinline__ void paged_attention(T* __restrict__ out, const T* __restrict__ q,
                                                const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                                                const int64_t* __restrict__ meta, int64_t tokens, int64_t hq,
                                                int64_t hkv, int64_t group, int64_t group_offset, int64_t d,
                                                int64_t block_size, float scale, int64_t window,
                                                const float* __restrict__ sinks) {
    const int64_t* pos = meta;
    const int64_t* tab = meta + tokens;
    const uint32_t* tables = reinterpret_cast<const uint32_t*>(meta + 2 * tokens);
    const uint32_t bs = (uint32_t)block_size;
    for (int64_t row = blockIdx.x; row < tokens * hq; row += gridDim.x) {
        const int64_t t = row / hq, h = row - t * hq;
        const int64_t kvh = (h + group_offset) / group;
        const int64_t p = pos[t];
        const int64_t lo = (window > 0 && p + 1 > window) ? p + 1 - window : 0;
        const uint32_t* table = tables + tab[t];
        // Key j < 2^31: 32-bit division by the block size (a 64-bit one costs several times more).
        auto key_at = [=](int64_t j) {
            const uint32_t blk = (uint32_t)j / bs, off = (uint32_t)j - blk * bs;
            return (((int64_t)table[blk] * block_size + off) * hkv + kvh) * d;
        };
        const float sink = sinks ? sinks[h] : -INFINITY;
        tp::attend_row<T>(out + row * d, q + row * d, k_cache, v_cache, d, lo, p, scale, sink, key_at);
    }
}

template <typename U>
__device__ __forceinline__ void write_slots(U* __restrict__ cache, const U* __restrict__ src,
                                            const int64_t* __restrict__ slots, int64_t tokens, int64_t row_units) {
    const int64_t total = tokens * row_units;
    for (int64_t u = tp::global_thread(); u < total; u += tp::grid_stride()) {
        const int64_t t = u / row_units, c = u - t * row_units;
        cache[slots[t] * row_units + c] = src[u];
    }
}

#define TP_PAGED_ATTENTION(SUFFIX, T)                                                                       \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32) tp_paged_attention_##SUFFIX(                \
        T* out, const T* q, const T* k_cache, const T* v_cache, const int64_t* meta, int64_t tokens,        \
        int64_t hq, int64_t hkv, int64_t group, int64_t group_offset, int64_t d, int64_t block_size,        \
        float scale, int64_t window, const float* sinks) {                                                  \
        paged_attention<T>(out, q, k_cache, v_cache, meta, tokens, hq, hkv, group, group_offset, d,         \
                           block_size, scale, window, sinks);                                               \
    }
TP_PAGED_ATTENTION(f32, float)
TP_PAGED_ATTENTION(f16, __half)
TP_PAGED_ATTENTION(bf16, __nv_bfloat16)

#define TP_WRITE_SLOTS(NAME, U)                                                                              \
    extern "C" __global__ void __launch_bounds__(ELEMENTWISE_THREADS)                                        \
        NAME(U* cache, const U* src, const int64_t* slots, int64_t tokens, int64_t row_units) {             \
        write_slots<U>(cache, src, slots, tokens, row_units);                                                \
    }
TP_WRITE_SLOTS(tp_write_slots_u16, uint4)
TP_WRITE_SLOTS(tp_write_slots_u8, uint2)
TP_WRITE_SLOTS(tp_write_slots_u4, uint32_t)
TP_WRITE_SLOTS(tp_write_slots_u2, uint16_t)
TP_WRITE_SLOTS(tp_write_slots_u1, uint8_t)
