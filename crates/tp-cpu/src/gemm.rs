//! The packed GEMM driver: `y = x W^T + bias` (`[N, K]` weight) or `y = x W + bias` (`[K, N]`),
//! `f32` accumulation into `y`, for every vector micro-kernel ([`super::ukernel`]).
//!
//! Blocking (Goto / BLIS, with the roles of the operands chosen for row-major `y`):
//!
//! 1. x is packed once, whole, into `MR`-row panels per depth block of `KC` (in parallel). AMX
//!    tiles read x's rows in place instead when `k` is a multiple of 32 (only a last panel of
//!    fewer than 32 rows is packed).
//! 2. The work is cut into tasks of (`NC` columns of `y`, a multiple of `NR`) x (a block of
//!    rows), claimed by the pool's threads. A task packs its `NC` columns of W for a group of
//!    depth blocks (as many as fit half of L2; all of them unless `k` is deep; the weight is
//!    read once per row block), then walks its x panels: for each panel, depth block after
//!    depth block of the group, the micro-kernel runs across the `NC / NR` panels of W
//!    (streamed from L2) while the x panel stays in L1, and the panel's `MR x NC` block of `y`
//!    stays in cache from one depth block to the next.
//! 3. The first depth block stores its tile plus the bias; later ones add into `y` (AMX loads
//!    the block into its accumulator tiles and stores it back). A rounded product (bf16/f16
//!    out) or a transposed one (`y^T`, for weight gradients on AMX) sums each panel's block in a
//!    per-task scratch instead, and writes it out once, rounded or column by column, after its
//!    last depth block.
//!
//! Packed buffers live in per-thread scratch that is kept between calls, so a steady stream of
//! products (decode, layers) allocates nothing.
//!
//! A caller that multiplies by the same `[N, K]` weight many times can pack it once
//! ([`pack_weight`]: every panel step 2 would build, for every depth block) and hand the result
//! in as [`BSource::Packed`]; the tasks then read those panels instead of packing W, and every
//! tile sees the same panels in the same order, so the result is bitwise the same.

use crate::amx;
use crate::dispatch::{CpuKernel, Isa};
use crate::element::{Float, FloatKind};
use crate::pack::{self, Lanes, Src};
use crate::pool;
use crate::shape::Layout;
use crate::tiles::Tiles;
use crate::ukernel::{self, Tile};
use std::cell::RefCell;
use std::mem::MaybeUninit;

/// A micro-kernel with its tile shape, lane kind and packing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Micro {
    F32(Isa),
    /// `vdpbf16ps` over `bf16` pairs (AVX-512 shape).
    Bf16Dot,
    /// AMX tiles (`tdpbf16ps`, or `tdpfp16ps` when `fp16`), real or modelled; `pack` is the ISA
    /// the packing runs with.
    Amx {
        tiles: Tiles,
        fp16: bool,
        pack: Isa,
    },
}

impl Micro {
    /// The micro-kernel `kernel` runs products of `kind` with.
    pub(crate) fn choose(kernel: CpuKernel, kind: FloatKind) -> Micro {
        match kernel.tiles_for(kind) {
            Some(tiles) => Micro::Amx { tiles, fp16: kind == FloatKind::F16, pack: kernel.f32_isa() },
            None if kind == FloatKind::BF16 && kernel.has_bf16_dot() => Micro::Bf16Dot,
            None => Micro::F32(kernel.f32_isa()),
        }
    }

    fn shape(self) -> (usize, usize) {
        match self {
            Micro::F32(Isa::Portable) => ukernel::PORTABLE,
            Micro::F32(Isa::Avx2) => ukernel::AVX2,
            Micro::F32(Isa::Avx512) | Micro::Bf16Dot => ukernel::AVX512,
            Micro::Amx { .. } => (amx::MR, amx::NR),
        }
    }

    fn lanes(self) -> Lanes {
        match self {
            Micro::F32(_) => Lanes::F32,
            Micro::Bf16Dot | Micro::Amx { .. } => Lanes::Pairs,
        }
    }

    fn pack_isa(self) -> Isa {
        match self {
            Micro::F32(isa) => isa,
            Micro::Bf16Dot => Isa::Avx512,
            Micro::Amx { pack, .. } => pack,
        }
    }

    /// Depth units a block of `len` elements of K occupies once packed (AMX pads to whole tile
    /// steps of 32 elements).
    fn depth(self, len: usize) -> usize {
        let d = self.lanes().depth(len);
        match self {
            Micro::Amx { .. } => d.next_multiple_of(amx::STEP),
            _ => d,
        }
    }
}

/// How the driver cuts `K` for a micro-kernel: `count` equal blocks of `elems` elements (the last
/// may be shorter), each `depth` units once packed (a multiple of 16, so whole AMX tile steps).
#[derive(Debug, Clone, Copy)]
struct KBlocks {
    elems: usize,
    depth: usize,
    count: usize,
}

impl KBlocks {
    /// The blocks of `k > 0` for `micro`.
    fn new(micro: Micro, k: usize) -> KBlocks {
        let lanes = micro.lanes();
        let k_depth = lanes.depth(k);
        let kc = match micro {
            Micro::Amx { .. } => AMX_KC,
            _ => KC,
        };
        let depth = k_depth.div_ceil(k_depth.div_ceil(kc)).next_multiple_of(16);
        let elems = match lanes {
            Lanes::F32 => depth,
            Lanes::Pairs => 2 * depth,
        };
        KBlocks { elems, depth, count: k.div_ceil(elems) }
    }

    /// Block `kb`: its first element, its length, and its packed depth.
    fn block(self, micro: Micro, k: usize, kb: usize) -> (usize, usize, usize) {
        let k0 = kb * self.elems;
        let len = self.elems.min(k - k0);
        (k0, len, micro.depth(len))
    }

    /// Packed depth of all blocks together.
    fn total_depth(self, micro: Micro, k: usize) -> usize {
        micro.depth(self.elems) * (self.count - 1) + self.block(micro, k, self.count - 1).2
    }
}

/// Where the driver gets W's panels.
#[derive(Clone, Copy)]
pub(crate) enum ASource<'a, T> {
    /// `x: [m, k]` row-major.
    Rows(&'a [T]),
    /// `x` given as its transpose, `[k, m]` row-major (the `dY^T` of a weight gradient); not for
    /// AMX, whose tiles take x from rows.
    Cols(&'a [T]),
}

/// Where the GEMM's `W` comes from.
pub(crate) enum BSource<'a, T> {
    /// Packs them from the weight (in `layout`) in each task, for each depth block.
    Pack(&'a [T], Layout),
    /// Reads them from an `[N, K]` weight packed once by [`pack_weight`] (same `micro`, `n`, `k`).
    Packed(&'a [u32]),
}

/// Lanes [`pack_weight`] writes for an `[n, k]` weight (`k > 0`), or `None` on overflow.
pub(crate) fn packed_len(micro: Micro, n: usize, k: usize) -> Option<usize> {
    let nr = micro.shape().1;
    n.div_ceil(nr).checked_mul(nr)?.checked_mul(KBlocks::new(micro, k).total_depth(micro, k))
}

/// Where depth block `kb` of an `n`-column packed weight starts in [`pack_weight`]'s output:
/// blocks follow each other, each holding all `ceil(n / NR)` panels of `NR x depth` lanes.
fn packed_block_at(micro: Micro, blocks: KBlocks, n: usize, kb: usize) -> usize {
    let nr = micro.shape().1;
    kb * n.div_ceil(nr) * nr * micro.depth(blocks.elems)
}

/// Packs a whole `[n, k]` weight (`k > 0`) for `micro`, exactly as the driver's tasks pack it:
/// for each depth block, every `NR`-column panel. `out` holds [`packed_len`] lanes, 64-byte
/// aligned.
pub(crate) fn pack_weight<T: Float>(micro: Micro, w: &[T], n: usize, k: usize, out: &mut [u32]) {
    assert!(w.len() == n * k && k > 0 && Some(out.len()) == packed_len(micro, n, k), "pack_weight: operands");
    let nr = micro.shape().1;
    let blocks = KBlocks::new(micro, k);
    let npanels = n.div_ceil(nr);
    let per_task = (NC / nr).max(1);
    let groups = npanels.div_ceil(per_task);
    let out_ptr = Out(out.as_mut_ptr());
    let task = |t: usize| {
        let (kb, g) = (t / groups, t % groups);
        let (k0, len, depth) = blocks.block(micro, k, kb);
        let (p0, p1) = (g * per_task, ((g + 1) * per_task).min(npanels));
        let start = packed_block_at(micro, blocks, n, kb) + p0 * nr * depth;
        let size = (p1 - p0) * nr * depth;
        // SAFETY: tasks write disjoint ranges `start..start + size` of `out` (one per (block,
        // panel group)), inside it (the last block ends at `packed_len`), which outlives the run.
        let dst = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(start), size) };
        let rows = (n - p0 * nr).min((p1 - p0) * nr);
        pack::rows(micro.pack_isa(), micro.lanes(), Src { data: w, ld: k }, p0 * nr, rows, k0, len, nr, depth, dst);
    };
    let tasks = blocks.count * groups;
    if n * k >= PARALLEL_MIN_FLOPS / 2 && pool::num_threads() > 1 {
        pool::run(tasks, &task);
    } else {
        (0..tasks).for_each(task);
    }
}

/// What one task needs to run its micro-kernels: for AMX, the configured tile engine of this
/// thread and a tile of `C`.
struct Runner {
    micro: Micro,
    amx: Option<(amx::Engine, Box<[f32; amx::MR * amx::NR]>)>,
}

impl Runner {
    fn new(micro: Micro) -> Runner {
        let amx = match micro {
            Micro::Amx { tiles, .. } => Some((amx::Engine::new(tiles), Box::new([0f32; amx::MR * amx::NR]))),
            _ => None,
        };
        Runner { micro, amx }
    }

    /// One tile: `a` and `b` are the panels (`depth` units each), `t` its block of `y`. With
    /// `rows`, `a` is x's own rows that many lanes apart instead of a packed panel (AMX and the
    /// AVX-512 `f32` kernel only).
    ///
    /// # Safety
    /// The CPU supports the kernel (dispatch chose it); `a`, `b` hold `depth` steps of the panel
    /// shape, 64-byte aligned; `t` is a writable block of `y` with its bias.
    unsafe fn run(&mut self, depth: usize, a: &[u32], rows: Option<usize>, b: &[u32], t: Tile) {
        if let (Micro::Amx { fp16, .. }, Some((engine, c))) = (self.micro, &mut self.amx) {
            // SAFETY: forwarded contract.
            unsafe { amx_tile(engine, c, fp16, depth, (a, rows.unwrap_or(depth)), b, t) };
            return;
        }
        // SAFETY: forwarded contract.
        unsafe {
            match (self.micro, rows) {
                #[cfg(target_arch = "x86_64")]
                (Micro::F32(Isa::Avx512), Some(ld)) => ukernel::f32_avx512_rows(depth, a, ld, b, t),
                (_, Some(_)) => unreachable!("x is read in place only by AMX and the AVX-512 f32 kernel"),
                #[cfg(target_arch = "x86_64")]
                (Micro::F32(Isa::Avx2), None) => ukernel::f32_avx2(depth, a, b, t),
                #[cfg(target_arch = "x86_64")]
                (Micro::F32(Isa::Avx512), None) => ukernel::f32_avx512(depth, a, b, t),
                #[cfg(target_arch = "x86_64")]
                (Micro::Bf16Dot, None) => ukernel::bf16_avx512(depth, a, b, t),
                _ => ukernel::f32_portable(depth, a, b, t),
            }
        }
    }
}

/// One AMX tile into `t`'s block of `y`. A whole `32 x 32` block without a bias is read (after
/// the first depth block) and written by the tile instructions in place; a clipped block, or the
/// first block with a bias, goes through the scratch tile `c`, which starts as the block (zero
/// padded) or the bias rows.
///
/// # Safety
/// As [`Runner::run`].
unsafe fn amx_tile(
    engine: &mut amx::Engine,
    c: &mut [f32; amx::MR * amx::NR],
    fp16: bool,
    depth: usize,
    (a, a_ld): (&[u32], usize),
    b: &[u32],
    t: Tile,
) {
    let (mr, nr) = (amx::MR, amx::NR);
    if t.mr == mr && t.nr == nr && !(t.first && t.bias.is_some()) {
        // The tile stores land on 64 lines of `y` that are usually not cached: ask for them
        // (for writing) now, so that the fetch overlaps the tile's products.
        #[cfg(target_arch = "x86_64")]
        for i in 0..mr {
            use std::arch::x86_64::{_MM_HINT_ET0, _mm_prefetch};
            let row = t.c.wrapping_add(i * t.ldc);
            // SAFETY: a prefetch is a hint that never faults; SSE is in x86_64's baseline.
            unsafe {
                _mm_prefetch::<_MM_HINT_ET0>(row.cast_const().cast());
                _mm_prefetch::<_MM_HINT_ET0>(row.wrapping_add(16).cast_const().cast());
            }
        }
        let src = (!t.first).then_some((t.c.cast_const(), t.ldc));
        // SAFETY: the block is 32 x 32 inside `y` at stride `ldc`, writable and (after the
        // first depth block) initialised (caller's contract).
        unsafe { engine.tile(fp16, depth, a, a_ld, b, src, (t.c, t.ldc)) };
        return;
    }
    for i in 0..mr {
        let row = &mut c[i * nr..(i + 1) * nr];
        match (t.first, t.bias) {
            (true, Some(bias)) => {
                // SAFETY: the bias has `t.nr` readable entries (caller's contract).
                let bias = unsafe { std::slice::from_raw_parts(bias, t.nr) };
                row[..t.nr].copy_from_slice(bias);
                row[t.nr..].fill(0.0);
            }
            (false, _) if i < t.mr => {
                // SAFETY: row `i < mr` of the block has `nr` readable, initialised elements.
                let y = unsafe { std::slice::from_raw_parts(t.c.add(i * t.ldc), t.nr) };
                row[..t.nr].copy_from_slice(y);
                row[t.nr..].fill(0.0);
            }
            _ => row.fill(0.0),
        }
    }
    let p = c.as_mut_ptr();
    // SAFETY: `c` is 32 rows of 32 f32, read and written at stride 32.
    unsafe { engine.tile(fp16, depth, a, a_ld, b, Some((p.cast_const(), nr)), (p, nr)) };
    for i in 0..t.mr {
        // SAFETY: row `i < mr` of the block has `nr` writable elements (caller's contract).
        let y = unsafe { std::slice::from_raw_parts_mut(t.c.add(i * t.ldc), t.nr) };
        y.copy_from_slice(&c[i * nr..i * nr + t.nr]);
    }
}

/// Most depth units per block (f32 lanes; pair lanes cover twice as many `k`); `K` is cut into
/// equal blocks of at most this many, a multiple of 16.
const KC: usize = 512;
/// Most pair lanes per depth block for AMX tiles (512 elements of `k`): a 32-row panel of x
/// (32 KiB) stays in L1 across the task's W panels, which stream from L2; the accumulators stay
/// in tiles for the whole block. Measured on Sapphire Rapids (2026-12-08): 128 and 512 lanes
/// were slower at the training shapes (fewer tile steps per load of `y`, or an x panel past L1).
const AMX_KC: usize = 256;
/// Columns of `y` per task, rounded down to a multiple of the kernel's `NR`.
const NC: usize = 256;
/// Bytes of packed W a task keeps for the depth blocks it walks together (each x panel runs
/// over all of them before the next panel): within L2 on both Zen 4 (1 MiB) and Sapphire Rapids
/// (2 MiB), so W is read from memory once per row block however deep `k` is.
const W_GROUP_BYTES: usize = 512 << 10;
/// Fewest rows of `y` per task when rows are split to make more tasks.
const MIN_ROWS_PER_TASK: usize = 96;
/// Products below this many flops run on the calling thread alone.
const PARALLEL_MIN_FLOPS: usize = 1 << 21;

thread_local! {
    /// Per-thread packing buffers: x panels (the calling thread), W blocks (every thread).
    static A_SCRATCH: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    static B_SCRATCH: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

type Slot = std::thread::LocalKey<RefCell<Vec<u32>>>;

/// A 64-byte-aligned run of `len` lanes inside `buf`, growing `buf` as needed.
fn aligned(buf: &mut Vec<u32>, len: usize) -> &mut [u32] {
    if buf.len() < len + 16 {
        *buf = vec![0; len + 16];
    }
    let off = buf.as_ptr().align_offset(64).min(16);
    &mut buf[off..off + len]
}

/// Borrows this thread's buffer `slot` (taking it out, so a nested call gets a fresh one) for `f`.
pub(crate) fn with_scratch<R>(slot: &'static Slot, len: usize, f: impl FnOnce(&mut [u32]) -> R) -> R {
    let mut buf = slot.with(|s| std::mem::take(&mut *s.borrow_mut()));
    let r = f(aligned(&mut buf, len));
    // Keep buffers up to 64 MiB for the next call; drop bigger ones.
    if buf.len() <= 16 << 20 {
        slot.with(|s| *s.borrow_mut() = buf);
    }
    r
}

/// `y` as a raw pointer for the tasks, which write disjoint blocks of it.
#[derive(Clone, Copy)]
struct Out<E = f32>(*mut E);
// SAFETY: only used inside `pool::run`, which returns after every task finished, while the
// `&mut [E]` it came from is borrowed by `gemm`; tasks write disjoint blocks (one per task).
unsafe impl<E> Send for Out<E> {}
// SAFETY: as above; shared references to `Out` only copy the pointer.
unsafe impl<E> Sync for Out<E> {}

impl<E> Out<E> {
    /// The pointer (a method, so closures capture the whole `Out`, not its raw field).
    fn get(self) -> *mut E {
        self.0
    }
}

/// Where the product goes.
pub(crate) enum Dest<'a, T> {
    /// `f32` sums into `y`; with `accumulate`, added to what `y` holds.
    F32 { y: &'a mut [MaybeUninit<f32>], accumulate: bool },
    /// Rounded once (to nearest even) to `T`: each task sums a panel's block of `y` in an `f32`
    /// scratch that stays in cache, and rounds it into `y` once its last depth block is done,
    /// so no `f32` copy of the whole product exists.
    Rounded(&'a mut [MaybeUninit<T>]),
    /// `f32` sums transposed into `y: [n, m]` (with `accumulate`, added to what it holds):
    /// each task's block of sums, once final, is written (or added) column by column, each
    /// column of a panel a contiguous run of `y`. For a weight gradient computed as `dW^T`.
    F32T { y: &'a mut [MaybeUninit<f32>], accumulate: bool },
}

/// Where a task's finished sums go when they are not summed straight into `y`.
#[derive(Clone, Copy)]
enum Sink<T> {
    /// Straight into `y` (no scratch).
    Direct,
    /// Rounded to `T` into this output.
    Rounded(Out<T>),
    /// Transposed into this `[n, m]` output, added with `accumulate`.
    Transposed(Out<f32>, bool),
}

thread_local! {
    /// Per-thread `f32` sums of one x panel's block of a rounded product.
    static C_SCRATCH: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// `y[m x n] = x[m x k] · op(W) + bias`, `op(W) = W^T` for an `[N, K]` weight, W's panels from
/// `b`. `y` need not be initialised: every element is written. `k > 0`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm<T: Float>(
    micro: Micro,
    x: ASource<'_, T>,
    b: BSource<'_, T>,
    bias: Option<&[f32]>,
    m: usize,
    k: usize,
    n: usize,
    y: &mut [MaybeUninit<f32>],
) {
    gemm_into(micro, x, b, bias, m, k, n, y, false)
}

/// [`gemm`], or with `accumulate` `y += x · op(W)` into an initialised `y` (the first depth
/// block adds into `y` as the later ones do; `bias` must then be `None`): a weight gradient
/// accumulated in place, with no `[m, n]` temporary.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_into<T: Float>(
    micro: Micro,
    x: ASource<'_, T>,
    b: BSource<'_, T>,
    bias: Option<&[f32]>,
    m: usize,
    k: usize,
    n: usize,
    y: &mut [MaybeUninit<f32>],
    accumulate: bool,
) {
    gemm_dest(micro, x, b, bias, m, k, n, Dest::F32 { y, accumulate })
}

/// The driver: [`gemm`] into any [`Dest`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_dest<T: Float>(
    micro: Micro,
    x: ASource<'_, T>,
    b: BSource<'_, T>,
    bias: Option<&[f32]>,
    m: usize,
    k: usize,
    n: usize,
    dest: Dest<'_, T>,
) {
    // Sums go to `y_out` (f32 output), or to a scratch per task finished into `sink`.
    let (y_out, sink, accumulate, y_len) = match dest {
        Dest::F32 { y, accumulate } => (Out(y.as_mut_ptr().cast::<f32>()), Sink::Direct, accumulate, y.len()),
        Dest::Rounded(y) => (Out(std::ptr::null_mut()), Sink::Rounded(Out(y.as_mut_ptr())), false, y.len()),
        Dest::F32T { y, accumulate } => {
            (Out(std::ptr::null_mut()), Sink::Transposed(Out(y.as_mut_ptr().cast::<f32>()), accumulate), false, y.len())
        }
    };
    let scratch = !matches!(sink, Sink::Direct);
    assert!(!(accumulate && bias.is_some()), "gemm: a bias with accumulation");
    let (x, x_cols) = match x {
        ASource::Rows(x) => (x, false),
        ASource::Cols(x) => (x, true),
    };
    assert!(x.len() == m * k && y_len == m * n && k > 0, "gemm: operands");
    assert!(!(x_cols && matches!(micro, Micro::Amx { .. })), "gemm: AMX packs x from rows only");
    match b {
        BSource::Pack(w, _) => assert!(w.len() == n * k, "gemm: w"),
        BSource::Packed(p) => {
            assert!(Some(p.len()) == packed_len(micro, n, k) && p.as_ptr().align_offset(64) == 0, "gemm: packed w")
        }
    }
    assert!(bias.is_none_or(|b| b.len() == n), "gemm: bias");
    if m == 0 || n == 0 {
        return;
    }
    let (mr, nr) = micro.shape();
    let lanes = micro.lanes();
    let blocks = KBlocks::new(micro, k);
    let (kc_depth, kc_elems, kblocks) = (blocks.depth, blocks.elems, blocks.count);
    let mpanels = m.div_ceil(mr);
    let parallel = 2 * m * n * k >= PARALLEL_MIN_FLOPS && pool::num_threads() > 1;
    let run = |tasks: usize, f: &(dyn Fn(usize) + Sync)| {
        if parallel { pool::run(tasks, f) } else { (0..tasks).for_each(f) }
    };
    // AMX tiles load x's rows in place when they are whole pairs of whole tile steps (k a
    // multiple of 32, 4-byte aligned), and the AVX-512 f32 kernel broadcasts from them: only a
    // last panel of fewer than `MR` rows is packed. An element is `1 / per_lane` lanes.
    let direct: Option<&[u32]> = match micro {
        Micro::Amx { .. } if !x_cols && k.is_multiple_of(32) => bytemuck::try_cast_slice::<T, u32>(x).ok(),
        // (f16/bf16 elements on this kernel are widened while packing: f32 only.)
        Micro::F32(Isa::Avx512) if !x_cols && T::KIND == FloatKind::F32 => bytemuck::try_cast_slice::<T, u32>(x).ok(),
        _ => None,
    };
    let per_lane = if lanes == Lanes::F32 { 1 } else { 2 };
    // Panels `packed_from..mpanels` are packed (all of them unless x is read in place).
    let packed_from = if direct.is_some() { m / mr } else { 0 };
    let packed_panels = mpanels - packed_from;
    let a_len = packed_panels * mr * blocks.total_depth(micro, k);
    // Where the depth block `kb` of packed panel `p` starts in packed x.
    let a_at = |kb: usize, p: usize| {
        packed_panels * mr * kb * kc_depth + (p - packed_from) * mr * micro.depth(kc_elems.min(k - kb * kc_elems))
    };

    with_scratch(&A_SCRATCH, a_len, |a_buf| {
        // 1. Pack x: tasks of (depth block, 8 panels).
        {
            let a_out = Out(a_buf.as_mut_ptr());
            let groups = packed_panels.div_ceil(8);
            run(kblocks * groups, &|t| {
                let (kb, g) = (t / groups, t % groups);
                let (k0, len, depth) = blocks.block(micro, k, kb);
                let (p0, p1) = (packed_from + 8 * g, (packed_from + 8 * g + 8).min(mpanels));
                let rows = (m - p0 * mr).min((p1 - p0) * mr);
                let start = a_at(kb, p0);
                let size = (p1 - p0) * mr * depth;
                // SAFETY: tasks cover disjoint ranges `start..start + size` of `a_buf` (one per
                // (block, panel group)), all inside it (`a_at` of the last panel of the last
                // block plus its size is `a_len`), and `a_buf` outlives `run`.
                let dst = unsafe { std::slice::from_raw_parts_mut(a_out.get().add(start), size) };
                match micro {
                    // x given as its transpose `[k, m]`: its columns are x's rows.
                    _ if x_cols => pack::cols(lanes, Src { data: x, ld: m }, k0, len, p0 * mr, rows, mr, depth, dst),
                    Micro::Amx { .. } => {
                        pack::rows_plain(Src { data: x, ld: k }, p0 * mr, rows, k0, len, mr, depth, dst)
                    }
                    _ => pack::rows(
                        micro.pack_isa(),
                        lanes,
                        Src { data: x, ld: k },
                        p0 * mr,
                        rows,
                        k0,
                        len,
                        mr,
                        depth,
                        dst,
                    ),
                }
            });
        }
        let a_buf: &[u32] = a_buf;

        // 2. Tasks: column blocks of at most NC columns, as many as a multiple of the threads
        // (so equal cores finish together), panels spread evenly over them; rows are split too
        // only when there are fewer panels of columns than threads.
        let threads = if parallel { pool::num_threads() } else { 1 };
        let npanels_n = n.div_ceil(nr);
        let nblocks = npanels_n.div_ceil((NC / nr).max(1)).next_multiple_of(threads).min(npanels_n);
        let (q, r) = (npanels_n / nblocks, npanels_n % nblocks);
        let first_panel = |b: usize| b * q + b.min(r);
        let row_blocks =
            if nblocks >= threads { 1 } else { threads.div_ceil(nblocks).min(m / MIN_ROWS_PER_TASK).max(1) };
        let panels_per_rb = mpanels.div_ceil(row_blocks);
        let row_blocks = mpanels.div_ceil(panels_per_rb);
        let bias = bias.map(|b| Out(b.as_ptr().cast_mut()));
        let max_block_panels = q + usize::from(r > 0);
        // Depth blocks walked together: a task's panels of W for them stay within L2.
        let group = (W_GROUP_BYTES / (max_block_panels * nr * kc_depth * 4).max(1)).clamp(1, kblocks);
        run(nblocks * row_blocks, &|t| {
            let (nb, rb) = (t % nblocks, t / nblocks);
            let j0 = first_panel(nb) * nr;
            let ncols = (first_panel(nb + 1) * nr).min(n) - j0;
            let npanels = ncols.div_ceil(nr);
            let (p0, p1) = (rb * panels_per_rb, ((rb + 1) * panels_per_rb).min(mpanels));
            // Rounded sums are kept for one x panel when every depth block is walked at once,
            // else for all of the task's panels (each revisited group after group).
            let c_rows = if group >= kblocks { mr } else { (p1 - p0) * mr };
            let c_len = if scratch { c_rows * ncols } else { 0 };
            with_scratch(&C_SCRATCH, c_len, |c_buf| {
                let c_out = Out(c_buf.as_mut_ptr().cast::<f32>());
                // Where row `i` (of y), column `j` of the sums is, and the row stride there.
                let (c_at, ldc): (&dyn Fn(usize, usize) -> *mut f32, usize) = match scratch {
                    false => (&|i, j| y_out.get().wrapping_add(i * n + j), n),
                    true => (&|i, j| c_out.get().wrapping_add(((i - p0 * mr) % c_rows) * ncols + j - j0), ncols),
                };
                let mut runner = Runner::new(micro);
                // Every tile of the task, x panel by x panel: for each depth block in turn, the
                // panel against the task's `npanels` panels of W in that block (`b_at(kb)`). The
                // panel's block of `y` is revisited block after block while it is still in cache.
                let block_len = |kb: usize| npanels * nr * blocks.block(micro, k, kb).2;
                let mut walk = |b_all: &[u32], b_at: &dyn Fn(usize) -> usize, kbs: std::ops::Range<usize>| {
                    let last = kbs.end == kblocks;
                    for p in p0..p1 {
                        let i0 = p * mr;
                        for kb in kbs.clone() {
                            let (k0, _, depth) = blocks.block(micro, k, kb);
                            let (a, a_ld) = match direct {
                                // Rows i0.. of x from element k0, k elements apart.
                                Some(x) if p < packed_from => {
                                    let (ld, at) = (k / per_lane, (i0 * k + k0) / per_lane);
                                    (&x[at..][..(mr - 1) * ld + depth], Some(ld))
                                }
                                _ => (&a_buf[a_at(kb, p)..][..mr * depth], None),
                            };
                            let b_kb = &b_all[b_at(kb)..][..block_len(kb)];
                            for q in 0..npanels {
                                let jj = j0 + q * nr;
                                let tile = Tile {
                                    c: c_at(i0, jj),
                                    ldc,
                                    mr: mr.min(m - i0),
                                    nr: nr.min(j0 + ncols - jj),
                                    first: kb == 0 && !accumulate,
                                    bias: bias.map(|b| b.get().cast_const().wrapping_add(jj)),
                                };
                                let b = &b_kb[q * nr * depth..][..nr * depth];
                                // SAFETY: dispatch chose `micro` for this CPU; `a`/`b` hold `depth`
                                // steps of the panel shape, 64-byte aligned (panel sizes are
                                // multiples of 16 lanes, and both buffers start aligned); the tile
                                // is this task's own block of `y` (tasks split rows by `rb` and
                                // columns by `nb`), clipped to `m x n`, and the bias has `n` entries.
                                unsafe { runner.run(depth, a, a_ld, b, tile) };
                            }
                        }
                        if let (Sink::Transposed(yt, add), true) = (sink, last) {
                            // The panel's sums are final: column `j` of them is row `j` of `y`
                            // from element `i0`.
                            let rows = mr.min(m - i0);
                            for j in 0..ncols {
                                let dst = yt.get().wrapping_add((j0 + j) * m + i0);
                                let col = c_at(i0, j0 + j).cast_const();
                                for i in 0..rows {
                                    // SAFETY: element `i0 + i` of row `j0 + j < n` of the
                                    // `[n, m]` output belongs to this task alone (its rows and
                                    // columns of the product), initialised when adding; the
                                    // scratch holds row `i < rows`, column `j < ncols` of the
                                    // panel's sums.
                                    unsafe {
                                        let v = *col.add(i * ncols);
                                        if add { *dst.add(i) += v } else { dst.add(i).write(v) }
                                    }
                                }
                            }
                        }
                        if let (Sink::Rounded(r), true) = (sink, last) {
                            // The panel's sums are final: round them into `y`.
                            for i in 0..mr.min(m - i0) {
                                // SAFETY: row `i0 + i < m`, columns `j0..j0 + ncols` of `y` are this
                                // task's own (disjoint from every other task's); the scratch row
                                // holds `ncols` sums, all written by the tiles above.
                                let (src, dst) = unsafe {
                                    (
                                        std::slice::from_raw_parts(c_at(i0 + i, j0).cast_const(), ncols),
                                        std::slice::from_raw_parts_mut(r.get().add((i0 + i) * n + j0), ncols),
                                    )
                                };
                                T::narrow_slice(src, dst);
                            }
                        }
                    }
                };
                let groups = (0..kblocks).step_by(group).map(|g0| g0..(g0 + group).min(kblocks));
                match b {
                    BSource::Packed(packed) => {
                        let at = |kb| packed_block_at(micro, blocks, n, kb) + j0 * blocks.block(micro, k, kb).2;
                        groups.for_each(|kbs| walk(packed, &at, kbs));
                    }
                    BSource::Pack(w, layout) => {
                        // This task's panels of W for a group of depth blocks, block `g0 + i` at
                        // `i * full`.
                        let full = npanels * nr * kc_depth;
                        with_scratch(&B_SCRATCH, max_block_panels * nr * kc_depth * group, |b_buf| {
                            for kbs in groups {
                                let g0 = kbs.start;
                                for kb in kbs.clone() {
                                    let (k0, len, depth) = blocks.block(micro, k, kb);
                                    let dst = &mut b_buf[(kb - g0) * full..][..npanels * nr * depth];
                                    match layout {
                                        Layout::Nk => {
                                            let src = Src { data: w, ld: k };
                                            pack::rows(micro.pack_isa(), lanes, src, j0, ncols, k0, len, nr, depth, dst)
                                        }
                                        Layout::Kn => pack::cols(
                                            lanes,
                                            Src { data: w, ld: n },
                                            k0,
                                            len,
                                            j0,
                                            ncols,
                                            nr,
                                            depth,
                                            dst,
                                        ),
                                    }
                                }
                                walk(b_buf, &|kb| (kb - g0) * full, kbs);
                            }
                        });
                    }
                }
            });
        });
    });
}
