// Host build of kernels/index_math.cuh: the very functions the shard-copy kernels run, exported
// with C linkage so CPU tests can check them against tp-core's TensorShard.
#include "../../../kernels/index_math.cuh"

extern "C" {
int64_t tp_host_split_start(int64_t len, int64_t world, int64_t rank) {
    return tp::split_start(tp::make_split(len, world), rank);
}
int64_t tp_host_split_len(int64_t len, int64_t world, int64_t rank) {
    return tp::split_len(tp::make_split(len, world), rank);
}
int64_t tp_host_split_owner(int64_t len, int64_t world, int64_t i) {
    return tp::split_owner(tp::make_split(len, world), i);
}
int64_t tp_host_gather_src(int64_t rows, int64_t cols, int64_t world, int64_t row, int64_t col) {
    return tp::gather_src(tp::make_split(cols, world), rows, row, col);
}
void tp_host_grouped_tile(int t, int tiles_m, int tiles_n, int group, int* tm, int* tn) {
    tp::grouped_tile(t, tiles_m, tiles_n, group, tm, tn);
}
int64_t tp_host_row_copy_src(int64_t rows, int64_t row_units, int64_t src_pitch, int64_t src_off, int64_t dst_pitch,
                             int64_t dst_off, int64_t u) {
    return tp::row_copy_src(tp::RowCopy{rows, row_units, src_pitch, src_off, dst_pitch, dst_off}, u);
}
int64_t tp_host_row_copy_dst(int64_t rows, int64_t row_units, int64_t src_pitch, int64_t src_off, int64_t dst_pitch,
                             int64_t dst_off, int64_t u) {
    return tp::row_copy_dst(tp::RowCopy{rows, row_units, src_pitch, src_off, dst_pitch, dst_off}, u);
}
}
