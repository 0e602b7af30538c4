//! The packed GEMM driver: `y = x W^T + bias` (`[N, K]` weight) or `y = x W + bias` (`[K, N]`),
//! `f32` accumulation into `y`, for every vector micro-kernel ([`super::ukernel`]).
//!
//! Blocking (Goto / BLIS, with the roles of the operands chosen for row-major `y`):
//!
//! 1. x is packed once, whole, into `MR`-row panels per depth block of `KC` (in parallel).
//! 2. The work is cut into tasks of (`NC` columns of `y`, a multiple of `NR`) x (a block of rows), claimed by the
//!    pool's threads. A task walks the depth blocks: it packs its `NC x KC` block of W (L2-sized,
//!    the weight is read once per row block), then for each `MR`-row panel of x (which stays in
//!    L1) runs the micro-kernel across the `NC / NR` panels of W (streamed from L2).
//! 3. The first depth block stores its tile plus the bias; later ones add into `y`.
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
        let depth = k_depth.div_ceil(k_depth.div_ceil(KC)).next_multiple_of(16);
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
    let out_ptr = Out(out.as_mut_ptr().cast());
    let task = |t: usize| {
        let (kb, g) = (t / groups, t % groups);
        let (k0, len, depth) = blocks.block(micro, k, kb);
        let (p0, p1) = (g * per_task, ((g + 1) * per_task).min(npanels));
        let start = packed_block_at(micro, blocks, n, kb) + p0 * nr * depth;
        let size = (p1 - p0) * nr * depth;
        // SAFETY: tasks write disjoint ranges `start..start + size` of `out` (one per (block,
        // panel group)), inside it (the last block ends at `packed_len`), which outlives the run.
        let dst = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().cast::<u32>().add(start), size) };
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

    /// One tile: `a` and `b` are the packed panels (`depth` units each), `t` its block of `y`.
    ///
    /// # Safety
    /// The CPU supports the kernel (dispatch chose it); `a`, `b` hold `depth` steps of the panel
    /// shape, 64-byte aligned; `t` is a writable block of `y` with its bias.
    unsafe fn run(&mut self, depth: usize, a: &[u32], b: &[u32], t: Tile) {
        if let (Micro::Amx { fp16, .. }, Some((engine, c))) = (self.micro, &mut self.amx) {
            engine.tile(fp16, depth, a, b, c);
            // SAFETY: forwarded contract.
            unsafe { add_tile(&c[..], amx::NR, t) };
            return;
        }
        // SAFETY: forwarded contract.
        unsafe {
            match self.micro {
                #[cfg(target_arch = "x86_64")]
                Micro::F32(Isa::Avx2) => ukernel::f32_avx2(depth, a, b, t),
                #[cfg(target_arch = "x86_64")]
                Micro::F32(Isa::Avx512) => ukernel::f32_avx512(depth, a, b, t),
                #[cfg(target_arch = "x86_64")]
                Micro::Bf16Dot => ukernel::bf16_avx512(depth, a, b, t),
                _ => ukernel::f32_portable(depth, a, b, t),
            }
        }
    }
}

/// Adds (or, on the first block, stores with the bias) a computed tile `c` (row stride `ldc`)
/// into `t`'s block of `y`.
///
/// # Safety
/// `t` describes a writable `mr x nr` block with `nr` readable bias entries if any, and `c` holds
/// `mr` rows of `ldc >= nr`.
unsafe fn add_tile(c: &[f32], ldc: usize, t: Tile) {
    for i in 0..t.mr {
        let src = &c[i * ldc..i * ldc + t.nr];
        // SAFETY: row `i < mr` of the block has `nr` writable elements (caller's contract), and
        // the bias `nr` readable ones.
        let dst = unsafe { std::slice::from_raw_parts_mut(t.c.add(i * t.ldc), t.nr) };
        match (t.first, t.bias) {
            (true, Some(b)) => {
                // SAFETY: as above.
                let b = unsafe { std::slice::from_raw_parts(b, t.nr) };
                dst.iter_mut().zip(src.iter().zip(b)).for_each(|(d, (s, b))| *d = s + b);
            }
            (true, None) => dst.copy_from_slice(src),
            (false, _) => dst.iter_mut().zip(src).for_each(|(d, s)| *d += s),
        }
    }
}

/// Most depth units per block (f32 lanes; pair lanes cover twice as many `k`); `K` is cut into
/// equal blocks of at most this many, a multiple of 16.
const KC: usize = 512;
/// Columns of `y` per task, rounded down to a multiple of the kernel's `NR`.
const NC: usize = 256;
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

/// Asks for `data` to be brought into L2 (a hint; never faults).
fn prefetch_l2(data: &[u32]) {
    #[cfg(target_arch = "x86_64")]
    for line in data.chunks(16) {
        use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
        // SAFETY: SSE is part of x86_64's baseline; a prefetch is a hint that never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

/// `y` as a raw pointer for the tasks, which write disjoint blocks of it.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: only used inside `pool::run`, which returns after every task finished, while the
// `&mut [f32]` it came from is borrowed by `gemm`; tasks write disjoint blocks (one per task).
unsafe impl Send for Out {}
// SAFETY: as above; shared references to `Out` only copy the pointer.
unsafe impl Sync for Out {}

impl Out {
    /// The pointer (a method, so closures capture the whole `Out`, not its raw field).
    fn get(self) -> *mut f32 {
        self.0
    }
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
    assert!(!(accumulate && bias.is_some()), "gemm: a bias with accumulation");
    let (x, x_cols) = match x {
        ASource::Rows(x) => (x, false),
        ASource::Cols(x) => (x, true),
    };
    assert!(x.len() == m * k && y.len() == m * n && k > 0, "gemm: operands");
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
    let a_len = mpanels * mr * blocks.total_depth(micro, k);
    let parallel = 2 * m * n * k >= PARALLEL_MIN_FLOPS && pool::num_threads() > 1;
    let run = |tasks: usize, f: &(dyn Fn(usize) + Sync)| {
        if parallel { pool::run(tasks, f) } else { (0..tasks).for_each(f) }
    };
    // Where the depth block `kb` of panel `p` starts in packed x.
    let a_at =
        |kb: usize, p: usize| mpanels * mr * kb * kc_depth + p * mr * micro.depth(kc_elems.min(k - kb * kc_elems));

    with_scratch(&A_SCRATCH, a_len, |a_buf| {
        // 1. Pack x: tasks of (depth block, 8 panels).
        {
            let a_out = Out(a_buf.as_mut_ptr().cast());
            let groups = mpanels.div_ceil(8);
            run(kblocks * groups, &|t| {
                let (kb, g) = (t / groups, t % groups);
                let (k0, len, depth) = blocks.block(micro, k, kb);
                let (p0, p1) = (8 * g, (8 * g + 8).min(mpanels));
                let rows = (m - p0 * mr).min((p1 - p0) * mr);
                let start = a_at(kb, p0);
                let size = (p1 - p0) * mr * depth;
                // SAFETY: tasks cover disjoint ranges `start..start + size` of `a_buf` (one per
                // (block, panel group)), all inside it (`a_at` of the last panel of the last
                // block plus its size is `a_len`), and `a_buf` outlives `run`.
                let dst = unsafe { std::slice::from_raw_parts_mut(a_out.get().cast::<u32>().add(start), size) };
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
        let y_out = Out(y.as_mut_ptr().cast());
        let bias = bias.map(|b| Out(b.as_ptr().cast_mut()));
        let max_block_panels = q + usize::from(r > 0);
        run(nblocks * row_blocks, &|t| {
            let (nb, rb) = (t % nblocks, t / nblocks);
            let j0 = first_panel(nb) * nr;
            let ncols = (first_panel(nb + 1) * nr).min(n) - j0;
            let npanels = ncols.div_ceil(nr);
            let (p0, p1) = (rb * panels_per_rb, ((rb + 1) * panels_per_rb).min(mpanels));
            let mut runner = Runner::new(micro);
            // The tiles of depth block `kb`: this task's x panels against its `npanels` panels
            // of W in `b_buf`.
            let mut tiles = |kb: usize, depth: usize, b_buf: &[u32]| {
                for p in p0..p1 {
                    let a = &a_buf[a_at(kb, p)..][..mr * depth];
                    if p + 1 < p1 {
                        // The next x panel comes from L3 or memory: start fetching it now.
                        prefetch_l2(&a_buf[a_at(kb, p + 1)..][..mr * depth]);
                    }
                    let i0 = p * mr;
                    for q in 0..npanels {
                        let jj = j0 + q * nr;
                        let tile = Tile {
                            c: y_out.get().wrapping_add(i0 * n + jj),
                            ldc: n,
                            mr: mr.min(m - i0),
                            nr: nr.min(j0 + ncols - jj),
                            first: kb == 0 && !accumulate,
                            bias: bias.map(|b| b.get().cast_const().wrapping_add(jj)),
                        };
                        let b = &b_buf[q * nr * depth..][..nr * depth];
                        // SAFETY: dispatch chose `micro` for this CPU; `a`/`b` hold `depth`
                        // steps of the panel shape, 64-byte aligned (panel sizes are multiples
                        // of 16 lanes, and both buffers start aligned); the tile is this task's
                        // own block of `y` (tasks split rows by `rb` and columns by `nb`),
                        // clipped to `m x n`, and the bias has `n` entries.
                        unsafe { runner.run(depth, a, b, tile) };
                    }
                }
            };
            match b {
                BSource::Packed(packed) => {
                    for kb in 0..kblocks {
                        let depth = blocks.block(micro, k, kb).2;
                        let start = packed_block_at(micro, blocks, n, kb) + j0 * depth;
                        tiles(kb, depth, &packed[start..][..npanels * nr * depth]);
                    }
                }
                BSource::Pack(w, layout) => {
                    with_scratch(&B_SCRATCH, max_block_panels * nr * micro.depth(kc_elems), |b_buf| {
                        for kb in 0..kblocks {
                            let (k0, len, depth) = blocks.block(micro, k, kb);
                            let b_buf = &mut b_buf[..npanels * nr * depth];
                            match layout {
                                Layout::Nk => {
                                    let src = Src { data: w, ld: k };
                                    pack::rows(micro.pack_isa(), lanes, src, j0, ncols, k0, len, nr, depth, b_buf)
                                }
                                Layout::Kn => {
                                    pack::cols(lanes, Src { data: w, ld: n }, k0, len, j0, ncols, nr, depth, b_buf)
                                }
                            }
                            tiles(kb, depth, b_buf);
                        }
                    });
                }
            }
        });
    });
}
