//! Intel AMX: the `32 x 32` micro-kernel, written once against [`TileOps`] (in
//! [`super::tiles`], with the tile configuration), which has two implementations:
//! [`Hardware`] (the instructions, through `asm!`) and [`super::amx_model::Model`] (a software
//! model of their documented semantics). Machines without AMX run the very same kernel, tile
//! configuration, packing and strides through the model, so its data movement is tested
//! everywhere; machines with AMX test the instructions.
//!
//! Tile use (palette 1, every tile 16 rows x 64 bytes):
//!
//! | tile | holds | rows | 64-byte row |
//! |---|---|---|---|
//! | tmm0..tmm3 | C, rows 0..16 / 16..32 x columns 0..16 / 16..32 | M | 16 `f32` |
//! | tmm4, tmm5 | A, rows 0..16 / 16..32 | M | 32 `bf16`/`f16` along K |
//! | tmm6, tmm7 | B, columns 0..16 / 16..32 | K / 2 | 16 columns x one pair of K ("VNNI") |
//!
//! A is packed row-major (each row's K contiguous, zero-padded to a multiple of 32), B in pair
//! lanes depth-major ([`super::pack`]), so a step of 32 along K is four tile loads and four
//! `tdpbf16ps` (or `tdpfp16ps`), each `16 x 16 x 32`.

use super::amx_model::Model;
use super::tiles::{TileConfig, TileOps, Tiles};

/// The real instructions. Exists only where AMX is usable (dispatch checked CPUID, XCR0 and the
/// OS permission before choosing [`Tiles::Hardware`]); `new` is the one place that relies on it.
#[cfg(target_arch = "x86_64")]
pub(crate) struct Hardware(());

#[cfg(target_arch = "x86_64")]
impl Hardware {
    /// # Safety
    /// The CPU must have AMX-TILE and AMX-BF16 (and AMX-FP16 for `FP16` dots), with the tile
    /// data permission granted to this process.
    pub(crate) unsafe fn new() -> Self {
        Hardware(())
    }
}

// SAFETY: each method is the instruction itself; `Hardware` exists only on CPUs that have them
// (see `Hardware::new`).
#[cfg(target_arch = "x86_64")]
unsafe impl TileOps for Hardware {
    fn configure(&mut self, cfg: &TileConfig) {
        // SAFETY: `cfg` is a valid 64-byte, 64-byte-aligned palette-1 configuration read by the
        // instruction; AMX is present (type invariant).
        unsafe { std::arch::asm!("ldtilecfg [{}]", in(reg) cfg, options(nostack, readonly, preserves_flags)) }
    }
    fn zero<const T: u8>(&mut self) {
        // SAFETY: register-only; AMX present and configured by the caller's protocol.
        unsafe { std::arch::asm!("tilezero tmm{t}", t = const T, options(nostack, nomem, preserves_flags)) }
    }
    unsafe fn load<const T: u8>(&mut self, base: *const u8, stride: usize) {
        // SAFETY: the caller guarantees every configured row at `base + r * stride` is readable.
        unsafe {
            std::arch::asm!(
                "tileloadd tmm{t}, [{b} + {s}*1]",
                t = const T, b = in(reg) base, s = in(reg) stride,
                options(nostack, readonly, preserves_flags)
            )
        }
    }
    unsafe fn store<const T: u8>(&mut self, base: *mut u8, stride: usize) {
        // SAFETY: the caller guarantees every configured row at `base + r * stride` is writable.
        unsafe {
            std::arch::asm!(
                "tilestored [{b} + {s}*1], tmm{t}",
                t = const T, b = in(reg) base, s = in(reg) stride,
                options(nostack, preserves_flags)
            )
        }
    }
    fn dot<const FP16: bool, const C: u8, const A: u8, const B: u8>(&mut self) {
        // SAFETY: register-only; the configured shapes match (TileConfig::KERNEL); AMX-FP16 is
        // present whenever `FP16` is requested (dispatch::tiles_for).
        unsafe {
            if FP16 {
                std::arch::asm!("tdpfp16ps tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B,
                    options(nostack, nomem, preserves_flags))
            } else {
                std::arch::asm!("tdpbf16ps tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B,
                    options(nostack, nomem, preserves_flags))
            }
        }
    }
    fn release(&mut self) {
        // SAFETY: returns the tile state to its initial state; always valid with AMX present.
        unsafe { std::arch::asm!("tilerelease", options(nostack, nomem, preserves_flags)) }
    }
}

/// Tile rows and columns of the micro-kernel.
pub(crate) const MR: usize = 32;
pub(crate) const NR: usize = 32;
/// Pair lanes per tile step (32 elements of K).
pub(crate) const STEP: usize = 16;

/// One thread's tile engine for the duration of a task: configured on creation, released on
/// drop.
pub(crate) enum Engine {
    #[cfg(target_arch = "x86_64")]
    Hardware(Hardware),
    Model(Box<Model>),
}

impl Engine {
    pub(crate) fn new(tiles: Tiles) -> Engine {
        let mut e = match tiles {
            // SAFETY: dispatch hands out `Tiles::Hardware` only when AMX is usable.
            #[cfg(target_arch = "x86_64")]
            Tiles::Hardware => Engine::Hardware(unsafe { Hardware::new() }),
            _ => Engine::Model(Box::default()),
        };
        match &mut e {
            #[cfg(target_arch = "x86_64")]
            Engine::Hardware(h) => h.configure(&TileConfig::KERNEL),
            Engine::Model(m) => m.configure(&TileConfig::KERNEL),
        }
        e
    }

    /// `C = C0 + A · B` for one `32 x 32` tile: `a` is 32 rows of `depth` pair lanes, `a_ld`
    /// lanes apart (a packed panel, `a_ld = depth`, or x's own rows), `b` is `depth` rows of 32
    /// pair lanes; `depth` is a multiple of [`STEP`].
    /// `C0` is zero, or read from `src` (32 rows of 32 `f32` at a stride of `src.1` floats);
    /// `C` is written to `dst` (likewise). The accumulators stay in tiles for the whole depth,
    /// so a block of `y` is loaded and stored once per depth block, with no pass on the side.
    ///
    /// # Safety
    /// `src` (when given) is readable and `dst` writable for 32 rows of 32 `f32` at their
    /// strides.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn tile(
        &mut self,
        fp16: bool,
        depth: usize,
        a: &[u32],
        a_ld: usize,
        b: &[u32],
        src: Option<(*const f32, usize)>,
        dst: (*mut f32, usize),
    ) {
        // SAFETY: forwarded contract.
        unsafe {
            match (self, fp16) {
                #[cfg(target_arch = "x86_64")]
                (Engine::Hardware(h), false) => tile::<_, false>(h, depth, a, a_ld, b, src, dst),
                #[cfg(target_arch = "x86_64")]
                (Engine::Hardware(h), true) => tile::<_, true>(h, depth, a, a_ld, b, src, dst),
                (Engine::Model(m), false) => tile::<_, false>(&mut **m, depth, a, a_ld, b, src, dst),
                (Engine::Model(m), true) => tile::<_, true>(&mut **m, depth, a, a_ld, b, src, dst),
            }
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        match self {
            #[cfg(target_arch = "x86_64")]
            Engine::Hardware(h) => h.release(),
            Engine::Model(m) => m.release(),
        }
    }
}

/// The micro-kernel, for any [`TileOps`]; see the module docs for the tile map and
/// [`Engine::tile`] for the contract.
///
/// # Safety
/// As [`Engine::tile`].
unsafe fn tile<X: TileOps, const FP16: bool>(
    x: &mut X,
    depth: usize,
    a: &[u32],
    a_ld: usize,
    b: &[u32],
    src: Option<(*const f32, usize)>,
    (dst, ldd): (*mut f32, usize),
) {
    assert!(
        depth.is_multiple_of(STEP) && a_ld >= depth && a.len() >= (MR - 1) * a_ld + depth && b.len() >= depth * NR,
        "amx tile: operands"
    );
    let a_stride = a_ld * 4; // bytes between rows of A
    let b_stride = NR * 4; // bytes between pair rows of B
    match src {
        // SAFETY: each load reads 16 rows of 16 f32 (64 bytes) of the caller's 32 x 32 block at
        // its stride: rows 0..16 / 16..32, columns 0..16 / 16..32.
        Some((c, ld)) => unsafe {
            x.load::<0>(c.cast(), ld * 4);
            x.load::<1>(c.add(16).cast(), ld * 4);
            x.load::<2>(c.add(16 * ld).cast(), ld * 4);
            x.load::<3>(c.add(16 * ld + 16).cast(), ld * 4);
        },
        None => {
            x.zero::<0>();
            x.zero::<1>();
            x.zero::<2>();
            x.zero::<3>();
        }
    }
    for s in 0..depth / STEP {
        let a0 = a[s * STEP..].as_ptr().cast::<u8>();
        let a1 = a[16 * a_ld + s * STEP..].as_ptr().cast::<u8>();
        let b0 = b[s * STEP * NR..].as_ptr().cast::<u8>();
        let b1 = b[s * STEP * NR + 16..].as_ptr().cast::<u8>();
        // SAFETY: each load reads 16 rows of 64 bytes: A rows `r` (and `16 + r`) at lanes
        // `s*16..s*16+16` of rows `a_ld` lanes apart; B pair rows `s*16 + r` at lanes `0..16`
        // (and `16..32`) of a row of 32 lanes; all inside `a` and `b` (asserted above).
        // Each load comes right before the first product that needs it, so that a product
        // starts as soon as its operands arrive and the next step's loads wait only for the
        // products that read the same tiles.
        unsafe {
            x.load::<4>(a0, a_stride);
            x.load::<6>(b0, b_stride);
            x.dot::<FP16, 0, 4, 6>();
            x.load::<7>(b1, b_stride);
            x.dot::<FP16, 1, 4, 7>();
            x.load::<5>(a1, a_stride);
        }
        x.dot::<FP16, 2, 5, 6>();
        x.dot::<FP16, 3, 5, 7>();
    }
    // SAFETY: each store writes 16 rows of 16 f32 of the caller's writable 32 x 32 block at its
    // stride, as the loads above.
    unsafe {
        x.store::<0>(dst.cast(), ldd * 4);
        x.store::<1>(dst.add(16).cast(), ldd * 4);
        x.store::<2>(dst.add(16 * ldd).cast(), ldd * 4);
        x.store::<3>(dst.add(16 * ldd + 16).cast(), ldd * 4);
    }
}
