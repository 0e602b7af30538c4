//! The kernels' index arithmetic (`kernels/index_math.cuh`), compiled as host C++ by build.rs
//! and exposed here so CPU tests can check it against `tp-core`'s `TensorShard` policy.
//! These are the same source lines the shard-copy kernels run on the GPU.

unsafe extern "C" {
    fn tp_host_split_start(len: i64, world: i64, rank: i64) -> i64;
    fn tp_host_split_len(len: i64, world: i64, rank: i64) -> i64;
    fn tp_host_split_owner(len: i64, world: i64, i: i64) -> i64;
    fn tp_host_gather_src(rows: i64, cols: i64, world: i64, row: i64, col: i64) -> i64;
    fn tp_host_grouped_tile(t: i32, tiles_m: i32, tiles_n: i32, group: i32, tm: *mut i32, tn: *mut i32);
    fn tp_host_row_copy_src(rows: i64, units: i64, sp: i64, so: i64, dp: i64, dof: i64, u: i64) -> i64;
    fn tp_host_row_copy_dst(rows: i64, units: i64, sp: i64, so: i64, dp: i64, dof: i64, u: i64) -> i64;
}

// The C++ functions take and return plain integers, touch no memory and have no preconditions
// but the arithmetic ones each wrapper asserts (world > 0, an index below the length), which keep
// them free of division by zero.

/// First index of rank `rank`'s shard of a length `len` over `world` ranks.
pub fn split_start(len: i64, world: i64, rank: i64) -> i64 {
    assert!(world > 0);
    // SAFETY: plain integers in and out, no memory touched; world > 0 (asserted).
    unsafe { tp_host_split_start(len, world, rank) }
}

/// Length of rank `rank`'s shard.
pub fn split_len(len: i64, world: i64, rank: i64) -> i64 {
    assert!(world > 0);
    // SAFETY: plain integers in and out, no memory touched; world > 0 (asserted).
    unsafe { tp_host_split_len(len, world, rank) }
}

/// The rank whose shard holds index `i` (`0 <= i < len`).
pub fn split_owner(len: i64, world: i64, i: i64) -> i64 {
    assert!(world > 0 && (0..len).contains(&i));
    // SAFETY: plain integers in and out, no memory touched; world > 0 and i in range (asserted).
    unsafe { tp_host_split_owner(len, world, i) }
}

/// Index into a rank-major all-gather buffer `(rank, rows, cols_r)` of output element `(row, col)`
/// of the interleaved `(rows, cols)` result.
pub fn gather_src(rows: i64, cols: i64, world: i64, row: i64, col: i64) -> i64 {
    assert!(world > 0 && (0..cols).contains(&col));
    // SAFETY: plain integers in and out, no memory touched; world > 0, col in range (asserted).
    unsafe { tp_host_gather_src(rows, cols, world, row, col) }
}

/// Source and destination unit index of unit `u` of a strided row copy
/// (`rows` rows of `units`; pitches and offsets in units).
#[allow(clippy::too_many_arguments)]
pub fn row_copy(
    rows: i64,
    units: i64,
    src_pitch: i64,
    src_off: i64,
    dst_pitch: i64,
    dst_off: i64,
    u: i64,
) -> (i64, i64) {
    assert!(units > 0);
    // SAFETY: plain integers in and out, no memory touched; units > 0 (asserted).
    unsafe {
        (
            tp_host_row_copy_src(rows, units, src_pitch, src_off, dst_pitch, dst_off, u),
            tp_host_row_copy_dst(rows, units, src_pitch, src_off, dst_pitch, dst_off, u),
        )
    }
}

/// `(tile_m, tile_n)` of tile `t` in the persistent GEMM's grouped order (`group` tile-rows at a
/// time); `t < tiles_m * tiles_n`, all positive.
pub fn grouped_tile(t: i32, tiles_m: i32, tiles_n: i32, group: i32) -> (i32, i32) {
    assert!(tiles_m > 0 && tiles_n > 0 && group > 0 && (0..tiles_m * tiles_n).contains(&t));
    let (mut tm, mut tn) = (0, 0);
    // SAFETY: integer arithmetic writing two ints through valid pointers to locals; the assert
    // rules out division by zero.
    unsafe { tp_host_grouped_tile(t, tiles_m, tiles_n, group, &mut tm, &mut tn) };
    (tm, tn)
}
