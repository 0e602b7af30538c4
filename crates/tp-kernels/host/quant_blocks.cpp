// Host build of kernels/quant_blocks.cuh: the per-format dequantization of block units that the
// quant kernels run, exported with C linkage so CPU tests can check it against independent
// references. Built with -ffp-contract=off (build.rs): every f32 operation rounds on its own, as
// __fmul_rn / __fadd_rn / __fsub_rn do on the device.
#include "../../../kernels/quant_blocks.cuh"

namespace {

// Dequantizes `blocks` blocks unit by unit, as tp_dequant_* does (one unit per thread there).
template <class B>
void dequant_blocks(const uint8_t* src, int64_t blocks, float* dst) {
    const B* b = reinterpret_cast<const B*>(src);
    for (int64_t i = 0; i < blocks; ++i) {
        for (int u = 0; u < B::UNITS; ++u) {
            const tp::quant::Unit r = b[i].unit(u);
            for (int j = 0; j < 4; ++j) {
                dst[i * B::ELEMS + r.e0 + j] = r.w[j];
                dst[i * B::ELEMS + r.e1 + j] = r.w[4 + j];
            }
        }
    }
}

template <class B>
int64_t info(int what) {
    return what == 0 ? static_cast<int64_t>(sizeof(B)) : what == 1 ? B::ELEMS : B::UNITS;
}

}  // namespace

// Dispatches on the ggml type id: F(Block) for each format; returns OTHERWISE for other ids.
#define TP_QUANT_DISPATCH(TYPE, F, OTHERWISE)                   \
    switch (TYPE) {                                             \
        case tp::quant::BlockQ4_0::ID: F(tp::quant::BlockQ4_0); \
        case tp::quant::BlockQ4_1::ID: F(tp::quant::BlockQ4_1); \
        case tp::quant::BlockQ5_0::ID: F(tp::quant::BlockQ5_0); \
        case tp::quant::BlockQ5_1::ID: F(tp::quant::BlockQ5_1); \
        case tp::quant::BlockQ8_0::ID: F(tp::quant::BlockQ8_0); \
        case tp::quant::BlockQ2_K::ID: F(tp::quant::BlockQ2_K); \
        case tp::quant::BlockQ3_K::ID: F(tp::quant::BlockQ3_K); \
        case tp::quant::BlockQ4_K::ID: F(tp::quant::BlockQ4_K); \
        case tp::quant::BlockQ5_K::ID: F(tp::quant::BlockQ5_K); \
        case tp::quant::BlockQ6_K::ID: F(tp::quant::BlockQ6_K); \
        default: return OTHERWISE;                              \
    }

extern "C" {
// Dequantizes `blocks` whole blocks of type `ggml_type` at `src` into `dst` (blocks * elems
// floats). Returns 0, or -1 for a type with no block struct here.
int tp_host_dequantize(uint32_t ggml_type, const uint8_t* src, int64_t blocks, float* dst) {
#define TP_RUN(B)                    \
    dequant_blocks<B>(src, blocks, dst); \
    return 0;
    TP_QUANT_DISPATCH(ggml_type, TP_RUN, -1)
#undef TP_RUN
}

// The block struct's size in bytes (what 0), elements (1) or units (2); -1 for an unknown type.
int64_t tp_host_block_info(uint32_t ggml_type, int what) {
#define TP_INFO(B) return info<B>(what);
    TP_QUANT_DISPATCH(ggml_type, TP_INFO, -1)
#undef TP_INFO
}
}
