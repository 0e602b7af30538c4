//! The AMX tile interface shared by the kernel ([`super::amx`]) and the software model
//! ([`super::amx_model`]): the tile configuration, the [`TileOps`] trait of the instructions the
//! kernel uses, and [`Tiles`], which of the two implementations runs.

/// Real AMX instructions, or their software model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tiles {
    Hardware,
    Emulated,
}

/// The 64-byte operand of `ldtilecfg` (Intel SDM vol. 1, "Tile configuration"): palette, start
/// row, 14 reserved bytes, 16 two-byte `colsb` (bytes per row), 16 one-byte `rows`.
#[repr(C, align(64))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TileConfig {
    pub(crate) palette: u8,
    pub(crate) start_row: u8,
    pub(crate) reserved: [u8; 14],
    pub(crate) colsb: [u16; 16],
    pub(crate) rows: [u8; 16],
}

const _: () = assert!(std::mem::size_of::<TileConfig>() == 64);
const _: () = assert!(std::mem::offset_of!(TileConfig, colsb) == 16);
const _: () = assert!(std::mem::offset_of!(TileConfig, rows) == 48);

impl TileConfig {
    /// Palette 1 with tiles 0..8 all 16 rows x 64 bytes (the table in the module docs).
    pub(crate) const KERNEL: TileConfig = {
        let mut c = TileConfig { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
        let mut t = 0;
        while t < 8 {
            c.colsb[t] = 64;
            c.rows[t] = 16;
            t += 1;
        }
        c
    };
}

/// The tile instructions the kernel uses. Tile numbers are immediates (const parameters).
///
/// # Safety
/// Implementations follow the instructions' semantics; callers follow their rules: configure
/// first, operands within the configured shapes, memory at `base + r * stride` readable
/// (loads) or writable (stores) for every configured row `r` and its `colsb` bytes.
pub(crate) unsafe trait TileOps {
    /// `ldtilecfg`.
    fn configure(&mut self, cfg: &TileConfig);
    /// `tilezero tmmT`.
    fn zero<const T: u8>(&mut self);
    /// `tileloadd tmmT, [base + stride]`.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn load<const T: u8>(&mut self, base: *const u8, stride: usize);
    /// `tilestored [base + stride], tmmT`.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn store<const T: u8>(&mut self, base: *mut u8, stride: usize);
    /// `tdpbf16ps tmmC, tmmA, tmmB` (`FP16`: `tdpfp16ps`).
    fn dot<const FP16: bool, const C: u8, const A: u8, const B: u8>(&mut self);
    /// `tilerelease`.
    fn release(&mut self);
}
