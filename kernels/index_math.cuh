// index_math.cuh -- the index arithmetic shared by the shard-copy kernels and by host tests.
//
// Everything here is a pure function of integers, marked TP_HD (host + device), so the same
// source is compiled by nvcc into the kernels and by the host C++ compiler into
// crates/tp-kernels/host/index_math.cpp, whose exported copies the CPU tests check against
// tp-core's TensorShard. All indices are 64-bit: tensors may exceed 2^31 elements.
#pragma once
#include <stdint.h>

#if defined(__CUDACC__)
#define TP_HD __host__ __device__ __forceinline__
#else
#define TP_HD inline
#endif

namespace tp {

// ---------------------------------------------------------------------------------------------
// Balanced split policy (tp-core's TensorShard): a length L over W ranks, L = q*W + r. Ranks
// [0, r) hold q + 1, ranks [r, W) hold q; rank i starts at i*q + min(i, r).
// ---------------------------------------------------------------------------------------------
// ---------------------------------------------------------------------------------------------
// Strided row copy: `rows` rows of `row_units` units; row j of src starts at src_off +
// j*src_pitch, row j of dst at dst_off + j*dst_pitch (all in units). Unit u of the flat copy
// is row u / row_units, column u % row_units. Narrow, scatter-back and cat are all this copy.
// ---------------------------------------------------------------------------------------------
struct RowCopy {
    int64_t rows, row_units, src_pitch, src_off, dst_pitch, dst_off;
};

TP_HD int64_t row_copy_src(const RowCopy& c, int64_t u) {
    return c.src_off + (u / c.row_units) * c.src_pitch + u % c.row_units;
}

TP_HD int64_t row_copy_dst(const RowCopy& c, int64_t u) {
    return c.dst_off + (u / c.row_units) * c.dst_pitch + u % c.row_units;
}

struct Split {
    int64_t q, r;  // L = q*W + r, 0 <= r < W
};

TP_HD Split make_split(int64_t len, int64_t world) { return Split{len / world, len % world}; }
TP_HD int64_t split_start(Split s, int64_t rank) { return rank * s.q + (rank < s.r ? rank : s.r); }
TP_HD int64_t split_len(Split s, int64_t rank) { return s.q + (rank < s.r ? 1 : 0); }
// The rank whose shard holds global index i (0 <= i < L). The first r shards are q + 1 long;
// past them q > 0 must hold, since i < L.
TP_HD int64_t split_owner(Split s, int64_t i) {
    const int64_t big = (s.q + 1) * s.r;
    return i < big ? i / (s.q + 1) : s.r + (i - big) / s.q;
}

// ---------------------------------------------------------------------------------------------
// Gather-interleave: an all-gather buffer is rank-major, (rank, rows, cols_r) with cols_r the
// balanced split of `cols` over `world`; the output is (rows, cols). Output element (row, col)
// comes from rank r = shard_owner(col), whose block starts at rows * shard_start(r) and is
// cols_r wide.
// ---------------------------------------------------------------------------------------------
TP_HD int64_t gather_src(Split s, int64_t rows, int64_t row, int64_t col) {
    const int64_t r = split_owner(s, col);
    const int64_t start = split_start(s, r);
    const int64_t width = split_len(s, r);
    return rows * start + row * width + (col - start);
}

// ---------------------------------------------------------------------------------------------
// Grouped tile order of the persistent GEMM (gemm_wgmma.cu): tile t of a tiles_m x tiles_n grid
// walks `group` tile-rows at a time, column-major inside the group, so CTAs running at once
// share B tiles in L2. A bijection of [0, tiles_m * tiles_n) onto the grid.
// ---------------------------------------------------------------------------------------------
TP_HD void grouped_tile(int t, int tiles_m, int tiles_n, int group, int* tm, int* tn) {
    const int per_group = group * tiles_n;
    const int first_m = (t / per_group) * group;
    const int group_m = (tiles_m - first_m) < group ? (tiles_m - first_m) : group;
    const int in_group = t % per_group;
    *tm = first_m + in_group % group_m;
    *tn = in_group / group_m;
}

}  // namespace tp
