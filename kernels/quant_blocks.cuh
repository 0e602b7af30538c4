// quant_blocks.cuh -- llama.cpp's (ggml's) quantized block formats, byte for byte, and one
// device function per format that dequantizes a "unit" of a block: 8 elements, two runs of 4.
//
// Layouts (little-endian; `half` is an IEEE binary16 stored as 2 bytes; no padding):
//   Q4_0  (id 2)  18 B / 32:  half d; u8 qs[16]                          x = d (q - 8)
//   Q4_1  (id 3)  20 B / 32:  half d, m; u8 qs[16]                       x = d q + m
//   Q5_0  (id 6)  22 B / 32:  half d; u8 qh[4]; u8 qs[16]                x = d (q - 16)
//   Q5_1  (id 7)  24 B / 32:  half d, m; u8 qh[4]; u8 qs[16]             x = d q + m
//   Q8_0  (id 8)  34 B / 32:  half d; i8 qs[32]                          x = d q
//   Q2_K  (id 10) 84 B / 256: u8 scales[16]; u8 qs[64]; half d, dmin     x = d sc q - dmin m
//   Q3_K  (id 11) 110 B/ 256: u8 hmask[32]; u8 qs[64]; u8 scales[12]; half d   x = d (sc-32) (q-4h)
//   Q4_K  (id 12) 144 B/ 256: half d, dmin; u8 scales[12]; u8 qs[128]   x = d sc q - dmin m
//   Q5_K  (id 13) 176 B/ 256: half d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]
//   Q6_K  (id 14) 210 B/ 256: u8 ql[128]; u8 qh[64]; i8 scales[16]; half d   x = d sc (q - 32)
// Legacy blocks: element j < 16 is the low nibble of qs[j], element j + 16 its high nibble; the
// 5th bit of element j is bit j of qh (a little-endian u32). K-quant element orders are given
// at each unit function below.
//
// Arithmetic: each value is computed with the operations, operand order and f32 roundings of
// ggml's dequantize_row_* (mul_rn / add_rn / sub_rn: __fmul_rn and friends on the device, so
// nvcc cannot contract a multiply and an add into an FMA): the results are bit-exact with
// ggml's CPU dequantization.
//
// Alignment: every block size and every field offset is even, and rows are whole blocks, so a
// block stored anywhere in a 2-byte aligned buffer may be read with 16-bit loads; most blocks
// are NOT 4-byte aligned (18, 22, 34, 110, 210 bytes), so 32-bit values are assembled from two
// 16-bit loads, never read with one 32-bit load.
//
// A unit is what one thread dequantizes at a time: UNITS units cover a block (4 for the 32-element
// legacy blocks, 32 for the 256-element K-quants). Consecutive units read consecutive bytes of
// the quants, so a warp's loads coalesce.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <string.h>

// Host + device: nvcc compiles these functions into the kernels; the host C++ compiler compiles
// them into crates/tp-kernels/host/quant_blocks.cpp (built with -ffp-contract=off, so its float
// operations round one at a time as __fmul_rn and friends do), whose exported copy the CPU
// tests check against independent references. The device path uses the intrinsics, the host
// path plain C++ (__CUDA_ARCH__ is defined only while nvcc compiles device code).
#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define TP_QHD __host__ __device__ __forceinline__
#define TP_UNROLL _Pragma("unroll")
#else
#define TP_QHD inline
#define TP_UNROLL
#endif

namespace tp {
namespace quant {

// 8 dequantized elements of one block: w[0..3] are elements e0..e0+3, w[4..7] elements e1..e1+3
// (e0 and e1 multiples of 4).
struct Unit {
    float w[8];
    int e0, e1;
};

// Read-only loads from 2-byte aligned addresses.
TP_QHD uint32_t ld_u8(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
    return __ldg(p);
#else
    return *p;
#endif
}
TP_QHD uint32_t ld_u16(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
    return __ldg(reinterpret_cast<const unsigned short*>(p));
#else
    return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8);  // little-endian
#endif
}
// A little-endian u32 at a 2-byte aligned address, as two 16-bit loads.
TP_QHD uint32_t ld_u32(const uint8_t* p) { return ld_u16(p) | (ld_u16(p + 2) << 16); }

// The binary16 at a 2-byte aligned address, widened to f32 (exact).
TP_QHD float ld_half(const uint8_t* p) {
    const uint32_t h = ld_u16(p);
#if defined(__CUDA_ARCH__)
    return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
#else
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0 && man == 0) {
        bits = sign;
    } else if (exp == 0) {  // subnormal: man * 2^-24, renormalised
        int e = -1;
        uint32_t m = man;
        do {
            m <<= 1;
            ++e;
        } while ((m & 0x400u) == 0);
        bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (m & 0x3FFu) << 13;
    } else if (exp == 0x1F) {
        bits = sign | 0x7F800000u | man << 13;
    } else {
        bits = sign | (exp + 127 - 15) << 23 | man << 13;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

// f32 operations rounded one at a time (never contracted into an FMA), as ggml's C computes.
TP_QHD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
TP_QHD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}
TP_QHD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}

// Byte i (0..3) of a u32.
TP_QHD uint32_t byte_of(uint32_t v, int i) { return (v >> (8 * i)) & 0xFFu; }

// ---- legacy formats: 32 elements, 4 units of 8 (unit u: elements 4u..4u+3 and 16+4u..16+4u+3,
// from qs[4u..4u+3]; Q8_0: elements 8u..8u+7) ----

struct BlockQ4_0 {
    static constexpr int ID = 2, ELEMS = 32, BYTES = 18, UNITS = 4;
    uint8_t d[2];
    uint8_t qs[16];
    TP_QHD Unit unit(int u) const {
        const float dv = ld_half(d);
        const uint32_t q = ld_u32(qs + 4 * u);
        Unit r;
TP_UNROLL
        for (int i = 0; i < 4; ++i) {
            r.w[i] = mul_rn(static_cast<float>(static_cast<int>(byte_of(q, i) & 0xF) - 8), dv);
            r.w[4 + i] = mul_rn(static_cast<float>(static_cast<int>(byte_of(q, i) >> 4) - 8), dv);
        }
        r.e0 = 4 * u;
        r.e1 = 16 + 4 * u;
        return r;
    }
};

struct BlockQ4_1 {
    static constexpr int ID = 3, ELEMS = 32, BYTES = 20, UNITS = 4;
    uint8_t d[2], m[2];
    uint8_t qs[16];
    TP_QHD Unit unit(int u) const {
        const float dv = ld_half(d), mv = ld_half(m);
        const uint32_t q = ld_u32(qs + 4 * u);
        Unit r;
TP_UNROLL
        for (int i = 0; i < 4; ++i) {
            r.w[i] = add_rn(mul_rn(static_cast<float>(byte_of(q, i) & 0xF), dv), mv);
            r.w[4 + i] = add_rn(mul_rn(static_cast<float>(byte_of(q, i) >> 4), dv), mv);
        }
        r.e0 = 4 * u;
        r.e1 = 16 + 4 * u;
        return r;
    }
};

struct BlockQ5_0 {
    static constexpr int ID = 6, ELEMS = 32, BYTES = 22, UNITS = 4;
    uint8_t d[2];
    uint8_t qh[4];
    uint8_t qs[16];
    TP_QHD Unit unit(int u) const {
        const float dv = ld_half(d);
        const uint32_t h = ld_u32(qh), q = ld_u32(qs + 4 * u);
        Unit r;
TP_UNROLL
        for (int i = 0; i < 4; ++i) {
            const int j = 4 * u + i;
            const int lo = static_cast<int>((byte_of(q, i) & 0xF) | (((h >> j) & 1u) << 4)) - 16;
            const int hi = static_cast<int>((byte_of(q, i) >> 4) | (((h >> (j + 16)) & 1u) << 4)) - 16;
            r.w[i] = mul_rn(static_cast<float>(lo), dv);
            r.w[4 + i] = mul_rn(static_cast<float>(hi), dv);
        }
        r.e0 = 4 * u;
        r.e1 = 16 + 4 * u;
        return r;
    }
};

struct BlockQ5_1 {
    static constexpr int ID = 7, ELEMS = 32, BYTES = 24, UNITS = 4;
    uint8_t d[2], m[2];
    uint8_t qh[4];
    uint8_t qs[16];
    TP_QHD Unit unit(int u) const {
        const float dv = ld_half(d), mv = ld_half(m);
        const uint32_t h = ld_u32(qh), q = ld_u32(qs + 4 * u);
        Unit r;
TP_UNROLL
        for (int i = 0; i < 4; ++i) {
            const int j = 4 * u + i;
            const uint32_t lo = (byte_of(q, i) & 0xF) | (((h >> j) & 1u) << 4);
            const uint32_t hi = (byte_of(q, i) >> 4) | (((h >> (j + 16)) & 1u) << 4);
            r.w[i] = add_rn(mul_rn(static_cast<float>(lo), dv), mv);
            r.w[4 + i] = add_rn(mul_rn(static_cast<float>(hi), dv), mv);
        }
        r.e0 = 4 * u;
        r.e1 = 16 + 4 * u;
        return r;
    }
};

struct BlockQ8_0 {
    static constexpr int ID = 8, ELEMS = 32, BYTES = 34, UNITS = 4;
    uint8_t d[2];
    int8_t qs[32];
    TP_QHD Unit unit(int u) const {
        const float dv = ld_half(d);
        const uint8_t* p = reinterpret_cast<const uint8_t*>(qs) + 8 * u;
        const uint32_t q0 = ld_u32(p), q1 = ld_u32(p + 4);
        Unit r;
TP_UNROLL
        for (int i = 0; i < 4; ++i) {
            r.w[i] = mul_rn(static_cast<float>(static_cast<int8_t>(byte_of(q0, i))), dv);
            r.w[4 + i] = mul_rn(static_cast<float>(static_cast<int8_t>(byte_of(q1, i))), dv);
        }
        r.e0 = 8 * u;
        r.e1 = 8 * u + 4;
        return r;
    }
};

// ---- K-quants: 256 elements, 32 units of 8 ----

// Q2_K: element 128n + 32j + l (n < 2, j < 4, l < 32) is bits 2j..2j+1 of qs[32n + l], with
// scale byte scales[8n + 2j + l/16] (low nibble: scale, high nibble: min).
// Unit u = 16n + 8p + t (p < 2, t < 8): l = 4t..4t+3 for j = 2p (-> e0) and j = 2p + 1 (-> e1).
struct BlockQ2_K {
    static constexpr int ID = 10, ELEMS = 256, BYTES = 84, UNITS = 32;
    uint8_t scales[16];
    uint8_t qs[64];
    uint8_t d[2], dmin[2];
    TP_QHD Unit unit(int u) const {
        const int n = u >> 4, p = (u >> 3) & 1, t = u & 7;
        const float dv = ld_half(d), mv = ld_half(dmin);
        const uint32_t q = ld_u32(qs + 32 * n + 4 * t);
        Unit r;
TP_UNROLL
        for (int run = 0; run < 2; ++run) {
            const int j = 2 * p + run;
            const uint32_t sc = ld_u8(scales + 8 * n + 2 * j + t / 4);
            const float dl = mul_rn(dv, static_cast<float>(sc & 0xF));
            const float ml = mul_rn(mv, static_cast<float>(sc >> 4));
TP_UNROLL
            for (int i = 0; i < 4; ++i) {
                const uint32_t v = (byte_of(q, i) >> (2 * j)) & 3u;
                r.w[4 * run + i] = sub_rn(mul_rn(dl, static_cast<float>(v)), ml);
            }
        }
        r.e0 = 128 * n + 64 * p + 4 * t;
        r.e1 = r.e0 + 32;
        return r;
    }
};

// Q3_K: element 128n + 32j + l is (bits 2j..2j+1 of qs[32n + l]) - 4 unless bit 4n + j of
// hmask[l] is set, times d * (s - 32) with s the 6-bit scale 8n + 2j + l/16: its low 4 bits are
// the low (index < 8) or high (index >= 8) nibble of scales[index % 8], its high 2 bits are bits
// 2(index/4).. of scales[8 + index % 4]. Units as Q2_K.
struct BlockQ3_K {
    static constexpr int ID = 11, ELEMS = 256, BYTES = 110, UNITS = 32;
    uint8_t hmask[32];
    uint8_t qs[64];
    uint8_t scales[12];
    uint8_t d[2];
    TP_QHD Unit unit(int u) const {
        const int n = u >> 4, p = (u >> 3) & 1, t = u & 7;
        const float dv = ld_half(d);
        const uint32_t q = ld_u32(qs + 32 * n + 4 * t), h = ld_u32(hmask + 4 * t);
        Unit r;
TP_UNROLL
        for (int run = 0; run < 2; ++run) {
            const int j = 2 * p + run;
            const int s = 8 * n + 2 * j + t / 4;
            const uint32_t low = (ld_u8(scales + (s & 7)) >> (s < 8 ? 0 : 4)) & 0xF;
            const uint32_t high = (ld_u8(scales + 8 + (s & 3)) >> (2 * (s >> 2))) & 3u;
            const float dl = mul_rn(dv, static_cast<float>(static_cast<int>(low | (high << 4)) - 32));
TP_UNROLL
            for (int i = 0; i < 4; ++i) {
                const int v = static_cast<int>((byte_of(q, i) >> (2 * j)) & 3u) -
                              (((byte_of(h, i) >> (4 * n + j)) & 1u) ? 0 : 4);
                r.w[4 * run + i] = mul_rn(dl, static_cast<float>(v));
            }
        }
        r.e0 = 128 * n + 64 * p + 4 * t;
        r.e1 = r.e0 + 32;
        return r;
    }
};

// The 6-bit (scale, min) pair s (< 8) of a Q4_K / Q5_K block's 12 scale bytes (ggml's
// get_scale_min_k4): pairs 0..3 are the low 6 bits of bytes s and s + 4; pairs 4..7 take their
// low 4 bits from byte s + 4 (scale: low nibble, min: high nibble) and their high 2 bits from the
// top bits of bytes s - 4 (scale) and s (min).
TP_QHD void scale_min_k4(const uint8_t* sc, int s, uint32_t& scale, uint32_t& min) {
    if (s < 4) {
        scale = ld_u8(sc + s) & 63;
        min = ld_u8(sc + s + 4) & 63;
    } else {
        const uint32_t b = ld_u8(sc + s + 4);
        scale = (b & 0xF) | ((ld_u8(sc + s - 4) >> 6) << 4);
        min = (b >> 4) | ((ld_u8(sc + s) >> 6) << 4);
    }
}

// Q4_K: element 64c + l (c < 4, l < 32) is the low nibble of qs[32c + l] with pair 2c, element
// 64c + 32 + l its high nibble with pair 2c + 1; x = (d * scale) q - (dmin * min).
// Unit u = 8c + t: l = 4t..4t+3 of both halves (e0: low nibbles, e1: high nibbles).
struct BlockQ4_K {
    static constexpr int ID = 12, ELEMS = 256, BYTES = 144, UNITS = 32;
    uint8_t d[2], dmin[2];
    uint8_t scales[12];
    uint8_t qs[128];
    TP_QHD Unit unit(int u) const {
        const int c = u >> 3, t = u & 7;
        const float dv = ld_half(d), mv = ld_half(dmin);
        const uint32_t q = ld_u32(qs + 32 * c + 4 * t);
        Unit r;
TP_UNROLL
        for (int half = 0; half < 2; ++half) {
            uint32_t sc, mn;
            scale_min_k4(scales, 2 * c + half, sc, mn);
            const float dl = mul_rn(dv, static_cast<float>(sc)), ml = mul_rn(mv, static_cast<float>(mn));
TP_UNROLL
            for (int i = 0; i < 4; ++i) {
                const uint32_t v = (byte_of(q, i) >> (4 * half)) & 0xF;
                r.w[4 * half + i] = sub_rn(mul_rn(dl, static_cast<float>(v)), ml);
            }
        }
        r.e0 = 64 * c + 4 * t;
        r.e1 = r.e0 + 32;
        return r;
    }
};

// Q5_K: Q4_K plus a 5th bit: bit 2c (low nibbles) or 2c + 1 (high nibbles) of qh[l]. Units as Q4_K.
struct BlockQ5_K {
    static constexpr int ID = 13, ELEMS = 256, BYTES = 176, UNITS = 32;
    uint8_t d[2], dmin[2];
    uint8_t scales[12];
    uint8_t qh[32];
    uint8_t qs[128];
    TP_QHD Unit unit(int u) const {
        const int c = u >> 3, t = u & 7;
        const float dv = ld_half(d), mv = ld_half(dmin);
        const uint32_t q = ld_u32(qs + 32 * c + 4 * t), h = ld_u32(qh + 4 * t);
        Unit r;
TP_UNROLL
        for (int half = 0; half < 2; ++half) {
            uint32_t sc, mn;
            scale_min_k4(scales, 2 * c + half, sc, mn);
            const float dl = mul_rn(dv, static_cast<float>(sc)), ml = mul_rn(mv, static_cast<float>(mn));
TP_UNROLL
            for (int i = 0; i < 4; ++i) {
                const uint32_t v =
                    ((byte_of(q, i) >> (4 * half)) & 0xF) | (((byte_of(h, i) >> (2 * c + half)) & 1u) << 4);
                r.w[4 * half + i] = sub_rn(mul_rn(dl, static_cast<float>(v)), ml);
            }
        }
        r.e0 = 64 * c + 4 * t;
        r.e1 = r.e0 + 32;
        return r;
    }
};

// Q6_K: element 128n + 32g + l (n < 2, g < 4, l < 32) takes its low 4 bits from
// ql[64n + 32(g & 1) + l] (low nibble for g < 2, high for g >= 2) and its high 2 bits from bits
// 2g..2g+1 of qh[32n + l]; x = (d * scales[8n + 2g + l/16]) (q - 32).
// Unit u = 16n + 8p + t: l = 4t..4t+3 of g = p (-> e0) and g = p + 2 (-> e1), from the same ql bytes.
struct BlockQ6_K {
    static constexpr int ID = 14, ELEMS = 256, BYTES = 210, UNITS = 32;
    uint8_t ql[128];
    uint8_t qh[64];
    int8_t scales[16];
    uint8_t d[2];
    TP_QHD Unit unit(int u) const {
        const int n = u >> 4, p = (u >> 3) & 1, t = u & 7;
        const float dv = ld_half(d);
        const uint32_t q = ld_u32(ql + 64 * n + 32 * p + 4 * t), h = ld_u32(qh + 32 * n + 4 * t);
        const uint8_t* sc = reinterpret_cast<const uint8_t*>(scales);
        Unit r;
TP_UNROLL
        for (int run = 0; run < 2; ++run) {
            const int g = p + 2 * run;
            const int s = static_cast<int8_t>(ld_u8(sc + 8 * n + 2 * g + t / 4));
            const float dl = mul_rn(dv, static_cast<float>(s));
TP_UNROLL
            for (int i = 0; i < 4; ++i) {
                const uint32_t v = ((byte_of(q, i) >> (4 * run)) & 0xF) | (((byte_of(h, i) >> (2 * g)) & 3u) << 4);
                r.w[4 * run + i] = mul_rn(dl, static_cast<float>(static_cast<int>(v) - 32));
            }
        }
        r.e0 = 128 * n + 32 * p + 4 * t;
        r.e1 = r.e0 + 64;
        return r;
    }
};

// Every field offset is even (the 16-bit loads above rely on it).
template <class... S>
constexpr bool all_even(S... offsets) {
    return ((offsets % 2 == 0) && ...);
}

#define TP_QUANT_LAYOUT(B, BYTES_, ...)                                                       \
    static_assert(sizeof(B) == BYTES_ && B::BYTES == BYTES_, #B ": wrong size");            \
    static_assert(alignof(B) == 1, #B ": blocks are packed, 1-byte aligned");               \
    static_assert(B::ELEMS == 8 * B::UNITS, #B ": units of 8 elements must cover the block"); \
    static_assert(all_even(__VA_ARGS__), #B ": fields must start at even offsets");
TP_QUANT_LAYOUT(BlockQ4_0, 18, offsetof(BlockQ4_0, qs))
TP_QUANT_LAYOUT(BlockQ4_1, 20, offsetof(BlockQ4_1, m), offsetof(BlockQ4_1, qs))
TP_QUANT_LAYOUT(BlockQ5_0, 22, offsetof(BlockQ5_0, qh), offsetof(BlockQ5_0, qs))
TP_QUANT_LAYOUT(BlockQ5_1, 24, offsetof(BlockQ5_1, m), offsetof(BlockQ5_1, qh), offsetof(BlockQ5_1, qs))
TP_QUANT_LAYOUT(BlockQ8_0, 34, offsetof(BlockQ8_0, qs))
TP_QUANT_LAYOUT(BlockQ2_K, 84, offsetof(BlockQ2_K, qs), offsetof(BlockQ2_K, d), offsetof(BlockQ2_K, dmin))
TP_QUANT_LAYOUT(BlockQ3_K, 110, offsetof(BlockQ3_K, qs), offsetof(BlockQ3_K, scales), offsetof(BlockQ3_K, d))
TP_QUANT_LAYOUT(BlockQ4_K, 144, offsetof(BlockQ4_K, dmin), offsetof(BlockQ4_K, scales), offsetof(BlockQ4_K, qs))
TP_QUANT_LAYOUT(BlockQ5_K, 176, offsetof(BlockQ5_K, dmin), offsetof(BlockQ5_K, scales), offsetof(BlockQ5_K, qh),
                offsetof(BlockQ5_K, qs))
TP_QUANT_LAYOUT(BlockQ6_K, 210, offsetof(BlockQ6_K, qh), offsetof(BlockQ6_K, scales), offsetof(BlockQ6_K, d))
#undef TP_QUANT_LAYOUT

}  // namespace quant
}  // namespace tp
